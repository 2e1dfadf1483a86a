"""Checkpoint save and resume blocking time at a model preset, one process (GPU: 350M, seq 2048; CPU: 125M, seq 128).

Setup: a one-stage run with a checkpoint every 2 steps is killed (-9) after step 3.
Timed, each `--repeats` times, minimum kept (a shared machine only ever adds time):
- resume: `python -m trainers.train` relaunched from that checkpoint and killed the moment step 3 is
  done again (TESSERA_FAULT); spawn to death, imports, build, the checkpoint's SHA-256 and load included;
- fresh: the same launch in an empty save folder, killed after step 1: the anchor, what a start costs
  without a checkpoint to read. resume - fresh is what reading the checkpoint costs;
- save: the run finished from the checkpoint, so it saves once more at the stage's end; the trainer's
  own blocking save time (write, fsync, hash, publish; trainers/saver.py) from TESSERA_PEAK_LOG;
- disk: the same number of bytes written and fsynced as one plain file next to the checkpoints: the
  anchor of the save (save_over_disk = 1 means the save costs no more than the bytes' raw write).

Prints one JSON line last: {"bench": "checkpoint_time", "save_s", "resume_s", "fresh_s", ...}.
Goals: resume - fresh <= 15 s, save_over_disk <= 2.
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
import subprocess
import tempfile
import time

import torch


def launch(job_path: Path, env: dict[str, str], expect: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", "--job", str(job_path), "--stage", "0"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - t0
    if proc.returncode != expect:
        raise SystemExit(f"launch exited {proc.returncode}, not {expect}:\n{proc.stderr[-3000:]}")
    return elapsed


def disk_seconds(folder: Path, nbytes: int) -> float:
    block = os.urandom(1 << 24)
    path = folder / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--preset", default="350m" if gpu else "125m")
    parser.add_argument("--seq-len", type=int, default=2048 if gpu else 128)
    parser.add_argument("--batch", type=int, default=8 if gpu else 4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from tests.support.training import tiny_job, write_job, write_mds
    from trainers.config import StageConfig
    from trainers.format.checkpoints import list_complete
    from trainers.model import PRESETS

    vocab, step = 50277, args.seq_len * args.batch
    with tempfile.TemporaryDirectory(prefix="tessera-ckpt-time-") as tmp:
        tmp = Path(tmp)
        src = write_mds(tmp / "src", 4 * args.batch, args.seq_len, vocab, seed=0)

        def job(name: str) -> tuple[Path, str]:
            (tmp / name).mkdir()
            j = tiny_job(
                tmp / name,
                {"src": str(src)},
                [StageConfig(name="bench", tokens=4 * step, mixture={"src": 1.0})],
                seq_len=args.seq_len,
                vocab_size=vocab,
                global_batch_size=args.batch,
                checkpoint_every_tokens=2 * step,
                model=PRESETS[args.preset],
                run_name=f"ckpt-{args.preset}",
            )
            return write_job(j, tmp / name / "job.json"), j.save_folder

        main_job, save_folder = job("run")
        launch(main_job, {"TESSERA_FAULT": f"step:{3 * step}"}, -9)  # setup: a checkpoint at step 2
        ckpt = list_complete(save_folder)[-1]
        ckpt_path = Path(ckpt.path)
        files = [p for p in ckpt_path.rglob("*") if p.is_file()] if ckpt_path.is_dir() else [ckpt_path]
        size = sum(p.stat().st_size for p in files)
        resume, fresh = [], []
        for i in range(args.repeats):
            resume.append(launch(main_job, {"TESSERA_FAULT": f"step:{3 * step}"}, -9))
            fresh_job, fresh_folder = job(f"fresh{i}")
            fresh.append(launch(fresh_job, {"TESSERA_FAULT": f"step:{step}"}, -9))
            shutil.rmtree(fresh_folder, ignore_errors=True)
        peak_log = tmp / "peak.jsonl"
        launch(main_job, {"TESSERA_PEAK_LOG": str(peak_log)}, 0)  # resumes at 2, saves at 4 (the stage's end)
        saves = [s for line in peak_log.read_text().splitlines() for s in json.loads(line)["save_s"]]
        disk = min(disk_seconds(Path(save_folder), size) for _ in range(args.repeats))
    save = min(saves)
    print(
        json.dumps(
            {
                "bench": "checkpoint_time",
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "preset": args.preset,
                "checkpoint_mb": round(size / 2**20, 1),
                "save_s": save,
                "disk_s": round(disk, 2),
                "save_over_disk": round(save / disk, 2),
                "resume_s": round(min(resume), 2),
                "fresh_s": round(min(fresh), 2),
                "resume_over_fresh_s": round(min(resume) - min(fresh), 2),
                "runs_s": {"resume": [round(t, 2) for t in resume], "fresh": [round(t, 2) for t in fresh]},
                "goal": {"resume_over_fresh_s": 15, "save_over_disk": 2},
            }
        )
    )


if __name__ == "__main__":
    main()
