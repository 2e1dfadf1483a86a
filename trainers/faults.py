"""Fault injection and observation, for the tests and benches; inert unless their variables are set.

One module holds every hook, so what a test can do to a trainer is read in one place:
`TESSERA_FAULT=<point>:<tokens>` (step, save, published: SIGKILL there; nan: poison that step),
`TESSERA_FAULT=stall-<point>:<seconds>` (node: a node's checkpoint fetch; launch: a launch's start, before it
plans; save: a checkpoint save), `TESSERA_FAULT_RANK=<r>` (only on that rank), `TESSERA_FAULT_STAGE=<k>` (only in
stage k), `TESSERA_FAULT_ONCE=<file>` (a kill only in the first launch that reaches it),
`TESSERA_FAULT=slow:<seconds>` (a straggler: each step, and the preflight's matmul, that much slower; `slow:x<F>`,
F times as slow),
`TESSERA_FAULT=slow-save:<seconds>` (a throttled writer: a save that writes a little at a time for that long),
`TESSERA_FREEZE=rank|group:<tokens>` with `TESSERA_FREEZE_RANK` and `TESSERA_FREEZE_ONCE` (a SIGSTOP of the rank,
or of its whole process group, right after a step: a hang for the watchdog) and `TESSERA_SAMPLE_LOG=<file>` (what
each step trained on).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

FAULT_ENV = "TESSERA_FAULT"


def maybe_stall(point: str, stage: int | None = None) -> None:
    """`TESSERA_FAULT=stall-<point>:<seconds>`: this rank is slow there (a large download, say); with
    `TESSERA_FAULT_STAGE=<k>`, only in stage k's launches."""
    spec = os.environ.get(FAULT_ENV, "")
    only = os.environ.get("TESSERA_FAULT_STAGE")
    if spec.startswith(f"stall-{point}:") and (only is None or stage is None or int(only) == stage):
        time.sleep(float(spec.split(":", 1)[1]))


def maybe_write_slowly(folder: Path, every_s: float) -> None:
    """`TESSERA_FAULT=slow-save:<seconds>`: a save that writes a little (1 KB) every `every_s` for that long before
    the checkpoint itself, into its folder: a throttled writer, slow but moving, for the watchdog's tests."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith("slow-save:"):
        return
    probe = Path(folder) / ".slow-save-probe"
    with open(probe, "ab") as f:
        deadline = time.monotonic() + float(spec.split(":", 1)[1])
        while time.monotonic() < deadline:
            f.write(b"x" * 1024)
            f.flush()
            time.sleep(every_s)
    probe.unlink(missing_ok=True)


def maybe_freeze(tokens: int, phase: str = "after") -> None:
    """`TESSERA_FREEZE=rank:<tokens>[:<phase>]` (or `group:...`): at <tokens>, the rank named by TESSERA_FREEZE_RANK
    (0) stops itself (or its whole process group, the launcher included) with SIGSTOP, as a wedged rank would. The
    phase says where: `after` the step that ends at <tokens> (the default), in the `step` that starts there (before
    its backward), in its `data` wait, in an `eval` batch of the checkpoint at <tokens>, or in its `save`. With
    `TESSERA_FREEZE_ONCE=<file>`, only the first launch that gets there, which writes its pid, process group and the
    time into the file. A hang at an exact point, for the watchdog's tests."""
    spec = os.environ.get("TESSERA_FREEZE", "")
    what, _, rest = spec.partition(":")
    at, _, where = rest.partition(":")
    if not at or int(at) != tokens or (where or "after") != phase:
        return
    if os.environ.get("TESSERA_FREEZE_RANK", "0") != os.environ.get("RANK", "0"):
        return
    once = os.environ.get("TESSERA_FREEZE_ONCE")
    if once:
        try:
            fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "at": time.time()}).encode())
        os.close(fd)
    if what == "group":
        os.killpg(os.getpgid(0), signal.SIGSTOP)
    else:
        os.kill(os.getpid(), signal.SIGSTOP)


def _slow_spec() -> str | None:
    """What follows `slow:` in TESSERA_FAULT on this rank (TESSERA_FAULT_RANK, else every rank), else None."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec.startswith("slow:") and os.environ.get("TESSERA_FAULT_RANK", os.environ.get("RANK")) == os.environ.get(
        "RANK", "0"
    ):
        return spec.split(":", 1)[1]
    return None


def slowed_by() -> float:
    """`TESSERA_FAULT=slow:<seconds>`: how much longer each step computes on this rank, and the preflight's matmul
    probe too (a straggler node is slow at both); 0 otherwise."""
    value = _slow_spec()
    return float(value) if value and not value.startswith("x") else 0.0


def slow_factor() -> float:
    """`TESSERA_FAULT=slow:x<F>`: this rank computes F times as long as it would, each step and the preflight's
    probe: a straggler by a ratio, which a loaded machine slows like its peers (an absolute delay drowns in the
    noise of a machine at load 10); 1 otherwise."""
    value = _slow_spec()
    return float(value[1:]) if value and value.startswith("x") else 1.0


def maybe_fault(point: str, tokens: int, path: Path | None = None) -> None:
    """Fault injection for the kill -9 tests: `TESSERA_FAULT=<point>:<tokens>`
    (optionally only on rank TESSERA_FAULT_RANK).

    `save` truncates the just-written checkpoint to half (what a kill mid-write leaves) and
    SIGKILLs this process before the manifest; `published` SIGKILLs after the local manifest,
    before any upload to a remote save folder; `step` SIGKILLs right after that step.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if spec != f"{point}:{tokens}":
        return
    if os.environ.get("TESSERA_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return  # TESSERA_FAULT_RANK=<r> limits the fault to one rank: a lost peer
    once = os.environ.get("TESSERA_FAULT_ONCE")
    if once:  # TESSERA_FAULT_ONCE=<file>: only the first launch that gets here dies (the file says it did)
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    if path is not None:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _step_tokens(state: State) -> int:
    return int(state.batch["input_ids"].numel()) * dist.get_world_size()


class Probe(Callback):
    """Test probes, off unless their environment variable is set.

    TESSERA_SAMPLE_LOG=<file>: rank 0 appends one JSON line per step, {tokens, samples, loss}:
    the global sample indices the step trained on (per rank) and the rank-averaged loss.
    TESSERA_FAULT=step:<tokens>: SIGKILL right after the step that ends at <tokens>.
    TESSERA_FAULT=nan:<tokens>: the step that ends at <tokens> computes a NaN loss.
    TESSERA_FAULT=slow:<seconds>: every step computes <seconds> longer (on TESSERA_FAULT_RANK only): a straggler;
    slow:x<F>: every step takes F times this rank's own last step.
    TESSERA_PEAK_LOG=<file>: at the stage's end every rank appends {rank, peak_mb, end_mb, save_s}: its peak
    and current resident memory (VmHWM, VmRSS) and the seconds each checkpoint save blocked it
    (bench/shard_memory.py).
    """

    def __init__(self):
        self.sample_log = os.environ.get("TESSERA_SAMPLE_LOG")
        self.peak_log = os.environ.get("TESSERA_PEAK_LOG")
        self.factor = slow_factor()
        self._step_started: float | None = None
        self._last_step_s = 0.0  # this rank's own last step, for slow:x<F>

    def before_dataloader(self, state: State, logger: Logger) -> None:
        maybe_freeze(int(state.timestamp.token), "data")  # after the heartbeat said `data`

    def before_backward(self, state: State, logger: Logger) -> None:
        maybe_freeze(int(state.timestamp.token), "step")

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        maybe_freeze(int(state.timestamp.token), "eval")

    def batch_start(self, state: State, logger: Logger) -> None:
        slow = slowed_by() + (self.factor - 1.0) * self._last_step_s
        if slow:
            time.sleep(slow)
        self._step_started = time.monotonic()
        if os.environ.get(FAULT_ENV) == f"nan:{int(state.timestamp.token) + _step_tokens(state)}":
            # Test hook: poison one weight so this step's forward really produces a NaN loss.
            with torch.no_grad():
                next(state.model.parameters()).view(-1)[0] = float("nan")

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._step_started is not None:
            self._last_step_s = time.monotonic() - self._step_started
        tokens = int(state.timestamp.token)
        if self.sample_log:
            mine = state.batch["sample_idx"].tolist()
            everyone = dist.all_gather_object(mine)
            if dist.get_global_rank() == 0:
                with open(self.sample_log, "a") as f:
                    loss = float(sum(state.total_loss_dict.values())) if state.total_loss_dict else None
                    f.write(json.dumps({"tokens": tokens, "samples": everyone, "loss": loss}) + "\n")
        maybe_fault("step", tokens)
        maybe_freeze(tokens)

    def fit_end(self, state: State, logger: Logger) -> None:
        if not self.peak_log:
            return
        import re

        status = Path("/proc/self/status").read_text()
        peak_kb, now_kb = (int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) for key in ("VmHWM", "VmRSS"))
        saves = next((c.save_seconds for c in state.callbacks if hasattr(c, "save_seconds")), [])
        record = {"rank": dist.get_global_rank(), "peak_mb": round(peak_kb / 1024, 1), "save_s": saves}
        record["end_mb"] = round(now_kb / 1024, 1)  # what the rank still holds after its last step and save
        with open(self.peak_log, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_sample_log(path: str | Path) -> dict[int, dict]:
    """The effective history: for each step (by token count) the record of the last launch that trained it.

    A relaunch re-trains the steps after its checkpoint, so later lines overwrite earlier ones.
    """
    steps: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        steps[record["tokens"]] = record
    return dict(sorted(steps.items()))
