"""Where each rank's steps go, and which rank is slow: data wait, compute and time in collectives, per rank.

A straggler (a throttled GPU, a noisy neighbour, a slow disk) slows every rank of a data-parallel
group, since each waits for it in the gradient all-reduce: the group's throughput says something is
slow, not who. Each step is split on every rank into
    data_s        waiting for the batch (Composer's BEFORE_DATALOADER to AFTER_DATALOADER);
    collective_s  wall time with a collective in flight: each bucket's gradient all-reduce (a DDP communication
                  hook around the default all-reduce), DDP's broadcast of the buffers at each forward, or under
                  FSDP2 each unit's parameter all-gather (issued, then waited for) and gradient reduce-scatter,
                  and the reductions Composer's loop makes itself (composer.utils.dist's functions, timed while the
                  stage trains); the union of their intervals;
    compute_s     the rest of the step: forward, backward and optimizer not spent waiting on a peer.
The slow rank is the one whose compute_s stands out: it waits least in the all-reduce, its peers most.

Every `slow_rank_every_steps` steps each rank hands its means to a background thread that posts them to
the launch's store (a key per rank: no collective, nothing on the hot path); rank 0's thread reads
every rank's and prints one `tessera.ranks {json}` line (trainers/progress.py), logs
`ranks/slowest_over_median` to MLflow at the step's tokens, and tags the run `tessera.slow_rank` when
one rank stays above `slow_rank_factor` x the median for three comparisons in a row. With one rank
only data_s and compute_s are known and nothing is compared.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import statistics
import sys
import threading
import time

from composer.core import Callback, State
from composer.loggers import Logger

from trainers.progress import format_ranks

log = logging.getLogger("tessera.train")
PERSIST = 3  # comparisons in a row a rank must stay slow before the run is tagged
COMPOSER_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "barrier",
)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class RankTiming(Callback):
    """Splits each step of this rank; compares the ranks every `every` steps through the store (rank 0 reports)."""

    def __init__(self, every: int, factor: float, metrics=None):
        self.every, self.factor, self.metrics = every, factor, metrics
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.where = {"host": socket.gethostname(), "node": os.environ.get("NODE_NAME") or socket.gethostname()}
        self._lock = threading.Lock()
        self._inflight: list[tuple[float, float]] = []
        self._hooked = False
        self._patched: list[tuple[object, str, object]] = []
        self._thread: threading.Thread | None = None
        self._data_started = self._step_started = 0.0
        self._data_s = 0.0
        self._window: list[tuple[float, float, float]] = []  # (data, compute, collective) of the window's steps
        self._windows = 0
        self._slow_streak: tuple[int | None, int] = (None, 0)
        self._posts: queue.Queue = queue.Queue()
        self.reports: list[dict] = []  # rank 0's comparisons, for tests

    # -- measuring ------------------------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if self.world > 1 and isinstance(state.model, DistributedDataParallel):
            state.model.register_comm_hook(None, self._timed_allreduce)
            # DDP also broadcasts the module's buffers at every forward (broadcast_buffers, Composer's default): a
            # blocking collective where the ranks that came early wait for the late one. torch 2.7's DDP does it
            # through this method; where it is missing only the gradient all-reduce is timed.
            broadcast = getattr(state.model, "_distributed_broadcast_coalesced", None)
            if broadcast is not None:
                state.model._distributed_broadcast_coalesced = self._timed(broadcast)
            self._hooked = True
        if self.world > 1 and self._time_fsdp2(state.model):
            self._hooked = True
        if self.world > 1:
            # Composer's loop itself reduces across ranks every step (the loss, its out-of-memory flags), through
            # composer.utils.dist, whose functions it looks up at each call: the first rank to arrive waits there.
            from composer.utils import dist as composer_dist

            for name in COMPOSER_COLLECTIVES:
                original = getattr(composer_dist, name, None)
                if original is not None:
                    self._patched.append((composer_dist, name, original))
                    setattr(composer_dist, name, self._timed(original))
        if self.world > 1:
            self._thread = threading.Thread(target=self._post_and_compare, name="tessera-rank-timing", daemon=True)
            self._thread.start()

    def _time_fsdp2(self, model) -> bool:
        """Time FSDP2's collectives, which have no hook: the three functions its parameter groups call (torch
        2.7's `_fsdp_param_group` namespace: the all-gather's issue, its wait and copy-out, the reduce-scatter).
        False if the model is not sharded, or this torch names them otherwise (then nothing is compared)."""
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            return False
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
        except ImportError:
            return False
        names = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
        if not all(callable(getattr(group, name, None)) for name in names):
            return False
        for name in names:
            original = getattr(group, name)
            self._patched.append((group, name, original))
            setattr(group, name, self._timed(original))
        return True

    def _timed_allreduce(self, _state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        started = time.perf_counter()

        def done(fut):
            with self._lock:
                self._inflight.append((started, time.perf_counter()))
            return fut.value()

        return allreduce_hook(None, bucket).then(done)

    def _timed(self, collective):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                with self._lock:
                    self._inflight.append((started, time.perf_counter()))

        return timed

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._data_started = time.perf_counter()

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._step_started = time.perf_counter()
        self._data_s = self._step_started - self._data_started

    def batch_end(self, state: State, logger: Logger) -> None:
        step_s = time.perf_counter() - self._step_started
        with self._lock:
            collective = _union(self._inflight) if self._hooked else 0.0
            self._inflight.clear()
        self._window.append((self._data_s, max(0.0, step_s - collective), collective))
        if len(self._window) >= self.every:
            means = [round(statistics.fmean(x), 6) for x in zip(*self._window, strict=True)]
            self._window.clear()
            self._windows += 1
            summary = {"rank": self.rank, **self.where, "data_s": means[0], "compute_s": means[1]}
            summary["collective_s"] = means[2] if self._hooked else None
            summary |= {
                "window": self._windows,
                "step": int(state.timestamp.batch),
                "tokens": int(state.timestamp.token),
            }
            self._posts.put(summary)

    # -- comparing, off the training thread ---------------------------------------------------------

    def _post_and_compare(self) -> None:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        while True:
            summary = self._posts.get()
            if summary is None:
                return
            try:
                store.set(f"tessera/timing/{self.rank}/{summary['window']}", json.dumps(summary))
                if self.rank == 0:
                    self._compare(store, summary)
            except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the run
                log.warning("rank timing: %s", exc)
                return

    def _compare(self, store, mine: dict) -> None:
        keys = [f"tessera/timing/{r}/{mine['window']}" for r in range(self.world)]
        deadline = time.monotonic() + 60
        while not store.check(keys):  # the other ranks post within a step or two of this one
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        ranks = [json.loads(store.get(k)) for k in keys]
        median = statistics.median(r["compute_s"] for r in ranks)
        slowest = max(ranks, key=lambda r: r["compute_s"])
        ratio = slowest["compute_s"] / median if median > 0 else 1.0
        report = {
            "step": mine["step"],
            "tokens": mine["tokens"],
            "steps": self.every,
            "ranks": ranks,
            "slowest": {k: slowest[k] for k in ("rank", "host", "node")},
            "slowest_over_median": round(ratio, 3),
            "factor": self.factor,
            "slow": ratio > self.factor,
        }
        self.reports.append(report)
        print(format_ranks(report), file=sys.stdout, flush=True)
        if self.metrics is not None:
            self.metrics.note(mine["tokens"], {"ranks/slowest_over_median": ratio})
        rank, streak = self._slow_streak
        streak = streak + 1 if ratio > self.factor and rank == slowest["rank"] else int(ratio > self.factor)
        self._slow_streak = (slowest["rank"], streak)
        if streak == PERSIST and self.metrics is not None:
            where = (
                slowest["host"] if slowest["node"] == slowest["host"] else f"{slowest['host']}, node {slowest['node']}"
            )
            self.metrics.note(
                None,
                {},
                tags={
                    "tessera.slow_rank": f"rank {slowest['rank']} ({where}): {ratio:.2f}x the median rank's compute "
                    f"per step, {PERSIST} comparisons in a row at {mine['tokens']:,} tokens"
                },
            )

    def fit_end(self, state: State, logger: Logger) -> None:
        self._posts.put(None)
        if self._thread is not None:  # the stage's last comparison is posted and said before the process ends
            self._thread.join(timeout=10)
        for module, name, original in self._patched:
            setattr(module, name, original)
        self._patched.clear()
