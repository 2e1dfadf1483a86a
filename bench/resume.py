"""Resume latency: process start -> first new optimizer step, resuming early vs late in a stage.

Setup (not timed): a tiny-recipe stage is trained to a checkpoint after `early` steps in one
save folder and after `late` (>= 100x further) steps in another, each launch killed with -9
right after the step following its checkpoint, as a crash would leave it.
Timed: `python -m trainers.train --job J --stage 0` relaunched in each folder with
TESSERA_FAULT=step:<first new step>, so the process SIGKILLs itself the moment that step is
done; the wall time from spawn to death is the resume blocking time (imports included). Each is
repeated and the minimum kept, since a shared machine only ever adds time.

Streaming restores the data position from its state dict (no replay), so late/early ~ 1.

Prints one JSON line last: {"bench": "resume", "late_over_early": ..., "early_s": ..., "late_s": ...}.
Goals: late/early <= 1.2, resume blocking time <= 15 s on CPU.

With --compile (train.compile: true), the same relaunch with a cold compile cache (an empty
TESSERA_COMPILE_CACHE_DIR each time) against a warm one (the folder the setup launch compiled into), interleaved:
{"bench": "resume_compile", "cold_s", "warm_s", "warm_over_cold", "compile_s": {"cold", "warm"}} (compile_s is
what the relaunch's own log says it spent compiling). Goal: warm/cold <= 0.5 (a relaunch does not pay the
whole compile again).
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
import subprocess
import tempfile
import time


def launch(job_path: Path, fault_tokens: int, extra: dict[str, str] | None = None) -> tuple[int, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULT": f"step:{fault_tokens}", **(extra or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", "--job", str(job_path), "--stage", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - t0
    if proc.returncode != -9:
        raise SystemExit(f"launch did not reach step {fault_tokens}: rc={proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.returncode, elapsed, proc.stderr


def compiled_seconds(stderr: str) -> float:
    """What the launch's log says its first step spent compiling (trainers/compile.py's CompileReport)."""
    line = next(x for x in stderr.splitlines() if "first step: compiled for" in x)
    return float(line.split("compiled for ")[1].split(" s")[0])


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main_compile(args) -> None:
    from tests.support.training import tiny_job, write_job, write_mds
    from trainers.config import StageConfig
    from trainers.model import PRESETS

    seq, batch, vocab = args.seq_len, args.batch, 512 if args.preset == "tiny" else 50277
    step = seq * batch
    steps = 20
    with tempfile.TemporaryDirectory(prefix="tessera-resume-compile-") as tmp:
        src = write_mds(Path(tmp) / "src", steps * batch, seq, vocab, seed=0)
        stages = [StageConfig(name="bench", tokens=steps * step, mixture={"src": 1.0})]
        root = Path(tmp) / "run"
        root.mkdir()
        job = tiny_job(
            root,
            {"src": str(src)},
            stages,
            seq_len=seq,
            vocab_size=vocab,
            global_batch_size=batch,
            checkpoint_every_tokens=2 * step,
            model=PRESETS[args.preset],
        )
        job = job.model_copy(update={"train": job.train.model_copy(update={"compile": True})})
        path = write_job(job, root / "job.json")
        warm = {"TESSERA_COMPILE_CACHE_DIR": str(Path(tmp) / "warm")}
        launch(path, 3 * step, warm)  # setup: compiles into the warm cache, checkpoint at 2 steps, dies at 3
        timings: dict[str, list[float]] = {"cold": [], "warm": []}
        compiling: dict[str, list[float]] = {"cold": [], "warm": []}
        for k in range(args.repeats):
            for name in ("cold", "warm"):
                cache = warm if name == "warm" else {"TESSERA_COMPILE_CACHE_DIR": str(Path(tmp) / f"cold-{k}")}
                _, elapsed, stderr = launch(path, 3 * step, cache)
                timings[name].append(elapsed)
                compiling[name].append(compiled_seconds(stderr))
    cold, warm_s = min(timings["cold"]), min(timings["warm"])
    print(
        json.dumps(
            {
                "bench": "resume_compile",
                "cold_s": round(cold, 2),
                "warm_s": round(warm_s, 2),
                "warm_over_cold": round(warm_s / cold, 3),
                "compile_s": {k: round(min(v), 2) for k, v in compiling.items()},
                "runs_s": {k: [round(v, 2) for v in vs] for k, vs in timings.items()},
                "goal": {"warm_over_cold": 0.5},
                "preset": args.preset,
                "device": _device(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--early", type=int, default=2, help="steps before the early checkpoint")
    parser.add_argument("--late", type=int, default=400, help="steps before the late checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="Cold against warm compile cache (train.compile).")
    parser.add_argument("--preset", default="tiny", help="With --compile: the model (350m on a GPU).")
    parser.add_argument("--seq-len", type=int, default=32, help="With --compile.")
    parser.add_argument("--batch", type=int, default=8, help="With --compile: the global batch.")
    args = parser.parse_args()
    if args.compile:
        main_compile(args)
        return

    from tests.support.training import tiny_job, write_job, write_mds
    from trainers.config import StageConfig

    seq, batch = 32, 8
    step = seq * batch
    steps = args.late + 20
    with tempfile.TemporaryDirectory(prefix="tessera-resume-") as tmp:
        src = write_mds(Path(tmp) / "src", steps * batch, seq, 512, seed=0)
        stages = [StageConfig(name="bench", tokens=steps * step, mixture={"src": 1.0})]
        jobs = {}
        for name, at in (("early", args.early), ("late", args.late)):
            root = Path(tmp) / name
            root.mkdir()
            job = tiny_job(
                root,
                {"src": str(src)},
                stages,
                seq_len=seq,
                global_batch_size=batch,
                checkpoint_every_tokens=at * step,
                keep_checkpoints=1,
            )
            jobs[name] = (write_job(job, root / "job.json"), at)
            launch(jobs[name][0], (at + 1) * step)  # setup: checkpoint at `at`, die one step later
        timings: dict[str, list[float]] = {"early": [], "late": []}
        for _ in range(args.repeats):  # interleaved, so drifting load hits both sides alike
            for name, (path, at) in jobs.items():
                timings[name].append(launch(path, (at + 1) * step)[1])
    early, late = min(timings["early"]), min(timings["late"])
    print(
        json.dumps(
            {
                "bench": "resume",
                "late_over_early": round(late / early, 3),
                "early_s": round(early, 2),
                "late_s": round(late, 2),
                "early_tokens": args.early * step,
                "late_tokens": args.late * step,
                "position_ratio": args.late / args.early,
                "runs_s": {k: [round(v, 2) for v in vs] for k, vs in timings.items()},
                "goal": {"late_over_early": 1.2, "blocking_s": 15},
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
