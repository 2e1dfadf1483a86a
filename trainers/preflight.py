"""Before a launch spends compute: can this node save, and does it compute and communicate like its peers?

Runs in every launch (each relaunch too) that has steps to train, once the launch's process group exists
and the start is planned, before the model is built or a checkpoint loaded:
- the first rank of each node checks the save folder's disk has room for two checkpoints of this
  model (ModelConfig.checkpoint_bytes: the next save is written before the oldest is rotated
  out), that the save folder takes a file (created, fsynced, removed), and that an s3 save folder
  takes an object (put, deleted). The stage's data was verified just before, by the plan
  (trainers/data_check.py);
- every rank times a short matmul (the best of its windows in a tenth of a second) and, with several ranks, an
  all-reduce of 16 MB over the launch's backend (gloo or NCCL) as bus bandwidth.

Each rank posts its figures to the launch's store as JSON (no collective, no pickle); rank 0 prints
one `tessera.preflight {...}` line, which the flow relays, and names a rank whose matmul is slower
than the median by more than `train.watchdog.slow_rank_factor`; the figures go to MLflow as
`preflight/*` at the launch's first token. A disk or permission failure is fatal, in one line naming
the folder; a probe that fails is an infrastructure fault, relaunched on the preemption budget.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from trainers.config import TrainJob
from trainers.disk import existing, human_bytes
from trainers.exit_codes import FatalError, InfrastructureError
from trainers.faults import slow_factor, slowed_by
from trainers.progress import format_preflight
from trainers.remote import RemoteFolder

log = logging.getLogger(__name__)

CHECKPOINTS_OF_ROOM = 2
MATMUL_S = 0.1  # how long the matmul probe runs: long enough for a steady rate, short beside any launch
MATMUL_WINDOW = 4  # matmuls between clock reads: a window of about a millisecond on a CPU, under a time slice
ALLREDUCE_BYTES = 16 << 20
ALLREDUCE_ROUNDS = 3
GATHER_TIMEOUT_S = 120


def check_save_folder(job: TrainJob) -> dict:
    """Room for two checkpoints and a writable save folder (and s3 prefix), or a FatalError naming which."""
    folder = Path(job.save_folder)
    need = CHECKPOINTS_OF_ROOM * job.model.checkpoint_bytes(job.vocab_size)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".tessera-preflight-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"tessera preflight\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except PermissionError as exc:
        raise FatalError(
            f"preflight: train.save_folder {folder} is not writable ({exc.strerror}); give the trainer's user write "
            "access to it, or point train.save_folder elsewhere"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ENOSPC:  # a full disk is said below, with its figures
            raise FatalError(f"preflight: train.save_folder {folder} cannot take a file: {exc}") from None
    usage = shutil.disk_usage(existing(folder))
    if usage.free < need:
        raise FatalError(
            f"preflight: no room for checkpoints: the disk holding {folder} has {human_bytes(usage.free)} free of "
            f"{human_bytes(usage.total)}, and {CHECKPOINTS_OF_ROOM} checkpoints of this model take about "
            f"{human_bytes(need)}; free some space (or give train.save_folder a larger disk), then rerun"
        )
    if job.remote_folder:
        _check_remote(job.remote_folder)
    return {"free_bytes": usage.free, "need_bytes": need}


def _check_remote(uri: str) -> None:
    """An s3 save folder takes an object: a missing bucket or a denied write is found now, not at the first save."""
    name = f".tessera-preflight-{uuid.uuid4().hex}"
    try:
        remote = RemoteFolder(uri)
        remote.put_text(name, "tessera preflight\n")
        remote.delete(name)
    except Exception as exc:  # noqa: BLE001 - the store's errors vary by backend; each is one line here
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        denied = any(w in text.lower() for w in ("accessdenied", "forbidden", "403", "nosuchbucket", "404"))
        if denied:
            raise FatalError(f"preflight: train.save_folder {uri} does not take a file ({text})") from None
        raise InfrastructureError(f"preflight: train.save_folder {uri} did not answer ({text})") from None


def matmul_gflops(device: torch.device) -> float:
    """GFLOP/s of square matmuls (fp32 on a CPU, bf16 on a GPU): the best of the short windows in about MATMUL_S
    seconds. Contention from other processes only ever slows a window, so the best one is the node's own rate,
    where the mean over the whole probe was the load of the moment: two ranks on a machine at load 8 differed by
    1.7x that way, enough to name the wrong rank slow.

    On a CPU the probe runs on this thread alone (one intra-op thread) and a window is timed by the CPU this thread
    spent in it, not the wall clock: a rank whose cores were given to other processes for a whole tenth of a second
    (a busy machine's time slices are longer than the probe) had no uncontended window at all, and CI named it slow
    at 2x; the process's CPU would count its other threads too (the heartbeat, the store, data prefetch). So a CPU
    rank's figure is one core's rate. A GPU's windows are the device's own, on the wall clock."""
    if device.type != "cuda":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _matmul_gflops(device, time.thread_time)
        finally:
            torch.set_num_threads(threads)
    return _matmul_gflops(device, time.perf_counter)


def _matmul_gflops(device: torch.device, clock) -> float:
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm up: the first call pays for kernel selection
    _sync(device)
    best, start = 0.0, time.perf_counter()
    window_start = clock()
    while True:
        for _ in range(MATMUL_WINDOW):
            torch.matmul(a, b)
        _sync(device)
        now, spent = time.perf_counter(), clock()
        best = max(best, 2 * n**3 * MATMUL_WINDOW / max(spent - window_start, 1e-9) / 1e9)
        window_start = spent
        if now - start >= MATMUL_S:
            break
    if not torch.isfinite(a @ b[:, :1]).all():
        raise InfrastructureError(f"preflight: the matmul probe on {device} gave non-finite numbers")
    # test hook: a straggler's probe takes `slow:<seconds>` longer, or `slow:x<F>` F times as long, for the same work
    computed = now - start
    slowed = computed * (slow_factor() - 1) + slowed_by()
    time.sleep(slowed)
    return best * computed / (computed + slowed)


def allreduce_gb_per_s(device: torch.device, world: int) -> float:
    """Bus bandwidth of an ALLREDUCE_BYTES all-reduce among all ranks (2(n-1)/n of the bytes cross each link)."""
    import torch.distributed as dist

    x = torch.ones(ALLREDUCE_BYTES // 4, device=device)
    dist.all_reduce(x)  # warm up: connections and buffers
    _sync(device)
    start = time.perf_counter()
    for _ in range(ALLREDUCE_ROUNDS):
        dist.all_reduce(x)
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2 * (world - 1) / world * ALLREDUCE_BYTES * ALLREDUCE_ROUNDS / elapsed / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(job: TrainJob, device: torch.device, rank: int, world: int) -> dict | None:
    """This launch's preflight; on rank 0 the summary of every rank (printed and returned), elsewhere None."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    host = socket.gethostname()
    mine: dict = {"rank": rank, "host": host, "node": os.environ.get("NODE_NAME") or host}
    if local_rank == 0:
        mine |= check_save_folder(job)
    try:
        mine["matmul_gflops"] = round(matmul_gflops(device), 2)
        if world > 1:
            mine["allreduce_gb_per_s"] = round(allreduce_gb_per_s(device, world), 3)
    except (FatalError, InfrastructureError):
        raise
    except Exception as exc:  # a probe that cannot run says the node is unwell, not the job
        raise InfrastructureError(f"preflight: a probe failed on rank {rank} ({host}): {exc}") from exc
    ranks = [mine] if world == 1 else _gather(mine, rank, world)
    if ranks is None:
        return None
    summary = summarize(ranks, job.train.watchdog.slow_rank_factor)
    print(format_preflight(summary), file=sys.stdout, flush=True)
    return summary


def _gather(mine: dict, rank: int, world: int) -> list[dict] | None:
    """Every rank's figures on rank 0, through the launch's store; None on the other ranks."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.set(f"tessera/preflight/{rank}", json.dumps(mine))
    if rank != 0:
        return None
    keys = [f"tessera/preflight/{r}" for r in range(world)]
    deadline = time.monotonic() + GATHER_TIMEOUT_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise InfrastructureError(f"preflight: ranks {missing} did not report within {GATHER_TIMEOUT_S} s")
        time.sleep(0.05)
    return [json.loads(store.get(k)) for k in keys]


def summarize(ranks: list[dict], factor: float) -> dict:
    """The launch's figures: the slowest matmul against the median, and the ranks slower than `factor` x it."""
    rates = [r["matmul_gflops"] for r in ranks]
    median = statistics.median(rates)
    slowest = min(ranks, key=lambda r: r["matmul_gflops"])
    slow = [
        {k: r[k] for k in ("rank", "host", "node", "matmul_gflops")}
        for r in ranks
        if r["matmul_gflops"] * factor < median
    ]
    bandwidth = [r["allreduce_gb_per_s"] for r in ranks if "allreduce_gb_per_s" in r]
    return {
        "ranks": ranks,
        "matmul_gflops_median": round(median, 2),
        "matmul_gflops_min": slowest["matmul_gflops"],
        "slowest": {k: slowest[k] for k in ("rank", "host", "node")},
        "allreduce_gb_per_s": round(min(bandwidth), 3) if bandwidth else None,
        "factor": factor,
        "slow": slow,
    }


def metrics(summary: dict) -> dict[str, float]:
    """The summary's MLflow metrics."""
    row = {
        "preflight/matmul_gflops_median": summary["matmul_gflops_median"],
        "preflight/matmul_gflops_min": summary["matmul_gflops_min"],
        "preflight/slow_ranks": float(len(summary["slow"])),
    }
    if summary["allreduce_gb_per_s"] is not None:
        row["preflight/allreduce_gb_per_s"] = summary["allreduce_gb_per_s"]
    return row
