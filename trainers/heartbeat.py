"""This rank's heartbeat: what it is doing and when it last made progress, for the watchdog beside the ranks.

A run that stops making progress without dying (a hung collective, a wedged GPU, a stuck read) is
caught by infra/watchdog.py, which runs outside the ranks (in the launching task locally, in the
pod's entrypoint on Kubernetes) and reads these files. Writing one costs no collective and no
syscall beyond a pwrite: each rank keeps one fixed-size file (`TESSERA_HEARTBEAT_DIR/rank<R>.json`,
trainers/contract.py) open and rewrites it in place at every phase change and step end; a reader
that catches it mid-write sees bad JSON and looks again at its next poll. Nothing is fsynced: a
heartbeat matters only while the launch lives.

Fields: rank, local_rank, pid, host, node (the Kubernetes node, NODE_NAME), stage, phase
(trainers/contract.PHASES), since (when the phase began), beat (the last progress: a phase change,
a step's or an eval batch's end, bytes a save has written), step, tokens, world (the launch's rank count: with
several, a silent rank's peers wait in a collective), step_p99_s, eval_p99_s and data_p99_s (the 99th
percentile of the last 200 steps' compute time, eval batches and waits for a batch: the watchdog learns
those phases' budgets from them), write_bytes_per_s (how fast this launch's saves wrote), hint_bytes (how
much a size-bound phase moves: a checkpoint to load or save, data to verify) and timing (where this rank's
steps went, trainers/callbacks.Heartbeat).

`faulthandler` writes every thread's Python stack to `stacks-rank<R>.txt` on SIGUSR1: the watchdog
asks for it before it kills a hung group, and the handler runs in C, so a rank blocked inside a
collective answers too. Standard library only: `start()` runs first thing in the entrypoint, before
torch is imported, so a rank stuck importing or joining the rendezvous is seen as well.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from trainers.contract import HEARTBEAT_BYTES, HEARTBEAT_DIR_ENV, PHASES

STEP_WINDOW = 200  # steps behind the learned step budget


class Beat:
    """One rank's heartbeat file."""

    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / f"rank{rank}.json", os.O_RDWR | os.O_CREAT, 0o644)
        # Kept open for the life of the process: faulthandler writes to its descriptor from a signal handler.
        self.stacks = open(folder / f"stacks-rank{rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True, chain=False)
        now = time.time()
        host = socket.gethostname()
        self.record: dict = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "pid": os.getpid(),
            "host": host,
            "node": os.environ.get("NODE_NAME") or host,
            "stage": None,
            "phase": "startup",
            "since": now,
            "beat": now,
            "step": None,
            "tokens": None,
            "step_p99_s": None,
            "eval_p99_s": None,
            "data_p99_s": None,
            "write_bytes_per_s": None,
            "world": int(os.environ.get("WORLD_SIZE", "1")),
            "hint_bytes": 0,
            "timing": None,
        }
        self._windows: dict[str, collections.deque[float]] = {}  # recent durations of a step, an eval batch, ...
        self.started = now  # the process's start, to within its interpreter's start-up
        self._spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()
        self._write()

    def phase(self, name: str, hint_bytes: int = 0) -> None:
        assert name in PHASES, name
        now = time.time()
        self._spent[self.record["phase"]] += now - self.record["since"]
        self.record.update(phase=name, since=now, beat=now, hint_bytes=int(hint_bytes))
        self._write()

    def spent(self) -> dict[str, float]:
        """Seconds this process has spent in each phase so far (the goodput ledger's raw material)."""
        spent = dict(self._spent)
        spent[self.record["phase"]] += time.time() - self.record["since"]
        return {k: round(v, 3) for k, v in spent.items()}

    def progress(self, step: int | None = None, tokens: int | None = None, compute_s: float | None = None) -> None:
        if compute_s is not None:
            self.learn("step", compute_s)
        if step is not None:
            self.record.update(step=step, tokens=tokens)
        self.record["beat"] = time.time()
        self._write()

    def learn(self, what: str, seconds: float) -> None:
        """One more duration of `what` (step: a step's compute; eval: an eval batch; data: a wait for a batch): its
        p99 over the last STEP_WINDOW goes in the record, for the watchdog to budget that phase from. Written with
        the next beat."""
        window = self._windows.setdefault(what, collections.deque(maxlen=STEP_WINDOW))
        window.append(seconds)
        ordered = sorted(window)
        self.record[f"{what}_p99_s"] = round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4)

    def set(self, **fields) -> None:
        self.record.update(fields)
        self._write()

    def _write(self) -> None:
        with self._lock:  # a save's growth thread beats too (trainers/saver.GrowthBeats)
            self._write_now()

    def _write_now(self) -> None:
        data = json.dumps(self.record, separators=(",", ":")).encode()
        if len(data) > HEARTBEAT_BYTES:  # the timing summary is the only field that grows
            data = json.dumps({**self.record, "timing": None}, separators=(",", ":")).encode()
        os.pwrite(self.fd, data.ljust(HEARTBEAT_BYTES), 0)


_BEAT: list[Beat] = []


def start() -> Beat | None:
    """This rank's heartbeat, in phase `startup`, when the launcher asked for one (TESSERA_HEARTBEAT_DIR)."""
    folder = os.environ.get(HEARTBEAT_DIR_ENV)
    if not folder:
        return None
    if not _BEAT:
        _BEAT.append(Beat(Path(folder), int(os.environ.get("RANK", "0"))))
    return _BEAT[0]


def current() -> Beat | None:
    return _BEAT[0] if _BEAT else None


def phase(name: str, hint_bytes: int = 0) -> None:
    """This rank enters `name` (a no-op without a heartbeat): the phases tessera runs outside Composer's loop."""
    if _BEAT:
        _BEAT[0].phase(name, hint_bytes)
