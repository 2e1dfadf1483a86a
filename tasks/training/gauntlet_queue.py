"""The gauntlet queue: every new checkpoint of a training run evaluated, then registered, without stopping training.

While a stage trains, the flow calls `GauntletQueue.sweep` every few seconds. Evaluations run one at a
time in this process (they share the CPU with training; on Kubernetes they are pods, bounded by
compute.kubernetes.eval_concurrency, a Prefect concurrency limit) and registrations one at a time, in the
checkpoints' order (alias moves must not interleave). A registration is submitted only once its evaluation has
ended and the registration before it is done, so a failed evaluation skips only its own registration, and no
task ever waits in a thread for another: when the flow run is stopped, Prefect's task runner cancels what has
not started and waits for what runs, so every task run of a cancelled flow ends Completed or never starts, none
Crashed (a task thread waiting on `wait_for` when the runner cancels would be). A score a stopped run did not
register is cached (tasks/gauntlet/evaluate.py): its rerun registers it without running the gauntlet again.

Each checkpoint is pinned first against the trainer's keep-last-K rotation, and unpinned once registered; at
most `MAX_WAITING` pinned checkpoints wait behind the ones being scored (`Backlog`): pins escape keep-last-K, so
without the bound they could fill the disk. When the gauntlet is slower than the checkpoint interval, the oldest
waiting are skipped (and unpinned), each named in a log line, and the newest are scored.

The queue reads the run's checkpoints through one CheckpointStore (trainers/format/store.py): the trainer's
folder, or on Kubernetes, where that folder is in the pods, its s3 mirror (a sweep is one LIST there; each
manifest is read once). Pinning is the store's: a hard link locally, a marker object in the mirror.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prefect import get_run_logger
from prefect.futures import PrefectFuture, wait
from pydantic import BaseModel, ConfigDict

from evaluation.config import EvalConfig
from infra.config import ComputeConfig
from tasks.gauntlet.evaluate import evaluate_checkpoint
from tasks.registry.register import Registration, existing_registrations, register_checkpoint
from tasks.tracking_config import TrackingConfig
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.store import CheckpointStore

T = TypeVar("T")

MAX_WAITING = 2  # checkpoints queued behind the one being scored
POLL_S = 1.0  # how often results() looks for an ended evaluation to register


@dataclass
class Backlog(Generic[T]):
    """Checkpoints waiting for the gauntlet, oldest first, at most `limit` of them."""

    limit: int = MAX_WAITING
    waiting: list[T] = field(default_factory=list)

    def add(self, item: T) -> list[T]:
        """Queue `item`; returns the oldest waiting items skipped to make room."""
        self.waiting.append(item)
        skipped = self.waiting[: max(0, len(self.waiting) - self.limit)]
        del self.waiting[: len(skipped)]
        return skipped

    def take(self) -> T | None:
        return self.waiting.pop(0) if self.waiting else None

    def __len__(self) -> int:
        return len(self.waiting)


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


class GauntletQueue:
    """Evaluates, then registers, each checkpoint not seen before.

    Evaluations run one at a time (they share the CPU with training) and registrations one at a
    time (alias moves must not interleave); a failed evaluation skips only its own registration.
    Each checkpoint is pinned first (the store's pin), so a keep-last-K cleanup in the trainer cannot
    delete it while it waits to be scored and exported, and unpinned once registered. At most
    `MAX_WAITING` pinned checkpoints wait behind the one being scored: when the gauntlet is
    slower than the checkpoint interval the oldest are skipped, each named in the log, so pins
    never fill the disk.
    """

    def __init__(self, target: QueueTarget, store: CheckpointStore, version_tags: dict[str, str] | None = None):
        self.target, self.run_id, self.run_name = target, target.run_id, target.run_name
        # A version is a promotion candidate only if scored on the whole gauntlet: a missing task
        # file fails its evaluation (and so skips its registration) instead of scoring a part of it.
        self.eval_cfg = target.eval.model_copy(update={"strict": True})
        self.version_tags = version_tags or {}
        self.store = store  # one store for the queue's life: the s3 face remembers the manifests it has read
        # Pins a crashed flow left (one flow runs per run name, tasks/runs/run_slot.py): what is still in the save
        # folder is pinned again as it is found.
        stale = store.drop_pins()
        if stale:
            get_run_logger().info(
                "released %d checkpoint(s) an earlier flow run of this run had kept for evaluation and never "
                "released (it was stopped): %s; each is evaluated again if it has no version yet",
                len(stale),
                ", ".join(stale),
            )
        self.backlog: Backlog[tuple[CheckpointInfo, CheckpointInfo]] = Backlog()  # (checkpoint, pinned)
        self.seen: set[int] = set()
        # evaluations not yet handed to a registration, in the checkpoints' order: (evaluation, checkpoint, pinned)
        self.scoring: list[tuple[PrefectFuture, CheckpointInfo, CheckpointInfo]] = []
        self.pending: list[tuple[PrefectFuture, PrefectFuture | None]] = []  # (evaluation, its registration or None)
        self.held: list[tuple[PrefectFuture, CheckpointInfo]] = []  # (registration, pinned): unpinned once done
        self.done: list[Registration] = []
        self.already = existing_registrations(target.tracking, self.run_id)

    def sweep(self) -> None:
        self._unpin_finished()
        self._register_scored()
        for ckpt in self.store.complete():
            if ckpt.tokens not in self.seen:
                self.seen.add(ckpt.tokens)
                # what a person waits for before a cancel or a compare, said as it happens, not at the run's end
                get_run_logger().info(
                    "checkpoint saved: %s tokens (step %s, stage %s): %s",
                    f"{ckpt.tokens:,}",
                    f"{ckpt.batch:,}",
                    ckpt.stage,
                    self.store.where(ckpt),
                )
                self._enqueue(ckpt)
                self._submit_if_idle()
        self._submit_if_idle()

    def _enqueue(self, ckpt: CheckpointInfo) -> None:
        if ckpt.tokens in self.already:  # a rerun: evaluated and registered before
            self.done.append(self.already[ckpt.tokens])
            return
        pinned = self.store.pin(ckpt)
        if pinned is None:  # keep-last-K rotated it out first (the store says so in the log)
            return
        for skipped, held in self.backlog.add((ckpt, pinned)):
            get_run_logger().warning(
                "skipping the gauntlet for the checkpoint at %d tokens (%s): evaluation is behind training, "
                "%d newer checkpoints are waiting",
                skipped.tokens,
                skipped.path,
                MAX_WAITING,
            )
            self.store.unpin(held)

    def _scoring(self) -> bool:
        """As many evaluations are running as may run at once (local futures: no API round trip): one in this
        process, compute.kubernetes.eval_concurrency in pods."""
        pods = self.target.compute.kubernetes
        at_once = pods.eval_concurrency if self._in_pods and pods is not None else 1
        scoring = [summary for summary, _, _ in self.scoring]
        return len(scoring) - len(_ended(scoring)) >= at_once

    def _submit_if_idle(self) -> None:
        while len(self.backlog) and not self._scoring():
            self._submit_next()

    def _submit_next(self) -> None:
        item = self.backlog.take()
        if item is not None:
            self._submit(*item)

    @property
    def _in_pods(self) -> bool:
        return self.target.compute.backend == "kubernetes"

    def _submit(self, ckpt: CheckpointInfo, pinned: CheckpointInfo) -> None:
        # in-process evaluations share the CPU with training: one at a time (_scoring gates the submit, so none
        # waits on another); pods are bounded by compute.kubernetes.eval_concurrency (a Prefect concurrency limit)
        summary = evaluate_checkpoint.submit(
            pinned,
            self.eval_cfg,
            self.target.tracking,
            self.run_id,
            self.target.seq_len,
            self.run_name,
            self.target.compute,
        )
        self.scoring.append((summary, ckpt, pinned))

    def _register_scored(self) -> None:
        """The oldest evaluation's registration, once that evaluation has ended and no registration runs."""
        while self.scoring and len(_ended([r for r, _ in self.held])) == len(self.held):
            summary, ckpt, pinned = self.scoring[0]
            if not _ended([summary]):
                return
            self.scoring.pop(0)
            if not summary.state.is_completed():  # results() raises it; the checkpoint is not a version
                self.store.unpin(pinned)
                self.pending.append((summary, None))
                continue
            # The version records where the checkpoint itself lives (not the pin, which goes once registered),
            # so continued pretraining can find its optimizer state.
            registration = register_checkpoint.submit(
                pinned,
                summary,
                self.target.tracking,
                self.run_id,
                self.target.recipe_hash,
                self.store.model_home(ckpt.tokens),
                {**self.version_tags, "checkpoint": self.store.where(ckpt)},
            )
            self.pending.append((summary, registration))
            self.held.append((registration, pinned))

    def _unpin_finished(self) -> None:
        """Each pin released once, when its registration is done (a remote unpin is a request)."""
        finished = _ended([r for r, _ in self.held])
        for registration, pinned in self.held:
            if registration in finished:
                self.store.unpin(pinned)
                done = registration.result(raise_on_failure=False)
                if isinstance(done, Registration):
                    get_run_logger().info(
                        "registered %s v%d: the checkpoint at %s tokens (step %s)%s",
                        done.name,
                        done.version,
                        f"{done.tokens:,}",
                        f"{pinned.batch:,}",
                        "" if done.created else ", registered before",
                    )
        self.held = [(registration, pinned) for registration, pinned in self.held if registration not in finished]

    def results(self) -> list[Registration]:
        """Every registration, oldest first; raises the first evaluation or registration error."""
        # training is over: what is still waiting is scored and registered, in order
        while len(self.backlog) or self.scoring or self.held:
            self._submit_if_idle()
            self._unpin_finished()
            self._register_scored()
            outstanding = [f for f, _, _ in self.scoring] + [r for r, _ in self.held]
            if outstanding:
                wait(outstanding, timeout=POLL_S)
        for summary, registration in self.pending:
            summary.result()  # surfaces a failed evaluation as itself
            if registration is not None:
                self.done.append(registration.result())
        return sorted(self.done, key=lambda r: r.tokens)


def _ended(futures: list[PrefectFuture]) -> set[PrefectFuture]:
    """The futures whose task runs have ended, from the local futures alone (no API round trip).

    `prefect.futures.wait(fs, timeout=0)` alone cannot say this: it counts a future done only once the future holds
    its final state, which only a wait on that future stores, and with no time to wait it stops before reading the
    completions it was told of. While each registration was chained on its evaluation, the registration's thread
    did that wait; without it an ended evaluation would look busy until the stage's end. A zero wait on each future
    stores the final state of those that ended (and the `state` read after it asks no server).
    """
    for future in futures:
        future.wait(timeout=0)
    return set(wait(futures, timeout=0).done) if futures else set()
