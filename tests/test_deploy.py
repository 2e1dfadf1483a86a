"""`tessera deploy` and `tessera up` against real servers: Prefect server + process worker + MLflow."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psutil
import pytest

from cli.deploy import DeployError, load_project
from cli.forms import UI_DROPPED_BOUNDS
from flows.continued import ContinueParams
from flows.evaluate import EvalParams
from flows.pipeline import PipelineParams
from flows.prepare import PrepareParams
from tasks.recipe import load_recipe
from tests.conftest import ROOT, answers, free_port, prefect_api, start_tessera_up, stop_tree, tiny_recipe

pytestmark = pytest.mark.slow

PARAMS = {
    "pretrain_pipeline/pretrain": PipelineParams,
    "prepare_data/prepare": PrepareParams,
    "tessera-eval/eval": EvalParams,
    "continued_pretraining/continue": ContinueParams,
    "continued_pretraining/continued-pretraining-weekly": ContinueParams,
}


def tessera(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def deployment(api: str, name: str) -> dict:
    response = httpx.get(f"{api}/deployments/name/{name}", timeout=10)
    response.raise_for_status()
    return response.json()


def run_deployment(api: str, name: str, params: dict) -> str:
    response = prefect_api(
        "POST",
        f"{api}/deployments/{deployment(api, name)['id']}/create_flow_run",
        json={"parameters": {"params": params}},
    )
    return response.json()["id"]


def final_state(api: str, flow_run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} not finished after {timeout:.0f} s")


def started_by(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


WEEKLY = "continued_pretraining/continued-pretraining-weekly"


def scheduled_runs(api: str, deployment_id: str) -> list[dict]:
    """The deployment's runs in state Scheduled, soonest first: its *Upcoming* tab in the UI."""
    body = {
        "flow_runs": {"deployment_id": {"any_": [deployment_id]}, "state": {"type": {"any_": ["SCHEDULED"]}}},
        "sort": "EXPECTED_START_TIME_ASC",
        "limit": 20,
    }
    return prefect_api("POST", f"{api}/flow_runs/filter", json=body).json()


def until(what, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        if time.monotonic() > deadline:
            pytest.fail(f"{message} after {timeout:.0f} s")
        time.sleep(1)
    return value


def test_a_cron_schedule_creates_runs_and_the_worker_runs_one(live_stack, tmp_path):
    """The server's scheduler, on as for a user, fills the weekly deployment's Upcoming tab and fires a cron.

    With SQLAlchemy 2.1 Prefect 3.8's scheduler failed every loop ("Can't evaluate bulk DML statement"): the
    schedule showed as active and no run was ever created.
    """
    api = live_stack.api_url
    weekly = deployment(api, WEEKLY)
    upcoming = until(lambda: scheduled_runs(api, weekly["id"]), 90, "the weekly deployment has no scheduled run")
    starts = [datetime.fromisoformat(r["expected_start_time"]) for r in upcoming]
    assert len(starts) >= 3 and all(r["auto_scheduled"] for r in upcoming)
    assert all((t.weekday(), t.hour, t.minute, t.utcoffset()) == (0, 3, 0, timedelta(0)) for t in starts)
    now = datetime.now(UTC)
    assert now < starts[0] <= now + timedelta(days=7)
    assert [b - a for a, b in zip(starts, starts[1:])] == [timedelta(days=7)] * (len(starts) - 1)
    # a Monday-03:00 run must not fire into the test session and train the repo's own recipe
    prefect_api("POST", f"{api}/deployments/{weekly['id']}/pause_deployment")
    until(lambda: not scheduled_runs(api, weekly["id"]), 30, "pausing left the weekly deployment's runs scheduled")

    flow = prefect_api("POST", f"{api}/flows/", json={"name": "schedule-probe"}).json()
    probe = prefect_api(
        "POST",
        f"{api}/deployments/",
        json={
            "name": "every-minute",
            "flow_id": flow["id"],
            "entrypoint": "tests/schedule_probe.py:schedule_probe",
            "work_pool_name": "tessera-local",
            "parameters": {"marker": str(tmp_path / "marker")},
            "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
            "schedules": [{"schedule": {"cron": "* * * * *", "timezone": "UTC"}, "active": True}],
        },
    ).json()
    try:
        until(lambda: scheduled_runs(api, probe["id"]), 90, "the one-minute cron created no scheduled run")

        def completed() -> list[dict]:
            body = {
                "flow_runs": {
                    "deployment_id": {"any_": [probe["id"]]},
                    "state": {"type": {"any_": ["COMPLETED", "FAILED", "CRASHED"]}},
                },
                "limit": 5,
            }
            return prefect_api("POST", f"{api}/flow_runs/filter", json=body).json()

        done = until(completed, 180, "no scheduled run of the one-minute cron finished")
        assert [(r["state"]["type"], r["auto_scheduled"]) for r in done[:1]] == [("COMPLETED", True)]
        expected = datetime.fromisoformat(done[0]["expected_start_time"])
        assert (expected.second, expected.microsecond) == (0, 0)  # a minute boundary: the cron, not a manual run
        assert (tmp_path / "marker" / "ran").exists()
    finally:
        prefect_api("POST", f"{api}/deployments/{probe['id']}/pause_deployment")
        prefect_api("DELETE", f"{api}/deployments/{probe['id']}")


def test_up_serves_the_deployments_on_an_online_local_worker(live_stack):
    api = live_stack.api_url
    for name, model in PARAMS.items():
        d = deployment(api, name)
        assert d["work_pool_name"] == "tessera-local"
        assert d["enforce_parameter_schema"] is True
        assert "tessera" in d["tags"] and d["description"]
        # Prefect's default pull step: flow runs start in the checkout `tessera deploy` ran from
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        schema = d["parameter_openapi_schema"]
        assert schema["required"] == ["params"]
        form = schema["definitions"][model.__name__]["properties"]  # the UI form is the parameter model
        assert {f: form[f].get("description") for f in model.model_fields} == {
            f: info.description for f, info in model.model_fields.items()
        }
    # every form defaults to the recipe `tessera up` was given (whose MLflow store it serves), not prefect.yaml's
    served = str(Path(live_stack.recipe).resolve())  # outside the checkout: absolute
    assert deployment(api, "pretrain_pipeline/pretrain")["parameters"] == {"params": {"recipe": served}}
    assert deployment(api, "prepare_data/prepare")["parameters"] == {"params": {"recipe": served}}
    assert deployment(api, "tessera-eval/eval")["parameters"] == {}
    weekly = deployment(api, "continued_pretraining/continued-pretraining-weekly")
    # the folder a person drops files in, whole: not a path relative to some checkout
    assert weekly["parameters"] == {"params": {"recipe": served, "new_data": str(ROOT / "data" / "incoming")}}
    # and the bounds only that recipe knows: its stages to choose from, the tokens of a step to be a multiple of
    from tasks.recipe import load_recipe

    recipe = load_recipe(served)
    form = deployment(api, "pretrain_pipeline/pretrain")["parameter_openapi_schema"]["definitions"]["PipelineParams"]
    step = recipe.train.global_batch_size * recipe.data.seq_len
    # (every bound under allOf, where Prefect's UI passes it to its in-place check: cli/forms.bounds_the_ui_checks)
    assert form["properties"]["eval_every"]["allOf"] == [{"minimum": 1, "multipleOf": step}]
    assert form["properties"]["lr"]["allOf"] == [{"exclusiveMinimum": 0, "maximum": 1}]
    assert not set(UI_DROPPED_BOUNDS) & (set(form["properties"]["lr"]) | set(form["properties"]["eval_every"]))
    row = form["properties"]["stage_tokens"]["items"]["properties"]
    steps = [
        (s.global_batch_size or recipe.train.global_batch_size) * (s.seq_len or recipe.data.seq_len)
        for s in recipe.train.stages
    ]
    assert row["stage"]["enum"] == [s.name for s in recipe.train.stages]
    assert row["tokens"]["allOf"] == [{"exclusiveMinimum": 0, "multipleOf": math.gcd(*steps)}]
    # a form without a recipe is moved too
    eval_form = deployment(api, "tessera-eval/eval")["parameter_openapi_schema"]["definitions"]["EvalParams"]
    assert eval_form["properties"]["batch_size"]["allOf"] == [{"exclusiveMinimum": 0}]
    assert not [k for k, v in eval_form["properties"].items() if set(UI_DROPPED_BOUNDS) & set(v)]
    printed = live_stack.output.read_text()
    assert f"every form's recipe defaults to {served}" in printed
    # the MLflow link that lands on training, and the one line on why the bare address does not
    assert f"MLflow UI    {live_stack.mlflow_url}/tessera/model-training" in printed
    assert "'new Model Registry UI': 'Try it now' shows the aliases" in printed
    assert "this link makes model training your browser's MLflow view" in printed
    # the page that link opens, served by the MLflow server `tessera up` runs (cli/mlflow_app.py)
    page = httpx.get(f"{live_stack.mlflow_url}/tessera/model-training", timeout=30)
    assert page.status_code == 200
    assert 'localStorage.setItem("mlflow.workflowType_v1", JSON.stringify("machine_learning"))' in page.text
    assert 'location.replace("../#/experiments?workflowType=machine_learning")' in page.text
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in weekly["schedules"]] == [
        ("0 3 * * 1", "UTC", True)
    ]

    limits = {}
    for name in PARAMS:
        d = deployment(api, name)
        limit = d["global_concurrency_limit"]
        limits[name] = limit and (limit["limit"], d["concurrency_options"]["collision_strategy"])
    assert limits == {
        "pretrain_pipeline/pretrain": None,
        "prepare_data/prepare": (1, "ENQUEUE"),
        "tessera-eval/eval": (2, "ENQUEUE"),
        "continued_pretraining/continue": (1, "ENQUEUE"),
        "continued_pretraining/continued-pretraining-weekly": (1, "CANCEL_NEW"),
    }

    pool = httpx.get(f"{api}/work_pools/tessera-local", timeout=10).json()
    assert pool["type"] == "process"
    workers = httpx.post(
        f"{api}/work_pools/tessera-local/workers/filter", json={"limit": 10, "offset": 0}, timeout=10
    ).json()
    assert [w["status"] for w in workers if w["name"] == live_stack.state["worker_name"]] == ["ONLINE"]

    assert httpx.get(f"{live_stack.mlflow_url}/health", timeout=10).text == "OK"
    # the UI finds its API on the port it was given, and serves its pages (the SPA answers a browser's Accept)
    assert httpx.get(f"{live_stack.ui_url}/ui-settings", timeout=10).json()["api_url"] == api
    page = httpx.get(f"{live_stack.ui_url}/deployments", headers={"Accept": "text/html"}, timeout=10)
    assert page.status_code == 200 and "<html" in page.text


def test_deploy_prints_one_url_per_deployment_and_is_idempotent(live_stack):
    runs = [tessera("deploy", "--recipe", str(live_stack.recipe), env=live_stack.env) for _ in range(2)]
    ids = []
    for run in runs:
        assert run.returncode == 0, run.stderr
        lines = dict(line.split() for line in run.stdout.splitlines())
        assert set(lines) == set(PARAMS)
        prefix = f"{live_stack.ui_url}/deployments/deployment/"
        assert all(url.startswith(prefix) for url in lines.values())
        ids.append({name: url.removeprefix(prefix) for name, url in lines.items()})
    assert ids[0] == ids[1] == {name: deployment(live_stack.api_url, name)["id"] for name in PARAMS}
    served = str(Path(live_stack.recipe).resolve())
    assert deployment(live_stack.api_url, "pretrain_pipeline/pretrain")["parameters"] == {"params": {"recipe": served}}
    # prefect.yaml's own default without --recipe; a recipe that does not load is one line and publishes nothing
    bad = tessera("deploy", "pretrain", "--recipe", "/nonexistent/recipe.yaml", env=live_stack.env)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "/nonexistent/recipe.yaml" in bad.stderr
    assert deployment(live_stack.api_url, "pretrain_pipeline/pretrain")["parameters"] == {"params": {"recipe": served}}
    # publishing again re-activates the weekly schedule: pause it again (see the cron test)
    prefect_api("POST", f"{live_stack.api_url}/deployments/{ids[1][WEEKLY]}/pause_deployment")


def test_deploy_bad_input_is_one_line(live_stack):
    unknown = tessera("deploy", "pretrain", "nosuch", env=live_stack.env)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == [
        "tessera: error: unknown deployment 'nosuch'; prefect.yaml declares: pretrain, prepare, eval, continue, "
        "continued-pretraining-weekly"
    ]
    try:
        import prefect_kubernetes  # noqa: F401
    except ImportError:
        k8s = tessera("deploy", "--pool", "tessera-k8s", env=live_stack.env)
        assert k8s.returncode == 2 and len(k8s.stderr.splitlines()) == 1
        assert "pip install prefect-kubernetes" in k8s.stderr
        assert httpx.get(f"{live_stack.api_url}/work_pools/tessera-k8s", timeout=10).status_code == 404


def test_deploy_without_a_server_says_how_to_start_one(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/api"
    run = tessera("deploy", env={"PREFECT_API_URL": dead})
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.splitlines()) == 1
    assert (
        run.stderr.startswith(f"tessera: error: the Prefect server at {dead} does not answer")
        and "`tessera up`" in run.stderr
    )

    # no server configured at all: no PREFECT_API_URL and an empty profile
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path), PREFECT_PROFILES_PATH=str(tmp_path / "profiles.toml"))
    unset = subprocess.run(
        [sys.executable, "-m", "cli.main", "deploy"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert unset.returncode == 2
    assert unset.stderr.splitlines() == [
        "tessera: error: no Prefect server configured (PREFECT_API_URL is not set); start one with `tessera up`"
    ]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("deployments:\n", "deployments: [\n", ":{line}: invalid YAML: expected the node content, but found '-'"),
        (
            "      limit: 1\n",
            "      limit: lots\n",
            ": deployments.1.concurrency_limit.limit: Input should be a valid integer, unable to parse string as an "
            "integer",
        ),
        (
            "    work_pool: *tessera_local\n\n  - name: prepare",
            "    work_pool: {name: gpu}\n\n  - name: prepare",
            ": deployments.0 (pretrain): work pool 'gpu' is not under definitions.work_pools",
        ),
    ],
)
def test_a_bad_prefect_yaml_is_one_line(tmp_path, old, new, message):
    text = (ROOT / "prefect.yaml").read_text()
    assert old in text
    (tmp_path / "prefect.yaml").write_text(text.replace(old, new, 1))
    with pytest.raises(DeployError) as exc:
        load_project(tmp_path)
    line = text.splitlines().index("deployments:") + 2  # the first "- name:" under it
    assert str(exc.value) == f"{tmp_path / 'prefect.yaml'}{message.format(line=line)}"


def _ours(path: Path) -> list[psutil.Process]:
    """Processes whose command line names `path`: what a tessera up on that work dir would have started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(path) in arg for arg in proc.info["cmdline"] or []) and proc.pid != os.getpid():
            found.append(proc)
    return found


def test_up_on_a_port_in_use_says_so_and_starts_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mlflow_port = free_port()
        run = tessera(
            "up",
            str(tiny_recipe(tmp_path)),
            "--work-dir",
            str(tmp_path / "work"),
            "--prefect-port",
            str(port),
            "--mlflow-port",
            str(mlflow_port),
        )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        f"tessera: error: --prefect-port {port}: 127.0.0.1:{port} is already in use; pick another port or stop what "
        "listens there"
    ]
    assert _ours(tmp_path) == [] and not answers(f"http://127.0.0.1:{mlflow_port}/health")


def test_a_service_dying_during_start_up_is_one_line_and_stops_the_rest(tmp_path):
    recipe = tiny_recipe(tmp_path)
    text = recipe.read_text().replace(f"sqlite:///{tmp_path / 'mlflow.db'}", "mysql://nobody@127.0.0.1:1/none")
    recipe.write_text(text)  # MLflow exits at once: this environment has no MySQL driver
    process, prefect_port, _, output = start_tessera_up(recipe, tmp_path / "work")
    assert process.wait(timeout=180) == 1
    log = tmp_path / "work" / "up" / "mlflow.log"
    lines = output.read_text().splitlines()
    assert lines[-1] == f"tessera: error: mlflow exited during start-up (exit code 1); see {log}"
    # what MLflow logged as it died is said too, each line naming its log
    said = lines[:-1]
    assert said and all(
        line.startswith("tessera up: mlflow logged an error: ") and line.endswith(f"(see {log})") for line in said
    )
    assert any("ModuleNotFoundError: No module named 'MySQLdb'" in line for line in said)
    # the Prefect server it had started is gone with it
    assert not answers(f"http://127.0.0.1:{prefect_port}/api/health")
    assert [p for p in _ours(tmp_path) if p.is_running()] == []


def test_a_run_triggered_through_the_api_runs_on_the_worker(live_stack):
    flow_run = run_deployment(live_stack.api_url, "prepare_data/prepare", {"recipe": str(live_stack.recipe)})
    pid = live_stack.flow_run_pid(flow_run, timeout=60)
    assert pid is not None, "no process runs the flow run"
    engine = psutil.Process(pid)
    assert engine.environ()["PREFECT__FLOW_RUN_ID"] == flow_run
    assert engine.ppid() == live_stack.worker_pid and os.getsid(pid) == pid  # the worker's child, its own session
    state = final_state(live_stack.api_url, flow_run, timeout=300)
    assert state["type"] == "COMPLETED", state["message"]
    # data/... paths of the recipe resolved against the checkout the deployment points at
    root = Path(load_recipe(live_stack.recipe).data.root)
    assert sorted(p.parent.name.split("-")[0] for p in root.glob("*/provenance.json")) == ["literary", "stories"]


def test_mlflow_stops_and_restarts_on_its_port_while_the_stack_stays_up(live_stack):
    live_stack.mlflow_stop()
    assert live_stack.process.poll() is None and answers(f"{live_stack.api_url}/health")
    live_stack.mlflow_start()
    experiments = httpx.post(
        f"{live_stack.mlflow_url}/api/2.0/mlflow/experiments/search", json={"max_results": 10}, timeout=10
    )
    assert experiments.status_code == 200
    assert live_stack.process.poll() is None


def test_sigterm_stops_every_process_up_started_and_nothing_else(tmp_path):
    sibling = subprocess.Popen(["sleep", "600"])  # ours, not tessera up's: it must survive
    recipe = tiny_recipe(tmp_path)
    up, prefect_port, mlflow_port, output = start_tessera_up(recipe, tmp_path / "work", "--no-deploy")
    api = f"http://127.0.0.1:{prefect_port}/api"
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "work" / "up" / "state.json").exists():  # written once everything answers
            assert up.poll() is None, output.read_text()
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(1)
        deployed = tessera("deploy", "pretrain", env={"PREFECT_API_URL": api})  # one deployment, one line
        assert deployed.returncode == 0, deployed.stderr
        pretrain = deployment(api, "pretrain_pipeline/pretrain")
        assert deployed.stdout.split() == [
            "pretrain_pipeline/pretrain",
            f"http://127.0.0.1:{prefect_port}/deployments/deployment/{pretrain['id']}",
        ]
        assert pretrain["work_pool_name"] == "tessera-local"
        run_deployment(api, "pretrain_pipeline/pretrain", {"recipe": str(recipe)})
        # wait until a trainer runs: flow run and trainer live in sessions of their own
        while not any("trainers.train" in " ".join(p.cmdline()) for p in started_by(up.pid) if p.is_running()):
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(1)
        tree = started_by(up.pid)
        assert {os.getsid(p.pid) for p in tree} - {os.getsid(up.pid)}, "expected processes in other sessions"

        up.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert up.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(tree, timeout=max(0.0, 30 - (time.monotonic() - stopped)))
        assert alive == [], [p.cmdline() for p in alive]
        assert sibling.poll() is None
        assert not answers(f"{api}/health") and not answers(f"http://127.0.0.1:{mlflow_port}/health")
        assert output.read_text().splitlines()[-2:] == ["tessera up: stopping ...", "tessera up: stopped"]
        # the flow run says why it ended, in its final state (read from the stopped server's database)
        import sqlite3

        with sqlite3.connect(tmp_path / "work" / "prefect" / "prefect.db") as db:
            rows = db.execute(
                "SELECT fr.state_type, fr.state_name, s.message FROM flow_run fr JOIN flow_run_state s "
                "ON s.id = fr.state_id WHERE fr.parent_task_run_id IS NULL"
            ).fetchall()
        assert [(kind, name) for kind, name, _ in rows] == [("CANCELLED", "Cancelled")]
        # what stays, as the run's folder has it: the newest checkpoint, or nothing yet (stopped before the first)
        from trainers.format.checkpoints import list_complete

        saved = list_complete(tmp_path / "work" / "runs" / "tiny" / "checkpoints")
        kept = (
            f"its checkpoint at {saved[-1].tokens:,} tokens (step {saved[-1].batch:,}, stage {saved[-1].stage}) "
            "stays, and a rerun of the same run name resumes from it"
            if saved
            else "nothing was saved yet, so a rerun of the same run name starts it fresh"
        )
        assert rows[0][2] == (
            f"stopped by `tessera up` shutting down (SIGTERM): every rank of run 'tiny' was stopped; {kept}"
        )
    finally:
        if up.poll() is None:
            stop_tree(started_by(up.pid))
        sibling.kill()
        sibling.wait()


def test_a_run_on_another_recipes_store_says_so_in_one_line(monkeypatch, tmp_path):
    """`tessera up` tells its worker the store it serves; a form run on a recipe tracking elsewhere is told."""
    from tasks.mlflow_run import SERVED_STORE_ENV, resolved_uri, served_elsewhere

    served = resolved_uri(f"sqlite:///{tmp_path / 'served' / 'mlflow.db'}")
    monkeypatch.setenv(SERVED_STORE_ENV, served)
    assert served_elsewhere(f"sqlite:///{tmp_path / 'served' / 'mlflow.db'}") is None
    other = f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}"
    line = served_elsewhere(other)
    assert line == (
        f"this run tracks into {resolved_uri(other)}, not the MLflow store `tessera up` serves ({served}): its runs "
        "and models show in that store's MLflow, not at the MLflow link `tessera up` printed"
    )
    monkeypatch.delenv(SERVED_STORE_ENV)
    assert served_elsewhere(other) is None  # `tessera run` and workers `tessera up` did not start: nothing to say


def test_up_unsticks_a_run_whose_deployment_was_deleted_while_it_ran(live_stack):
    """`tessera up` revokes the lease a deleted deployment's live run holds, so the run can still end (without it
    Prefect's server answers 500 to every transition of that run: tests/test_stuck_runs.py)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Completed, Pending, Running

    with temporary_settings({PREFECT_API_URL: live_stack.api_url}), get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("stuck-probe")
        deployment = client.create_deployment(
            flow_id=flow_id, name="deleted-while-running", concurrency_limit=1, entrypoint="x.py:probe"
        )
        run = client.create_flow_run_from_deployment(deployment)  # no work pool: no worker picks it up
        for state in (Pending(), Running()):
            client.set_flow_run_state(run.id, state)
        client.delete_deployment(deployment)
        deadline = time.monotonic() + 60
        while client.read_flow_run(run.id).state.state_details.deployment_concurrency_lease_id is not None:
            said = live_stack.output.read_text()
            if f"({run.id}): its deployment or its concurrency limit was removed" in said:
                break
            assert time.monotonic() < deadline, said[-2000:]
            time.sleep(1)
        assert client.set_flow_run_state(run.id, Completed()).state.type.value == "COMPLETED"
    assert f"tessera up: flow run {run.name!r} ({run.id}): its deployment or its concurrency limit was removed" in (
        live_stack.output.read_text()
    )
