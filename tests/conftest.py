"""Shared test fixtures: one Prefect harness per session, real MLflow stores under tmp dirs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"

# Keep Prefect, HF and MLflow quiet and offline for every test process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# One intra-op thread per process (inherited by every trainer, flow and server a test starts): the
# suite runs three xdist workers on two cores, so more threads only oversubscribe the cores, and
# OpenMP threads spin while they wait. The tiny test models gain nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Importing torch._inductor.async_compile (something in an in-process Composer fit does) starts a pool
# of three compile workers that each import torch: seconds of CPU per test process, for torch.compile,
# which nothing here uses.
os.environ.setdefault("TORCH_WARM_POOL", "0")
# Compiled kernels (trainers/compile.py) shared by every test and both workers: a CPU compile of even the tiny
# model's block costs tens of seconds, and the folders under it are keyed by code, versions and device, so a
# shared cache can only ever hand a test what that test would have compiled itself.
os.environ.setdefault("TESSERA_COMPILE_CACHE_DIR", str(Path(tempfile.gettempdir()) / "tessera-test-compile-cache"))

# Prefect's console log handler keeps the sys.stderr of the moment prefect is first imported. First imported inside
# a test that uses capsys, it holds that test's capture, closed when the test ends, and every later Prefect log line
# in the process fails ("I/O operation on closed file", then a RecursionError in logging's error path). Setting it up
# here, after the environment above, binds it to the process's own stderr whatever the test order
# (a plain `import prefect` is lazy and configures nothing).
from prefect.logging.configuration import ensure_logging_setup  # noqa: E402

ensure_logging_setup()

# A StreamingDataset a test makes in its own process registers a shared-memory prefix on the host, as the trainers
# the other workers run do at the same moment; Streaming's scan-then-create races (FileExistsError on
# "/<prefix>_locals", met with three workers). The tests' datasets take their prefixes as the trainers do: under
# the host-wide lock, retried when a Streaming user outside it took the one found (trainers/shm.py).
from trainers.shm import leader_decides_prefixes  # noqa: E402

leader_decides_prefixes()


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """A real, temporary Prefect API (sqlite) shared by every test in the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def mlflow_uri(tmp_path) -> str:
    """A fresh sqlite-backed MLflow tracking store and registry."""
    from tests.support.mlflow_store import sqlite_store

    return sqlite_store(tmp_path / "mlflow.db")


@pytest.fixture()
def moto_s3(monkeypatch):
    """A real S3-compatible server (moto's server mode) on localhost; yields a boto3 client for it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its buckets in process-wide state that outlives a server: start every test empty.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
    for k, v in {
        "S3_ENDPOINT_URL": url,
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    yield boto3.client("s3", endpoint_url=url)
    server.stop()


# --- a live `tessera up` stack, shared by the session --------------------------------------------------


def free_port() -> int:
    """A localhost port nobody listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_raw() -> dict:
    """configs/tiny.yaml as a dict, with the tests' small tokenizer (tests/support/test_tokenizer.py says why)."""
    import yaml

    from tests.support.test_tokenizer import PATH

    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["data"]["tokenizer"]["path"] = str(PATH)
    return raw


def tiny_recipe(base: Path, data_root: Path | None = None, prefect_db: bool = True) -> Path:
    """configs/tiny.yaml (with the tests' small tokenizer) with its work dir, data root, MLflow store and artifacts
    under `base`; with `prefect_db`, the work dir holds a migrated Prefect database (tests/support/prefect_home.py)
    for the server a command starts there."""
    import yaml

    from tests.support.mlflow_store import sqlite_store
    from tests.support.prefect_home import seed_prefect_home

    raw = tiny_raw()
    raw["work_dir"] = str(base / "work")
    raw["data"]["root"] = str(data_root or base / "work" / "data")
    raw["tracking"]["tracking_uri"] = sqlite_store(base / "mlflow.db")
    raw["tracking"]["artifact_location"] = str(base / "mlartifacts")
    path = base / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    if prefect_db:
        seed_prefect_home(base / "work" / "prefect")
    return path


def _die_with_parent() -> None:
    # if pytest itself is killed, its `tessera up` gets a SIGTERM and takes its stack down with it
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_tessera_up(recipe: Path, work_dir: Path, *args: str) -> tuple[subprocess.Popen, int, int, Path]:
    """`tessera up RECIPE` on free ports as a child of this process; returns it, its two ports, its output file."""
    from tests.support.prefect_home import seed_prefect_home

    prefect_port, mlflow_port = free_port(), free_port()
    output = work_dir.parent / f"tessera-up-{prefect_port}.out"
    seed_prefect_home(work_dir / "prefect")  # where cli/up_plan.py puts the server's home
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.main",
                "up",
                str(recipe),
                "--work-dir",
                str(work_dir),
                "--prefect-port",
                str(prefect_port),
                "--mlflow-port",
                str(mlflow_port),
                *args,
            ],
            # The scheduler runs, as it does for a user: it is a background service that the pins must keep
            # working (tests/test_deploy.py::test_a_cron_schedule_creates_runs_and_the_worker_runs_one).
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    return process, prefect_port, mlflow_port, output


def stop_tree(procs, grace: float = 15.0) -> None:
    """SIGTERM these psutil processes, SIGKILL what is left after `grace` seconds."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def prefect_api(method: str, url: str, **kw):
    """One request to a Prefect server, retried on 503 and on a read timeout as Prefect's own client does.

    The server answers 503 when its sqlite database is briefly locked (it maps retryable database
    errors to 503, and its client retries them up to PREFECT_CLIENT_MAX_RETRIES times), and its client
    retries a read that timed out (prefect/client/base.py); a test that speaks raw HTTP must do the same
    or it fails on a busy machine where the product would not (a GET timed out at 30 s with -n 2).
    """
    import httpx

    for attempt in range(6):
        try:
            response = httpx.request(method, url, timeout=30, **kw)
        except httpx.ReadTimeout:
            if attempt == 5:
                raise
            continue
        if response.status_code != 503:
            break
        time.sleep(0.5 * 2**attempt)
    response.raise_for_status()
    return response


class TensorOps:
    """The aten ops run on real (not meta) tensors inside the block: what work touched memory."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(isinstance(a, torch.Tensor) and a.device.type != "meta" for a in args):
                    ops.add(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@dataclass
class LiveStack:
    """A running `tessera up`: where it serves, its process, and helpers that know its process layout.

    Layout: `tessera up` -> `prefect server start`, `mlflow server` (-> uvicorn), `prefect worker start`
    -> one process per flow run (`python -m prefect.engine`, in its own session, PREFECT__FLOW_RUN_ID in
    its environment) -> the trainer's launcher (its own session) -> ranks. Trainers inherit
    PREFECT__FLOW_RUN_ID too; the flow-run process is the topmost one carrying it. `state` is
    `<work_dir>/up/state.json`: pids, argv, the env tessera sets and the log of every service.
    """

    api_url: str
    ui_url: str
    mlflow_url: str
    work_dir: Path
    recipe: Path
    process: subprocess.Popen
    env: dict[str, str]  # for Prefect clients, on top of os.environ: PREFECT_API_URL
    state: dict = field(default_factory=dict)
    output: Path | None = None  # what tessera up printed
    restarted_mlflow: subprocess.Popen | None = None  # the MLflow mlflow_start() runs, if any

    @property
    def worker_pid(self) -> int:
        return self.state["services"]["prefect-worker"]["pid"]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until the API, an online worker, MLflow and every prefect.yaml deployment answer."""
        import httpx

        from cli.deploy import load_project

        wanted = set(load_project().deployments)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"tessera up exited ({self.process.returncode}):\n{self.output.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                online = httpx.post(
                    f"{self.api_url}/work_pools/tessera-local/workers/filter",
                    timeout=5,
                    json={"workers": {"status": {"any_": ["ONLINE"]}}, "limit": 10, "offset": 0},
                )
                deployed = httpx.post(f"{self.api_url}/deployments/filter", json={"limit": 200}, timeout=5)
                state_file = self.work_dir / "up" / "state.json"
                if (
                    online.status_code == 200
                    and online.json()
                    and deployed.status_code == 200
                    and wanted <= {d["name"] for d in deployed.json()}
                    and answers(f"{self.mlflow_url}/health")
                    and state_file.exists()
                ):
                    self.state = json.loads(state_file.read_text())
                    return
            if time.monotonic() > deadline:
                pytest.fail(f"tessera up not ready after {timeout:.0f} s:\n{self.output.read_text()}")
            time.sleep(1.0)

    def mlflow_stop(self, timeout: float = 30.0) -> None:
        """Stop the MLflow server (tessera up's, or the one mlflow_start() began); tessera up keeps running."""
        import psutil

        if self.restarted_mlflow is not None:
            pid, parent, self.restarted_mlflow = self.restarted_mlflow.pid, os.getpid(), None
        else:
            pid, parent = self.state["services"]["mlflow"]["pid"], self.process.pid
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            if root.ppid() == parent:  # still that MLflow, not a process that got its pid after it exited
                stop_tree([root] + root.children(recursive=True))
        deadline = time.monotonic() + timeout
        while answers(f"{self.mlflow_url}/health"):
            assert time.monotonic() < deadline, f"MLflow at {self.mlflow_url} still answers"
            time.sleep(0.5)

    def mlflow_start(self, timeout: float = 120.0) -> None:
        """Start MLflow again on the same port and store, as tessera up did; stopped by mlflow_stop() or teardown."""
        service = self.state["services"]["mlflow"]
        with open(service["log"], "ab") as out:
            self.restarted_mlflow = subprocess.Popen(
                service["argv"],
                cwd=service["cwd"],
                env={**os.environ, **service["env"]},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not answers(f"{self.mlflow_url}/health"):
            assert self.restarted_mlflow.poll() is None, f"MLflow exited; see {service['log']}"
            assert time.monotonic() < deadline, f"MLflow not up after {timeout:.0f} s; see {service['log']}"
            time.sleep(0.5)

    def flow_run_pid(self, flow_run_id, timeout: float = 0.0) -> int | None:
        """The pid of the process running flow run `flow_run_id` (waits up to `timeout` s for it to start)."""
        import psutil

        deadline = time.monotonic() + timeout
        while True:
            carrying = {}  # pid -> parent pid, of every descendant whose environment names the run
            for proc in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if proc.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id):
                        carrying[proc.pid] = proc.ppid()
            top = [pid for pid, parent in carrying.items() if parent not in carrying]
            if top or time.monotonic() >= deadline:
                return top[0] if top else None
            time.sleep(0.5)

    def close(self, timeout: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.restarted_mlflow is not None:
            self.mlflow_stop()


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    """The real `tessera up` (server, worker, MLflow, deployments) on free localhost ports, under a tmp dir."""
    base = tmp_path_factory.mktemp("live_stack")
    recipe = tiny_recipe(base)
    process, prefect_port, mlflow_port, output = start_tessera_up(recipe, base / "work")
    api = f"http://127.0.0.1:{prefect_port}/api"
    stack = LiveStack(
        api_url=api,
        ui_url=f"http://127.0.0.1:{prefect_port}",
        mlflow_url=f"http://127.0.0.1:{mlflow_port}",
        work_dir=base / "work",
        recipe=recipe,
        process=process,
        env={"PREFECT_API_URL": api},
        output=output,
    )
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.close()


@pytest.fixture(autouse=True)
def launches_allowed():
    """Each test may launch: a flow run in this worker that failed earlier stopped the process's launches
    (infra.lifecycle.cancel_all, as a failed flow must), which only the next pipeline flow run would allow again."""
    from infra import allow_launches

    allow_launches()
    yield


@pytest.fixture(autouse=True)
def isolated_mlflow_globals(request):
    """Each test starts with MLflow's process-wide tracking and registry URIs unset, and leaves them so.

    `mlflow.set_registry_uri` in one test would otherwise redirect every later `MlflowClient(uri)` (whose
    registry defaults to the global one) to that test's store. MLflow 3 falls back to ./mlflow.db when a
    tracking URI is missing; no code path of ours may do that, and the check names the test that did.
    """
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    before = (ROOT / "mlflow.db").exists()
    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    yield
    tracking_utils._tracking_uri = None
    registry_utils._registry_uri = None
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    stray = not before and (ROOT / "mlflow.db").exists()
    if stray:
        (ROOT / "mlflow.db").unlink()
    assert not stray, f"{request.node.nodeid} fell back to MLflow's default ./mlflow.db"


# --- xdist workers (`make test` runs pytest -n 4) ---------------------------------------------------------

# The modules that use the live stack (`tessera up`, a session fixture): they run on one worker, which
# starts it once. A module that uses it without being listed here fails at collection (below).
LIVE_MODULES = {"tests/test_deploy.py", "tests/test_live_pipeline.py", "tests/test_ui.py"}
# The longest modules, longest first: a worker takes them before the short ones, so the workers finish close
# together instead of one starting a 10-minute module at the end. Measured with --durations in CI; test_stopping,
# test_refusals and test_shm (alphabetically late, so last) were still running alone at the end of a four-worker
# suite (2026-11-29).
_LONGEST_FIRST = [
    "live",
    "test_train.py",
    "test_sharded.py",
    "test_watchdog.py",
    "test_server_restart.py",
    "test_train_ops.py",
    "test_pipeline_e2e.py",
    "test_continued.py",
    "test_compile.py",
    "test_k8s_faults.py",
    "test_metrics_outbox_s3.py",
    "test_disk_full.py",
    "test_data_check.py",
    "test_data_interrupt.py",
    "test_exclusive.py",
    "test_stopping.py",
    "test_refusals.py",
    "test_shm.py",
    "test_register.py",
    "test_promote_in_pods.py",
    "test_remote_folder.py",
    "test_data_cli.py",
]


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "live" if path in LIVE_MODULES else path


def pytest_xdist_make_scheduler(config, log):
    """Whole modules to a worker, so module fixtures run once; the live-stack modules together.

    xdist's own `--dist loadgroup` would do this with markers, but with pytest 9 it cannot rename the
    node ids it groups by (pytest-xdist 3.8.0), and every test became its own group.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    """Check LIVE_MODULES; on an xdist worker, put the longest modules first (the scheduler keeps the order)."""
    unlisted = sorted(
        {item.nodeid.split("::", 1)[0] for item in items if "live_stack" in getattr(item, "fixturenames", ())}
        - LIVE_MODULES
    )
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(unlisted)} to LIVE_MODULES (it uses live_stack)")
    if hasattr(config, "workerinput"):

        def rank(item) -> int:
            scope = _scope(item.nodeid)
            name = scope if scope == "live" else Path(scope).name
            return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

        items.sort(key=rank)  # stable: each module keeps its own order


# --- no process of the suite outlives it ------------------------------------------------------------------

# Every process a test starts inherits this mark (servers, trainers, flow runs, their own children), also those
# that start sessions of their own and are reparented to init when their parent dies: the session's end finds
# them by it, whatever their ancestry.
SUITE_MARK = "TESSERA_TEST_SUITE"
os.environ.setdefault(SUITE_MARK, f"{os.getpid()}-{time.time_ns()}")


def _marked_leftovers() -> list:
    """Live processes carrying this suite's mark, other than this one, its ancestors and xdist's workers
    (which exit as the controller finishes)."""
    import psutil

    mine = os.environ[SUITE_MARK]
    skip = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid in skip:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(SUITE_MARK) != mine:
                continue
            cmdline = proc.info["cmdline"] or []
            if any("sys.stdin.readline" in part for part in cmdline[:3]):  # an execnet gateway: an xdist worker
                continue
            if proc.ppid() == os.getpid() and any("from multiprocessing." in part for part in cmdline[:4]):
                continue  # this process's own resource tracker: it ends when this process does
            found.append(proc)
    return found


@pytest.hookimpl(trylast=True)  # after xdist has shut its workers down
def pytest_sessionfinish(session, exitstatus):
    """After the whole suite (the controller, or a run without -n): a process a test started and did not stop
    fails the run, named with its command line, and is stopped so it cannot hold a port or a lock into the next."""
    if hasattr(session.config, "workerinput") or os.environ.get("TESSERA_ALLOW_LEFTOVERS") == "1":
        return
    deadline = time.monotonic() + 20  # teardown of a worker's last fixtures may still be stopping a server
    left = _marked_leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = _marked_leftovers()
    if not left:
        return
    lines = []
    for proc in left:
        with contextlib.suppress(Exception):
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
    stop_tree(left, grace=5)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n")
        reporter.write_line(f"{len(left)} process(es) of the suite were still alive after it, now stopped:", red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
