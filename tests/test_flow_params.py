"""The Prefect form's overrides, the retry budgets of a training stage, and the progress relay."""

from __future__ import annotations

import json
import logging

import pytest

from flows.pipeline import PipelineParams
from tasks.artifacts import artifact_key
from tasks.recipe import NAME_PATTERN, RecipeError, load_recipe
from tasks.recipe_form import apply_overrides
from tasks.runs.flow_outcome import form_values
from tasks.training.stage_ends import exit_kind
from tasks.training.train_progress import ProgressRelay, Rate, describe, progress_bar
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_overrides_change_only_what_the_form_sets():
    recipe = load_recipe(TINY)
    params = PipelineParams(
        recipe=str(TINY), lr=1e-3, eval_every=8192, stage_tokens={"stories": 8192}, tracking_uri="http://127.0.0.1:5000"
    )
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


def test_form_fields_are_plain_inputs_whose_bounds_are_schema_constraints_and_said_in_words():
    """The UI (and an enforced deployment schema) rejects these before any infrastructure starts."""
    schema = PipelineParams.model_json_schema()
    props = schema["properties"]
    assert list(props)[:2] == ["recipe", "run_name"]
    assert schema["required"] == ["recipe"]
    # one plain input each, starting empty: no `str | None` switch, no null default the UI would reject
    assert {k: v for k, v in props["lr"].items() if k not in ("title", "description")} == {
        "exclusiveMinimum": 0,
        "maximum": 1,
        "type": "number",
    }
    assert "above 0 and at most 1" in props["lr"]["description"]
    assert (props["procs_per_node"]["minimum"], props["procs_per_node"]["maximum"]) == (1, 64)
    assert "1 to 64" in props["procs_per_node"]["description"]
    assert not [k for k, v in props.items() if "anyOf" in v or v.get("default", "unset") is None]
    assert props["run_name"]["pattern"] == NAME_PATTERN and "names the tessera run" in props["run_name"]["description"]
    assert props["backend"]["enum"] == ["recipe", "local", "kubernetes"] and props["backend"]["default"] == "recipe"
    assert props["if_running"]["enum"] == ["refuse", "wait"]
    assert props["compile"]["enum"] == ["recipe", "auto", "on", "off"] and props["compile"]["default"] == "recipe"
    recipe = load_recipe(TINY)
    for choice, value in (("auto", "auto"), ("on", True), ("off", False), ("recipe", recipe.train.compile)):
        applied = apply_overrides(recipe, PipelineParams(recipe=str(TINY), compile=choice), "tiny.yaml")
        assert applied.train.compile == value, choice
    rows = props["stage_tokens"]
    assert rows["type"] == "array" and rows["items"]["required"] == ["stage", "tokens"]
    assert all(props[name].get("description") for name in props)
    with pytest.raises(ValueError):
        PipelineParams(recipe=str(TINY), lr=0)


def test_a_value_the_form_should_have_refused_is_one_line_in_the_flow():
    """The UI's "Validate parameters" switched off: the flow checks the same bounds first thing."""
    with pytest.raises(RecipeError) as info:
        form_values(PipelineParams, {"recipe": "configs/tiny.yaml", "lr": 5})
    assert str(info.value) == (
        "form field lr 5: Input should be less than or equal to 1 (Peak learning rate "
        "(train.optim.lr): above 0 and at most 1.)"
    )
    with pytest.raises(RecipeError, match=r"^form field stage_tokens.0.tokens -8: Input should be greater than 0"):
        form_values(PipelineParams, {"recipe": "r.yaml", "stage_tokens": [{"stage": "literary", "tokens": -8}]})
    with pytest.raises(RecipeError, match=r"^form field recipe: Field required \(Path to the recipe YAML"):
        form_values(PipelineParams, {})
    # the CLI, the tests and deployments made before the form had rows pass a mapping: the same budgets
    rows = form_values(PipelineParams, {"recipe": "r.yaml", "stage_tokens": {"stories": 8192}}).stage_tokens
    assert [(r.stage, r.tokens) for r in rows] == [("stories", 8192)]
    params = PipelineParams(recipe="r.yaml")
    assert form_values(PipelineParams, params) is params


def test_tracked_params_name_every_stage_and_the_optimizer():
    params = load_recipe(TINY).tracked_params()
    assert params["stage.literary.tokens"] == "32768"
    assert params["stage.literary.mixture"] == "literary:0.8,stories:0.2"
    assert params["train.optim.lr"] == "0.003" and params["train.optim.warmup_tokens"] == "4096"
    assert params["eval.every"] == "16384" and params["model.d_model"] == "64"
    assert params["data.tokenizer"].endswith("tokenizer.json")
    assert all(isinstance(v, str) and len(v) <= 6000 for v in params.values())


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (0, "ok"),
        (78, "fatal"),
        (2, "fatal"),  # the trainer's fatal code, argparse usage
        (-9, "preempted"),
        (137, "preempted"),
        (76, "preempted"),  # SIGKILL (Popen, shell), the trainer after SIGTERM
        (75, "failed"),
        (1, "failed"),  # the trainer's retryable failures, an unexpected crash
    ],
)
def test_exit_codes_draw_on_the_right_budget(code, kind):
    assert exit_kind(code) == kind


def _line(tokens: int, rate: float = 1000.0) -> str:
    progress = {
        "stage": "literary",
        "stage_index": 0,
        "step": tokens // 1024,
        "tokens": tokens,
        "stage_start": 0,
        "stage_end": 32768,
        "loss": 7.25,
        "tokens_per_sec": rate,
        "elapsed_s": 1.0,
    }
    return "tessera.progress " + json.dumps(progress)


def test_relay_reports_the_newest_progress_at_a_bounded_rate(caplog):
    logger = logging.getLogger("test.relay")
    relay = ProgressRelay(logger, "tiny", "literary", every_s=3600, artifacts=False)
    with caplog.at_level(logging.INFO, logger="test.relay"):
        relay.feed(["noise", _line(1024)])  # the first progress is said at once
        relay.feed([_line(2048), "more noise", _line(16384)])  # within the interval: kept, not said
        relay.close()  # the end of a launch says the newest
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        describe(json.loads(_line(1024)[len("tessera.progress ") :])),
        describe(json.loads(_line(16384)[len("tessera.progress ") :])),
    ]
    assert lines[1] == (
        "stage literary: 16,384/32,768 tokens (50%) at the run's step 16, loss 7.2500, 1,000 tok/s, ETA 16s"
    )


def _start(kind: str, tokens: int, **extra) -> str:
    record = {
        "stage": "literary",
        "stage_index": 0,
        "kind": kind,
        "tokens": tokens,
        "step": tokens // 1024,
        "checkpoint": f"/ck/ep0-ba{tokens // 1024}.pt" if tokens else None,
        "written": "2026-11-25T10:57:12+00:00" if tokens else None,
        **extra,
    }
    return "tessera.start " + json.dumps(record)


def test_the_log_says_where_each_launch_starts(caplog):
    logger = logging.getLogger("test.relay.start")
    with caplog.at_level(logging.INFO, logger="test.relay.start"):
        for line in (
            _start("fresh", 0),
            _start("resume", 16384),
            _start("done", 32768),
            _start("fresh", 0, init_from="models:/tessera-tiny/2"),
        ):
            ProgressRelay(logger, "chain", "literary", artifacts=False).feed(["noise", line])
    assert [r.getMessage() for r in caplog.records] == [
        "stage literary: starting run chain fresh",
        "stage literary: resuming run chain from the checkpoint at 16,384 tokens (step 16), "
        "written 2026-11-25 10:57:12 UTC",
        "stage literary: already complete at 32,768 tokens; nothing to train",
        "stage literary: starting run chain fresh from the weights of models:/tessera-tiny/2",
    ]


def test_the_eta_follows_the_rate_over_minutes_not_one_window():
    """A gauntlet slowing one 10 s window six-fold moves the ETA by seconds, not from 2 to 18 minutes."""
    rate = Rate(window_s=120)
    tokens = 0
    for second in range(10, 130, 10):  # 1000 tok/s, then one slow window
        tokens += 10_000 if second != 120 else 1_600
        smoothed = rate.add({"tokens": tokens, "elapsed_s": float(second)})
    assert 900 < smoothed < 1000
    assert rate.add({"tokens": 0, "elapsed_s": 1.0}) is None  # a relaunch starts its own clock
    assert progress_bar(0.5, 10) == "█████░░░░░" and progress_bar(1.2, 4) == "████"


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("Tiny_run.2", "train", "Stage A") == "tiny-run-2-train-stage-a"


def test_a_dead_tracking_server_at_close_never_hides_the_training_error(prefect_harness, monkeypatch):
    """The flow re-raises the training error, not a tracking error (which the CLI would report as bad input)."""
    import time

    from prefect import flow

    import tasks.runs.run_record as run_record
    from tasks.tracking_config import TrackingConfig
    from tasks.training.stage_ends import TrainingFatal

    monkeypatch.setattr(run_record, "CLOSE_AFTER_FAILURE_S", 3.0)
    dead = TrackingConfig(tracking_uri="http://127.0.0.1:9", registered_model="m")

    @flow(name="close-after-failure")
    def failing() -> None:
        error = TrainingFatal("stage s: trainer exited with code 78 (fatal)")
        try:
            raise error
        except TrainingFatal as exc:
            run_record.close_after_failure(dead, "no-such-run", exc)
            raise

    start = time.monotonic()
    state = failing(return_state=True)
    assert time.monotonic() - start < 60
    with pytest.raises(TrainingFatal, match="code 78"):
        state.result()


@pytest.mark.parametrize("name", [".", "..", "...", "../../x", "a/b", "/etc"])
def test_a_run_name_that_would_leave_the_runs_folder_is_refused_in_one_line(name, tmp_path, capsys):
    """`.` and `..` matched the old pattern and wrote into runs/ itself or beside it; the CLI, the form's schema
    and the flow (validation off) refuse every name that does not name one folder inside runs/."""
    import re

    from cli.main import main
    from tasks.recipe import run_folder
    from tests.conftest import tiny_recipe

    assert not re.fullmatch(NAME_PATTERN, name)
    recipe = tiny_recipe(tmp_path, prefect_db=False)  # refused before anything is written
    assert main(["run", str(recipe), "--run-name", name]) == 2
    runs = tmp_path / "work" / "runs"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tessera: error: --run-name: run name {name!r}: must name a folder inside {runs} (letters, digits, "
        "'.', '_', '-')"
    ]
    with pytest.raises(RecipeError, match=rf"^form field run_name {re.escape(repr(name))}: String should match"):
        form_values(PipelineParams, {"recipe": str(recipe), "run_name": name})
    with pytest.raises(RecipeError):
        run_folder(tmp_path / "work", name)
    assert not (tmp_path / "work").exists()  # nothing was written anywhere
    assert run_folder(tmp_path / "work", ".hidden.v2") == runs / ".hidden.v2"  # dots are fine beside other text


def test_a_task_given_a_kubernetes_compute_with_secret_keys_receives_it_whole():
    """A SecretRef's `keys` (a recipe field) once shadowed the mapping method Prefect calls on a task's pydantic
    parameters: every task given such a compute section (train_stage, the gauntlet, promotion) failed before running."""
    from prefect import flow, task

    from tests.k8s.variants import GPU_TWO_NODES, compute

    @task
    def credentials_of(c):
        return c.kubernetes.s3_credentials.key_map, c.kubernetes.mlflow_credentials.name

    @flow(name="compute-param")
    def with_compute():
        return credentials_of(compute(GPU_TWO_NODES))

    assert with_compute() == (
        {"AWS_ACCESS_KEY_ID": "access-key", "AWS_SECRET_ACCESS_KEY": "secret-key"},
        "mlflow-auth",
    )
    again = compute(GPU_TWO_NODES).model_dump(by_alias=True)  # what a recipe and a form write: `keys`
    assert again["kubernetes"]["s3Credentials"]["keys"] == {
        "AWS_ACCESS_KEY_ID": "access-key",
        "AWS_SECRET_ACCESS_KEY": "secret-key",
    }


def _ui_property_keys() -> set[str]:
    """The keys Prefect's UI keeps of each schema property when it asks its server to check a form: read from the
    UI bundle that this Prefect serves (its SchemaPropertyResponse mapper), so a Prefect upgrade that changes
    them fails here rather than in a person's form."""
    import re
    from pathlib import Path

    import prefect

    assets = Path(prefect.__file__).parent / "server" / "ui" / "assets"
    for bundle in sorted(assets.glob("index-*.js")):
        found = re.search(r"SchemaPropertyResponse:function\(e\)\{return\{(.*?)\}\}", bundle.read_text())
        if found:
            return {part.split(":", 1)[0] for part in found[1].split(",")}
    raise AssertionError(f"no SchemaPropertyResponse mapper in {assets}: Prefect's UI changed how it checks forms")


def _as_the_ui_sends_it(schema):
    """`schema` as Prefect's UI posts it to /ui/schemas/validate: each property cut to the keys the UI keeps,
    `items` and `allOf` passed as they are."""
    keys = _ui_property_keys()

    def prop(node: dict) -> dict:
        cut = {k: v for k, v in node.items() if k in keys}
        if isinstance(cut.get("properties"), dict):
            cut["properties"] = {k: prop(v) for k, v in cut["properties"].items()}
        return cut

    return {
        **schema,
        "properties": {k: prop(v) for k, v in schema["properties"].items()},
        "definitions": {
            name: {**d, "properties": {k: prop(v) for k, v in d.get("properties", {}).items()}}
            for name, d in schema.get("definitions", {}).items()
        },
    }


def test_the_forms_bounds_reach_the_check_prefects_ui_makes_in_place():
    """A form's bounds beside its field's type are cut by the UI before its in-place check (lr 5 passed it, and
    only the run's creation said no, in a toast); under allOf they reach it, and they refuse what they refused."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import build_error_obj, preprocess_schema, validate

    from cli.forms import UI_DROPPED_BOUNDS, bounds_the_ui_checks, recipe_schema
    from flows.pipeline import pretrain_pipeline

    assert not set(UI_DROPPED_BOUNDS) & _ui_property_keys() and {"allOf", "items"} <= _ui_property_keys()
    published = parameter_schema(pretrain_pipeline.fn).model_dump_for_openapi()
    recipe = load_recipe(TINY)
    bad = {
        "params": {
            "recipe": str(TINY),
            "run_name": "a b",
            "lr": 5,
            "eval_every": 1000,
            "procs_per_node": 0,
            "stage_tokens": [{"stage": "poems", "tokens": 1000}],
        }
    }
    good = {
        "params": {
            "recipe": str(TINY),
            "lr": 0.5,
            "eval_every": 8192,
            "stage_tokens": [{"stage": "stories", "tokens": 8192}],
        }
    }

    def errors(schema, values):
        found = build_error_obj(validate(values, preprocess_schema(schema), preprocess=False))
        return (
            {e["property"]: sorted(str(x) for x in e["errors"]) for e in found["errors"][0]["errors"]}
            if found["errors"]
            else {}
        )

    before = recipe_schema(published, recipe)
    after = bounds_the_ui_checks(before)
    assert errors(after, bad) == errors(before, bad) and errors(after, good) == errors(before, good) == {}
    refused = errors(after, bad)
    assert set(refused) == {"run_name", "lr", "eval_every", "procs_per_node", "stage_tokens"}
    assert refused["lr"] == ["5 is greater than the maximum of 1"]
    assert refused["eval_every"] == ["1000 is not a multiple of 1024"]
    # what the UI checks: before, only the rows' bounds (inside `items`) survived its cut; now every field's do
    assert set(errors(_as_the_ui_sends_it(before), bad)) == {"stage_tokens"}
    assert errors(_as_the_ui_sends_it(after), bad) == refused
