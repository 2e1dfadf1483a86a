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
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def launch(job_path: Path, fault_tokens: int) -> tuple[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULT": f"step:{fault_tokens}"}
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
    return proc.returncode, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--early", type=int, default=2, help="steps before the early checkpoint")
    parser.add_argument("--late", type=int, default=400, help="steps before the late checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

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
