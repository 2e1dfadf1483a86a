"""Model FLOPs utilisation of the tessera trainer on one GPU, 125M and 350M presets, bf16, seq_len 2048.

MFU = tokens/s x FLOPs per token (6N + 12*L*T*D, trainers.model.flops_per_token) / peak bf16
FLOPs of the device. Throughput is the trainer's own meter (median over steps after warmup),
with device_microbatch_size 'auto' so Composer picks the largest microbatch that fits.

Prints one JSON line last: {"bench": "mfu", "results": [{"preset", "mfu", "tokens_per_sec"}...]}.
Goal >= 0.45 on one H100. Without a CUDA device it says so and exits 0 with {"skipped": ...}.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402


def measure(preset: str, seq_len: int, batch: int, steps: int, warmup: int, tmp: Path) -> dict:
    from tests.support.training import tiny_job, write_mds
    from trainers.build import build_trainer
    from trainers.config import StageConfig
    from trainers.model import PRESETS

    vocab = 50277
    src = write_mds(tmp / f"src-{preset}", steps * batch, seq_len, vocab, seed=0)
    tokens = steps * batch * seq_len
    job = tiny_job(
        tmp / preset,
        {"src": str(src)},
        [StageConfig(name="mfu", tokens=tokens, mixture={"src": 1.0})],
        seq_len=seq_len,
        vocab_size=vocab,
        global_batch_size=batch,
        checkpoint_every_tokens=tokens,
        model=PRESETS[preset],
        run_name=f"mfu-{preset}",
    )
    job = job.model_copy(update={"train": job.train.model_copy(update={"device_microbatch_size": "auto"})})
    trainer = build_trainer(job, 0)
    trainer.fit()
    rows = trainer.tessera_metrics.history[warmup:]
    trainer.close()
    return {
        "preset": preset,
        "mfu": round(statistics.median(r["throughput/mfu"] for r in rows), 4),
        "tokens_per_sec": round(statistics.median(r["throughput/tokens_per_sec"] for r in rows), 1),
        "max_memory_gb": round(max(r.get("memory/max_allocated_gb", 0) for r in rows), 1),
        "seq_len": seq_len,
        "global_batch": batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["125m", "350m"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/mfu.py: no CUDA device on this machine; MFU is only meaningful on a GPU (goal >= 45% on one H100)")
        print(json.dumps({"bench": "mfu", "skipped": "no CUDA device", "goal": 0.45}))
        return
    with tempfile.TemporaryDirectory(prefix="tessera-mfu-") as tmp:
        results = [measure(p, args.seq_len, args.batch, args.steps, args.warmup, Path(tmp)) for p in args.presets]
    print(json.dumps({"bench": "mfu", "device": torch.cuda.get_device_name(), "results": results, "goal": 0.45}))


if __name__ == "__main__":
    main()
