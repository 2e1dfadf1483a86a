"""The checkpoint saver: when a step is saved, and how a saved file becomes visible.

Composer's CheckpointSaver writes the file (or, sharded, every rank its shard of the folder); this one
publishes its manifest (the done-marker, trainers/format/checkpoints.py), then moves the stage's latest
symlink, then hands the checkpoint to the s3:// mirror, then rotates. The names and the removal of old
files are trainers/layout.py's; the repair a launch does first is trainers/plan.py's.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from composer.callbacks import CheckpointSaver
from composer.core import Event, State
from composer.loggers import Logger
from composer.utils import dist

from trainers import heartbeat, time_records
from trainers.config import Stage, TrainJob
from trainers.disk import no_space
from trainers.faults import maybe_fault, maybe_freeze, maybe_stall, maybe_write_slowly
from trainers.format import checkpoints
from trainers.format.checkpoints import CheckpointInfo
from trainers.layout import RunFolder, discard
from trainers.remote import RemoteFolder


def checkpoint_due(every: int, stage: Stage, event_wanted: Event):
    """`(state, event) -> bool`: true at `event_wanted` of every step that is checkpointed.

    A step is checkpointed when it crosses a multiple of `every` tokens ("crossed" rather
    than "is a multiple": with per-stage batch sizes a stage's steps need not land on the
    multiples themselves) and at the stage's end. Validation runs on the same steps.
    """
    step, stage_end = stage.tokens_per_batch, stage.end

    def due(state: State, event: Event) -> bool:
        tokens = int(state.timestamp.token.value)
        return event == event_wanted and (tokens // every > (tokens - step) // every or tokens >= stage_end)

    return due


class GrowthBeats:
    """While a save runs: a thread that beats this rank's heartbeat whenever the files written in `folder` since
    the save began grow, so a slow save that is still writing is never judged hung, and a frozen one stops beating.
    `grown` is how many bytes appeared (this node's ranks' together: the disk's speed, which sizes the next
    save's budget)."""

    POLL_S = 1.0

    def __init__(self, folder: Path):
        self.folder, self.grown = Path(folder), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="save-growth", daemon=True)

    def __enter__(self) -> GrowthBeats:
        self._since = time.time() - 1.0
        self._base = self._size()
        self._thread.start()
        if dist.get_global_rank() == 0:
            maybe_write_slowly(self.folder, self.POLL_S / 2)  # test hook: a throttled writer
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.grown = max(self.grown, self._size() - self._base)

    def _size(self) -> int:
        total = 0
        for entry in _walk(self.folder):
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:  # renamed or removed meanwhile
                continue
            if stat.st_mtime >= self._since:
                total += stat.st_size
        return total

    def _watch(self) -> None:
        last = self._base
        while not self._stop.wait(self.POLL_S):
            size = self._size()
            if size > last:
                self.grown = size - self._base
                beat = heartbeat.current()
                if beat is not None:
                    beat.progress()
            last = max(last, size)


def _walk(folder: Path):
    """Every file under `folder` (a sharded checkpoint is a folder of files), as os.DirEntry."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            yield entry


def _written_by_this_rank(folder: Path) -> list[str]:
    """The names of a sharded checkpoint folder's files this rank writes: its shards, and on rank 0 DCP's metadata."""
    rank = dist.get_global_rank()
    mine = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(checkpoints.SHARD_METADATA)
    return mine


def _node_ranks() -> set[int]:
    """The global ranks of this node (the launcher numbers them node by node: infra/launcher.py)."""
    per_node = dist.get_local_world_size()
    first = dist.get_global_rank() - dist.get_local_rank()
    return set(range(first, first + per_node))


class PublishingCheckpointSaver(CheckpointSaver):
    """Composer's saver, reordered so the latest symlink moves only after the manifest is published.

    Saves at every multiple of checkpoint_every_tokens and at the stage's end. Keeps the last
    `keep` complete checkpoints of the run (by manifest), never the in-progress one.
    """

    def __init__(self, job: TrainJob, stage_index: int):
        self.run_folder = RunFolder.of(job)  # not self.folder: Composer keeps its folder string there
        self.run_stage = job.stage(stage_index)
        self.keep_last_k = job.train.keep_checkpoints
        # How long the stage's end waits for uploads that keep failing before it gives up in one line: inside the
        # watchdog's budget for it (upload_s plus the bytes' time), so the line, not a watchdog kill, says why.
        self.upload_wait_s = 0.8 * job.train.watchdog.upload_s
        # Rank 0 mirrors the run (manifests, rotation); with sharded checkpoints the first rank of every other
        # node uploads what its node's ranks wrote, which may be on its disk only.
        self.remote = RemoteFolder.for_job(job) if os.environ.get("LOCAL_RANK", "0") == "0" else None
        self.last_saved_tokens: int | None = None
        self.save_seconds: list[float] = []  # how long each save blocked this rank (write, hash, publish)
        due = checkpoint_due(job.checkpoint_every_tokens, self.run_stage, Event.BATCH_CHECKPOINT)
        super().__init__(
            folder=str(self.run_folder.path),
            filename=self.run_folder.checkpoint_template(stage_index),
            remote_file_name=None,
            latest_filename=self.run_folder.latest_template(stage_index),
            # Unused without remote_file_name, but Composer's autoresume asserts it is set.
            latest_remote_file_name=self.run_folder.latest_template(stage_index),
            save_interval=due,
            overwrite=True,  # a file left by a killed save is replaced; plan_start already removed it
            num_checkpoints_to_keep=-1,  # rotation is by manifest below; Composer's list forgets across relaunches
        )

    def _save_checkpoint(self, state: State, logger: Logger) -> None:
        # The watchdog gives a save a budget by its size (about 12 bytes a parameter: weights, Adam's moments).
        heartbeat.phase("save", hint_bytes=12 * sum(p.numel() for p in state.model.parameters()))
        latest, self.latest_filename = self.latest_filename, None  # Composer would link before publishing
        started = time.monotonic()
        with GrowthBeats(self.run_folder.path) as growth:  # a save that is writing is making progress
            try:
                maybe_stall("save", self.run_stage.index)  # test hooks: a save that hangs, a rank frozen in it
                maybe_freeze(int(state.timestamp.token), "save")
                super()._save_checkpoint(state, logger)
            except Exception as exc:
                if no_space(exc) is not None:
                    self._drop_cut_short(state)
                raise
            finally:
                self.latest_filename = latest
            self._publish(state)
        took = time.monotonic() - started
        self.save_seconds.append(round(took, 3))
        beat = heartbeat.current()
        if beat is not None and growth.grown > 0 and took > 0:
            beat.set(write_bytes_per_s=round(growth.grown / took))  # the next save's budget is sized by it
        heartbeat.phase("step")

    def _drop_cut_short(self, state: State) -> None:
        """Remove what this rank wrote of a save the disk could not hold. It has no manifest, so nothing reads it
        and the next launch's plan_start would remove it anyway; removed now, it gives the full disk back the room
        for this rank's one fatal line (its log is often on the same disk) and for whatever else shares it."""
        from composer.utils.checkpoint import get_save_filename

        written = Path(get_save_filename(state, self.filename.format(state, keep_placeholders=True)))
        if state.fsdp_sharded_state_dict_enabled:
            mine = [written.parent / name for name in _written_by_this_rank(written.parent)]
        else:
            mine = [written]
        for path in mine:
            try:
                discard(path)
            except OSError:  # the fatal line still goes out; the relaunch's repair removes it
                pass

    def _publish(self, state: State) -> None:
        tokens = int(state.timestamp.token.value)
        self.last_saved_tokens = tokens
        files = None
        if state.fsdp_sharded_state_dict_enabled:
            path, files = self._shards_written(tokens)
        elif dist.get_global_rank() == 0:
            path = Path(self.saved_checkpoints[-1]).resolve()
            maybe_fault("save", tokens, path)
        else:
            return
        info = CheckpointInfo(
            path=str(path),
            tokens=tokens,
            batch=int(state.timestamp.batch.value),
            stage=self.run_stage.name,
            stage_index=self.run_stage.index,
            files=files,
        )
        if dist.get_global_rank() != 0:
            if self.remote is not None:  # another node's first rank: its node's shards to the mirror
                self.remote.upload_async(info, written_by=_node_ranks(), publish=False)
                self.run_folder.keep_newest_shards(self.keep_last_k)  # uploads read hard links: never cut short
            return
        info = checkpoints.publish(self.run_folder.path, info)
        self.run_folder.point_latest(self.run_stage.index, path)
        maybe_fault("published", tokens)
        if self.remote is not None:
            self.remote.upload_async(info, written_by=_node_ranks() if info.sharded else None, keep=self.keep_last_k)
        self.run_folder.keep_last(self.keep_last_k)
        # Where this launch's time went, up to a checkpoint that stays (the goodput ledger reads it)
        self._record_time(tokens, final=False)

    def _shards_written(self, tokens: int):
        """(folder, every file of it) of the sharded checkpoint all ranks just wrote.

        Each rank fsyncs and hashes the files it wrote itself (its shard; rank 0 also DCP's .metadata), so
        the work is spread and no rank reads a file another node's disk holds; rank 0 gathers the list and
        publishes it. A rank killed before the gather leaves the folder without a manifest: incomplete.
        """
        folder = self.run_folder.path / self.run_folder.sharded_template(self.run_stage.index).format(token=tokens)
        folder = folder.resolve()
        mine = _written_by_this_rank(folder)
        if mine:
            maybe_fault("save", tokens, folder / mine[0])  # a kill mid-write of this rank's shard
        entries = [e.model_dump() for e in checkpoints.shard_files(folder, mine)]
        every = [checkpoints.ShardFile(**e) for per_rank in dist.all_gather_object(entries) for e in per_rank]
        return folder, sorted(every, key=lambda e: e.name)

    def batch_end(self, state: State, logger: Logger) -> None:
        super().batch_end(state, logger)
        if self.remote is not None:
            self.remote.poll()  # never waits, never fails: a failed upload is retried in the background

    def fit_end(self, state: State, logger: Logger) -> None:
        super().fit_end(state, logger)
        if self.remote is not None:  # the stage is done only when its checkpoints are up
            heartbeat.phase("upload", hint_bytes=self.remote.pending_bytes())
            self.remote.poll(block=True, wait_s=self.upload_wait_s)
            heartbeat.phase("close")
        if dist.get_global_rank() == 0:
            self._record_time(int(state.timestamp.token.value), final=True)

    def _record_time(self, tokens: int, final: bool) -> None:
        folder = self.run_folder
        time_records.record(folder.path, folder.run_name, self.run_stage.name, tokens, final, self.remote)

    def post_close(self) -> None:
        super().post_close()
        if self.remote is not None:
            self.remote.close()
