"""One-rank trainers forked from one warm process per test worker, as a launch forks its ranks (infra/warm.py).

A launch's ranks fork from a forkserver that imported the trainer's modules once (infra/launcher.py). A test that
runs `python -m trainers.train` on its own paid those imports again, about 4 CPU s a trainer, some 60 times a suite.
Here a test worker starts one such forkserver, with the launch's own preloads and rules (infra/warm_open.py,
infra/warm.py, WARM_MODULES, infra/warm_seal.py), and each one-rank trainer forks from it and enters through
`infra.warm.run_rank`, the entry of every rank forked warm: it is the path the flow's trainers take, not a
shortcut beside it.

What a fork cannot change: the server's imports read the environment once, when it started. A trainer whose
environment differs from the server's in anything but variables the trainer and its clients read when they use
them (`CALL_TIME_PREFIXES`: tessera's own, the s3 clients' and MLflow's) runs as a fresh interpreter instead, as
before (tests/test_remote_folder.py's, whose PYTHONPATH adds a sitecustomize).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainers.contract import WARM_MODULES

# Read when used, not when imported (checked): tessera's own by trainers/; AWS_* by boto3's clients; S3_ENDPOINT_URL
# by trainers/format/s3.py, Composer's and Streaming's s3 clients; MLFLOW_* by MLflow's environment_variables
# getters. PYTEST_CURRENT_TEST changes with every test and nothing reads it.
CALL_TIME_PREFIXES = ("TESSERA_", "AWS_", "S3_ENDPOINT_URL", "MLFLOW_", "PYTEST_CURRENT_TEST")
_STARTED: list[dict[str, str]] = []  # the environment the server started with, once it has


def _server_env() -> dict[str, str]:
    """Start this process's forkserver with the launch's preloads (once); returns the environment it started with."""
    if not _STARTED:
        import multiprocessing
        from multiprocessing import forkserver

        saved = dict(os.environ)
        from tests.support.training import TRAINER_ENV

        os.environ.update(TRAINER_ENV)  # the server inherits the environment it starts with, as the trainers run
        try:
            multiprocessing.set_forkserver_preload(["infra.warm_open", "infra.warm", *WARM_MODULES, "infra.warm_seal"])
            forkserver.ensure_running()
            _STARTED.append(dict(os.environ))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _STARTED[0]


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a trainer with `env` may fork from the server: it differs only in variables read at call time."""
    server = _server_env()
    differ = {k for k in set(env) | set(server) if env.get(k) != server.get(k)}
    return all(k.startswith(CALL_TIME_PREFIXES) for k in differ)


def trainer_command(argv: Sequence[str]) -> list[str]:
    """The command line a one-rank trainer runs as, in a fresh interpreter (and names itself by, forked)."""
    return [sys.executable, "-m", "trainers.train", *argv]


def _trainer(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: the trainer's environment, folder and output files, then the warm rank's entry."""
    import io

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        if fd == 2 and err == out:  # one file, one offset: as stderr=subprocess.STDOUT
            os.dup2(1, 2)
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # As `python -u` (PYTHONUNBUFFERED): a trainer killed -9 has written every line it printed.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    from infra.warm import run_rank

    run_rank("trainers.train", argv, "0")


class ForkedTrainer:
    """A trainer forked warm, behind the part of subprocess.Popen's interface these tests use."""

    def __init__(self, args: list[str], process) -> None:
        self.args, self._process, self.pid = args, process, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N when signal N ended it, as Popen says

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a pid that may have been reused
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_trainer(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: Path | None, stderr: Path | None
) -> ForkedTrainer | None:
    """`python -m trainers.train argv` forked warm, its output in `stdout` and `stderr` (None: discarded; the same
    path: one file, as stderr=STDOUT), or None when `env` rules the fork out (`forkable`)."""
    if not forkable(env):
        return None
    import multiprocessing

    out, err = (str(path) if path is not None else os.devnull for path in (stdout, stderr))
    child = multiprocessing.get_context("forkserver").Process(
        target=_trainer, args=(list(argv), dict(env), str(cwd), out, err), name="trainer"
    )
    child.start()
    return ForkedTrainer(trainer_command(argv), child)


def run_trainer(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess | None:
    """As subprocess.run would report `python -m trainers.train argv` (return code, stdout and stderr), forked warm;
    None when `env` rules the fork out (`forkable`)."""
    with tempfile.TemporaryDirectory(prefix="tessera-trainer-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = start_trainer(argv, env, cwd, out, err)
        if child is None:
            return None
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(child.args, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(child.args, code, out.read_text(), err.read_text())
