"""`tessera up`: the whole UI on this machine, Prefect server + a process worker + MLflow, until Ctrl-C.

This module starts what cli/up_plan.py decided (ports, folders, the environment each service gets), publishes the
deployments and says where everything is; cli/up_stack.py owns the processes, how they are watched (their errors
said on the terminal) and how they are stopped.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from prefect.settings import PREFECT_API_URL, temporary_settings

from cli.deploy import (
    Deployed,
    DeployError,
    Project,
    deploy,
    ensure_pool,
    load_project,
    recipe_default,
)
from cli.mlflow_app import MODEL_TRAINING_PAGE
from cli.up_plan import LOCAL_POOL, Plan, UpOptions, plan_up
from cli.up_stack import UpError, _become_subreaper, _Stack
from tasks.recipe import load_recipe
from tasks.slots import ensure_names_lock
from trainers.contract import EXIT_BAD_INPUT, EXIT_FAILED

STATE_FILE = "state.json"


class _Stopped(BaseException):
    """Ctrl-C or SIGTERM: a request to stop, not an error."""


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _worker_online(api: str, name: str, since: str) -> bool:
    body = {
        "workers": {"status": {"any_": ["ONLINE"]}, "last_heartbeat_time": {"after_": since}},
        "limit": 200,
        "offset": 0,
    }
    try:
        response = httpx.post(f"{api}/work_pools/{LOCAL_POOL}/workers/filter", json=body, timeout=5)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and any(w["name"] == name for w in response.json())


def _lock(path: Path):
    handle = open(path, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UpError(f"another tessera up is running with work dir {path.parent.parent}", EXIT_BAD_INPUT) from None
    return handle


def _on_signal(signum: int, frame) -> None:
    raise _Stopped(signum)


def _check_ports(host: str, ports: dict[str, int]) -> None:
    if len(set(ports.values())) < len(ports):
        raise UpError(f"{' and '.join(ports)} are the same port ({next(iter(ports.values()))})", EXIT_BAD_INPUT)
    for flag, port in ports.items():
        if not _port_free(host, port):
            raise UpError(
                f"{flag} {port}: {host}:{port} is already in use; pick another port or stop what listens there",
                EXIT_BAD_INPUT,
            )


def up(opts: UpOptions) -> int:
    """Start the stack, print where everything is, and wait; 0 after Ctrl-C or SIGTERM."""
    recipe = load_recipe(opts.recipe)  # bad input stops here, before anything starts
    try:
        project = load_project()
    except DeployError as exc:
        raise UpError(str(exc), EXIT_BAD_INPUT) from None
    if LOCAL_POOL not in project.pools:
        raise UpError(f"{project.root / 'prefect.yaml'}: definitions.work_pools has no {LOCAL_POOL!r}", EXIT_BAD_INPUT)
    plan = plan_up(opts, recipe, project)
    _check_ports(opts.host, plan.ports)
    folders = [plan.logs, Path(plan.server.env["PREFECT_HOME"])]
    if plan.store and plan.store.startswith("sqlite:///"):
        folders.append(Path(plan.store.removeprefix("sqlite:///")).parent)
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)  # the servers' sqlite stores cannot create their own folders
        except OSError as exc:
            raise UpError(f"cannot create {folder}: {exc.strerror}", EXIT_BAD_INPUT) from None
    lock = _lock(plan.logs / "lock")
    try:
        return _run(plan, project, opts.deploy)
    finally:
        lock.close()


def _run(plan: Plan, project: Project, publish: bool) -> int:
    stack = _Stack()
    started = time.monotonic()
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code, quiet_stop = EXIT_FAILED, True  # a failed start-up says one line, nothing more
    try:
        _become_subreaper()
        stack.start(plan.server)
        if plan.mlflow:
            stack.start(plan.mlflow)
        stack.wait_for(plan.server, lambda: _answers(f"{plan.api}/health"))
        stack.api = plan.api
        since = datetime.now(UTC).replace(microsecond=0).isoformat()  # this session's heartbeats only
        try:
            with temporary_settings({PREFECT_API_URL: plan.api}):
                ensure_pool(project, LOCAL_POOL)
                ensure_names_lock()  # also with --no-deploy: run names' slots are created through it
                stack.start(plan.worker)  # it boots while the deployments are published
                deployed = deploy(project=project, log=plan.logs / "deploy.log", recipe=plan.recipe) if publish else []
        except DeployError as exc:
            raise UpError(f"deploy: {exc}") from None
        stack.wait_for(plan.worker, lambda: _worker_online(plan.api, plan.worker_name, since))
        if plan.mlflow:
            stack.wait_for(plan.mlflow, lambda: _answers(f"{plan.mlflow_url}/health"))
        _write_state(plan, stack)
        _print_ready(time.monotonic() - started, plan, deployed, stack)
        quiet_stop = False
        code = stack.supervise(every_10s=_unstick(plan.api))
    except _Stopped as stop:
        code, quiet_stop = 0, False
        name = "Ctrl-C" if stop.args and stop.args[0] == signal.SIGINT else "SIGTERM"
        stack.why = f"stopped by `tessera up` shutting down ({name})"
    finally:
        for sig in previous:  # a second Ctrl-C while stopping skips the grace periods
            signal.signal(sig, lambda *_: setattr(stack, "hurry", True))
        if not quiet_stop:
            print("tessera up: stopping ...", flush=True)
        while True:
            try:
                stack.stop()
                break
            except _Stopped:  # a signal that arrived before the handlers above were in place
                stack.hurry = True
        (plan.logs / STATE_FILE).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not quiet_stop:
            print("tessera up: stopped", flush=True)
    return code


def _unstick(api: str):
    """Flow runs a deleted deployment would leave stuck (tasks/runs/stuck_runs.py): unstuck or ended, and said here."""
    from tasks.runs.stuck_runs import Reconciler

    reconciler = Reconciler()

    def round_() -> None:
        try:
            with temporary_settings({PREFECT_API_URL: api}):
                lines = reconciler.round()
        except Exception:  # noqa: BLE001 - a server that is restarting: the next round looks again
            return
        for line in lines:
            print(f"tessera up: {line}", flush=True)

    return round_


def _write_state(plan: Plan, stack: _Stack) -> None:
    """Where everything runs, for tools and tests; service env holds only what tessera sets (no secrets)."""
    state = {
        "pid": os.getpid(),
        "prefect_api_url": plan.api,
        "prefect_ui_url": plan.ui,
        "mlflow_url": plan.mlflow_url,
        "work_pool": LOCAL_POOL,
        "worker_name": plan.worker_name,
        "services": {s.name: s.describe() for s in stack.services.values()},
    }
    (plan.logs / STATE_FILE).write_text(json.dumps(state, indent=2))


# MLflow 3.17 opens its bare address on its GenAI view, and neither a server option nor an experiment tag changes
# that: the view follows the page's `workflowType`, then the browser's last choice. The server `tessera up` starts
# serves a page that makes model training the browser's choice (cli/mlflow_app.py); a recipe's own server does not.
MLFLOW_VIEW_NOTE = (
    "(this link makes model training your browser's MLflow view, where the runs, their gauntlet reports and the "
    "registry are; MLflow's bare address would open its GenAI view)"
)
MLFLOW_ELSEWHERE_NOTE = (
    "(MLflow's bare address opens its GenAI view; this link opens model training, and its 'Model training' switch "
    "keeps it for your browser)"
)
# MLflow 3's registry page greets each new browser with a one-time "new Model Registry UI" modal, a choice kept in
# the browser's storage that no server option sets. Its "Try it now" is the view of aliases and tags, which is
# where tessera's champion alias and version tags show.
MLFLOW_REGISTRY_NOTE = (
    "(MLflow's registry asks each new browser once about its 'new Model Registry UI': 'Try it now' shows the "
    "aliases, such as the champion, that tessera sets)"
)


def mlflow_ui(base: str, served_here: bool = False) -> str:
    """The MLflow page a person should land on: the experiments, in the model-training view; through the page that
    keeps that view for the browser when the server is the one `tessera up` runs."""
    if served_here:
        return f"{base.rstrip('/')}{MODEL_TRAINING_PAGE}"
    return f"{base.rstrip('/')}/#/experiments?workflowType=machine_learning"


def _print_ready(seconds: float, plan: Plan, deployed: list[Deployed], stack: _Stack) -> None:
    width = max((len(f"{d.flow_name}/{d.name}") for d in deployed), default=0)
    lines = [
        f"tessera up: ready in {seconds:.1f} s (Ctrl-C stops everything)",
        f"  Prefect UI   {plan.ui}",
        f"  Prefect API  {plan.api}   (export PREFECT_API_URL={plan.api} to use it from a shell)",
        f"  MLflow UI    {mlflow_ui(plan.mlflow_url, served_here=plan.mlflow is not None)}"
        + (f"   (store {plan.store})" if plan.store else "   (the recipe's own server: not started here)"),
        f"  {'':<12} {MLFLOW_VIEW_NOTE if plan.mlflow is not None else MLFLOW_ELSEWHERE_NOTE}",
        f"  {'':<12} {MLFLOW_REGISTRY_NOTE}",
        f"  worker       {plan.worker_name} on work pool {LOCAL_POOL}",
        "  errors       what these services log as an error is printed here as it happens",
    ]
    for i, d in enumerate(deployed):
        lines.append(f"  {'deployments' if i == 0 else '':<12} {f'{d.flow_name}/{d.name}':<{width}}  {d.url}")
    if deployed:
        lines.append(f"  {'':<12} every form's recipe defaults to {recipe_default(plan.recipe)}")
    logs = [s.log for s in stack.services.values()] + ([plan.logs / "deploy.log"] if deployed else [])
    for i, log in enumerate(logs):
        lines.append(f"  {'logs' if i == 0 else '':<12} {log}")
    print("\n".join(lines), flush=True)
