"""The gauntlet queue: every new checkpoint of a training run evaluated, then registered, without stopping training.

While a stage trains, the flow calls `GauntletQueue.sweep` every few seconds. Evaluations run one at a
time in this process (they share the CPU with training; on Kubernetes they are pods, bounded by
compute.kubernetes.eval_concurrency, a Prefect concurrency limit) and registrations one at a time (alias
moves must not interleave): each is chained on the one before with Prefect's `wait_for`, so a failed
evaluation skips only its own registration. Each checkpoint is pinned first (tasks/pins.py) against the
trainer's keep-last-K rotation, and unpinned once registered; at most `pins.MAX_WAITING` pinned
checkpoints wait behind the one being scored, so pins never fill the disk.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.futures import PrefectFuture, wait
from prefect.utilities.annotations import allow_failure
from pydantic import BaseModel, ConfigDict

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks import pins
from tasks.evaluate import evaluate_checkpoint
from tasks.register import Registration, existing_registrations, register_checkpoint
from tasks.tracking_config import TrackingConfig
from trainers.format.checkpoints import CheckpointInfo, list_complete


class QueueTarget(BaseModel):
    """What the queue needs of a run: its sections of the recipe, not the whole Recipe."""

    model_config = ConfigDict(frozen=True)

    run_name: str
    run_id: str
    eval: EvalConfig
    tracking: TrackingConfig
    compute: ComputeConfig
    seq_len: int
    recipe_hash: str
    remote_folder: str | None = None


class GauntletQueue:
    """Evaluates, then registers, each checkpoint not seen before.

    Evaluations run one at a time (they share the CPU with training) and registrations one at a
    time (alias moves must not interleave); a failed evaluation skips only its own registration.
    Each checkpoint is pinned first (tasks/pins.py), so a keep-last-K cleanup in the trainer cannot
    delete it while it waits to be scored and exported, and unpinned once registered. At most
    `pins.MAX_WAITING` pinned checkpoints wait behind the one being scored: when the gauntlet is
    slower than the checkpoint interval the oldest are skipped, each named in the log, so pins
    never fill the disk.
    """

    def __init__(self, target: QueueTarget, run_dir: Path, version_tags: dict[str, str] | None = None):
        self.target, self.run_id, self.run_name = target, target.run_id, target.run_name
        # A version is a promotion candidate only if scored on the whole gauntlet: a missing task
        # file fails its evaluation (and so skips its registration) instead of scoring a part of it.
        self.eval_cfg = target.eval.model_copy(update={"strict": True})
        self.remote_folder, self.version_tags = target.remote_folder, version_tags or {}
        self.pins = run_dir / "pins"
        # Pins a crashed flow left: what is still in the save folder is pinned again as it is found.
        stale = pins.drop_stale(self.pins)
        if stale:
            get_run_logger().info("dropped %d pin(s) an earlier flow left behind: %s", len(stale), ", ".join(stale))
        self.backlog: pins.Backlog[tuple[CheckpointInfo, CheckpointInfo]] = pins.Backlog()  # (checkpoint, pinned)
        self.seen: set[int] = set()
        self.pending: list[tuple[PrefectFuture, PrefectFuture, Path]] = []
        self.done: list[Registration] = []
        self.already = existing_registrations(target.tracking, self.run_id)

    def sweep(self, save_folder: Path) -> None:
        self._unpin_finished()
        for ckpt in self._complete(save_folder):
            if ckpt.tokens not in self.seen:
                self.seen.add(ckpt.tokens)
                self._enqueue(ckpt)
                self._submit_if_idle()
        self._submit_if_idle()

    def _enqueue(self, ckpt: CheckpointInfo) -> None:
        if ckpt.tokens in self.already:  # a rerun: evaluated and registered before
            self.done.append(self.already[ckpt.tokens])
            return
        pinned = self._pin(ckpt)
        if pinned is None:
            return
        if self._in_pods:  # pods read s3 and are bounded by a concurrency limit: nothing held locally
            self._submit(ckpt, pinned)
            return
        for skipped, held in self.backlog.add((ckpt, pinned)):
            get_run_logger().warning(
                "skipping the gauntlet for the checkpoint at %d tokens (%s): evaluation is behind training, "
                "%d newer checkpoints are waiting",
                skipped.tokens,
                skipped.path,
                pins.MAX_WAITING,
            )
            pins.unpin(Path(held.path))

    def _scoring(self) -> bool:
        """An evaluation is still running (local futures: no API round trip)."""
        return bool(wait([summary for summary, _, _ in self.pending], timeout=0).not_done)

    def _submit_if_idle(self) -> None:
        if not self._scoring():
            self._submit_next()

    def _submit_next(self) -> None:
        item = self.backlog.take()
        if item is not None:
            self._submit(*item)

    @property
    def _in_pods(self) -> bool:
        return self.target.compute.backend == "kubernetes"

    def _complete(self, save_folder: Path) -> list[CheckpointInfo]:
        if self._in_pods:  # the trainer's folder is in its pod: watch the s3 mirror
            from trainers.remote import RemoteFolder  # boto3: only when there is a remote folder to read

            return RemoteFolder(self.remote_folder).complete()
        return list_complete(save_folder)

    def _pin(self, ckpt: CheckpointInfo) -> CheckpointInfo | None:
        if ckpt.path.startswith("s3://"):  # nothing local to pin; the evaluation pod reads it from s3
            return ckpt
        held = pins.pin(ckpt.path, self.pins)
        return None if held is None else ckpt.model_copy(update={"path": str(held)})

    def _submit(self, ckpt: CheckpointInfo, pinned: CheckpointInfo) -> None:
        previous = self.pending[-1] if self.pending else None
        summary = evaluate_checkpoint.submit(
            pinned,
            self.eval_cfg,
            self.target.tracking,
            self.run_id,
            self.target.seq_len,
            self.run_name,
            # in-process evaluations share the CPU with training: one at a time; pods are bounded by
            # compute.kubernetes.eval_concurrency (a Prefect concurrency limit) instead
            self.target.compute,
            wait_for=[allow_failure(previous[0])] if previous and not self._in_pods else None,
        )
        # The version records where the checkpoint itself lives (not the pin, which goes once registered),
        # so continued pretraining can find its optimizer state.
        where = f"{self.remote_folder}/{Path(ckpt.path).name}" if self.remote_folder else ckpt.path
        registration = register_checkpoint.submit(
            pinned,
            summary,
            self.target.tracking,
            self.run_id,
            self.target.recipe_hash,
            self.remote_folder,
            {**self.version_tags, "checkpoint": where},
            wait_for=[allow_failure(previous[1])] if previous else None,
        )
        self.pending.append((summary, registration, Path(pinned.path)))

    def _unpin_finished(self) -> None:
        finished = wait([r for _, r, _ in self.pending], timeout=0).done  # local futures: no API round trip
        for _, registration, pin in self.pending:
            if registration in finished:
                pins.unpin(pin)

    def results(self) -> list[Registration]:
        """Every registration, oldest first; raises the first evaluation or registration error."""
        while len(self.backlog):  # training is over: what is still waiting is scored, in order
            self._submit_next()
        wait([f for pair in self.pending for f in pair[:2]])
        self._unpin_finished()
        for summary, registration, _ in self.pending:
            summary.result()  # surfaces a failed evaluation as itself, not as an unfinished registration
            self.done.append(registration.result())
        return sorted(self.done, key=lambda r: r.tokens)
