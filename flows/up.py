"""`tessera up`: the whole UI on this machine, Prefect server + a process worker + MLflow, until Ctrl-C.

Each service runs in its own session, so a Ctrl-C in the terminal reaches only `tessera up`, which
stops them in the order that leaves nothing behind: the worker first (nothing new starts), then the
flow runs and whatever they launched, then MLflow and the Prefect server last (a dying flow run can
still report its state). On Linux `tessera up` is also the child subreaper of its tree: a flow run
whose worker died, or a trainer whose flow run died, is re-parented to it instead of to init, so it
is still found and stopped. Nothing outside its own tree is ever signalled.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.deploy import PROJECT_ROOT, QUIET_ENV, Deployed, DeployError, Project, deploy, ensure_pool, load_project
from flows.recipe import Recipe, load_recipe
from flows.runtime import PREFECT_SERVER_OUTAGE
from flows.service_logs import ErrorReporter, ServiceLog, prefect_worker_own
from tasks.tracking import resolved_uri

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

LOCAL_POOL = "tessera-local"
STARTUP_TIMEOUT_S = 240.0  # a first start migrates a fresh database; 2 cores shared with training are slow
FLOW_RUN_GRACE_S = 15.0  # a flow run cancels its trainer (10 s grace) and reports its state
SERVICE_GRACE_S = 10.0
STATE_FILE = "state.json"

# Every service and flow run gets what flows/cli.py sets for itself (offline, quiet), and no telemetry.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_CLIENT_MAX_RETRIES": PREFECT_SERVER_OUTAGE[1],  # flow runs ride out a server restart
    **QUIET_ENV,
}


class UpError(RuntimeError):
    """`tessera up` cannot start or keep its stack; str() is one line, `code` the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


class _Stopped(BaseException):
    """Ctrl-C or SIGTERM: a request to stop, not an error."""


@dataclass(frozen=True)
class UpOptions:
    recipe: str
    work_dir: str | None = None  # default: the recipe's work_dir, where `tessera run` keeps Prefect's database
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    deploy: bool = True


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]  # set on top of tessera up's own environment
    log: Path
    url: str
    essential: bool = True  # MLflow is not: flows write to its store directly, it only shows it
    process: subprocess.Popen | None = None

    def describe(self) -> dict:
        pid = self.process.pid if self.process else None
        return {"pid": pid, "argv": self.argv, "env": self.env, "cwd": str(PROJECT_ROOT), "log": str(self.log), "url": self.url}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _Stack:
    services: dict[str, Service] = field(default_factory=dict)
    hurry: bool = False
    errors: ErrorReporter = field(default_factory=lambda: ErrorReporter([], _say))
    api: str | None = None  # the Prefect API, once it answers: flow runs stopped here are told why
    why: str = "stopped by `tessera up` shutting down"

    def start(self, service: Service) -> Service:
        with open(service.log, "wb") as out:
            service.process = subprocess.Popen(
                service.argv,
                cwd=PROJECT_ROOT,
                env={**os.environ, **service.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches tessera up alone; it stops the services in order
            )
        self.services[service.name] = service
        own = prefect_worker_own if service.name == "prefect-worker" else (lambda logger: True)
        self.errors.logs.append(ServiceLog(service.name, service.log, own))
        return service

    def wait_for(self, service: Service, ready: Callable[[], bool], timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Until `service` is ready; any service that exits meanwhile fails the start-up."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.errors.poll()
            for started in self.services.values():
                code = started.process.poll()
                if code is not None:
                    self.errors.poll(final=True)  # why it exited, if it said
                    raise UpError(f"{started.name} exited during start-up (exit code {code}); see {started.log}")
            if time.monotonic() > deadline:
                raise UpError(f"{service.name} was not ready after {timeout:.0f} s; see {service.log}")
            time.sleep(0.5)

    def supervise(self) -> int:
        """Until a signal: report a service that exits; stop everything if it was an essential one."""
        reported: set[str] = set()
        while True:
            time.sleep(1.0)
            self._reap_orphans()
            self.errors.poll()
            for service in self.services.values():
                code = service.process.poll()
                if code is None or service.name in reported:
                    continue
                reported.add(service.name)
                self.errors.poll(final=True)  # its last words first
                if service.essential:
                    print(f"tessera up: {service.name} exited (exit code {code}); stopping; see {service.log}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return EXIT_FAILED
                print(f"tessera up: {service.name} exited (exit code {code}); the rest keeps running; see {service.log}",
                      file=sys.stderr, flush=True)  # fmt: skip

    def _reap_orphans(self) -> None:
        # orphans re-parented to this subreaper are its children now: collect them once they exit
        own = {s.process.pid for s in self.services.values()}
        for child in psutil.Process().children():
            if child.pid not in own:
                with suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)

    def stop(self) -> None:
        me = psutil.Process()
        worker = self.services.get("prefect-worker")
        worker_tree = _tree(worker.process.pid) if worker else []
        if worker_tree:
            # Prefect 3.8.8's process worker, sent SIGTERM while a flow run executes, logs that it sends
            # itself SIGINT and goes on: the run continues, and the worker keeps polling and starting new
            # runs (a second SIGTERM makes it SIGKILL itself); it never signals its flow runs. Kill it
            # outright, so it starts nothing while tessera up stops its flow runs itself.
            _signal(worker_tree[:1], signal.SIGKILL)
            psutil.wait_procs(worker_tree[:1], timeout=5)
        servers = {p.pid for name in ("prefect-server", "mlflow") if name in self.services
                   for p in _tree(self.services[name].process.pid)}  # fmt: skip
        # flow runs (their own sessions: no group signal reaches them), their trainers, a deploy under way
        rest = {p.pid: p for p in worker_tree[1:] + me.children(recursive=True) if p.pid not in servers}
        self._tell_flow_runs(list(rest.values()))
        self._terminate(list(rest.values()), FLOW_RUN_GRACE_S)
        # the servers last, so the flow runs above could still report their final state
        trees = [p for name in ("mlflow", "prefect-server") if name in self.services
                 for p in _tree(self.services[name].process.pid)]  # fmt: skip
        self._terminate(trees, SERVICE_GRACE_S)
        self._terminate(me.children(recursive=True), 0)  # anything that outlived its parent's signal
        for service in self.services.values():
            service.process.poll()

    def _tell_flow_runs(self, procs: list[psutil.Process]) -> None:
        """Mark each flow run about to be stopped Cancelling, saying why: the flow ends Cancelled with that
        message instead of Crashed with none (flows/outcome.py reads it)."""
        if not self.api:
            return
        runs = set()
        for proc in procs:
            with suppress(psutil.Error):
                runs.add(proc.environ().get("PREFECT__FLOW_RUN_ID"))
        for run in sorted(r for r in runs if r):
            state = {"type": "CANCELLING", "name": "Cancelling", "message": self.why}
            with suppress(httpx.HTTPError):
                httpx.post(f"{self.api}/flow_runs/{run}/set_state", json={"state": state, "force": True}, timeout=5)

    def _terminate(self, procs: list[psutil.Process], grace: float) -> None:
        _signal(procs, signal.SIGTERM)
        deadline = time.monotonic() + grace
        alive = procs
        while alive and time.monotonic() < deadline and not self.hurry:
            _, alive = psutil.wait_procs(alive, timeout=0.2)
        _signal(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with suppress(psutil.NoSuchProcess):  # psutil also refuses a pid that was reused meanwhile
            proc.send_signal(sig)


def _become_subreaper() -> None:
    if sys.platform == "linux":
        import ctypes

        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _url_host(host: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _worker_online(api: str, name: str, since: str) -> bool:
    body = {"workers": {"status": {"any_": ["ONLINE"]}, "last_heartbeat_time": {"after_": since}}, "limit": 200, "offset": 0}
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


@dataclass(frozen=True)
class _Plan:
    """What `tessera up` will start and where, decided before anything starts."""

    work_dir: Path
    api: str
    ui: str
    mlflow_url: str
    store: str | None  # the MLflow store served here; None when the recipe names its own server
    worker_name: str
    server: Service
    worker: Service
    mlflow: Service | None
    ports: dict[str, int]

    @property
    def logs(self) -> Path:
        return self.work_dir / "up"


def _plan(opts: UpOptions, recipe: Recipe, project: Project) -> _Plan:
    work_dir = Path(opts.work_dir or recipe.work_dir).resolve()
    logs, prefect_home = work_dir / "up", work_dir / "prefect"
    host = _url_host(opts.host)
    api, ui = f"http://{host}:{opts.prefect_port}/api", f"http://{host}:{opts.prefect_port}"
    tracking = resolved_uri(recipe.tracking.tracking_uri)
    own_mlflow = not tracking.startswith(("http://", "https://"))
    mlflow_url = f"http://{host}:{opts.mlflow_port}" if own_mlflow else tracking
    home = {"PREFECT_HOME": str(prefect_home), "PREFECT_PROFILES_PATH": str(prefect_home / "profiles.toml"),
            "PYTHONUNBUFFERED": "1", **OFFLINE_ENV}  # fmt: skip
    worker_name = f"tessera-up@{socket.gethostname()}"
    server = Service(
        "prefect-server",
        [sys.executable, "-m", "prefect", "server", "start", "--host", opts.host, "--port", str(opts.prefect_port)],
        {**home,
         # the UI asks /ui-settings where the API is: that comes from these settings, not from --host/--port
         "PREFECT_SERVER_API_HOST": opts.host, "PREFECT_SERVER_API_PORT": str(opts.prefect_port),
         "PREFECT_API_URL": api, "PREFECT_UI_API_URL": api,
         # in memory, a run-name slot held when the server stops would stay held after its restart
         "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"},
        logs / "prefect-server.log", ui,
    )  # fmt: skip
    worker = Service(
        "prefect-worker",
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", LOCAL_POOL,
         "--type", project.pools[LOCAL_POOL].type, "--name", worker_name],
        {**home, "PREFECT_API_URL": api, "TESSERA_MLFLOW_UI_URL": mlflow_url,
         "PREFECT_WORKER_QUERY_SECONDS": "2"},  # a click in the UI starts a run within seconds
        logs / "prefect-worker.log", f"{ui}/work-pools/work-pool/{LOCAL_POOL}",
    )  # fmt: skip
    mlflow = None
    if own_mlflow:
        argv = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking,
                "--host", opts.host, "--port", str(opts.mlflow_port), "--workers", "1"]  # fmt: skip
        location = recipe.tracking.artifact_location
        if location:  # where runs logged through this server keep artifacts; tessera's own runs name theirs
            argv += ["--artifacts-destination", location if "://" in location else str(Path(location).resolve())]
        # MLflow's job runner serves GenAI jobs tessera never submits: two processes less on a small machine
        mlflow = Service("mlflow", argv, {**home, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                         logs / "mlflow.log", mlflow_url, essential=False)  # fmt: skip
    ports = {"--prefect-port": opts.prefect_port, **({"--mlflow-port": opts.mlflow_port} if own_mlflow else {})}
    return _Plan(work_dir, api, ui, mlflow_url, tracking if own_mlflow else None, worker_name, server, worker, mlflow, ports)


def _check_ports(host: str, ports: dict[str, int]) -> None:
    if len(set(ports.values())) < len(ports):
        raise UpError(f"{' and '.join(ports)} are the same port ({next(iter(ports.values()))})", EXIT_BAD_INPUT)
    for flag, port in ports.items():
        if not _port_free(host, port):
            raise UpError(f"{flag} {port}: {host}:{port} is already in use; pick another port or stop what listens there",
                          EXIT_BAD_INPUT)  # fmt: skip


def up(opts: UpOptions) -> int:
    """Start the stack, print where everything is, and wait; 0 after Ctrl-C or SIGTERM."""
    recipe = load_recipe(opts.recipe)  # bad input stops here, before anything starts
    try:
        project = load_project()
    except DeployError as exc:
        raise UpError(str(exc), EXIT_BAD_INPUT) from None
    if LOCAL_POOL not in project.pools:
        raise UpError(f"{project.root / 'prefect.yaml'}: definitions.work_pools has no {LOCAL_POOL!r}", EXIT_BAD_INPUT)
    plan = _plan(opts, recipe, project)
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


def _run(plan: _Plan, project: Project, publish: bool) -> int:
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
        since = datetime.now(timezone.utc).replace(microsecond=0).isoformat()  # this session's heartbeats only
        try:
            with temporary_settings({PREFECT_API_URL: plan.api}):
                ensure_pool(project, LOCAL_POOL)
                stack.start(plan.worker)  # it boots while the deployments are published
                deployed = deploy(project=project, log=plan.logs / "deploy.log") if publish else []
        except DeployError as exc:
            raise UpError(f"deploy: {exc}") from None
        stack.wait_for(plan.worker, lambda: _worker_online(plan.api, plan.worker_name, since))
        if plan.mlflow:
            stack.wait_for(plan.mlflow, lambda: _answers(f"{plan.mlflow_url}/health"))
        _write_state(plan, stack)
        _print_ready(time.monotonic() - started, plan, deployed, stack)
        quiet_stop = False
        code = stack.supervise()
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


def _write_state(plan: _Plan, stack: _Stack) -> None:
    """Where everything runs, for tools and tests; service env holds only what tessera sets (no secrets)."""
    state = {"pid": os.getpid(), "prefect_api_url": plan.api, "prefect_ui_url": plan.ui, "mlflow_url": plan.mlflow_url,
             "work_pool": LOCAL_POOL, "worker_name": plan.worker_name,
             "services": {s.name: s.describe() for s in stack.services.values()}}  # fmt: skip
    (plan.logs / STATE_FILE).write_text(json.dumps(state, indent=2))


def _print_ready(seconds: float, plan: _Plan, deployed: list[Deployed], stack: _Stack) -> None:
    width = max((len(f"{d.flow_name}/{d.name}") for d in deployed), default=0)
    lines = [
        f"tessera up: ready in {seconds:.1f} s (Ctrl-C stops everything)",
        f"  Prefect UI   {plan.ui}",
        f"  Prefect API  {plan.api}   (export PREFECT_API_URL={plan.api} to use it from a shell)",
        f"  MLflow UI    {plan.mlflow_url}"
        + (f"   (store {plan.store})" if plan.store else "   (the recipe's own server: not started here)"),
        f"  worker       {plan.worker_name} on work pool {LOCAL_POOL}",
        "  errors       what these services log as an error is printed here as it happens",
    ]
    for i, d in enumerate(deployed):
        lines.append(f"  {'deployments' if i == 0 else '':<12} {f'{d.flow_name}/{d.name}':<{width}}  {d.url}")
    logs = [s.log for s in stack.services.values()] + ([plan.logs / "deploy.log"] if deployed else [])
    for i, log in enumerate(logs):
        lines.append(f"  {'logs' if i == 0 else '':<12} {log}")
    print("\n".join(lines), flush=True)
