"""Composer callbacks: stage entry, metrics to MLflow, the loss guard, and test probes."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from trainers.config import LossGuardConfig, MlflowTarget
from trainers.exit_codes import FatalError
from trainers.resume import _maybe_fault


class MlflowMetrics(Callback):
    """Logs train/loss, train/lr, throughput, MFU and val/<source>/loss into an existing MLflow run, step = tokens.

    Buffered and flushed with one `log_batch` call every `flush_every_s`, so a sqlite or remote
    tracking server costs nothing per step. Rank 0 only: the loss Composer hands us is already
    averaged over ranks.
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
        logged_marker: Path | None = None,
        relog: bool = False,
    ):
        self.target = target
        self.lr_source = lr_source
        self.flops_per_token = flops_per_token
        self.stage_name = stage_name
        self.stage_start = stage_start
        # How often buffered metrics reach MLflow; TESSERA_METRICS_FLUSH_S=0 sends every step.
        self.flush_every_s = float(os.environ.get("TESSERA_METRICS_FLUSH_S", "10")) if flush_every_s is None else flush_every_s
        # Steps up to `logged_until` were logged by an earlier launch of this run that was killed after
        # flushing them: the relaunch re-trains them bit for bit and must not log them a second time.
        self.logged_marker = logged_marker
        self.logged_until = 0 if relog else self._read_marker()
        self._flushed_tokens = self.logged_until
        self.flush_every_tokens = flush_every_tokens
        self.step_tokens = step_tokens
        self._buffer: list = []
        self._client = None
        self._last_flush = time.monotonic()
        self._window: tuple[float, int] | None = None
        self.history: list[dict[str, float]] = []  # also kept in memory, for benches and tests

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0 or self.target is None:
            return
        from mlflow.entities import RunTag
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(self.target.tracking_uri)
        prefix = f"stage/{self.stage_name}"
        self._client.log_batch(
            self.target.run_id, tags=[RunTag(f"{prefix}/start_tokens", str(self.stage_start))], synchronous=True
        )

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
        # Also flush at every checkpoint boundary: a kill -9 then loses no metric of a step that
        # the relaunch will not re-train (and re-log).
        self._record(tokens, row, flush=time.monotonic() - self._last_flush > self.flush_every_s or self._crossed(tokens))

    def eval_end(self, state: State, logger: Logger) -> None:
        """A val/<source> evaluator finished (at a checkpoint step): log its loss now, before the save."""
        if dist.get_global_rank() != 0 or "LanguageCrossEntropy" not in state.eval_metric_values:
            return
        tokens = int(state.timestamp.token)
        loss = float(state.eval_metric_values["LanguageCrossEntropy"])
        self._record(tokens, {f"{state.dataloader_label}/loss": loss}, flush=True)

    def _record(self, tokens: int, row: dict[str, float], flush: bool) -> None:
        """Keep a row in memory and buffer it for MLflow (unless an earlier launch logged this step)."""
        self.history.append({"tokens": tokens, **row})
        if self._client is None or tokens <= self.logged_until:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer += [Metric(k, v, now, tokens) for k, v in row.items() if math.isfinite(v)]
        if flush:
            self.flush()

    def _crossed(self, tokens: int) -> bool:
        every = self.flush_every_tokens
        return tokens // every > (tokens - self.step_tokens) // every

    def flush(self) -> None:
        if self._client is not None and self._buffer:
            # MLflow caps a log_batch at 1000 metrics.
            for i in range(0, len(self._buffer), 1000):
                self._client.log_batch(self.target.run_id, metrics=self._buffer[i : i + 1000], synchronous=True)
            self._flushed_tokens = max(self._flushed_tokens, max(m.step for m in self._buffer))
            self._buffer = []
            self._write_marker()
        self._last_flush = time.monotonic()

    def _read_marker(self) -> int:
        if self.logged_marker is None or self.target is None or not self.logged_marker.exists():
            return 0
        marker = json.loads(self.logged_marker.read_text())
        return int(marker["tokens"]) if marker.get("mlflow_run_id") == self.target.run_id else 0

    def _write_marker(self) -> None:
        if self.logged_marker is None:
            return
        tmp = self.logged_marker.with_name(f".tmp-{self.logged_marker.name}")
        tmp.write_text(json.dumps({"mlflow_run_id": self.target.run_id, "tokens": self._flushed_tokens}))
        os.replace(tmp, self.logged_marker)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()
        if self._client is not None:
            from mlflow.entities import RunTag

            self._client.log_batch(
                self.target.run_id,
                tags=[RunTag(f"stage/{self.stage_name}/end_tokens", str(int(state.timestamp.token)))],
                synchronous=True,
            )

    def close(self, state: State, logger: Logger) -> None:
        self.flush()


def _peak_flops() -> float | None:
    """Dense bf16 peak of the local accelerator, for MFU; None on CPU (no meaningful peak)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for key, peak in (("h200", 989.5e12), ("h100", 989.5e12), ("a100", 312e12), ("l40s", 362e12), ("a10", 125e12)):
        if key in name:
            return peak
    return None


class LossGuard(Callback):
    """Stops on a NaN/inf loss (or a spike) before it is checkpointed; trainers/rollback.py handles the rest.

    It runs at BATCH_END, before BATCH_CHECKPOINT, so a poisoned step never reaches a checkpoint.
    It knows where a relaunch would resume (the plan's start, or the last checkpoint this launch
    saved) and how much data the launch already skipped from there, for the rollback record.
    """

    def __init__(self, cfg: LossGuardConfig, stage_index: int, resume_tokens: int, already_skipped: int, saver):
        self.cfg = cfg
        self.stage_index = stage_index
        self.resume_tokens = resume_tokens
        self.already_skipped = already_skipped
        self.saver = saver
        self.mean: float | None = None
        self.steps = 0

    def batch_start(self, state: State, logger: Logger) -> None:
        if os.environ.get("TESSERA_FAULT") == f"nan:{int(state.timestamp.token) + _step_tokens(state)}":
            # Test hook: poison one weight so this step's forward really produces a NaN loss.
            with torch.no_grad():
                next(state.model.parameters()).view(-1)[0] = float("nan")

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self.cfg.enabled or not state.total_loss_dict:
            return
        loss = float(sum(state.total_loss_dict.values()))
        tokens = int(state.timestamp.token)
        problem = None
        if not math.isfinite(loss):
            problem = f"loss is {loss} at {tokens} tokens"
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


def _step_tokens(state: State) -> int:
    return int(state.batch["input_ids"].numel()) * dist.get_world_size()


class LossAnomaly(FatalError):
    """A bad loss. Fatal if it escapes; the entrypoint turns it into a rollback while budget lasts."""

    def __init__(self, message: str, tokens: int, resume_tokens: int, already_skipped: int, stage_index: int):
        super().__init__(message)
        self.tokens = tokens
        self.resume_tokens = resume_tokens
        self.already_skipped = already_skipped
        self.stage_index = stage_index


class Probe(Callback):
    """Test probes, off unless their environment variable is set.

    TESSERA_SAMPLE_LOG=<file>: rank 0 appends one JSON line per step, {tokens, samples, loss}:
    the global sample indices the step trained on (per rank) and the rank-averaged loss.
    TESSERA_FAULT=step:<tokens>: SIGKILL right after the step that ends at <tokens>.
    """

    def __init__(self):
        self.sample_log = os.environ.get("TESSERA_SAMPLE_LOG")

    def batch_end(self, state: State, logger: Logger) -> None:
        tokens = int(state.timestamp.token)
        if self.sample_log:
            mine = state.batch["sample_idx"].tolist()
            everyone = dist.all_gather_object(mine)
            if dist.get_global_rank() == 0:
                with open(self.sample_log, "a") as f:
                    loss = float(sum(state.total_loss_dict.values())) if state.total_loss_dict else None
                    f.write(json.dumps({"tokens": tokens, "samples": everyone, "loss": loss}) + "\n")
        _maybe_fault("step", tokens)


def read_sample_log(path: str | Path) -> dict[int, dict]:
    """The effective history: for each step (by token count) the record of the last launch that trained it.

    A relaunch re-trains the steps after its checkpoint, so later lines overwrite earlier ones.
    """
    steps: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        steps[record["tokens"]] = record
    return dict(sorted(steps.items()))
