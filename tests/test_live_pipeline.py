"""tessera operated as a service: runs triggered, cancelled and killed through a real Prefect server and worker.

Everything goes through `tessera up` (tests/conftest.py: live_stack): a real `prefect server`, a process
worker on `tessera-local`, a real `mlflow server`, and the deployments of prefect.yaml. Flow runs are
created through the REST API exactly as the UI creates them (a deployment, parameters from the form).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ROOT, prefect_api
from tests.support.training import rank_pids

pytestmark = pytest.mark.slow

DEPLOYMENT = "pretrain_pipeline/pretrain"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}
# A shorter curriculum for the runs that are interrupted: 32 steps, a checkpoint (and gauntlet) every 8,
# so the first stage has checkpoints at 8192 and 16384 tokens before its end at 24576.
SHORT = {
    "stage_tokens": [{"stage": "literary", "tokens": 24576}, {"stage": "stories", "tokens": 8192}],
    "eval_every": 8192,
}


GENERIC_CANCEL = "Flow run was cancelled successfully."  # Prefect's runner's own message


def _api(stack, method: str, path: str, **kw):
    response = prefect_api(method, f"{stack.api_url}{path}", **kw)
    return response.json() if response.content else None


def trigger(stack, env: dict[str, str] | None = None, **params) -> str:
    """Create a flow run of the pretrain deployment with these form values, as the UI's Run button does; `env`:
    the run's own environment variables (the process work pool's `env` job variable, the UI's custom run)."""
    deployment = _api(stack, "GET", f"/deployments/name/{DEPLOYMENT}")
    body = {"parameters": {"params": {"recipe": str(stack.recipe), **params}}}
    run = _api(
        stack,
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        json=body | ({"job_variables": {"env": env}} if env else {}),
    )
    return run["id"]


# The cancelled and the killed run of `chain` are stopped mid-stage literary, once a checkpoint is in. On a quiet
# machine the tiny model trains the rest of the stage (8 steps after 16,384 tokens) faster than the test can see the
# checkpoint and act, so those two runs step slower (trainers/faults.py: a sleep per step, the same numbers).
MID_STAGE = {"TESSERA_FAULT": "slow:0.5"}


def flow_run(stack, run_id: str) -> dict:
    return _api(stack, "GET", f"/flow_runs/{run_id}")


def logs(stack, run_id: str) -> str:
    rows = _api(
        stack,
        "POST",
        "/logs/filter",
        json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200, "sort": "TIMESTAMP_ASC"},
    )
    return "\n".join(r["message"] for r in rows)


def wait_state(stack, run_id: str, wanted: set[str], timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = flow_run(stack, run_id)
        state = run["state"]["type"]
        if state in wanted:
            return run
        if state in TERMINAL:
            pytest.fail(f"flow run {run['name']} ended {state}: {run['state']['message']}\n{logs(stack, run_id)}")
        if time.monotonic() > deadline:
            pytest.fail(f"flow run {run['name']} still {state} after {timeout:.0f} s\n{logs(stack, run_id)}")
        time.sleep(2)


def cancel_history(stack, run_id: str, timeout: float = 120) -> list[tuple[str, str]]:
    """The (type, message) states of a cancelled run once Prefect's runner has run the end hooks and written its own
    generic Cancelled, and the flow's explanation has been put back over it (or `timeout` has passed)."""
    deadline = time.monotonic() + timeout
    while True:
        states = sorted(_api(stack, "GET", f"/flow_run_states/?flow_run_id={run_id}"), key=lambda s: s["timestamp"])
        history = [(s["type"], s["message"]) for s in states]
        said = [m for _, m in history]
        if (GENERIC_CANCEL in said and said[-1] != GENERIC_CANCEL) or time.monotonic() > deadline:
            return history
        time.sleep(1)


def run_dir(stack, name: str) -> Path:
    return stack.work_dir / "runs" / name


def trainer_pids(stack, name: str) -> list[int]:
    """Trainer processes (launchers and ranks; a forked rank has its forkserver's command line) of run `name`."""
    job = run_dir(stack, name) / "job.json"
    out = subprocess.run(["pgrep", "-f", f"trainers.train --job {job}"], capture_output=True, text=True).stdout
    return sorted({int(p) for p in out.split()} | set(rank_pids(job)))


def wait_for_checkpoint(stack, name: str, tokens: int, timeout: float = 600) -> None:
    from trainers.format.checkpoints import list_complete

    deadline = time.monotonic() + timeout
    while not any(c.tokens >= tokens for c in list_complete(run_dir(stack, name) / "checkpoints")):
        assert time.monotonic() < deadline, f"run {name}: no checkpoint at {tokens} tokens after {timeout:.0f} s"
        time.sleep(0.5)


def final_weights(stack, name: str) -> dict[str, torch.Tensor]:
    from trainers.format.checkpoints import list_complete

    last = list_complete(run_dir(stack, name) / "checkpoints")[-1]
    return torch.load(last.path, map_location="cpu", weights_only=False)["state"]["model"]


def mlflow_client(stack):
    from mlflow.tracking import MlflowClient

    return MlflowClient(stack.mlflow_url, stack.mlflow_url)


def mlflow_run(stack, name: str):
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("tessera-tiny")
    return client.search_runs([experiment.experiment_id], f"tags.`tessera.run_name` = '{name}'")[0]


def launches(stack, name: str, stage: str) -> str:
    return (run_dir(stack, name) / "logs" / stage / "rank0.log").read_text()


@pytest.fixture(scope="module")
def interrupted(live_stack):
    """Run `chain` cancelled from the UI mid-stage, rerun and SIGKILLed mid-stage, rerun to completion.

    Returns what each step observed; the tests below assert on it.
    """
    stack, name, seen = live_stack, "chain", {}
    first = trigger(stack, env=MID_STAGE, run_name=name, **SHORT)
    wait_for_checkpoint(stack, name, 8192)
    assert trainer_pids(stack, name), "the trainer should be running mid-stage"
    cancelled_at = time.monotonic()
    _api(stack, "POST", f"/flow_runs/{first}/set_state", json={"state": {"type": "CANCELLING", "name": "Cancelling"}})
    while trainer_pids(stack, name) and time.monotonic() - cancelled_at < 60:
        time.sleep(0.5)
    seen["cancel_stop_s"] = time.monotonic() - cancelled_at
    seen["cancelled"] = wait_state(stack, first, {"CANCELLED"}, timeout=120)
    seen["cancelled_s"] = time.monotonic() - cancelled_at
    seen["cancel_tasks"] = {
        t["name"]: (t["state"]["type"], t["state"]["message"])
        for t in _api(stack, "POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [first]}}})
    }
    seen["cancel_logs"] = logs(stack, first)
    seen["cancel_log_levels"] = {
        r["message"][:120]: r["level"]
        for r in _api(stack, "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [first]}}, "limit": 200})
    }
    # the flow's explanation must be the last word a minute on, as a person opening the run later reads it
    seen["cancel_history"] = cancel_history(stack, first)
    seen["cancelled_later"] = flow_run(stack, first)
    seen["after_cancel"] = mlflow_run(stack, name)

    second = trigger(stack, env=MID_STAGE, run_name=name, if_running="wait", **SHORT)
    wait_for_checkpoint(stack, name, 16384)
    pid = stack.flow_run_pid(second, timeout=30)
    assert pid is not None and trainer_pids(stack, name)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while trainer_pids(stack, name) and time.monotonic() - killed_at < 60:
        time.sleep(0.2)
    seen["kill_stop_s"] = time.monotonic() - killed_at
    seen["crashed"] = wait_state(stack, second, {"CRASHED", "FAILED"}, timeout=120)
    deadline = time.monotonic() + 60  # the worker's on_crashed hook marks the MLflow run
    while mlflow_run(stack, name).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)
    seen["after_kill"] = mlflow_run(stack, name)

    third = trigger(stack, run_name=name, if_running="wait", **SHORT)  # waits out the dead run's lease if needed
    seen["resumed"] = wait_state(stack, third, {"COMPLETED"})
    seen["after_resume"] = mlflow_run(stack, name)
    seen["resume_logs"] = logs(stack, third)
    seen["logs"] = {stage: launches(stack, name, stage) for stage in ("literary", "stories")}
    return seen


def test_cancel_from_the_ui_stops_every_rank_and_marks_the_mlflow_run(interrupted):
    assert interrupted["cancel_stop_s"] < 30, f"trainer still alive {interrupted['cancel_stop_s']:.0f} s after cancel"
    state = interrupted["cancelled"]["state"]
    assert (state["type"], state["name"]) == ("CANCELLED", "Cancelled")
    # The run's first Cancelled is the flow's own explanation, read from the state history: the poll above may
    # first see the runner's generic one written over it seconds later, before the watcher puts it back.
    history = interrupted["cancel_history"]
    ours = next(message for kind, message in history if kind == "CANCELLED")
    assert re.fullmatch(
        r"cancelled: every rank of run 'chain' was stopped; its checkpoint at ([\d,]+) tokens \(step [\d,]+, stage "
        r"literary\) stays, and a rerun of the same run name resumes from it",
        ours,
    ), history
    # the checkpoint it names is one the run has (8,192 tokens or later: the cancel came after that one)
    said = int(re.search(r"checkpoint at ([\d,]+) tokens", ours)[1].replace(",", ""))
    assert said >= 8192
    # the runner's own "Flow run was cancelled successfully." came after it and did not stay the last word
    later = interrupted["cancelled_later"]["state"]
    assert GENERIC_CANCEL in [m for _, m in interrupted["cancel_history"]], interrupted["cancel_history"]
    assert (later["type"], later["name"], later["message"]) == ("CANCELLED", "Cancelled", ours)
    # a clean cancel is not an error: no ERROR line in the run's log (the stage task's Cancelled end included)
    errors = {m: level for m, level in interrupted["cancel_log_levels"].items() if level >= 40}
    assert not errors, errors
    # Cancelled within seconds of the ranks being gone, said by the flow itself, not a red failure anywhere
    assert interrupted["cancelled_s"] - interrupted["cancel_stop_s"] < 10, interrupted["cancelled_s"]
    assert interrupted["cancel_tasks"]["train-literary"][0] == "CANCELLED", interrupted["cancel_tasks"]
    assert not [name for name, (kind, _) in interrupted["cancel_tasks"].items() if kind in ("FAILED", "CRASHED")]
    assert "Finished in state Running()" not in interrupted["cancel_logs"]
    run = interrupted["after_cancel"]
    # the flow's own handler and Prefect's on_cancellation hook both say so; whichever wrote last
    assert run.info.status == "KILLED" and "cancel" in run.data.tags["tessera.end"].lower()


def test_a_killed_flow_process_takes_its_trainer_with_it(interrupted):
    # the trainer's ranks watch the flow-run process; kill -9 of that process ends them within seconds
    assert interrupted["kill_stop_s"] < 15, f"trainer still alive {interrupted['kill_stop_s']:.0f} s after kill -9"
    run = interrupted["after_kill"]
    assert run.info.status == "FAILED", "the on_crashed hook should have marked the MLflow run"
    assert "Crashed" in run.data.tags["tessera.end"]


def test_each_rerun_resumes_from_the_last_checkpoint(interrupted):
    literary = interrupted["logs"]["literary"]
    assert literary.count("fresh at 0 tokens") == 1
    resumes = [int(line.split("resume at ")[1].split()[0]) for line in literary.splitlines() if "resume at " in line]
    assert len(resumes) >= 2 and resumes[0] >= 8192 and resumes[-1] >= 16384
    # the Prefect log says it too, with the checkpoint's step and time
    said = [
        line for line in interrupted["resume_logs"].splitlines() if "resuming run chain from the checkpoint" in line
    ]
    assert said and said[0].startswith(
        f"stage literary: resuming run chain from the checkpoint at {resumes[-1]:,} "
        f"tokens (step {resumes[-1] // 1024}), written 20"
    )
    assert said[0].endswith(" UTC")
    # the MLflow run's end is the last run's, not the cancel's
    run = interrupted["after_resume"]
    assert run.info.status == "FINISHED" and run.data.tags["tessera.end"] == "FINISHED"


def test_two_clicks_on_one_run_name_train_once(live_stack, interrupted):
    """Two runs of `twin` at once: one trains, the other is refused naming it; the result equals a single run."""
    stack = live_stack
    a, b = trigger(stack, run_name="twin", **SHORT), trigger(stack, run_name="twin", **SHORT)
    ends = {}
    for run_id in (a, b):
        deadline = time.monotonic() + 900
        while (state := flow_run(stack, run_id))["state"]["type"] not in TERMINAL:
            assert time.monotonic() < deadline
            time.sleep(2)
        ends[run_id] = state
    kinds = sorted((s["state"]["type"], s["state"]["name"]) for s in ends.values())
    assert kinds == [("CANCELLED", "Refused"), ("COMPLETED", "Completed")], kinds  # a refusal, not a crash
    refused = next(s for s in ends.values() if s["state"]["type"] == "CANCELLED")
    winner = next(s for s in ends.values() if s["state"]["type"] == "COMPLETED")
    assert refused["state"]["message"].startswith(f"run 'twin' is already running in flow run 'twin' ({winner['id']}")
    assert "Traceback" not in logs(stack, refused["id"])
    # one trainer went through the folder: one fresh start, no resume, and the weights of an uninterrupted
    # run, which the cancelled, killed and twice resumed `chain` must also have reached bit for bit
    assert launches(stack, "twin", "literary").count("fresh at 0 tokens") == 1
    twin, chain = final_weights(stack, "twin"), final_weights(stack, "chain")
    assert twin.keys() == chain.keys() and all(torch.equal(twin[k], chain[k]) for k in twin)


def test_a_ui_run_survives_a_60s_tracking_outage_and_records_everything(live_stack):
    """The form with one override (MLflow through the server), MLflow down for 60 s mid-training."""
    stack, name = live_stack, "ui-run"
    run_id = trigger(stack, run_name=name, tracking_uri=stack.mlflow_url)
    client = mlflow_client(stack)
    deadline = time.monotonic() + 600
    while True:  # some steps have reached MLflow: training is under way
        try:
            if client.get_metric_history(mlflow_run(stack, name).info.run_id, "train/loss"):
                break
        except (IndexError, Exception):  # noqa: BLE001 - the run may not exist yet
            pass
        assert time.monotonic() < deadline
        time.sleep(1)
    stack.mlflow_stop()
    time.sleep(60)
    stack.mlflow_start()
    done = wait_state(stack, run_id, {"COMPLETED"})

    # Prefect: named after the run, tagged, linked to MLflow, progress said in the log
    assert done["name"] == name and {"run:ui-run", "recipe:tiny", "tessera"} <= set(done["tags"])
    text = logs(stack, run_id)
    assert "at the run's step" in text and "stage literary: " in text and "tok/s" in text and "ETA" in text
    mlrun = mlflow_run(stack, name)
    links = _api(
        stack, "POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": ["ui-run-mlflow-run"]}}, "limit": 5}
    )
    # Prefect 3.8 stores a link artifact as markdown: [MLflow run ui-run](url)
    assert links and mlrun.info.run_id in links[0]["data"] and links[0]["data"].startswith("[MLflow run ui-run](")
    progress = _api(
        stack, "POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": ["ui-run-train-literary"]}}, "limit": 5}
    )
    assert progress and progress[0]["type"] == "progress" and float(progress[0]["data"]) == 100.0

    # MLflow: every step once although the server was down for a minute, and no relaunch to get there
    steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
    assert sorted(steps) == [1024 * k for k in range(1, 49)], "each of the 48 steps exactly once"
    assert "resume at" not in launches(stack, name, "literary") + launches(stack, name, "stories")
    gauntlet = client.get_metric_history(mlrun.info.run_id, "gauntlet/core_average")
    assert sorted(m.step for m in gauntlet) == [16384, 32768, 49152]

    # what was run: params, the resolved recipe and the job, the code, and the way back to Prefect
    assert mlrun.data.params["stage.literary.tokens"] == "32768" and mlrun.data.params["train.optim.lr"] == "0.003"
    assert mlrun.data.params["data.vocab_size"] == "4096"  # the tests' small tokenizer
    tags = mlrun.data.tags
    assert tags["tessera.prefect.flow_run_id"] == run_id and run_id in tags["tessera.prefect.flow_run_url"]
    assert tags["tessera.recipe_path"] == str(stack.recipe) and len(tags["tessera.git_sha"]) >= 40
    assert {a.path for a in client.list_artifacts(mlrun.info.run_id, "recipe")} == {
        "recipe/recipe.yaml",
        "recipe/job.json",
    }
    versions = client.search_model_versions(f"name = 'tessera-tiny' and run_id = '{mlrun.info.run_id}'")
    assert sorted(int(v.tags["tokens"]) for v in versions) == [16384, 32768, 49152]
    aliases = client.get_registered_model("tessera-tiny").aliases
    assert {"latest-checkpoint", "best", "champion"} <= set(aliases)


def test_bad_form_values_are_refused_before_anything_runs(live_stack):
    """Out-of-bounds values are rejected by the server (enforced schema); a bad recipe fails in one line."""
    stack = live_stack
    deployment = _api(stack, "GET", f"/deployments/name/{DEPLOYMENT}")
    refused = httpx.post(
        f"{stack.api_url}/deployments/{deployment['id']}/create_flow_run",
        timeout=30,
        json={"parameters": {"params": {"recipe": str(stack.recipe), "lr": 5}}},
    )
    assert refused.status_code == 409 and "lr" in refused.text  # no flow run was created at all
    # the bounds only the served recipe knows are in the form's schema too: refused by the server, marked by the UI
    from tasks.recipe import load_recipe

    recipe = load_recipe(str(stack.recipe))
    step = recipe.train.global_batch_size * recipe.data.seq_len
    for bad, field in (
        ({"eval_every": step + 1}, "eval_every"),
        ({"stage_tokens": [{"stage": "no-such-stage", "tokens": step}]}, "stage"),
        ({"stage_tokens": [{"stage": recipe.train.stages[0].name, "tokens": step + 1}]}, "tokens"),
    ):
        answer = httpx.post(
            f"{stack.api_url}/deployments/{deployment['id']}/create_flow_run",
            timeout=30,
            json={"parameters": {"params": {"recipe": str(stack.recipe), **bad}}},
        )
        assert answer.status_code == 409 and field in answer.text, (bad, answer.text)
    # the UI's "Validate parameters" switched off: the flow checks the same bounds first thing, in one line
    unchecked = _api(
        stack,
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        json={"parameters": {"params": {"recipe": str(stack.recipe), "lr": 5}}, "enforce_parameter_schema": False},
    )
    run = wait_state(stack, unchecked["id"], {"FAILED"}, timeout=300)
    assert run["state"]["message"].endswith(
        "RecipeError: form field lr 5: Input should be less than or equal to 1 (Peak learning rate "
        "(train.optim.lr): above 0 and at most 1.)"
    )
    assert "Traceback" not in logs(stack, unchecked["id"])
    # a run name that would write outside the runs folder: refused by the server, and by the flow itself
    outside = httpx.post(
        f"{stack.api_url}/deployments/{deployment['id']}/create_flow_run",
        timeout=30,
        json={"parameters": {"params": {"recipe": str(stack.recipe), "run_name": ".."}}},
    )
    assert outside.status_code == 409 and "run_name" in outside.text
    unchecked = _api(
        stack,
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        json={
            "parameters": {"params": {"recipe": str(stack.recipe), "run_name": ".."}},
            "enforce_parameter_schema": False,
        },
    )
    run = wait_state(stack, unchecked["id"], {"FAILED"}, timeout=300)
    assert "RecipeError: form field run_name '..': String should match pattern" in run["state"]["message"]
    said = logs(stack, unchecked["id"])
    assert "Traceback" not in said and "Engine execution exited with unexpected exception" not in said
    run_id = trigger(stack, recipe="configs/no-such-recipe.yaml")
    deadline = time.monotonic() + 300
    while (run := flow_run(stack, run_id))["state"]["type"] not in TERMINAL:
        assert time.monotonic() < deadline
        time.sleep(1)
    assert run["state"]["type"] == "FAILED"
    assert "configs/no-such-recipe.yaml: recipe file not found" in run["state"]["message"]
    said = logs(stack, run_id)
    assert "Traceback" not in said and "Engine execution exited with unexpected exception" not in said


def _continued_run_name(stack, run_id: str, timeout: float = 300) -> str:
    """The derived name a continued run tags its flow run with (`run:<name>`) once it has chosen its base."""
    deadline = time.monotonic() + timeout
    while True:
        run = flow_run(stack, run_id)
        tagged = [t.removeprefix("run:") for t in run["tags"] if t.startswith("run:")]
        if tagged:
            return tagged[0]
        assert run["state"]["type"] not in TERMINAL, f"{run['state']}\n{logs(stack, run_id)}"
        assert time.monotonic() < deadline, f"no run: tag after {timeout:.0f} s\n{logs(stack, run_id)}"
        time.sleep(0.5)


def test_a_continued_run_cancelled_or_killed_from_the_ui_says_so_and_closes_its_mlflow_run(live_stack, interrupted):
    """Issue 42: the `continue` flow's end hooks, run by the real worker's runner. A cancel from the UI mid-training
    ends Cancelled with tessera's explanation as the last word, logs no error (the hook once raised TypeError:
    Prefect passes `flow_run` by keyword) and marks the MLflow run KILLED; a kill -9 of the flow process ends it
    Crashed and the MLflow run FAILED."""
    stack = live_stack
    inbox = stack.work_dir / "incoming-hooks"
    inbox.mkdir(exist_ok=True)
    stories = (ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt").read_text().split("\n\n")
    (inbox / "arrived.txt").write_text("\n\n".join(stories[:200]))
    deployment = _api(stack, "GET", "/deployments/name/continued_pretraining/continue")
    params = {"recipe": str(stack.recipe), "new_data": str(inbox), "base": "models:/tessera-tiny/1", "tokens": 131072}
    seen = {}
    for how in ("cancel", "kill"):
        run_id = _api(
            stack, "POST", f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"params": params}}
        )["id"]
        name = _continued_run_name(stack, run_id)
        deadline = time.monotonic() + 600
        while not trainer_pids(stack, name):
            assert flow_run(stack, run_id)["state"]["type"] not in TERMINAL, logs(stack, run_id)
            assert time.monotonic() < deadline, f"continued run {name}: no trainer after 600 s"
            time.sleep(0.5)
        if how == "cancel":
            _api(stack, "POST", f"/flow_runs/{run_id}/set_state", json={"state": {"type": "CANCELLING"}})
            ended = wait_state(stack, run_id, {"CANCELLED"}, timeout=180)
            cancel_history(stack, run_id)  # the runner has run the hooks, and the flow's word is back on top
        else:
            os.kill(stack.flow_run_pid(run_id, timeout=30), signal.SIGKILL)
            ended = wait_state(stack, run_id, {"CRASHED", "FAILED"}, timeout=180)
        deadline = time.monotonic() + 60  # the runner's hooks run once the flow's process is gone
        while mlflow_run(stack, name).info.status == "RUNNING" and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)  # the hooks' log lines reach the server
        levels = _api(stack, "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
        seen[how] = (ended, flow_run(stack, run_id)["state"], mlflow_run(stack, name), levels, name)

    ended, last, run, levels, name = seen["cancel"]
    assert ended["state"]["type"] == "CANCELLED" and last["type"] == "CANCELLED"
    assert last["message"] != GENERIC_CANCEL and name in last["message"], last
    assert [r["message"][:200] for r in levels if r["level"] >= 40] == []  # no hook error, no red line
    assert run.info.status == "KILLED" and "cancel" in run.data.tags["tessera.end"].lower(), run.data.tags
    ended, last, run, levels, name = seen["kill"]
    assert last["type"] in ("CRASHED", "FAILED"), last
    assert not [r["message"] for r in levels if "_record_end" in r["message"]]
    assert run.info.status == "FAILED" and "Crashed" in run.data.tags["tessera.end"], run.data.tags


def test_no_service_logged_an_error_during_the_whole_session(live_stack):
    """Last in the live modules: the Prefect server's background services (the scheduler, the repossessor,
    the event and task-run recorders, ...), the worker and MLflow ran through every live test above
    without logging an error, which `tessera up` would have printed on its terminal. A pin pip check
    accepts can still break a service that only runs in the background (SQLAlchemy 2.1 broke the scheduler)."""
    from cli.service_logs import CONTENTION_HINT

    time.sleep(3)  # tessera up reads the logs once a second
    said = [line for line in live_stack.output.read_text().splitlines() if "logged an error" in line]
    # A flow run's own errors are said too, under its name (cli/service_logs.py): here only the bad input the
    # live tests above give on purpose (a form's bound, a run name, a recipe that is not there), each one line.
    runs = [line for line in said if line.startswith("tessera up: a flow run logged an error: Flow run '")]
    assert all("RecipeError(" in line and "Traceback" not in line for line in runs), runs
    said = [line for line in said if line not in runs]
    # Not a broken service: the Prefect server on SQLite, on 2 cores saturated by training, sometimes fails a
    # write at once rather than wait for the lock (a worker heartbeat), and it is retried. tessera up says
    # that too, with CONTENTION_HINT; every other error fails this test.
    assert [line for line in said if CONTENTION_HINT not in line] == []
