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
from collections.abc import Iterable
from uuid import UUID

from tasks.artifacts import artifact_key
from trainers.progress import parse_progress

# At least this often a running stage says where it is, even when the trainer prints more often.
RELAY_EVERY_S = 15.0


def describe(p: dict) -> str:
    """One progress line a person can read at a glance."""
    start, end, tokens = p["stage_start"], p["stage_end"], p["tokens"]
    done = (tokens - start) / max(1, end - start)
    rate = p.get("tokens_per_sec") or 0.0
    eta = f"ETA {_duration((end - tokens) / rate)}" if rate > 0 and tokens < end else "stage end"
    loss = "n/a" if p.get("loss") is None else f"{p['loss']:.4f}"
    return (
        f"stage {p['stage']}: step {p['step']:,}, {tokens - start:,}/{end - start:,} tokens ({done:.0%}), "
        f"loss {loss}, {rate:,.0f} tok/s, {eta}"
    )


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressRelay:
    """Feed it the job's output lines; it reports the newest progress at most every `every_s` seconds."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, run_name: str, stage: str,
                 every_s: float = RELAY_EVERY_S, artifacts: bool = True):  # fmt: skip
        self.logger, self.run_name, self.stage, self.every_s = logger, run_name, stage, every_s
        self.latest: dict | None = None
        self._reported: dict | None = None
        self._last_report = float("-inf")
        self._artifact_id: UUID | None = None
        self._artifacts = artifacts
        self._bar = None

    def feed(self, lines: Iterable[str]) -> None:
        for line in lines:
            progress = parse_progress(line)
            if progress is not None:
                self.latest = progress
        self._update_bar()
        if self.latest is not None and time.monotonic() - self._last_report >= self.every_s:
            self.report()

    def report(self) -> None:
        """Log the newest progress now (also at the end of a launch, so the last state is always said)."""
        p = self.latest
        if p is None or p is self._reported:
            return
        self.logger.info(describe(p))
        self._reported, self._last_report = p, time.monotonic()
        if self._artifacts:
            self._move_artifact(p)

    def _move_artifact(self, p: dict) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent = 100.0 * (p["tokens"] - p["stage_start"]) / max(1, p["stage_end"] - p["stage_start"])
        description = f"Run {self.run_name}, stage {self.stage}: {describe(p)}"
        try:
            if self._artifact_id is None:
                key = artifact_key(self.run_name, "train", self.stage)
                self._artifact_id = create_progress_artifact(percent, key=key, description=description)
            else:
                update_progress_artifact(self._artifact_id, percent, description=description)
        except Exception:  # noqa: BLE001 - a progress bar is never worth failing a training stage
            self.logger.debug("progress artifact update failed", exc_info=True)

    def _update_bar(self) -> None:
        if self.latest is None or not sys.stderr.isatty():
            return
        from tqdm.auto import tqdm

        p = self.latest
        if self._bar is None:
            self._bar = tqdm(total=p["stage_end"] - p["stage_start"], desc=f"train {self.stage}", unit="tok",
                             unit_scale=True, dynamic_ncols=True)  # fmt: skip
        self._bar.n = p["tokens"] - p["stage_start"]
        if p.get("loss") is not None:
            self._bar.set_postfix_str(f"loss {p['loss']:.3f}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self.report()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
