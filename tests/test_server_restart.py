"""A Prefect server that dies mid-run and comes back on the same database never locks a run name out.

Seen before the fix: the server SIGKILLed mid-training and restarted 65 s later; the run completed, but
its run-name slot stayed held (the lease renewal had failed with 410 Gone during the outage) and every
rerun of that name was refused. Here a real `prefect server` (filesystem lease storage, as `tessera up`
runs it) is killed while `tessera run` trains, kept down past the 60 s lease, started again on the same
database, and the same run name is run again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, answers, free_port, stop_tree, tiny_recipe
from tests.support.prefect_home import seed_prefect_home

pytestmark = pytest.mark.slow

OUTAGE_S = 65.0  # longer than tasks/exclusive.LEASE_S: the flow's lease expires while the server is down


def start_server(home: Path, port: int, log: Path) -> subprocess.Popen:
    seed_prefect_home(home)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
    }
    with open(log, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while not answers(f"http://127.0.0.1:{port}/api/health"):
        assert server.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "prefect server not up"
        time.sleep(0.5)
    return server


def test_a_server_restart_mid_run_then_a_rerun_of_the_same_name(tmp_path):
    import psutil

    port, home, log = free_port(), tmp_path / "prefect", tmp_path / "server.log"
    api = f"http://127.0.0.1:{port}/api"
    recipe = tiny_recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())  # a shorter curriculum: 24 steps, a checkpoint every 8
    raw["train"]["stages"][0]["tokens"], raw["train"]["stages"][1]["tokens"], raw["eval"]["every"] = 16384, 8192, 8192
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    # The flow must outlive the server's return by more than a lease renewal period (45 s), so that its renewal
    # meets the expired lease: the second stage's launch waits 60 s before it trains (asleep, no CPU spent).
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(home),
        "TESSERA_FAULT": "stall-launch:60",
        "TESSERA_FAULT_STAGE": "1",
    }
    server = start_server(home, port, log)
    run = None
    try:
        with open(tmp_path / "run-1.log", "wb") as out:
            run = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "run", str(recipe), "--run-name", "restart"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        from trainers.format.checkpoints import list_complete

        folder = tmp_path / "work" / "runs" / "restart" / "checkpoints"
        deadline = time.monotonic() + 600
        while not list_complete(folder):  # training is under way, the slot held
            assert run.poll() is None, (tmp_path / "run-1.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(1)
        held = httpx.get(f"{api}/v2/concurrency_limits/tessera-run-restart", timeout=10).json()["active_slots"]
        assert held == 1

        root = psutil.Process(server.pid)
        stop_tree([root] + root.children(recursive=True), grace=0)  # SIGKILL: no shutdown of any kind
        time.sleep(OUTAGE_S)
        server = start_server(home, port, log)
        assert run.wait(timeout=900) == 0, (tmp_path / "run-1.log").read_text()[-3000:]
        assert "410 Gone" in (tmp_path / "run-1.log").read_text()  # the outage did cost the flow its lease
        # whether the server's repossessor freed the expired lease's slot or it stayed counted depends on
        # when it ran; a slot left counted with no live holder must be reclaimed by the rerun
        leaked = httpx.get(f"{api}/v2/concurrency_limits/tessera-run-restart", timeout=10).json()["active_slots"]

        started = time.monotonic()
        again = subprocess.run(
            [sys.executable, "-m", "cli.main", "run", str(recipe), "--run-name", "restart"],
            cwd=ROOT,
            env={k: v for k, v in env.items() if not k.startswith("TESSERA_FAULT")},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert again.returncode == 0, again.stderr[-3000:]  # before the fix: "run 'restart' is already running"
        reclaimed = "reclaimed the slot of concurrency limit tessera-run-restart" in again.stdout + again.stderr
        assert reclaimed == bool(leaked), (leaked, again.stderr[-3000:])
        assert "run restart: 3 model versions" in again.stdout
        assert time.monotonic() - started < 300
        assert httpx.get(f"{api}/v2/concurrency_limits/tessera-run-restart", timeout=10).json()["active_slots"] == 0
    finally:
        if run is not None and run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=60)
        with __import__("contextlib").suppress(psutil.NoSuchProcess):
            root = psutil.Process(server.pid)
            stop_tree([root] + root.children(recursive=True))
