"""What `tessera up` will start and where, decided before anything starts: ports, URLs, folders, and each
service's command line and environment. cli/up.py starts the plan; cli/up_stack.py owns the processes.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from cli.deploy import QUIET_ENV, Project
from cli.up_stack import Service
from tasks.mlflow_run import SERVED_STORE_ENV, resolved_uri
from tasks.recipe import Recipe
from tasks.runs.runtime import PREFECT_SERVER_OUTAGE

LOCAL_POOL = "tessera-local"

# Every service and flow run gets what cli/main.py sets for itself (offline, quiet), and no telemetry.
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


@dataclass(frozen=True)
class UpOptions:
    recipe: str
    work_dir: str | None = None  # default: the recipe's work_dir, where `tessera run` keeps Prefect's database
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    deploy: bool = True


def url_host(host: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Plan:
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
    recipe: str  # every form's default recipe: the one whose store is served

    @property
    def logs(self) -> Path:
        return self.work_dir / "up"


def plan_up(opts: UpOptions, recipe: Recipe, project: Project) -> Plan:
    """Ports, URLs, folders and the three services (argv, environment, log, where each answers)."""
    work_dir = Path(opts.work_dir or recipe.work_dir).resolve()
    logs, prefect_home = work_dir / "up", work_dir / "prefect"
    host = url_host(opts.host)
    api, ui = f"http://{host}:{opts.prefect_port}/api", f"http://{host}:{opts.prefect_port}"
    tracking = resolved_uri(recipe.tracking.tracking_uri)
    own_mlflow = not tracking.startswith(("http://", "https://"))
    mlflow_url = f"http://{host}:{opts.mlflow_port}" if own_mlflow else tracking
    home = {
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_PROFILES_PATH": str(prefect_home / "profiles.toml"),
        "PYTHONUNBUFFERED": "1",
        **OFFLINE_ENV,
    }
    worker_name = f"tessera-up@{socket.gethostname()}"
    server = _server(opts, home, api, ui, logs)
    worker = _worker(project, home, api, ui, logs, worker_name, mlflow_url, tracking)
    mlflow = _mlflow(opts, recipe, home, logs, tracking, mlflow_url) if own_mlflow else None
    ports = {"--prefect-port": opts.prefect_port, **({"--mlflow-port": opts.mlflow_port} if own_mlflow else {})}
    return Plan(
        work_dir,
        api,
        ui,
        mlflow_url,
        tracking if own_mlflow else None,
        worker_name,
        server,
        worker,
        mlflow,
        ports,
        opts.recipe,
    )


def _server(opts: UpOptions, home: dict, api: str, ui: str, logs: Path) -> Service:
    return Service(
        "prefect-server",
        [sys.executable, "-m", "prefect", "server", "start", "--host", opts.host, "--port", str(opts.prefect_port)],
        {
            **home,
            # the UI asks /ui-settings where the API is: that comes from these settings, not from --host/--port
            "PREFECT_SERVER_API_HOST": opts.host,
            "PREFECT_SERVER_API_PORT": str(opts.prefect_port),
            "PREFECT_API_URL": api,
            "PREFECT_UI_API_URL": api,
            # in memory, a run-name slot held when the server stops would stay held after its restart
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        },
        logs / "prefect-server.log",
        ui,
    )


def _worker(
    project: Project, home: dict, api: str, ui: str, logs: Path, name: str, mlflow_url: str, tracking: str
) -> Service:
    pool_type = project.pools[LOCAL_POOL].type
    return Service(
        "prefect-worker",
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", LOCAL_POOL, "--type", pool_type, "--name", name],
        {
            **home,
            "PREFECT_API_URL": api,
            "TESSERA_MLFLOW_UI_URL": mlflow_url,
            SERVED_STORE_ENV: tracking,  # a run on another recipe's store says so (flows/pipeline.py)
            "PREFECT_WORKER_QUERY_SECONDS": "2",
        },  # a click in the UI starts a run within seconds
        logs / "prefect-worker.log",
        f"{ui}/work-pools/work-pool/{LOCAL_POOL}",
    )


def _mlflow(opts: UpOptions, recipe: Recipe, home: dict, logs: Path, tracking: str, url: str) -> Service:
    argv = [sys.executable, "-m", "mlflow", "server", "--app-name", "tessera", "--backend-store-uri", tracking]
    argv += ["--host", opts.host, "--port", str(opts.mlflow_port), "--workers", "1"]
    location = recipe.tracking.artifact_location
    if location:  # where runs logged through this server keep artifacts; tessera's own runs name theirs
        argv += ["--artifacts-destination", location if "://" in location else str(Path(location).resolve())]
    # MLflow's job runner serves GenAI jobs tessera never submits: two processes less on a small machine
    return Service(
        "mlflow",
        argv,
        {**home, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        logs / "mlflow.log",
        url,
        essential=False,
    )
