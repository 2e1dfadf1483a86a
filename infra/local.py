"""The `local` compute backend: a training command as N processes on this machine.

Composer's launcher starts the ranks and sets RANK/WORLD_SIZE/MASTER_*; on CPU the trainer
uses gloo. Each job runs in its own process group so cancelling it stops every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.config import ComputeConfig


@dataclass
class LocalJob:
    """A running launcher process and where its output goes."""

    process: subprocess.Popen
    log_path: Path

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def cancel(self, grace_s: float = 10.0) -> None:
        """SIGTERM the job's process group, then SIGKILL what is left after grace_s."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class LocalBackend:
    """Launches `python -m <module> <args>` under Composer's launcher with procs_per_node ranks."""

    def __init__(self, cfg: ComputeConfig):
        self.cfg = cfg

    def command(self, module: str, args: Sequence[str], log_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "composer.cli.launcher",
            "-n", str(self.cfg.procs_per_node),
            # rank 0 goes to the job log; other ranks get their own files instead of being discarded
            "--stdout", str(log_dir / "rank{rank}.stdout.log"),
            "--stderr", str(log_dir / "rank{rank}.stderr.log"),
            "-m", module, *args,
        ]  # fmt: skip

    def launch(
        self, module: str, args: Sequence[str], *, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> LocalJob:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "rank0.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                self.command(module, args, log_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )
        return LocalJob(process=process, log_path=log_path)


def backend_for(cfg: ComputeConfig) -> LocalBackend:
    """The backend a recipe's compute section names."""
    if cfg.backend == "local":
        return LocalBackend(cfg)
    raise ValueError(f"compute.backend: unsupported backend {cfg.backend!r}")
