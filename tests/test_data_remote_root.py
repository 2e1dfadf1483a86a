"""An s3:// data root on a real (moto) S3 server: prepared locally, published done-marker last, reused."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_data_helpers import SHAKESPEARE, make_config


def test_prepare_into_an_s3_root_publishes_done_last_and_reuses_it(tmp_path, moto_s3, prefect_harness):
    from streaming import StreamingDataset
    from transformers import AutoTokenizer

    from flows.prepare import prepare_sources
    from trainers.remote import fetch_folder

    moto_s3.create_bucket(Bucket="data")
    sources = [{"name": "plays", "paths": [str(SHAKESPEARE)], "separator": "\n\n", "val_fraction": 0.05}]
    data = make_config(tmp_path / "unused", sources, seq_len=64, workers=1)
    data = data.model_copy(update={"root": "s3://data/prepared", "local_cache": str(tmp_path / "cache")})
    first = prepare_sources(data)
    plays = first.sources["plays"]
    assert plays.root == f"s3://data/prepared/plays-{plays.hash}" and plays.path == plays.root + "/train"
    assert plays.val_path == plays.root + "/val" and not plays.cached
    keys = [o["Key"] for o in moto_s3.list_objects_v2(Bucket="data")["Contents"]]
    prefix = f"prepared/plays-{plays.hash}/"
    assert f"{prefix}_DONE" in keys and f"{prefix}provenance.json" in keys and f"{prefix}train/index.json" in keys
    assert not (tmp_path / "unused").exists()  # nothing lands in a local folder named after the URI

    # the tokenizer is published beside the data, done-marker last: a training pod loads it from there
    tok_name = Path(first.tokenizer.hf_dir).name
    assert first.tokenizer.uri == f"s3://data/prepared/{tok_name}" and f"prepared/{tok_name}/_DONE" in keys
    copy = fetch_folder(first.tokenizer.uri, tmp_path / "pod-cache" / tok_name)
    text = "Shall I compare thee to a summer's day?"
    assert AutoTokenizer.from_pretrained(copy).encode(text) == AutoTokenizer.from_pretrained(
        first.tokenizer.hf_dir
    ).encode(text)

    # training streams it from the bucket: the samples are the ones written
    ds = StreamingDataset(remote=plays.path, local=str(tmp_path / "stream-cache"), shuffle=False, batch_size=1)
    assert ds.num_samples == plays.samples and len(ds[0]["tokens"]) == 64

    # a rerun, even from a machine without the working copy, reuses the published output
    again = prepare_sources(data.model_copy(update={"local_cache": str(tmp_path / "other-host")}))
    assert again.sources["plays"].cached and again.sources["plays"].root == plays.root
    assert not any((tmp_path / "other-host").glob("plays-*"))  # nothing was prepared again

    # an upload cut short (no remote done-marker) is finished by the next run from the local copy
    moto_s3.delete_object(Bucket="data", Key=f"{prefix}_DONE")
    local = tmp_path / "cache" / f"plays-{plays.hash}" / "provenance.json"
    written = json.loads(local.read_text())["finished"]
    healed = prepare_sources(data)
    assert healed.sources["plays"].root == plays.root
    assert json.loads(local.read_text())["finished"] == written  # uploaded again, not tokenized again
    done = moto_s3.get_object(Bucket="data", Key=f"{prefix}_DONE")["Body"].read()
    assert "finished" in json.loads(done)
