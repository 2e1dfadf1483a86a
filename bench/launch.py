"""Launch and restart latency: Composer's launcher against torch's elastic agent with warm ranks (infra/launcher.py).

Start: from spawning the launcher to every rank's first optimizer step of the tiny recipe (each rank's heartbeat
file, trainers/heartbeat.py, records its step), for 1, 2 and 4 ranks; `python -m composer.cli.launcher -n N` (the
old path: each rank a fresh interpreter) against `python -m infra.launcher --nproc-per-node N --warm ...` (ranks
forked from one process that imported the trainer once). The paths alternate, and each figure is the minimum of
--repeats runs, since a shared machine only ever adds time.

Restart: 2 ranks, rank 1 SIGKILLed right after step 20 (the checkpoint is at step 16), timed from the kill (the
fault hook's once-file) to both ranks' next optimizer step in a new process: a relaunch as the flow makes it (the
launcher ends, the flow waits tasks.training.train.PREEMPTION_DELAY_S and starts a new launcher) against a restart
in place (--max-restarts 1: the same launcher and forkserver).

With the start's wall time goes the CPU the whole launch used to get there (every process of its group, read from
/proc at the moment of the last rank's first step): on a machine with a core per rank the old path's per-rank
imports run in parallel, so its wall hides them; its CPU does not.

Prints one JSON line last: {"bench": "launch", "start_s": {"composer": {1: .., 2: .., 4: ..}, "torch_warm": {...}},
"start_ratio": {N: warm/composer}, "start_cpu_s": {...}, "start_cpu_ratio": {...}, "restart_s": {"relaunch": ..,
"in_place": ..}, "restart_ratio": ..}. Goals: start_ratio at 2 ranks <= 0.5, restart_ratio <= 0.5.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

SEQ, BATCH = 64, 4
STEP = SEQ * BATCH


def _env(beats: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env | {"TESSERA_HEARTBEAT_DIR": str(beats)} | (extra or {})


def _command(path: str, ranks: int, job: Path, logs: Path, restarts: int = 0) -> list[str]:
    from trainers.contract import WARM_MODULES

    train = ["-m", "trainers.train", "--job", str(job), "--stage", "0"]
    if path == "composer":
        return [sys.executable, "-m", "composer.cli.launcher", "-n", str(ranks), *train]
    return [
        sys.executable,
        "-m",
        "infra.launcher",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(restarts),
        "--log-dir",
        str(logs),
        "--warm",
        ",".join(WARM_MODULES),
        *train,
    ]


def _beats(folder: Path, ranks: int) -> list[dict | None]:
    out = []
    for rank in range(ranks):
        try:
            out.append(json.loads((folder / f"rank{rank}.json").read_bytes().strip()))
        except (OSError, ValueError):
            out.append(None)
    return out


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _fresh(job_path: Path) -> None:
    """A fresh start: no checkpoint, no lease, no heartbeats of an earlier run."""
    from trainers.config import TrainJob

    job = TrainJob.model_validate_json(job_path.read_text())
    shutil.rmtree(job.save_folder, ignore_errors=True)


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds the live processes of a process group have used (the launcher, its forkserver and
    the ranks; all still alive at a first step)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / tick


def time_start(path: str, ranks: int, job_path: Path, work: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of the whole launch) from spawning the launcher to every rank's first step."""
    _fresh(job_path)
    beats = work / f"beats-{path}-{ranks}"
    shutil.rmtree(beats, ignore_errors=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        _command(path, ranks, job_path, work / "logs"),
        cwd=ROOT,
        env=_env(beats),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while True:
            if all(b is not None and (b.get("step") or 0) >= 1 for b in _beats(beats, ranks)):
                return time.monotonic() - started, _group_cpu_s(proc.pid)
            if proc.poll() is not None:
                raise RuntimeError(f"{path} with {ranks} rank(s) exited {proc.returncode} before its first step")
            time.sleep(0.05)
    finally:
        _stop(proc)


def time_restart(mode: str, job_path: Path, work: Path) -> float:
    """Seconds from rank 1's kill -9 after step 20 to both ranks' next step in new processes."""
    from tasks.training.train import PREEMPTION_DELAY_S

    _fresh(job_path)
    beats = work / f"beats-restart-{mode}"
    shutil.rmtree(beats, ignore_errors=True)
    once = work / f"killed-{mode}"
    once.unlink(missing_ok=True)
    fault = {"TESSERA_FAULT": f"step:{20 * STEP}", "TESSERA_FAULT_RANK": "1", "TESSERA_FAULT_ONCE": str(once)}
    restarts = 1 if mode == "in_place" else 0
    cmd = _command("torch_warm", 2, job_path, work / "logs", restarts)
    spawn = dict(cwd=ROOT, env=_env(beats, fault), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, **spawn, start_new_session=True)
    try:
        while not once.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{mode}: the launch ended ({proc.returncode}) before the kill")
            time.sleep(0.02)
        killed_at = once.stat().st_mtime
        old = {b["pid"] for b in _beats(beats, 2) if b}
        if mode == "relaunch":  # as the flow does: the launch ends, a delay, a new launcher
            proc.wait()
            time.sleep(PREEMPTION_DELAY_S)
            proc = subprocess.Popen(cmd, **spawn, start_new_session=True)
        while True:
            now = _beats(beats, 2)
            if all(b is not None and b["pid"] not in old and (b.get("step") or 0) > 16 for b in now):
                return time.time() - killed_at
            if proc.poll() is not None:
                raise RuntimeError(f"{mode}: the launch ended ({proc.returncode}) before a step after the kill")
            time.sleep(0.05)
    finally:
        _stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", default="1,2,4")
    args = parser.parse_args()

    from tests.support.training import tiny_job, write_job, write_mds
    from trainers.config import StageConfig

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = write_mds(work / "src", 64 * BATCH, SEQ, 512, seed=0)
        job = tiny_job(
            work / "run",
            {"a": str(src)},
            [StageConfig(name="s", tokens=48 * STEP, mixture={"a": 1.0})],
            seq_len=SEQ,
            global_batch_size=BATCH,
            checkpoint_every_tokens=16 * STEP,
        )
        job_path = write_job(job, work / "job.json")
        start: dict[str, dict[int, float]] = {"composer": {}, "torch_warm": {}}
        cpu: dict[str, dict[int, float]] = {"composer": {}, "torch_warm": {}}
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for path in ("composer", "torch_warm"):
                start[path][ranks] = cpu[path][ranks] = float("inf")
            for _ in range(args.repeats):
                for path in ("composer", "torch_warm"):
                    wall, used = time_start(path, ranks, job_path, work)
                    start[path][ranks] = min(start[path][ranks], wall)
                    cpu[path][ranks] = min(cpu[path][ranks], used)
                    print(f"start {path} x{ranks}: {wall:.2f} s, {used:.1f} CPU s", file=sys.stderr, flush=True)
        restart = {"relaunch": float("inf"), "in_place": float("inf")}
        for _ in range(args.repeats):
            for mode in ("relaunch", "in_place"):
                restart[mode] = min(restart[mode], time_restart(mode, job_path, work))
                print(f"restart {mode}: {restart[mode]:.2f} s", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "bench": "launch",
                "start_s": {p: {n: round(s, 2) for n, s in v.items()} for p, v in start.items()},
                "start_ratio": {n: round(start["torch_warm"][n] / start["composer"][n], 3) for n in start["composer"]},
                "start_cpu_s": {p: {n: round(s, 1) for n, s in v.items()} for p, v in cpu.items()},
                "start_cpu_ratio": {n: round(cpu["torch_warm"][n] / cpu["composer"][n], 3) for n in cpu["composer"]},
                "restart_s": {k: round(v, 2) for k, v in restart.items()},
                "restart_ratio": round(restart["in_place"] / restart["relaunch"], 3),
                "cores": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
