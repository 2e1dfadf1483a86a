"""Relay a training job's progress lines to the people watching: Prefect logs, a progress artifact, a bar.

The trainer's rank 0 prints `tessera.progress {json}` lines (trainers/progress.py) into its log.
This reads them as they arrive and, at a bounded rate, logs one line per stage with step, tokens,
loss, throughput and an ETA to the stage's end, and moves the stage's Prefect progress artifact.
On a terminal it also drives a tqdm bar; in a worker's log the periodic lines are the progress.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from uuid import UUID

from infra.launch_outcome import read_records
from tasks.artifacts import artifact_key
from trainers.progress import parse_preflight, parse_progress, parse_ranks, parse_start

# At least this often a running stage says where it is, even when the trainer prints more often.
RELAY_EVERY_S = 15.0
# The rate behind the ETA is taken over this much of the launch's training time: a gauntlet or a
# checkpoint save on the same machine slows single windows several-fold, and an ETA read off one
# window jumped from 2 to 18 minutes between consecutive lines.
RATE_WINDOW_S = 120.0


def describe(p: dict, rate: float | None = None) -> str:
    """One progress line a person can read at a glance; `rate` (tokens/s) defaults to the line's own."""
    start, end, tokens = p["stage_start"], p["stage_end"], p["tokens"]
    done = (tokens - start) / max(1, end - start)
    rate = rate if rate is not None else (p.get("tokens_per_sec") or 0.0)
    eta = f"ETA {_duration((end - tokens) / rate)}" if rate > 0 and tokens < end else "stage end"
    loss = "n/a" if p.get("loss") is None else f"{p['loss']:.4f}"
    return (
        f"stage {p['stage']}: {tokens - start:,}/{end - start:,} tokens ({done:.0%}) at the run's step {p['step']:,}, "
        f"loss {loss}, {rate:,.0f} tok/s, {eta}"
    )


def describe_start(run_name: str, s: dict) -> str:
    """Where a launch starts, in words: the resume line of the run's log."""
    where = f"the checkpoint at {s['tokens']:,} tokens (step {s['step']:,})"
    written = f", written {s['written'].replace('T', ' ').replace('+00:00', ' UTC')}" if s.get("written") else ""
    if s["kind"] == "resume":
        return f"stage {s['stage']}: resuming run {run_name} from {where}{written}"
    if s["kind"] == "enter":
        return f"stage {s['stage']}: entering it from {where} that ended the stage before{written}"
    if s["kind"] == "done":
        return f"stage {s['stage']}: already complete at {s['tokens']:,} tokens; nothing to train"
    base = f" from the weights of {s['init_from']}" if s.get("init_from") else ""
    return f"stage {s['stage']}: starting run {run_name} fresh{base}"


def describe_slow_rank(stage: str, report: dict) -> str:
    """A slow rank, in one line: which, where, how much slower, and where its peers' time went."""
    slowest = report["slowest"]
    mine = next(r for r in report["ranks"] if r["rank"] == slowest["rank"])
    others = [r for r in report["ranks"] if r["rank"] != slowest["rank"]]
    where = slowest["host"] if slowest["node"] == slowest["host"] else f"{slowest['host']} on node {slowest['node']}"
    waits = ""
    if others and all(r.get("collective_s") is not None for r in others):
        waits = f"; the other ranks wait {max(r['collective_s'] for r in others):.3f} s a step in collectives"
    ratio = report["slowest_over_median"]
    return (
        f"stage {stage}: rank {slowest['rank']} ({where}) is slow: its steps compute {ratio:.2f}x "
        f"the median rank's ({mine['compute_s']:.3f} s a step{waits}), over the {report['steps']} steps up to step "
        f"{report['step']:,} (train.watchdog.slow_rank_factor {report['factor']:g})"
    )


def describe_preflight(stage: str, summary: dict) -> tuple[str, bool]:
    """(one line for the flow's log, whether it is a warning): the launch's probe figures, and any rank far below
    its peers, named with its host and node."""
    bandwidth = summary["allreduce_gb_per_s"]
    line = (
        f"stage {stage}: preflight passed on {len(summary['ranks'])} rank(s): matmul "
        f"{summary['matmul_gflops_median']:,.1f} GFLOP/s median, {summary['matmul_gflops_min']:,.1f} the slowest"
        + (f"; all-reduce {bandwidth:.2f} GB/s" if bandwidth is not None else "")
    )
    if not summary["slow"]:
        return line, False
    named = ", ".join(
        f"rank {r['rank']} ({r['host'] if r['node'] == r['host'] else r['host'] + ' on node ' + r['node']}, "
        f"{r['matmul_gflops']:,.1f} GFLOP/s)"
        for r in summary["slow"]
    )
    return (
        f"{line}; far below its peers (the median over train.watchdog.slow_rank_factor {summary['factor']:g}): {named}",
        True,
    )


def progress_bar(fraction: float, width: int = 20) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "░" * (width - filled)


class Rate:
    """Tokens per second over the last RATE_WINDOW_S of a launch's training time (the trainer's elapsed_s)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self.points: deque[tuple[float, int]] = deque()

    def add(self, p: dict) -> float | None:
        elapsed, tokens = float(p.get("elapsed_s") or 0.0), int(p["tokens"])
        if self.points and elapsed < self.points[-1][0]:  # a relaunch: its clock starts again
            self.points.clear()
        self.points.append((elapsed, tokens))
        while len(self.points) > 2 and elapsed - self.points[1][0] >= self.window_s:
            self.points.popleft()
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return (n1 - n0) / (t1 - t0) if t1 - t0 >= 1.0 else None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


SLOW_COMPARISONS = 3  # a rank slow this many comparisons in a row stays slow (trainers/rank_timing.py's PERSIST)


class ProgressRelay:
    """Feed it the job's output lines; it reports the newest progress at most every `every_s` seconds."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter,
        run_name: str,
        stage: str,
        every_s: float = RELAY_EVERY_S,
        artifacts: bool = True,
        avoid_node: Callable[[str, str], str] | None = None,
    ):
        self.logger, self.run_name, self.stage, self.every_s = logger, run_name, stage, every_s
        self.latest: dict | None = None
        self.restarts_said: set[int] = set()  # the restarts in place said live (the stage task says the others)
        self._reported: dict | None = None
        self._last_report = float("-inf")
        self._artifact_id: UUID | None = None
        self._artifacts = artifacts
        self._bar = None
        self._rate = Rate()
        self._smoothed: float | None = None
        self._slow: int | None = None  # the rank said to be slow, until the ranks even out
        # compute.kubernetes.avoid_slow_nodes: the launch's job labels a node whose rank stays slow
        self._avoid_node, self._slow_streak, self._avoided = avoid_node, 0, set()

    def feed(self, lines: Iterable[str]) -> None:
        for line in lines:
            progress = parse_progress(line)
            if progress is not None:
                self.latest = progress
                self._smoothed = self._rate.add(progress)
                continue
            start = parse_start(line)
            if start is not None:
                self.logger.info(describe_start(self.run_name, start))
                continue
            ranks = parse_ranks(line)
            if ranks is not None:
                self._slow_rank(ranks)
                continue
            checked = parse_preflight(line)
            if checked is not None:
                said, warn = describe_preflight(self.stage, checked)
                (self.logger.warning if warn else self.logger.info)(said)
                continue
            restarts, _ = read_records(line)  # the launcher's restarts in place, said as they happen
            for restart in restarts:
                self.restarts_said.add(restart.attempt)
                self.logger.warning(
                    "stage %s: %s; the launcher restarts the ranks from the last checkpoint", self.stage, restart.line()
                )
        self._update_bar()
        if self.latest is not None and time.monotonic() - self._last_report >= self.every_s:
            self.report()

    def _slow_rank(self, report: dict) -> None:
        """Say a slow rank once when it turns slow (and again if another rank becomes the slow one); with a node to
        avoid, label its node once it stayed slow SLOW_COMPARISONS comparisons in a row."""
        slowest = report["slowest"]
        if not report["slow"]:
            self._slow, self._slow_streak = None, 0
            return
        if self._slow == slowest["rank"]:
            self._slow_streak += 1
        else:
            self._slow, self._slow_streak = slowest["rank"], 1
            self.logger.warning(describe_slow_rank(self.stage, report))
        node = slowest.get("node")
        if self._avoid_node and self._slow_streak == SLOW_COMPARISONS and node and node not in self._avoided:
            self._avoided.add(node)
            why = (
                f"rank {slowest['rank']} of run {self.run_name} computed {report['slowest_over_median']:.2f}x the "
                f"median rank's steps, {SLOW_COMPARISONS} comparisons in a row up to step {report['step']:,}"
            )
            self.logger.warning("stage %s: %s", self.stage, self._avoid_node(node, why))

    def report(self) -> None:
        """Log the newest progress now (also at the end of a launch, so the last state is always said)."""
        p = self.latest
        if p is None or p is self._reported:
            return
        self.logger.info(describe(p, self._smoothed))
        self._reported, self._last_report = p, time.monotonic()
        if self._artifacts:
            self._move_artifact(p)

    def _move_artifact(self, p: dict) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        fraction = (p["tokens"] - p["stage_start"]) / max(1, p["stage_end"] - p["stage_start"])
        percent = 100.0 * fraction
        description = f"Run {self.run_name} {progress_bar(fraction)} {describe(p, self._smoothed)}"
        try:
            if self._artifact_id is None:
                key = artifact_key(self.run_name, "train", self.stage)
                self._artifact_id = create_progress_artifact(percent, key=key, description=description)
            else:
                update_progress_artifact(self._artifact_id, percent, description=description)
        except Exception:  # a progress bar is never worth failing a training stage
            self.logger.debug("progress artifact update failed", exc_info=True)

    def _update_bar(self) -> None:
        if self.latest is None or not sys.stderr.isatty():
            return
        from tqdm.auto import tqdm

        p = self.latest
        if self._bar is None:
            self._bar = tqdm(
                total=p["stage_end"] - p["stage_start"],
                desc=f"train {self.stage}",
                unit="tok",
                unit_scale=True,
                dynamic_ncols=True,
            )
        self._bar.n = p["tokens"] - p["stage_start"]
        if p.get("loss") is not None:
            self._bar.set_postfix_str(f"loss {p['loss']:.3f}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self.report()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
