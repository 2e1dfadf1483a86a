"""Where a stage's launch starts: the launch's process group, the start plan rank 0 decides and every rank shares,
each node's copy of the checkpoint and check of its data, and the start line the flow relays.

build.py calls `start` first, before the model costs memory and time; nothing here imports Composer's Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path

from trainers import folder_lock, heartbeat
from trainers.config import TrainJob
from trainers.contract import DIST_TIMEOUT_ENV, DIST_TIMEOUT_S
from trainers.data import cache_dir_for
from trainers.data_check import verify_streams
from trainers.exit_codes import FatalError
from trainers.faults import maybe_stall
from trainers.format.export import embedding_rows
from trainers.format.safe_load import UnsafeCheckpoint
from trainers.layout import RunFolder
from trainers.plan import StartPlan, plan_start, prepare_node
from trainers.progress import format_start
from trainers.rendezvous import init_process_group, rank0_decides, read, run_and_post, setup_store, world
from trainers.rollback import pending_skip
from trainers.shm import clean_stale_streaming_shm, leader_decides_prefixes

log = logging.getLogger("tessera.train")


def start(job: TrainJob, stage_index: int) -> tuple[StartPlan, int]:
    """Join the launch's process group, decide where the stage starts (rank 0 repairs and plans; the plan
    reaches every rank), clear a killed launch's shared memory, and say where it starts."""
    maybe_stall("launch", stage_index)  # test hook: a launch that is slow to start
    # Planning may download the checkpoint to resume from and verifies the stage's data: budgeted by their size.
    heartbeat.phase("plan", hint_bytes=checkpoint_bytes(job) + _data_bytes(job, stage_index))
    _, world_size = world()
    if world_size > 1:
        # One process group for the whole launch, made before anything else needs one: Streaming's
        # cleanup would otherwise create and destroy its own, and re-creating a group on the same
        # port right after can race a peer still leaving the old one.
        from composer.utils import dist, get_device

        device, timeout = get_device(None), float(os.environ.get(DIST_TIMEOUT_ENV, DIST_TIMEOUT_S))
        init_process_group(device.dist_backend.lower(), timeout)  # its store listens only where the launcher said
        dist.initialize_dist(device, timeout)  # Composer's checks; the group exists already
    plan, skip = _plan(job, stage_index)
    # A kill -9 leaves Streaming's shared memory behind (trainers/shm.py): local rank 0 removes the
    # segments no live process maps, while the node's other ranks wait; a live job's stay.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        clean_stale_streaming_shm()
    leader_decides_prefixes()  # before any dataset: another job on this host may be making its own
    if world_size > 1:
        from composer.utils import dist

        dist.barrier()
    stage = job.stage(stage_index)
    log.info("stage %s (%d): %s at %d tokens", stage.name, stage_index, plan.kind, plan.tokens)
    if world()[0] == 0:
        _say_start(job, stage_index, plan)
    return plan, skip


def _say_start(job: TrainJob, stage_index: int, plan: StartPlan) -> None:
    """The launch's start line (trainers/progress.py): the flow tells the person watching where it resumed."""
    import datetime as dt
    import sys

    stage = job.stage(stage_index)
    ckpt = plan.checkpoint or {}
    written = None
    if ckpt.get("path"):
        with contextlib.suppress(OSError):
            mtime = Path(ckpt["path"]).stat().st_mtime
            written = dt.datetime.fromtimestamp(mtime, dt.UTC).isoformat(timespec="seconds")
    record = {
        "stage": stage.name,
        "stage_index": stage_index,
        "kind": "done" if plan.tokens >= stage.end else plan.kind,
        "tokens": plan.tokens,
        "step": ckpt.get("batch", 0),
        "checkpoint": ckpt.get("path"),
        "written": written,
        "init_from": job.model.init_from if plan.kind == "fresh" else None,
    }
    print(format_start(record), file=sys.stdout, flush=True)


def _plan(job: TrainJob, stage_index: int) -> tuple[StartPlan, int]:
    """(start plan, samples to skip): rank 0 takes the run's lease, repairs the save folder and decides.

    The lease comes first: the repair deletes files, which must never happen under a live
    trainer of the same run. Then the first rank of every other node makes sure the checkpoint
    to load is in its own local folder.
    """

    def decide() -> dict:
        folder_lock.acquire(job.save_folder, job.run_name)
        plan = plan_start(job, stage_index)
        if plan.checkpoint is not None:  # the rows a run keeps: trainers/build._model_config
            try:
                rows = embedding_rows(plan.checkpoint["path"], trust=job.train.trust_checkpoints)
            except UnsafeCheckpoint as exc:  # refused on every relaunch: fatal, like Composer's own load of it
                raise FatalError(str(exc)) from None
            plan = dataclasses.replace(plan, vocab_rows=rows)
        return {"plan": dataclasses.asdict(plan), "skip": pending_skip(RunFolder.of(job), stage_index, plan.tokens)}

    decided = rank0_decides(decide)
    plan, skip = StartPlan(**decided["plan"]), int(decided["skip"])
    to_train = plan.tokens < job.stage(stage_index).end
    _, world_size = world()
    if world_size == 1 and to_train:
        _verify_data(job, stage_index)
    if world_size > 1:
        # No rank loads before every node has its file and has checked its data; each node's first rank says when.
        node, nodes = (
            int(os.environ.get("NODE_RANK", "0")),
            world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        )

        def ready() -> bool:
            if to_train:
                _verify_data(job, stage_index)
            if node != 0:  # rank 0's node has the file: rank 0 planned from it
                prepare_node(job, stage_index, plan)
            return True

        with setup_store() as store:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                run_and_post(store, f"tessera/node-ready/{node}", ready)
            for other in range(nodes):
                read(store, f"tessera/node-ready/{other}")
    return plan, skip


def checkpoint_bytes(job: TrainJob) -> int:
    return job.model.checkpoint_bytes(job.vocab_size)


def _data_bytes(job: TrainJob, stage_index: int) -> int:
    """The bytes a launch's data check reads: the stage's local shards as their indexes record them."""
    stage = job.stage(stage_index)
    total = 0
    for path in [stage.streams[name] for name in stage.config.mixture] + list(job.val_streams.values()):
        if "://" in path:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            shards = json.loads((Path(path) / "index.json").read_text())["shards"]
            total += sum(s["raw_data"]["bytes"] for s in shards)
    return total


def _verify_data(job: TrainJob, stage_index: int) -> None:
    """Every shard this node reads in the stage (its mixture and the held-out splits) against its index's hash
    (trainers/data_check.py): a damaged one is a fatal DamagedData naming it, before anything trains."""
    stage = job.stage(stage_index)
    streams = {name: stage.streams[name] for name in stage.config.mixture}
    streams |= {f"{name} (val)": path for name, path in job.val_streams.items()} if job.train.val_batches else {}
    started = time.monotonic()
    verify_streams(streams, functools.partial(cache_dir_for, run=job.run_name))
    log.info("prepared data verified: %d stream(s) in %.1fs", len(streams), time.monotonic() - started)
