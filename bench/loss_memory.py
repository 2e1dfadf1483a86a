"""Peak memory of one training step with the fused, chunked loss (trainers/lm_loss.py) against transformers' own loss.

The same model, batch and step in two fresh processes: `fused` trains through `use_fused_loss` (the trainer's
path: the logits of one chunk at a time, never the microbatch's), `hf` through LlamaForCausalLM's forward with
labels (the whole microbatch's logits, upcast to fp32, kept through the backward). Each process reports its
peak after one forward and backward: CUDA's max_memory_allocated on a GPU (bf16 autocast), the process's peak
RSS above what it held before the step on a CPU (fp32). The default is what the issue measured on an H200: the
350m preset, a microbatch of 16 x 2048 (`--cpu` uses the tiny preset and 8 x 2048, which a 24 GiB machine holds).

Prints one JSON line last: {"bench": "loss_memory", "fused": {"peak_gb", "step_s"}, "hf": {...}, "saved_gb",
"fused_over_hf"}. Goal (GPU, 350m, microbatch 16): the step's peak <= 45 GB.
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

VOCAB = 50277


def one_step(mode: str, preset: str, batch: int, seq: int) -> dict:
    import resource
    import time

    import torch

    from trainers.lm_loss import use_fused_loss
    from trainers.model import PRESETS, build_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(PRESETS[preset], VOCAB, seq, 0, seed=0).to(device)
    if mode == "fused":
        use_fused_loss(model)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak_gb": round(peak / 2**30, 2), "step_s": round(time.perf_counter() - started, 2), "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="350m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cpu", action="store_true", help="The tiny preset at 8 x 2048 (fits a 24 GiB CPU box).")
    parser.add_argument("--one", choices=["fused", "hf"], help=argparse.SUPPRESS)  # a measuring child
    args = parser.parse_args()
    if args.cpu:
        args.preset, args.batch = "tiny", 8
    if args.one:
        print(json.dumps(one_step(args.one, args.preset, args.batch, args.seq_len)))
        return
    results = {}
    for mode in ("fused", "hf"):
        cmd = [sys.executable, __file__, "--one", mode, "--preset", args.preset]
        cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    import torch

    print(
        json.dumps(
            {
                "bench": "loss_memory",
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "preset": args.preset,
                "microbatch": [args.batch, args.seq_len],
                "fused": results["fused"],
                "hf": results["hf"],
                "saved_gb": round(results["hf"]["peak_gb"] - results["fused"]["peak_gb"], 2),
                "fused_over_hf": round(results["fused"]["peak_gb"] / results["hf"]["peak_gb"], 3),
                "same_loss": abs(results["fused"]["loss"] - results["hf"]["loss"]) <= 1e-3 * results["hf"]["loss"],
                "goal": {"peak_gb_at_350m_microbatch_16": 45},
            }
        )
    )


if __name__ == "__main__":
    main()
