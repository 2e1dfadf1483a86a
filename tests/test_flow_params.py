"""The Prefect form's overrides, the retry budgets of a training stage, and the progress relay."""

from __future__ import annotations

import json
import logging

import pytest

from flows.pipeline import PipelineParams
from flows.recipe import RecipeError, apply_overrides, load_recipe
from tasks.train import exit_kind
from tasks.artifacts import artifact_key
from tasks.train_progress import ProgressRelay, describe
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_overrides_change_only_what_the_form_sets():
    recipe = load_recipe(TINY)
    params = PipelineParams(recipe=str(TINY), lr=1e-3, eval_every=8192, stage_tokens={"stories": 8192},
                            tracking_uri="http://127.0.0.1:5000")  # fmt: skip
    edited = apply_overrides(recipe, params, str(TINY))
    assert edited.train.optim.lr == 1e-3 and recipe.train.optim.lr == 3e-3  # a new recipe, the old one untouched
    assert edited.eval.every == 8192
    assert [s.tokens for s in edited.train.stages] == [32768, 8192]
    assert edited.tracking.tracking_uri == "http://127.0.0.1:5000"
    assert edited.content_hash() != recipe.content_hash()
    assert edited.model_copy(update={}).train.optim.warmup_tokens == recipe.train.optim.warmup_tokens
    assert apply_overrides(recipe, PipelineParams(recipe=str(TINY)), str(TINY)) is recipe


def test_an_override_the_recipe_rejects_is_one_line_naming_it():
    recipe = load_recipe(TINY)
    with pytest.raises(RecipeError) as info:
        apply_overrides(recipe, PipelineParams(recipe="r.yaml", eval_every=1000), "r.yaml")
    assert str(info.value) == (
        "r.yaml (overrides: eval.every=1000): eval.every: 1000 is not a multiple of global_batch_size*seq_len (1024)"
    )
    with pytest.raises(RecipeError) as info:
        apply_overrides(recipe, PipelineParams(recipe="r.yaml", stage_tokens={"poems": 1024}), "r.yaml")
    assert "stage_tokens: no stage named 'poems' (stages: literary, stories)" in str(info.value)


def test_form_bounds_are_json_schema_constraints():
    """The UI (and an enforced deployment schema) rejects these before any infrastructure starts."""
    schema = PipelineParams.model_json_schema()
    props = schema["properties"]
    assert list(props)[:2] == ["recipe", "run_name"]
    assert props["lr"]["anyOf"][0] == {"exclusiveMinimum": 0, "maximum": 1, "type": "number"}
    assert props["procs_per_node"]["anyOf"][0]["minimum"] == 1
    assert props["if_running"]["enum"] == ["refuse", "wait"]
    assert all(props[name].get("description") for name in props)
    with pytest.raises(ValueError):
        PipelineParams(recipe=str(TINY), lr=0)


def test_tracked_params_name_every_stage_and_the_optimizer():
    params = load_recipe(TINY).tracked_params()
    assert params["stage.literary.tokens"] == "32768"
    assert params["stage.literary.mixture"] == "literary:0.8,stories:0.2"
    assert params["train.optim.lr"] == "0.003" and params["train.optim.warmup_tokens"] == "4096"
    assert params["eval.every"] == "16384" and params["model.d_model"] == "64"
    assert params["data.tokenizer"].endswith("tokenizer.json")
    assert all(isinstance(v, str) and len(v) <= 6000 for v in params.values())


@pytest.mark.parametrize(("code", "kind"), [
    (0, "ok"), (78, "fatal"), (2, "fatal"),             # the trainer's fatal code, argparse usage
    (-9, "preempted"), (137, "preempted"), (76, "preempted"),  # SIGKILL (Popen, shell), the trainer after SIGTERM
    (75, "failed"), (1, "failed"),                      # the trainer's retryable failures, an unexpected crash
])  # fmt: skip
def test_exit_codes_draw_on_the_right_budget(code, kind):
    assert exit_kind(code) == kind


def _line(tokens: int, rate: float = 1000.0) -> str:
    progress = {"stage": "literary", "stage_index": 0, "step": tokens // 1024, "tokens": tokens, "stage_start": 0,
                "stage_end": 32768, "loss": 7.25, "tokens_per_sec": rate, "elapsed_s": 1.0}  # fmt: skip
    return "tessera.progress " + json.dumps(progress)


def test_relay_reports_the_newest_progress_at_a_bounded_rate(caplog):
    logger = logging.getLogger("test.relay")
    relay = ProgressRelay(logger, "tiny", "literary", every_s=3600, artifacts=False)
    with caplog.at_level(logging.INFO, logger="test.relay"):
        relay.feed(["noise", _line(1024)])  # the first progress is said at once
        relay.feed([_line(2048), "more noise", _line(16384)])  # within the interval: kept, not said
        relay.close()  # the end of a launch says the newest
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [describe(json.loads(_line(1024)[len("tessera.progress "):])),
                     describe(json.loads(_line(16384)[len("tessera.progress "):]))]  # fmt: skip
    assert lines[1] == "stage literary: step 16, 16,384/32,768 tokens (50%), loss 7.2500, 1,000 tok/s, ETA 16s"


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("Tiny_run.2", "train", "Stage A") == "tiny-run-2-train-stage-a"


def test_a_dead_tracking_server_at_close_never_hides_the_training_error(prefect_harness, monkeypatch):
    """The flow re-raises the training error, not a tracking error (which the CLI would report as bad input)."""
    import time

    from prefect import flow

    import flows.pipeline as pipeline
    from tasks.tracking_config import TrackingConfig
    from tasks.train import TrainingFatal

    monkeypatch.setattr(pipeline, "CLOSE_AFTER_FAILURE_S", 3.0)
    dead = TrackingConfig(tracking_uri="http://127.0.0.1:9", registered_model="m")

    @flow(name="close-after-failure")
    def failing() -> None:
        error = TrainingFatal("stage s: trainer exited with code 78 (fatal)")
        try:
            raise error
        except TrainingFatal as exc:
            pipeline._close_after_failure(dead, "no-such-run", exc)
            raise

    start = time.monotonic()
    state = failing(return_state=True)
    assert time.monotonic() - start < 60
    with pytest.raises(TrainingFatal, match="code 78"):
        state.result()
