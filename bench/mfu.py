"""Model FLOPs utilisation of the tessera trainer against its anchor, a plain compiled PyTorch loop, in one process.

For each preset (125m, 350m, 1b by default), bf16 autocast, seq_len 2048, global batch 32 as microbatch 16 x 2:
- tessera: `trainers.build.build_trainer` on a job of that shape (what a stage launch runs: Composer, the
  callbacks, the compiled blocks, the fused loss, fused AdamW), its own per-step meter;
- anchor: the same HF Llama (`trainers.model.build_model`, the same padded vocabulary), `torch.compile(model)`,
  `AdamW(fused=True)`, transformers' own loss, two microbatches of 16 accumulated, one sync per step (as the
  trainer's loss readout makes one).
Both take the median step after `--warmup` steps; MFU = tokens/s x FLOPs per token (6N + 12*L*T*D over the
tokenizer's vocabulary, trainers.model.flops_per_token) / the device's dense bf16 peak. The two run on the same
card in the same process, one after the other, with the memory freed and the peak counter reset between them.

Prints one JSON line last: {"bench": "mfu", "device", "results": [{"preset", "tessera": {tokens_per_sec, mfu,
peak_gb}, "anchor": {...}, "ratio"}], "goal"}. Goals: ratio >= 0.98 for every preset; MFU >= 0.40 at 350m and
>= 0.45 at 1b. Without a CUDA device it says so and exits 0 with {"skipped": ...}; `--cpu` runs the same code
on the CPU with the tiny preset and short sequences (a check that the bench itself works, not a figure).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import gc
import json
import statistics
import tempfile
import time

import torch

VOCAB = 50277  # GPT-NeoX's tokenizer, as the demo and the recipes use it
GOALS = {"ratio": 0.98, "mfu": {"350m": 0.40, "1b": 0.45}}


def _peak() -> float | None:
    from trainers.callbacks import _peak_flops

    return _peak_flops()


def _free() -> None:
    import torch._dynamo

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0.0


def tessera(preset: str, args, tmp: Path) -> dict:
    from tests.support.training import tiny_job, write_mds
    from trainers.build import build_trainer
    from trainers.config import StageConfig
    from trainers.model import PRESETS

    steps = args.warmup + args.steps
    src = write_mds(tmp / f"src-{preset}", steps * args.batch, args.seq_len, VOCAB, seed=0)
    tokens = steps * args.batch * args.seq_len
    job = tiny_job(
        tmp / preset,
        {"src": str(src)},
        [StageConfig(name="mfu", tokens=tokens, mixture={"src": 1.0})],
        seq_len=args.seq_len,
        vocab_size=VOCAB,
        global_batch_size=args.batch,
        checkpoint_every_tokens=tokens,
        model=PRESETS[preset],
        run_name=f"mfu-{preset}",
        val_batches=0,
        compile=args.compile,
    )
    train = job.train.model_copy(update={"device_microbatch_size": args.microbatch})
    job = job.model_copy(update={"train": train, "compile_cache_dir": str(tmp / "compile")})
    trainer = build_trainer(job, 0)
    trainer.fit()
    rows = trainer.tessera_metrics.history[args.warmup :]
    trainer.close()
    tps = statistics.median(r["throughput/tokens_per_sec"] for r in rows if "throughput/tokens_per_sec" in r)
    del trainer
    out = {"tokens_per_sec": round(tps, 1), "peak_gb": _peak_gb()}
    _free()
    return out


def anchor(preset: str, args) -> dict:
    """The plain loop: no Composer, no callbacks, nothing but the model, its loss and the optimizer."""
    from trainers.model import PRESETS, build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(PRESETS[preset], VOCAB, args.seq_len, 0, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if args.compile else model
    micro = args.batch // args.microbatch
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times = []
    for step in range(args.warmup + args.steps):
        batches = [torch.randint(0, VOCAB, (args.microbatch, args.seq_len), generator=gen) for _ in range(micro)]
        started = time.perf_counter()
        for ids in batches:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = step_model(input_ids=ids, labels=ids).loss / micro
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)  # one sync per step, as the trainer's loss readout
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    tps = args.batch * args.seq_len / statistics.median(times)
    out = {"tokens_per_sec": round(tps, 1), "peak_gb": _peak_gb()}
    del model, optimizer, step_model
    _free()
    return out


def measure(preset: str, args, tmp: Path) -> dict:
    from trainers.model import PRESETS, flops_per_token

    flops = flops_per_token(PRESETS[preset], VOCAB, args.seq_len).total
    peak = _peak()
    row = {"preset": preset}
    for name, run in (("tessera", lambda: tessera(preset, args, tmp)), ("anchor", lambda: anchor(preset, args))):
        result = run()
        result["mfu"] = round(result["tokens_per_sec"] * flops / peak, 4) if peak else None
        row[name] = result
        print(f"{preset} {name}: {json.dumps(result)}", flush=True)
    row["ratio"] = round(row["tessera"]["tokens_per_sec"] / row["anchor"]["tokens_per_sec"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["125m", "350m", "1b"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="Both sides eager.")
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU (tiny preset): checks the bench runs.")
    args = parser.parse_args()
    if args.cpu:
        args.presets, args.seq_len, args.batch, args.microbatch = ["tiny"], 64, 8, 4
    elif not torch.cuda.is_available():
        print("bench/mfu.py: no CUDA device on this machine; MFU is only meaningful on a GPU (--cpu checks the bench)")
        print(json.dumps({"bench": "mfu", "skipped": "no CUDA device", "goal": GOALS}))
        return
    with tempfile.TemporaryDirectory(prefix="tessera-mfu-") as tmp:
        results = [measure(p, args, Path(tmp)) for p in args.presets]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        json.dumps(
            {
                "bench": "mfu",
                "device": device,
                "torch": torch.__version__,
                "compile": args.compile,
                "seq_len": args.seq_len,
                "global_batch": args.batch,
                "microbatch": args.microbatch,
                "results": results,
                "goal": GOALS,
            }
        )
    )


if __name__ == "__main__":
    main()
