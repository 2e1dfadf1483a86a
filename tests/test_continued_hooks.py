"""A continued run that crashes or is cancelled closes its MLflow run, found by the flow run's `run:` tag."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT
from tests.support.mlflow_store import sqlite_store

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _setup(tmp_path, run_name: str | None):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.mlflow_run import open_run
    from tasks.recipe import load_recipe

    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["tracking"] |= {"tracking_uri": sqlite_store(tmp_path / "m.db"), "artifact_location": str(tmp_path / "a")}
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    tracking = load_recipe(recipe).tracking

    @flow(name="continued_pretraining")
    def stand_in(params: dict) -> None: ...

    tags = ["tessera"] + ([f"run:{run_name}"] if run_name else [])
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(stand_in, parameters={"params": {"recipe": str(recipe)}}, tags=tags)
    run_id = open_run(tracking, "weekly-cpt-v1-0123abcd", tags={"tessera.prefect.flow_run_id": str(flow_run.id)})
    return tracking, flow_run, run_id


def _status(tracking, run_id: str) -> str:
    from tasks.mlflow_run import client_for

    return client_for(tracking).get_run(run_id).info.status


def test_a_cancelled_or_crashed_continued_run_is_closed_in_mlflow(tmp_path):
    from prefect.states import Cancelled, Crashed

    from flows.continued import _record_end

    tracking, flow_run, run_id = _setup(tmp_path, "weekly-cpt-v1-0123abcd")
    _record_end(None, flow_run, Cancelled(message="cancelled from the UI"))
    assert _status(tracking, run_id) == "KILLED"

    tracking, flow_run, run_id = _setup(tmp_path / "b", "weekly-cpt-v1-0123abcd")
    _record_end(None, flow_run, Crashed(message="worker lost"))
    assert _status(tracking, run_id) == "FAILED"


def test_a_refused_run_or_one_that_never_started_closes_nothing(tmp_path):
    from prefect.states import Cancelled

    from flows.continued import _record_end
    from tasks.runs.flow_outcome import REFUSED

    tracking, flow_run, run_id = _setup(tmp_path, "weekly-cpt-v1-0123abcd")
    _record_end(None, flow_run, Cancelled(name=REFUSED, message="run is live elsewhere"))
    assert _status(tracking, run_id) == "RUNNING"  # the live holder's run

    tracking, flow_run, run_id = _setup(tmp_path / "b", None)  # stopped before it derived its run name
    _record_end(None, flow_run, Cancelled(message="cancelled early"))
    assert _status(tracking, run_id) == "RUNNING"


@pytest.mark.parametrize("which", ["pretrain_pipeline", "continued_pretraining"])
def test_prefects_runner_calls_each_flows_end_hooks_by_keyword_and_they_close_the_run(tmp_path, which, caplog):
    """Prefect's runner (its HookRunner, what a worker runs after a cancel or a crash) passes `flow`, `flow_run` and
    `state` by keyword: a hook whose parameter had another name raised TypeError there and the run stayed open."""
    import asyncio
    import logging

    from prefect.runner._hook_runner import HookRunner
    from prefect.states import Cancelling, Crashed

    import flows.continued
    import flows.pipeline

    the_flow = {"pretrain_pipeline": flows.pipeline.pretrain_pipeline}.get(which, flows.continued.continued_pretraining)

    async def resolve(_flow_run):
        return the_flow

    runner = HookRunner(resolve_flow=resolve)
    caplog.set_level(logging.INFO)
    for sub, call, state, status in (
        ("c", runner.run_cancellation_hooks, Cancelling(message="cancelled from the UI"), "KILLED"),
        ("x", runner.run_crashed_hooks, Crashed(message="worker lost"), "FAILED"),
    ):
        # the pretrain flow names its run from params (run_name), the continued one from the `run:` tag
        tracking, flow_run, run_id = _setup(tmp_path / sub, "weekly-cpt-v1-0123abcd")
        flow_run.parameters["params"]["run_name"] = "weekly-cpt-v1-0123abcd"
        asyncio.run(call(flow_run, state))
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert errors == [], errors
        assert any("finished running successfully" in r.getMessage() for r in caplog.records)
        assert _status(tracking, run_id) == status
        caplog.clear()
