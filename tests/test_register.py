"""Registration against a real sqlite MLflow registry: idempotent, aliases, loadable versions, dead server."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tasks.evaluate import EvalSummary
from tasks.register import BEST_ALIAS, LATEST_ALIAS, register_checkpoint
from tasks.tracking import TrackingError, client_for, open_run
from tasks.tracking_config import TrackingConfig
from tests.conftest import ROOT
from trainers.checkpoints import CheckpointInfo


@pytest.fixture(scope="module")
def composer_checkpoint(tmp_path_factory) -> str:
    """One real Composer HuggingFaceModel checkpoint of a tiny Llama, tokenizer embedded."""
    from composer import Trainer
    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("ckpt")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "data/tokenizers/gpt-neox-20b/tokenizer.json"), eos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=tok, use_logits=True)
    batch = {"input_ids": torch.randint(0, 1000, (2, 16)), "labels": torch.randint(0, 1000, (2, 16))}
    trainer = Trainer(model=model, train_dataloader=[batch], max_duration="1ba", device="cpu", progress_bar=False, device_train_microbatch_size=2,
                      save_folder=str(tmp), save_filename="ckpt.pt", save_interval="1ba")  # fmt: skip
    trainer.fit()
    trainer.close()
    return str(tmp / "ckpt.pt")


def summary(tokens: int, average: float) -> EvalSummary:
    return EvalSummary(tokens=tokens, stage="s", checkpoint="c", average=average,
                       metrics={"gauntlet/core_average": average, "icl/copa/0-shot": 0.5})  # fmt: skip


def test_register_is_idempotent_and_moves_aliases(tmp_path, composer_checkpoint):
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", artifact_location=str(tmp_path / "art"),
                              experiment="e", registered_model="tiny")  # fmt: skip
    run_id = open_run.fn(tracking, "run-a", tags={}, params={})
    assert open_run.fn(tracking, "run-a", tags={}, params={}) == run_id  # a rerun reuses the run

    def register(tokens: int, average: float):
        ckpt = CheckpointInfo(path=composer_checkpoint, tokens=tokens, batch=tokens // 64, stage="s", stage_index=0)
        return register_checkpoint.fn(ckpt, summary(tokens, average), tracking, run_id, "abc")

    first = [register(64, 0.2), register(128, 0.5), register(192, 0.3)]
    assert [(r.version, r.created) for r in first] == [(1, True), (2, True), (3, True)]
    # a retried task after success finds its version instead of making a fourth
    again = register(128, 0.5)
    assert (again.version, again.created) == (2, False)

    client = client_for(tracking)
    assert len(client.search_model_versions("name = 'tiny'")) == 3
    assert int(client.get_model_version_by_alias("tiny", LATEST_ALIAS).version) == 3
    assert int(client.get_model_version_by_alias("tiny", BEST_ALIAS).version) == 2
    v2 = client.get_model_version("tiny", "2")
    assert v2.tags["tokens"] == "128" and v2.tags["gauntlet_average"] == "0.500000"
    assert v2.tags["score/gauntlet/core_average"] == "0.500000" and v2.tags["recipe_hash"] == "abc"

    # the registered version is a plain HF model with the checkpoint's exact weights
    import mlflow
    from transformers import AutoModelForCausalLM

    from trainers.export import load_hf

    mlflow.set_tracking_uri(tracking.tracking_uri)
    local = mlflow.artifacts.download_artifacts(artifact_uri="models:/tiny@best", dst_path=str(tmp_path / "dl"))
    loaded = AutoModelForCausalLM.from_pretrained(local)
    original, _ = load_hf(composer_checkpoint)
    for (name, a), (_, b) in zip(sorted(loaded.state_dict().items()), sorted(original.state_dict().items())):
        assert torch.equal(a, b), name


def test_dead_tracking_server_is_one_line_and_fast():
    tracking = TrackingConfig(tracking_uri="http://127.0.0.1:9", registered_model="x")
    start = time.monotonic()
    with pytest.raises(TrackingError) as info:
        client_for(tracking)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert message.startswith("tracking.tracking_uri: cannot use MLflow at http://127.0.0.1:9: ")
    assert "\n" not in message


def test_cli_reports_dead_tracking_server(tmp_path):
    import yaml

    raw = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    raw["work_dir"] = str(tmp_path / "w")
    raw["data"]["root"] = str(tmp_path / "w" / "data")
    raw["tracking"]["tracking_uri"] = "http://127.0.0.1:9"
    recipe = tmp_path / "dead.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(recipe)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tessera: error:")]
    assert len(errors) == 1
    assert errors[0].startswith("tessera: error: tracking.tracking_uri: cannot use MLflow at http://127.0.0.1:9: ")
    assert "Traceback" not in proc.stderr
