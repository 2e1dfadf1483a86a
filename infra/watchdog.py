"""The watchdog beside the ranks: a rank that makes no progress for longer than its phase allows is hung.

It runs outside the rank processes, in the launcher's monitor loop (infra/launcher.py, locally and in each
pod; the launching task keeps one for a stopped launcher, infra/local.py), and reads the heartbeat each rank
of this node rewrites in TESSERA_HEARTBEAT_DIR (trainers/heartbeat.py; the names are trainers/contract.py's).
A rank is hung when `now - beat` exceeds its phase's budget (`Budgets.of`): the learned step budget, a size-bound
save or load, a first step, an eval batch. Then `stacks()` has each rank write its Python stacks where
the hang left it (py-spy where installed, else faulthandler on SIGUSR1) and only then wakes a stopped
one (SIGCONT: it must really die), and the caller kills the ranks, which the launcher restarts in place from
the last checkpoint (or, its restarts spent, the flow relaunches) as a preemption. The standard library, and
pydantic for the budgets' model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainers.contract import (
    DIST_TIMEOUT_ENV,
    DIST_TIMEOUT_S,
    HEARTBEAT_DIR_ENV,
    PHASES,
    WATCHDOG_ENV,
    WatchdogConfig,
)

STACKS_WAIT_S = 3.0  # for every rank's faulthandler to write its stacks


class Budgets(WatchdogConfig):
    """The recipe's `train.watchdog` section (trainers.contract.WatchdogConfig), as the launcher reads it from
    TESSERA_WATCHDOG, with how a phase's budget is reckoned from it."""

    @classmethod
    def from_json(cls, text: str | None) -> Budgets | None:
        """The budgets a launch's environment carries; None when it asks for no watchdog."""
        if not text:
            return None
        budgets = cls.model_validate({k: v for k, v in json.loads(text).items() if k in cls.model_fields})
        return budgets if budgets.enabled else None

    def of(self, beat: dict, collective_s: float | None = None) -> tuple[float, str]:
        """(seconds, how they were reckoned) that `beat`'s phase may go without progress.

        Learned from the work where the launch has measured it, within a floor and a ceiling: a step, an eval batch
        and a wait for a batch get `step_factor` x the rank's recent p99 of that work (an eval batch, which no rank
        has timed yet, that of a step, which computes more); a size-bound phase (a save, a load) `size_factor` x
        its bytes at the write speed this launch's saves measured (before one has, `bytes_per_s`). The floor is
        `step_floor_s`; the ceiling is the phase's own `<phase>_s` (plus the bytes at `bytes_per_s`). With several
        ranks (`collective_s`: the process group's timeout less a margin), no phase in which the others wait for
        this rank in a collective may outlast that timeout, which would turn a hang into a failure."""
        phase = beat.get("phase", "startup")
        budget, why = self._learned(phase, beat)
        if collective_s is not None and int(beat.get("world") or 1) > 1 and phase in COLLECTIVE_PHASES:
            if budget > collective_s:
                return collective_s, f"{why}, cut to the process group's collective timeout less a margin"
        return budget, why

    def _learned(self, phase: str, beat: dict) -> tuple[float, str]:
        if phase in ("step", "eval", "data"):
            p99 = beat.get(f"{phase}_p99_s") or (beat.get("step_p99_s") if phase == "eval" else None)
            ceiling = self.eval_s if phase == "eval" else self.data_s if phase == "data" else float("inf")
            if not p99:
                if phase == "step":
                    return self.step_floor_s, "the step floor; no step timed yet"
                return ceiling, f"the {phase} budget; none timed yet"
            learned, work = self.step_factor * p99, WORK[phase]
            whose = "" if phase == "step" else f"{work}' "  # the step's own wording, as the logs have always said it
            if learned <= self.step_floor_s:
                return self.step_floor_s, f"the step floor; {self.step_factor:g} x {whose}p99 {p99:.2f} s is less"
            if learned >= ceiling:
                return ceiling, f"the {phase} ceiling; {self.step_factor:g} x {whose}p99 {p99:.2f} s is more"
            return learned, f"{self.step_factor:g} x the recent {work}' p99 of {p99:.2f} s"
        base = getattr(self, f"{phase}_s", self.startup_s)
        hint = int(beat.get("hint_bytes") or 0)
        if not hint:
            return base, f"the {phase} budget"
        ceiling = base + hint / self.bytes_per_s
        speed = float(beat.get("write_bytes_per_s") or 0) if phase == "save" else 0.0
        rate = speed or self.bytes_per_s
        learned = max(self.step_floor_s, self.size_factor * hint / rate)
        measured = f"{rate / 1e6:.0f} MB/s {'measured' if speed else 'assumed'}"
        if learned >= ceiling:
            return ceiling, f"{base:.0f} s + {hint / 1e9:.2f} GB at {self.bytes_per_s / 1e6:.0f} MB/s"
        return learned, f"{self.size_factor:g} x {hint / 1e9:.2f} GB at {measured}, at least {self.step_floor_s:.0f} s"


WORK = {"step": "steps", "eval": "eval batches", "data": "waits for a batch"}
# The phases inside the training loop: a rank silent in one of them leaves its peers waiting in a collective.
COLLECTIVE_PHASES = ("step", "eval", "data", "save")
COLLECTIVE_MARGIN_S = 15.0  # the watchdog's poll, its stacks and the kill all fit before the group's own timeout


def collective_budget(dist_timeout_s: float, poll_s: float) -> float:
    """The most a silent rank of a multi-rank launch may be given: the process group's timeout less a margin."""
    return max(poll_s, dist_timeout_s - COLLECTIVE_MARGIN_S - 2 * poll_s)


def budgets_env(budgets: dict) -> dict[str, str]:
    """The launch environment that asks for a watchdog with these budgets (WatchdogConfig.model_dump())."""
    return {WATCHDOG_ENV: json.dumps(budgets)}


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T: stopped, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


@dataclass
class Hang:
    """What the watchdog saw: the rank it blames, and every rank's phase and silence."""

    rank: int
    pid: int | None
    host: str
    node: str
    phase: str
    silent_s: float
    budget_s: float
    why: str
    stopped: bool = False
    ranks: list[dict] = field(default_factory=list)

    def line(self) -> str:
        where = self.host if self.node in (self.host, "") else f"{self.host} on node {self.node}"
        stopped = ", its process stopped (SIGSTOP)" if self.stopped else ""
        others = [r for r in self.ranks if r["rank"] != self.rank]
        also = ""
        if others:
            also = "; " + ", ".join(f"rank {r['rank']} in {r['phase']} {r['silent_s']:.0f} s" for r in others)
        pid = f", pid {self.pid}" if self.pid else ""
        return (
            f"rank {self.rank} ({where}{pid}) hung in phase {self.phase} for {self.silent_s:.0f} s, over its "
            f"{self.budget_s:.0f} s budget ({self.why}){stopped}{also}"
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Watchdog:
    """The heartbeats of one node's ranks, judged against their budgets."""

    def __init__(
        self,
        folder: Path,
        budgets: Budgets,
        ranks: list[int],
        started: float | None = None,
        dist_timeout_s: float | None = None,
    ):
        self.folder, self.budgets, self.ranks = Path(folder), budgets, ranks
        self.started = time.time() if started is None else started
        timeout = float(os.environ.get(DIST_TIMEOUT_ENV, DIST_TIMEOUT_S)) if dist_timeout_s is None else dist_timeout_s
        self.collective_s = collective_budget(timeout, budgets.poll_s)
        self._last: dict[int, dict] = {}

    def beats(self) -> dict[int, dict]:
        """Each rank's latest heartbeat; a file caught mid-rewrite keeps the one read before."""
        for rank in self.ranks:
            try:
                text = (self.folder / f"rank{rank}.json").read_bytes().decode(errors="replace").strip()
                beat = json.loads(text)
            except (OSError, ValueError):
                continue
            if isinstance(beat, dict) and beat.get("phase") in PHASES:
                self._last[rank] = beat
        return dict(self._last)

    def check(self, now: float | None = None) -> Hang | None:
        """The hang to act on now, or None. Once any rank is past its budget, a rank whose process is stopped is
        the one blamed (its peers wait for it in a collective); otherwise the one silent longest."""
        now = time.time() if now is None else now
        beats = self.beats()
        judged: list[Hang] = []
        over = False
        for rank in self.ranks:
            beat = beats.get(rank)
            if beat is None:  # not even started its heartbeat: a rank stuck before Python ran its first line
                silent, budget, why = now - self.started, self.budgets.startup_s, "the startup budget, no heartbeat"
                beat = {"rank": rank, "phase": "startup", "host": "", "node": "", "pid": None}
            else:
                silent = now - float(beat.get("beat", now))
                budget, why = self.budgets.of(beat, self.collective_s)
            over = over or silent > budget
            pid = beat.get("pid")
            judged.append(
                Hang(
                    rank=rank,
                    pid=pid,
                    host=beat.get("host", ""),
                    node=beat.get("node", ""),
                    phase=beat["phase"],
                    silent_s=silent,
                    budget_s=budget,
                    why=why,
                    stopped=pid is not None and process_state(pid) == "T",
                )
            )
        if not over:
            return None
        stopped = [h for h in judged if h.stopped]
        hang = stopped[0] if stopped else max((h for h in judged if h.silent_s > h.budget_s), key=lambda h: h.silent_s)
        hang.ranks = [{"rank": h.rank, "phase": h.phase, "silent_s": round(h.silent_s, 1)} for h in judged]
        return hang

    def pids(self) -> list[int]:
        """The ranks' pids in rank order, whichever rank's heartbeat was read first (CI at 16d789d: rank 1's file,
        read before rank 0 had written one, came first, and a test took rank 0 for the frozen rank)."""
        beats = self.beats()
        return [int(beats[rank]["pid"]) for rank in sorted(beats) if beats[rank].get("pid")]

    def stacks(self) -> str:
        """Every rank's Python stacks where the hang left them, as text for the stage log; stopped ranks are woken
        (SIGCONT) only after their stacks are asked for.

        The order is the point: a stopped rank that is woken first runs on, its waiting peers with it, and under
        load the whole group can be steps further (or in its closing barrier) by the time it is asked, so the
        stacks would show where the ranks went, not where they hung (CI at dc718cc: rank 0's stack was past the
        collective it had been waiting in). A SIGUSR1 pending on a stopped process is handled before it runs
        another line once woken, and py-spy's --nonblocking reads a stopped process's memory without waking it.
        """
        pids = self.pids()
        spy = shutil.which("py-spy")
        dumps = _spy_dumps(spy, pids) if spy else None
        if dumps is not None:
            _wake(pids)
            return dumps
        before = {rank: self._stack_size(rank) for rank in self.ranks}
        for pid in pids:
            _signal(pid, signal.SIGUSR1)
        _wake(pids)
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and any(self._stack_size(r) <= before[r] for r in self.ranks):
            time.sleep(0.1)
        parts: list[str] = []
        for rank in self.ranks:
            path = self.folder / f"stacks-rank{rank}.txt"
            try:
                text = path.read_bytes()[before[rank] :].decode(errors="replace").strip()
            except OSError:
                text = ""
            text = text or "(none written: the rank did not answer)"
            parts.append(f"--- rank {rank}: Python stacks (faulthandler)\n{text}")
        return "\n".join(parts)

    def _stack_size(self, rank: int) -> int:
        try:
            return (self.folder / f"stacks-rank{rank}.txt").stat().st_size
        except OSError:
            return 0


def report_then_kill(watchdog: Watchdog, hang: Hang, write, kill, then: str) -> None:
    """Write the hang's line and every rank's stacks with `write`, then `kill` the ranks.

    The kill is in a `finally` and the report is best-effort: a log on a full disk (ENOSPC), or a closed one,
    must never leave a hung group running for good, which it did when the write's error ended the watchdog
    before its kill. What could not be written is said on stderr if that still works."""
    try:
        stacks = watchdog.stacks()  # before any rank is woken: see its docstring
        write(f"tessera.watchdog: {hang.line()}; every rank's stacks follow, then {then}\n{stacks}\n")
    except (OSError, ValueError) as exc:  # ValueError: a write to a closed file
        try:
            os.write(2, f"tessera.watchdog: {hang.line()}; could not write its report ({exc}); {then}\n".encode())
        except OSError:
            pass
    finally:
        kill()


def _spy_dumps(spy: str, pids: list[int]) -> str | None:
    """Every pid's stacks read by py-spy without waking or pausing it (--nonblocking); None if any dump failed, for
    faulthandler to answer instead."""
    parts: list[str] = []
    for pid in pids:
        try:
            out = subprocess.run(
                [spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode:
            return None
        parts.append(f"--- py-spy dump of pid {pid}\n{out.stdout}")
    return "\n".join(parts)


def _wake(pids: list[int]) -> None:
    """SIGCONT: a stopped rank must run to handle a pending SIGUSR1, and to die of a SIGTERM."""
    for pid in pids:
        _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(group: int, sig: int) -> bool:
    """Send sig to a process group; False when no process of the group is left."""
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a group of another user's: nothing of ours to stop
        return False


def fresh_folder(folder: Path) -> Path:
    """The launch's heartbeat folder, emptied of an earlier launch's files (their pids are gone)."""
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


__all__ = [
    "Budgets",
    "Hang",
    "Watchdog",
    "HEARTBEAT_DIR_ENV",
    "budgets_env",
    "fresh_folder",
    "process_state",
    "signal_group",
]
