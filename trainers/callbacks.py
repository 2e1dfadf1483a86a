"""Composer callbacks: metrics to MLflow, progress lines, the heartbeat, the loss guard, and test probes."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from trainers import heartbeat
from trainers.compile import compiled_seconds
from trainers.config import LossGuardConfig, MlflowTarget
from trainers.exit_codes import LossAnomaly
from trainers.metrics_journal import RemoteCopy, close_wait_s, marker_path, read_marker
from trainers.metrics_outbox import Outbox
from trainers.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV, format_progress

# A failed launch's own wait for MLflow, before its relaunch (which delivers the journal first).
FAILED_CLOSE_WAIT_S = 10.0


class MlflowMetrics(Callback):
    """Logs train/loss, train/lr, throughput, MFU and val/<source>/loss into an existing MLflow run, step = tokens.

    Rank 0 only: the loss Composer hands us is already averaged over ranks. Rows go through an
    Outbox (trainers/metrics_outbox.py): the hooks only queue them, a background thread ships
    them every `flush_every_s`, so neither a slow nor a dead tracking server reaches a step. At
    every checkpoint boundary the queued rows are journaled (fsynced) in the save folder, so a
    kill -9 loses no metric of a step that the relaunch will not re-train, whether or not the
    server was up. At the end of the stage it waits up to TESSERA_METRICS_CLOSE_WAIT_S (default
    120 s) for delivery; what is left stays journaled for the next launch, and the stage succeeds.
    With an s3 save folder (`copy`), the journal and marker are also kept there: the save folder
    here is then a pod's scratch disk, and the caller restores the copy onto it before this reads
    the marker.
    """

    def __init__(
        self,
        target: MlflowTarget | None,
        lr_source,
        flops_per_token: int,
        stage_name: str,
        stage_start: int,
        flush_every_tokens: int,
        step_tokens: int,
        flush_every_s: float | None = None,
        state_folder: Path | None = None,
        run_name: str = "",
        relog: bool = False,
        copy: RemoteCopy | None = None,
    ):
        self.target = target
        self.lr_source = lr_source
        self.flops_per_token = flops_per_token
        self.stage_name = stage_name
        self.stage_start = stage_start
        # How often queued metrics are shipped; TESSERA_METRICS_FLUSH_S=0 ships every step.
        self.flush_every_s = (
            float(os.environ.get("TESSERA_METRICS_FLUSH_S", "10")) if flush_every_s is None else flush_every_s
        )
        # Where the journal and the logged marker live: the run's save folder. Without one nothing is
        # sent, since nothing sent could be accounted for across a kill.
        self.state_folder = state_folder
        self.run_name = run_name
        self.copy = copy
        # Steps up to `logged_until` were journaled or logged by an earlier launch of this run that was
        # killed afterwards: the relaunch re-trains them bit for bit and must not log them a second time.
        marker = marker_path(state_folder, run_name) if state_folder is not None else None
        self.logged_until = 0 if relog or target is None or marker is None else read_marker(marker, target.run_id)
        self.flush_every_tokens = flush_every_tokens
        self.step_tokens = step_tokens
        self.outbox: Outbox | None = None
        self.start_tags: dict[str, str] = {}  # sent once with the stage's start (what this launch started from)
        self.launch_row: tuple[int, dict[str, float]] | None = None  # and this launch's own figures
        self._closed = False
        self._last_flush = time.monotonic()
        self._window: tuple[float, int] | None = None
        self.history: list[dict[str, float]] = []  # also kept in memory, for benches and tests

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0 or self.target is None or self.state_folder is None:
            return
        self.outbox = Outbox(self.target, self.state_folder, self.run_name, self.logged_until, self.copy)
        self.outbox.put(None, tags={f"stage/{self.stage_name}/start_tokens": str(self.stage_start), **self.start_tags})
        if self.launch_row is not None:
            self.outbox.put(*self.launch_row)
        self.flush()

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._window is None:
            self._window = (time.perf_counter(), int(state.timestamp.token))

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        tokens = int(state.timestamp.token)
        loss = float(sum(state.total_loss_dict.values())) if state.total_loss_dict else float("nan")
        row = {"train/loss": loss, "train/lr": self.lr_source.lr}
        t0, tok0 = self._window or (time.perf_counter(), tokens)
        elapsed = time.perf_counter() - t0
        if elapsed > 0 and tokens > tok0:
            tps = (tokens - tok0) / elapsed
            row["throughput/tokens_per_sec"] = tps
            peak = _peak_flops()
            if peak:
                row["throughput/mfu"] = tps * self.flops_per_token / (peak * dist.get_world_size())
            if torch.cuda.is_available():
                row["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        self._window = (time.perf_counter(), tokens)
        self._record(tokens, row, checkpoint=self._crossed(tokens))

    def eval_end(self, state: State, logger: Logger) -> None:
        """A val/<source> evaluator finished (at a checkpoint step): log its loss now, before the save."""
        if dist.get_global_rank() != 0 or "LanguageCrossEntropy" not in state.eval_metric_values:
            return
        tokens = int(state.timestamp.token)
        loss = float(state.eval_metric_values["LanguageCrossEntropy"])
        self._record(tokens, {f"{state.dataloader_label}/loss": loss}, checkpoint=True)

    def _record(self, tokens: int, row: dict[str, float], checkpoint: bool) -> None:
        """Keep a row in memory and queue it for MLflow (unless an earlier launch logged this step)."""
        self.history.append({"tokens": tokens, **row})
        if self.outbox is None or tokens <= self.logged_until:
            return
        self.outbox.put(tokens, row)
        if checkpoint:
            # The step is about to be checkpointed: after a kill the relaunch starts past it and would
            # never record it again, so it must be on disk now (local disk, and the s3 copy when the disk is a
            # pod's: a dead tracking server cannot stall either).
            self.outbox.persist()
        if checkpoint or time.monotonic() - self._last_flush > self.flush_every_s:
            self.flush()

    def note(self, tokens: int | None, row: dict[str, float], tags: dict[str, str] | None = None) -> None:
        """A row (at `tokens`) or tags from elsewhere in the trainer, through the same outbox: thread-safe."""
        if self.outbox is None:
            return
        if tags:
            self.outbox.put(None, tags=tags)
        if row and tokens is not None and tokens > self.logged_until:
            self.outbox.put(tokens, row)

    def note_launch(self, tokens: int, row: dict[str, float]) -> None:
        """A launch's own figures (its preflight), sent with the stage's start at the token the launch starts from,
        where earlier launches may have logged rows already: MLflow keeps each launch's value at that step."""
        self.launch_row = (tokens, row)

    def _crossed(self, tokens: int) -> bool:
        every = self.flush_every_tokens
        return tokens // every > (tokens - self.step_tokens) // every

    def flush(self) -> None:
        """Ship what is queued now, in the background: never raises, never waits for the server."""
        if self.outbox is not None:
            self.outbox.flush()
        self._last_flush = time.monotonic()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.outbox is None:
            return
        self.outbox.put(None, tags={f"stage/{self.stage_name}/end_tokens": str(int(state.timestamp.token))})
        self._close(close_wait_s())

    def close(self, state: State, logger: Logger) -> None:
        # Without fit_end first, training failed: the relaunch that follows delivers the journal
        # first thing, so a dead server must not hold it back for long.
        self._close(min(close_wait_s(), FAILED_CLOSE_WAIT_S))

    def _close(self, wait_s: float) -> None:
        if self.outbox is None or self._closed:
            return
        self._closed = True
        self.outbox.close(wait_s)


def _peak_flops() -> float | None:
    """Dense bf16 peak of the local accelerator, for MFU; None on CPU (no meaningful peak)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for key, peak in (("h200", 989.5e12), ("h100", 989.5e12), ("a100", 312e12), ("l40s", 362e12), ("a10", 125e12)):
        if key in name:
            return peak
    return None


class Progress(Callback):
    """Rank 0 prints `tessera.progress {json}` lines to stdout for the flow to relay (trainers/progress.py).

    One after the first step of the launch, then at most every TESSERA_PROGRESS_S seconds
    (default 10), and one after the step that reaches the end of the stage.
    """

    def __init__(
        self, stage_name: str, stage_index: int, stage_start: int, stage_end: int, every_s: float | None = None
    ):
        self.stage_name = stage_name
        self.stage_index = stage_index
        self.stage_start = stage_start
        self.stage_end = stage_end
        self.every_s = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)) if every_s is None else every_s
        self._started: float | None = None
        self._last: tuple[float, int] | None = None  # (time, tokens) of the previous line, or of the launch's start

    def fit_start(self, state: State, logger: Logger) -> None:
        self._started = time.monotonic()
        self._last = (self._started, int(state.timestamp.token))

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0 or self._started is None or self._last is None:
            return
        now, tokens = time.monotonic(), int(state.timestamp.token)
        first = self._last[0] == self._started
        if not (first or tokens >= self.stage_end or now - self._last[0] >= self.every_s):
            return
        window = now - self._last[0]
        loss = float(sum(state.total_loss_dict.values())) if state.total_loss_dict else float("nan")
        record = {
            "stage": self.stage_name,
            "stage_index": self.stage_index,
            "step": int(state.timestamp.batch),
            "tokens": tokens,
            "stage_start": self.stage_start,
            "stage_end": self.stage_end,
            "loss": loss,
            "tokens_per_sec": round((tokens - self._last[1]) / window, 1) if window > 0 else None,
            "elapsed_s": round(now - self._started, 3),
        }
        print(format_progress(record), file=sys.stdout, flush=True)
        self._last = (now, tokens)


class Heartbeat(Callback):
    """This rank's heartbeat through Composer's loop (trainers/heartbeat.py): first_step until the first step of the
    launch ends, then data (waiting for a batch) and step (forward, backward, optimizer) in turn, eval while the
    held-out batches are scored, close after the last step; compile whenever torch.compile works
    (trainers/compile.py switches to it and back). Each step's compute time, less what it spent compiling, teaches
    the watchdog its step budget. A no-op when the launcher asked for no heartbeat."""

    def __init__(self, stage_name: str):
        self.stage_name = stage_name
        self.first = True
        self._data_started = self._step_started = self._compiled_before = self._eval_started = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        beat = heartbeat.current()
        if beat is not None:
            beat.set(stage=self.stage_name)
            beat.phase("first_step")

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._data_started = time.perf_counter()
        if not self.first:
            heartbeat.phase("data")

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._step_started = time.perf_counter()
        self._compiled_before = compiled_seconds()
        beat = heartbeat.current()
        if not self.first and beat is not None:
            beat.learn("data", self._step_started - self._data_started)  # the data wait's budget learns from it
            heartbeat.phase("step")

    def batch_end(self, state: State, logger: Logger) -> None:
        beat = heartbeat.current()
        if beat is None:
            return
        # a step that compiled (a new microbatch size) teaches the step budget only its compute
        compiling = compiled_seconds() - self._compiled_before
        compute_s = None if self.first else max(0.0, time.perf_counter() - self._step_started - compiling)
        beat.progress(int(state.timestamp.batch), int(state.timestamp.token), compute_s)
        if self.first:
            self.first = False
            beat.phase("step")

    def eval_start(self, state: State, logger: Logger) -> None:
        heartbeat.phase("eval")

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        self._eval_started = time.perf_counter()

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        beat = heartbeat.current()
        if beat is not None:
            beat.learn("eval", time.perf_counter() - self._eval_started)  # the eval budget learns from it
            beat.progress()

    def eval_end(self, state: State, logger: Logger) -> None:
        heartbeat.phase("step")

    def fit_end(self, state: State, logger: Logger) -> None:
        heartbeat.phase("close")


class LossGuard(Callback):
    """Stops on a NaN/inf loss (or a spike) before it is checkpointed; trainers/rollback.py handles the rest.

    It runs at BATCH_END, before BATCH_CHECKPOINT, so a poisoned step never reaches a checkpoint.
    It knows where a relaunch would resume (the plan's start, or the last checkpoint this launch
    saved) and how much data the launch already skipped from there, for the rollback record.
    """

    def __init__(
        self, cfg: LossGuardConfig, stage_index: int, resume_tokens: int, already_skipped: int, saver, vocab_size: int
    ):
        self.cfg = cfg
        self.ceiling = 3 * math.log(vocab_size) if cfg.ceiling == "auto" else cfg.ceiling
        self.stage_index = stage_index
        self.resume_tokens = resume_tokens
        self.already_skipped = already_skipped
        self.saver = saver
        self.mean: float | None = None
        self.steps = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self.cfg.enabled or not state.total_loss_dict:
            return
        loss = float(sum(state.total_loss_dict.values()))
        tokens = int(state.timestamp.token)
        problem = None
        if not math.isfinite(loss):
            problem = f"loss is {loss} at {tokens} tokens"
        elif self.ceiling is not None and loss > self.ceiling:
            problem = (
                f"loss is {loss:.4g} at {tokens} tokens, above the ceiling {self.ceiling:.2f} "
                "(train.loss_guard.ceiling)"
            )
        elif self.cfg.spike_factor and self.mean is not None and self.steps >= self.cfg.warmup_steps:
            if loss > self.cfg.spike_factor * self.mean:
                problem = f"loss spiked to {loss:.4f} (running mean {self.mean:.4f}) at {tokens} tokens"
        if problem:
            saved = self.saver.last_saved_tokens
            if saved is not None and saved > self.resume_tokens:
                self.resume_tokens, self.already_skipped = saved, 0
            raise LossAnomaly(problem, tokens, self.resume_tokens, self.already_skipped, self.stage_index)
        self.steps += 1
        self.mean = loss if self.mean is None else 0.95 * self.mean + 0.05 * loss
