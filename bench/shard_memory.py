"""Peak memory per rank and blocking save time, FSDP2 against DDP: tessera's 125M preset on 2 CPU ranks.

Each run is a real launch of the trainer (`python -m infra.launcher --nproc-per-node 2 ... -m trainers.train`,
ranks forked warm, gloo) over a few steps of synthetic data, with one checkpoint at the end. Every rank reports its
peak resident memory (VmHWM) and how long each checkpoint save blocked it (trainers/faults.py, TESSERA_PEAK_LOG).

- `ddp` (the anchor, `train.parallelism.sharding: NO_SHARD`): each rank holds the whole model, its gradients
  and AdamW's two moments (16 bytes a parameter), plus DDP's gradient buckets; rank 0 writes one file.
- `fsdp2` (FULL_SHARD, the default for several ranks): each rank holds half of those; each writes its shard.

Goal: the sharded rank's peak <= 0.6x DDP's. Both include the same fixed cost of a Python process with torch,
Composer and transformers imported (`baseline_mb`, measured in the same run), which no sharding removes, and
a step's transients, which sharding does not shrink either: activations, the vocabulary-wide logits, each
block's gathered parameters, the root module's (embeddings and tied head) gathered for the whole step, and
freed memory glibc keeps. `end_mb`, resident after the last step and save, is closer to the state a rank holds.

Then each final checkpoint is read as evaluation and export read it (`load_hf`, a fresh process): the peak
of reading the sharded folder against reading DDP's single file, beside the model's own fp32 size.

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

EXPORT = (
    "import re, sys; from trainers.format.export import load_hf; m, t = load_hf(sys.argv[1]); "
    "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) // 1024)"
)
BASELINE = (
    "import re, composer, transformers, torch, trainers.build; "
    "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) // 1024)"
)


def run(mode: str, preset: str, steps: int, seq_len: int, tmp: Path) -> list[dict]:
    from tests.support.training import run_stage, tiny_job, write_job, write_mds
    from trainers.config import StageConfig
    from trainers.model import PRESETS

    vocab, batch = 50277, 4
    src = tmp / "src"
    if not src.exists():
        write_mds(src, steps * batch, seq_len, vocab, seed=0)
    tokens = steps * batch * seq_len
    job = tiny_job(
        tmp / mode,
        {"src": str(src)},
        [StageConfig(name="s", tokens=tokens, mixture={"src": 1.0})],
        seq_len=seq_len,
        vocab_size=vocab,
        global_batch_size=batch,
        checkpoint_every_tokens=tokens,
        model=PRESETS[preset],
        run_name=f"mem-{mode}",
        val_batches=0,
        parallelism={"sharding": "NO_SHARD" if mode == "ddp" else "FULL_SHARD"},
    )
    log = tmp / f"{mode}.jsonl"
    proc = run_stage(write_job(job, tmp / f"{mode}.json"), 0, procs=2, env={"TESSERA_PEAK_LOG": str(log)}, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"bench/shard_memory.py: the {mode} launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["rank"])


def export_peak(checkpoint: Path) -> int:
    """Peak RSS (MB) of a fresh process that reads the checkpoint's model for evaluation or export."""
    out = subprocess.run([sys.executable, "-c", EXPORT, str(checkpoint)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench/shard_memory.py: reading {checkpoint} failed:\n{out.stderr[-3000:]}")
    return int(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    from trainers.model import PRESETS

    baseline = int(subprocess.run([sys.executable, "-c", BASELINE], cwd=ROOT, capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory(prefix="tessera-shard-mem-") as tmp:
        ddp = run("ddp", args.preset, args.steps, args.seq_len, Path(tmp))
        fsdp = run("fsdp2", args.preset, args.steps, args.seq_len, Path(tmp))
        # Evaluation and export read only the model, whole, into one allocation: about one copy of it.
        from_file = export_peak(next(Path(tmp, "ddp", "ckpt").glob("mem-ddp-s0-tok*-rank0.pt")))
        from_shards = export_peak(next(p for p in Path(tmp, "fsdp2", "ckpt").glob("mem-fsdp2-s0-tok*") if p.is_dir()))
    ddp_peak, fsdp_peak = max(r["peak_mb"] for r in ddp), max(r["peak_mb"] for r in fsdp)
    result = {
        "bench": "shard_memory",
        "preset": args.preset,
        "params_m": round(PRESETS[args.preset].total_params(50277) / 1e6, 1),
        "ranks": 2,
        "ddp_peak_mb": [r["peak_mb"] for r in ddp],
        "fsdp2_peak_mb": [r["peak_mb"] for r in fsdp],
        "ratio": round(fsdp_peak / ddp_peak, 3),
        "ratio_above_baseline": round((fsdp_peak - baseline) / (ddp_peak - baseline), 3),
        # Resident after the last step and save: the state a rank keeps, without the step's transients
        "ddp_end_mb": [r["end_mb"] for r in ddp],
        "fsdp2_end_mb": [r["end_mb"] for r in fsdp],
        "end_ratio_above_baseline": round(
            (max(r["end_mb"] for r in fsdp) - baseline) / (max(r["end_mb"] for r in ddp) - baseline), 3
        ),
        "baseline_mb": baseline,
        "export_from_file_mb": from_file,
        "export_from_shards_mb": from_shards,
        "model_fp32_mb": round(4 * PRESETS[args.preset].total_params(50277) / 2**20),
        "ddp_save_s": [r["save_s"][-1] for r in ddp],
        "fsdp2_save_s": [r["save_s"][-1] for r in fsdp],
        "goal": 0.6,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
