"""The `local` compute backend: a training command as N processes on this machine.

infra/launcher.py (torch's elastic agent) starts the ranks, forked warm, and restarts them in place after a crash
or a hang up to `compute.restarts_in_place` times; on CPU the trainer uses gloo. Each job runs in its own process
group so cancelling it stops every rank. Being its own session, a job would also survive the death of the process
that launched it: the job's environment names that process in TESSERA_SUPERVISOR_PID, and the trainer stops when
it is gone.

The launcher runs the watchdog beside the ranks. This process keeps one too, for what the launcher cannot see: its
own process stopped (a SIGSTOP of the whole group). It acts only then; the launcher's restarts cannot help, so the
flow relaunches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.config import ComputeConfig
from infra.joblog import JobLog
from infra.launch_outcome import RECORD_PREFIX, LaunchOutcome, Restart, hang_of, read_records
from infra.lifecycle import forget, launching
from infra.watchdog import Budgets, Hang, Watchdog, fresh_folder, process_state, report_then_kill, signal_group

# The trainer's side of the contract (trainers/supervisor.py reads it): infra imports only that module of trainers.
from trainers.contract import HEARTBEAT_DIR_ENV, WATCHDOG_ENV
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV


@dataclass(eq=False)
class LocalJob:
    """A running launcher process and where its output goes."""

    process: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where this launch's output starts in the (appended) log
    stopped: bool = False  # cancelled by its owner (cancel_all), not lost to the outside world
    # Stops from outside that the job absorbed by restarting itself; a local job restarts nothing.
    preemptions: int = 0
    hung: Hang | None = None  # what a watchdog saw before it killed the ranks, when that ended the launch
    restarts: list[Restart] = field(default_factory=list)  # in place, by the launcher: read when the job ends
    avoid_node: None = None  # no nodes to keep a relaunch off (KubernetesJob.avoid_node)

    def __post_init__(self) -> None:
        self._log = JobLog(self.log_path, self.log_offset)
        self._outer_hang: Hang | None = None

    def watch(self, watchdog: Watchdog) -> threading.Thread:
        """Judge the ranks' heartbeats until the job ends, for a launcher that cannot (see the module docstring);
        a hung group's stacks go to the log (asked for before a stopped rank is woken: `Watchdog.stacks`), then it
        is killed, which reads as a preemption."""

        def run() -> None:
            while self.process.poll() is None and not self.stopped:
                hang = watchdog.check()
                if hang is not None and not self.stopped and self._launcher_cannot_act(hang):
                    self._kill_hung(watchdog, hang)
                    return
                time.sleep(watchdog.budgets.poll_s)

        thread = threading.Thread(target=run, name="tessera-watchdog", daemon=True)
        thread.start()
        return thread

    def _launcher_cannot_act(self, hang: Hang) -> bool:
        return process_state(self.process.pid) == "T"

    def _kill_hung(self, watchdog: Watchdog, hang: Hang) -> None:
        group = self.process.pid
        self._outer_hang = hang

        def write(text: str) -> None:
            with open(self.log_path, "a") as log:
                log.write(text)
                log.write("tessera.watchdog: killed the group; the flow relaunches it from the last checkpoint\n")

        def kill() -> None:
            signal_group(group, signal.SIGCONT)
            signal_group(group, signal.SIGKILL)

        report_then_kill(watchdog, hang, write, kill, "the group is killed")

    def new_output(self, max_bytes: int = 4 << 20) -> list[str]:
        """Complete lines of rank 0's output written since the last call (this launch's only)."""
        return self._log.new_lines(max_bytes)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code of the rank that failed first (-N: killed by signal N), or the launcher's (0 when all
        ranks succeeded): the launcher's end record says which rank failed first, and how (infra/launcher.py)."""
        code = self.process.wait(timeout)
        restarts, end = self._records()
        self.restarts = restarts
        if (
            self._outer_hang is not None
        ):  # this process killed the group: what the dying launcher saw is its consequence
            self.hung = self._outer_hang
            return -signal.SIGKILL
        if end is None:
            return code
        self.hung = hang_of(end)
        if self.hung is not None:  # the launcher's watchdog, its restarts spent: the ranks were killed
            return -signal.SIGKILL
        return int(end["code"]) if end.get("code") is not None else code

    def _records(self) -> tuple[list[Restart], dict | None]:
        return read_records(self._log.lines_with(RECORD_PREFIX))

    def result(self) -> LaunchOutcome:
        """How the launch ended (waits for it): the stage task reads this."""
        code = self.wait()
        return LaunchOutcome(code=code, hung=self.hung, restarts=list(self.restarts))

    def cancel(self, grace_s: float = 10.0) -> None:
        """SIGTERM the job's whole process group, then SIGKILL whatever is left after grace_s.

        The group can outlive the launcher (a rank stuck in a collective, dataloader workers),
        so this signals the group even when the launcher has already exited.
        """
        group = self.process.pid
        if signal_group(group, signal.SIGTERM):
            deadline = time.monotonic() + grace_s
            while signal_group(group, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            signal_group(group, signal.SIGKILL)
        self.process.wait()
        forget(self)

    def tail(self, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
        """The last lines of this launch's rank-0 log (reads only its end: logs of long runs are large)."""
        return self._log.tail(lines, max_bytes)


class LocalBackend:
    """Launches `python -m <module> <args>` as procs_per_node ranks under infra/launcher.py (torch's agent)."""

    def __init__(self, cfg: ComputeConfig):
        self.cfg = cfg

    def command(self, module: str, args: Sequence[str], log_dir: Path, warm: Sequence[str] = ()) -> list[str]:
        return [
            sys.executable,
            "-m",
            "infra.launcher",
            "--nproc-per-node",
            str(self.cfg.ranks_per_node),
            "--max-restarts",
            str(self.cfg.restarts_in_place),
            # rank 0 goes to the job log; other ranks get their own files instead of being discarded
            "--log-dir",
            str(log_dir),
            *(["--warm", ",".join(warm)] if warm else ["--cold"]),
            "-m",
            module,
            *args,
        ]

    def launch(
        self,
        module: str,
        args: Sequence[str],
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        warm: Sequence[str] = (),
    ) -> LocalJob:
        """`warm`: modules the ranks' forkserver imports once (infra/warm.py); none: fresh interpreters."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "rank0.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SUPERVISOR_ENV: str(os.getpid()), **(env or {})}
        budgets = Budgets.from_json(env.get(WATCHDOG_ENV))
        watchdog = None
        if budgets is not None:
            beats = fresh_folder(log_dir / "heartbeats")
            env[HEARTBEAT_DIR_ENV] = str(beats)
            watchdog = Watchdog(beats, budgets, list(range(self.cfg.ranks_per_node)))
        with launching() as live:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(
                    self.command(module, args, log_dir, warm),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            job = LocalJob(process=process, log_path=log_path, log_offset=offset)
            live.add(job)
        if watchdog is not None:
            job.watch(watchdog)
        return job
