"""Small sources pay no fixed cost they do not need (bench/tokenize.py --case small measures the time)."""

from __future__ import annotations

import psutil

from flows.prepare import prepare_sources
from tasks.data import parallel
from tests.test_data_helpers import SHAKESPEARE, make_config


def _pool_processes() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):  # a pool worker, not the resource tracker
                out.append(child)
        except psutil.Error:
            continue
    return out


def test_sources_that_fit_one_part_spawn_no_tokenizer_pool(tmp_path, prefect_harness):
    parallel.shutdown()  # the pool lives per process: start from none
    text = SHAKESPEARE.read_text()
    for i in range(3):
        (tmp_path / f"s{i}.txt").write_text(text[i * 100_000 : (i + 1) * 100_000])
    data = make_config(
        tmp_path / "data",
        [{"name": f"s{i}", "paths": [str(tmp_path / f"s{i}.txt")], "separator": "\n\n"} for i in range(3)],
        seq_len=64,
        workers=2,
    )
    prepared = prepare_sources(data)
    assert [s.documents > 0 for s in prepared.sources.values()] == [True] * 3
    # Each 100 kB source is one part and is tokenized in the flow's own process: spawning two
    # interpreters (and shutting them down at exit) would be pure overhead.
    assert _pool_processes() == []

    big = make_config(
        tmp_path / "big",
        [{"name": "big", "paths": [str(SHAKESPEARE)], "separator": "\n\n"}],
        seq_len=64,
        workers=2,
        chunk_bytes=300_000,
    )
    prepare_sources(big)
    assert len(_pool_processes()) == 2  # cut into parts: the pool is used, and kept for the process


SCRIPT = """
import sys
from tasks.data.config import DataConfig
from tasks.data import pipeline, tokenizer
data = DataConfig.model_validate_json(open(sys.argv[1]).read())
tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
res = pipeline.prepare_source(data.sources[0], data, tok)
print("transformers.models.auto.tokenization_auto" in sys.modules, "sklearn" in sys.modules)
import streaming.text  # still importable for real afterwards
from streaming import StreamingDataset
from trainers.shm import leader_decides_prefixes
leader_decides_prefixes()  # its prefix as the trainers take theirs: another worker's trainer may be registering one
print(len(StreamingDataset(local=res.path, batch_size=1)) == res.samples, streaming.text.__name__)
"""


def test_writing_mds_does_not_import_streamings_dataset_collections(tmp_path):
    import subprocess
    import sys

    from tests.test_data_helpers import ROOT

    (tmp_path / "s.txt").write_text(SHAKESPEARE.read_text()[:50_000])
    data = make_config(
        tmp_path / "data", [{"name": "s", "paths": [str(tmp_path / "s.txt")], "separator": "\n\n"}], seq_len=64
    )
    (tmp_path / "data.json").write_text(data.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "data.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Streaming's dataset collections (and the ~3 s, 300 MB of transformers' auto-tokenizers and
    # scikit-learn they import) are not needed to write MDS.
    assert done.stdout.split("\n")[:2] == ["False False", "True streaming.text"], done.stdout
