"""The processes `tessera up` starts and stops: its services, and everything they start in turn.

Each service runs in its own session, so a Ctrl-C in the terminal reaches only `tessera up`, which
stops them in the order that leaves nothing behind: the worker first (nothing new starts), then the
flow runs and whatever they launched (each told first why, so it ends Cancelled saying so rather
than Crashed), then MLflow and the Prefect server last (a dying flow run can still report its
state). On Linux `tessera up` is also the child subreaper of its tree: a flow run whose worker died,
or a trainer whose flow run died, is re-parented to it instead of to init, so it is still found and
stopped. Nothing outside its own tree is ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from cli.deploy import PROJECT_ROOT
from cli.service_logs import ErrorReporter, ServiceLog, flow_run_own, prefect_worker_own
from trainers.contract import EXIT_FAILED

STARTUP_TIMEOUT_S = 240.0  # a first start migrates a fresh database; 2 cores shared with training are slow
FLOW_RUN_GRACE_S = 15.0  # a flow run cancels its trainer (10 s grace) and reports its state
SERVICE_GRACE_S = 10.0


class UpError(RuntimeError):
    """`tessera up` cannot start or keep its stack; str() is one line, `code` the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


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
        return {
            "pid": pid,
            "argv": self.argv,
            "env": self.env,
            "cwd": str(PROJECT_ROOT),
            "log": str(self.log),
            "url": self.url,
        }


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
        # appended, not truncated: a restarted `tessera up` keeps the last session's tracebacks; a line says where
        # this session begins, and its errors are read from there (ServiceLog's offset)
        with open(service.log, "ab") as out:
            out.write(f"\n===== tessera up (pid {os.getpid()}) starts {service.name}: {time.ctime()} =====\n".encode())
            out.flush()
            begins = out.tell()
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
        self.errors.logs.append(ServiceLog(service.name, service.log, own, offset=begins))
        if service.name == "prefect-worker":  # the flow runs' own errors (a failing hook), which the worker relays
            self.errors.logs.append(ServiceLog("a flow run", service.log, flow_run_own, offset=begins))
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

    def supervise(self, every_10s: Callable[[], None] | None = None) -> int:
        """Until a signal: report a service that exits; stop everything if it was an essential one. `every_10s`
        runs between (tessera up's reconciliation of stuck flow runs)."""
        reported: set[str] = set()
        last = time.monotonic()
        while True:
            time.sleep(1.0)
            self._reap_orphans()
            self.errors.poll()
            if every_10s is not None and time.monotonic() - last >= 10.0:
                last = time.monotonic()
                every_10s()
            for service in self.services.values():
                code = service.process.poll()
                if code is None or service.name in reported:
                    continue
                reported.add(service.name)
                self.errors.poll(final=True)  # its last words first
                if service.essential:
                    print(
                        f"tessera up: {service.name} exited (exit code {code}); stopping; see {service.log}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return EXIT_FAILED
                print(
                    f"tessera up: {service.name} exited (exit code {code}); the rest keeps running; see {service.log}",
                    file=sys.stderr,
                    flush=True,
                )

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
        servers = {
            p.pid
            for name in ("prefect-server", "mlflow")
            if name in self.services
            for p in _tree(self.services[name].process.pid)
        }
        # flow runs (their own sessions: no group signal reaches them), their trainers, a deploy under way
        rest = {p.pid: p for p in worker_tree[1:] + me.children(recursive=True) if p.pid not in servers}
        self._tell_flow_runs(list(rest.values()))
        self._terminate(list(rest.values()), FLOW_RUN_GRACE_S)
        # the servers last, so the flow runs above could still report their final state
        trees = [
            p
            for name in ("mlflow", "prefect-server")
            if name in self.services
            for p in _tree(self.services[name].process.pid)
        ]
        self._terminate(trees, SERVICE_GRACE_S)
        self._terminate(me.children(recursive=True), 0)  # anything that outlived its parent's signal
        for service in self.services.values():
            service.process.poll()

    def _tell_flow_runs(self, procs: list[psutil.Process]) -> None:
        """Mark each flow run about to be stopped Cancelling, saying why: the flow ends Cancelled with that
        message instead of Crashed with none (tasks/runs/flow_outcome.py reads it)."""
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
