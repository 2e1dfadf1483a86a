"""tessera's trainer tokens/s against a plain PyTorch loop: same model, batch, data, optimizer, one process.

Both sides train the same Llama config from the same init on the same MDS samples, with AdamW
and grad-norm clipping. The tessera side is the real thing (build_trainer: Composer Trainer,
Streaming loader, LR/metrics/loss-guard/probe/checkpoint callbacks); checkpoints fall only at the
stage end, after the timed steps. Per-step throughput is the median over the steps after warmup,
so one-time startup (imports, dataset index, first-step allocations) is left out of both.

It also prices the hang watchdog (trainers/heartbeat.py, infra/watchdog.py): the same tessera run with every
step's heartbeat written and a watchdog polling the heartbeats every half second on a thread of the same process
(harsher than the real one, which polls every 2 s from another process), against the run without them, in turns
(off, on, off, on) so the machine's drift falls on both.

Prints one JSON line last: {"bench": "train_overhead", "ratio": tessera/plain, "watchdog_overhead": 1 - on/off,
...}. Goals: ratio >= 0.95, watchdog_overhead <= 0.01.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/train_overhead.py`: bench/ must not shadow stdlib modules (bench/tokenize.py).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch


def plain_loop(job, steps: int, warmup: int) -> float:
    """Median tokens/s of a hand-written loop over the first stage's samples (read in file order)."""
    from streaming import LocalDataset

    from trainers.build import optimizer_for
    from trainers.model import build_model

    model = build_model(job.model, job.vocab_size, job.seq_len, job.eos_token_id, job.train.seed)
    opt = optimizer_for(model, job.train.optim)
    data = LocalDataset(local=next(iter(job.streams.values())))
    loader = torch.utils.data.DataLoader(
        range(len(data)),
        batch_size=job.train.global_batch_size,
        drop_last=True,
        collate_fn=lambda idx: torch.stack([torch.from_numpy(data[i]["tokens"].astype("int64")) for i in idx]),
    )
    times = []
    model.train()
    t0 = time.perf_counter()
    for _, ids in zip(range(steps), loader):
        # Timed from the previous step's end, like the trainer's meter: data loading counts on both sides.
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.train.optim.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads the loss every step too (logging, loss guard)
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
    return job.tokens_per_batch / statistics.median(times[warmup:])


def tessera(job, warmup: int, watched: str | None = None) -> float:
    """Median tokens/s of the real trainer; with `watched` (a folder), heartbeats there and a watchdog reading them."""
    from infra.watchdog import Budgets, Watchdog
    from trainers import heartbeat
    from trainers.build import build_trainer
    from trainers.contract import HEARTBEAT_DIR_ENV

    heartbeat._BEAT.clear()
    os.environ.pop(HEARTBEAT_DIR_ENV, None)
    stop = threading.Event()
    if watched:
        os.environ[HEARTBEAT_DIR_ENV] = watched
        heartbeat.start()
        dog = Watchdog(Path(watched), Budgets(poll_s=0.5), [0])

        def watch() -> None:
            while not stop.wait(dog.budgets.poll_s):
                assert dog.check() is None, "the bench's own run looked hung"

        threading.Thread(target=watch, daemon=True).start()
    shutil.rmtree(job.save_folder, ignore_errors=True)  # each run trains the stage from the start
    trainer = build_trainer(job, 0)
    trainer.fit()
    history = trainer.tessera_metrics.history
    trainer.close()
    stop.set()
    heartbeat._BEAT.clear()
    os.environ.pop(HEARTBEAT_DIR_ENV, None)
    rates = [row["throughput/tokens_per_sec"] for row in history if "throughput/tokens_per_sec" in row]
    return statistics.median(rates[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    # One thread by default: on a shared CPU box, spinning OpenMP workers of either side make the
    # two measurements differ by 4x from run to run; pass 0 to keep torch's default.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tests.support.training import tiny_job, write_mds
    from trainers.config import ModelConfig, StageConfig

    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        samples = args.steps * args.batch
        src = write_mds(Path(tmp) / "src", samples, args.seq_len, args.vocab, seed=0)
        tokens = samples * args.seq_len
        job = tiny_job(
            tmp,
            {"src": str(src)},
            [StageConfig(name="bench", tokens=tokens, mixture={"src": 1.0})],
            seq_len=args.seq_len,
            vocab_size=args.vocab,
            global_batch_size=args.batch,
            checkpoint_every_tokens=tokens,  # only the stage-end save, after the timed steps
            model=ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=max(1, args.d_model // 64)),
        )
        # Plain loop first and last: the machine's load drifts, and the mean of the two brackets it.
        plain_a = plain_loop(job, args.steps, args.warmup)
        turns = []
        for _ in range(2):
            off = tessera(job, args.warmup)
            on = tessera(job, args.warmup, watched=str(Path(tmp) / "heartbeats"))
            turns.append((off, on))
        plain_b = plain_loop(job, args.steps, args.warmup)
    plain = (plain_a + plain_b) / 2
    ours = statistics.mean(off for off, _ in turns)
    watched = statistics.mean(on for _, on in turns)
    print(
        json.dumps(
            {
                "bench": "train_overhead",
                "ratio": round(ours / plain, 4),
                "goal": 0.95,
                "watchdog_overhead": round(1 - watched / ours, 4),
                "watchdog_goal": "<= 0.01",
                "tessera_tokens_per_sec": round(ours, 1),
                "tessera_watched_tokens_per_sec": round(watched, 1),
                "turns_off_on": [[round(a, 1), round(b, 1)] for a, b in turns],
                "plain_tokens_per_sec": round(plain, 1),
                "plain_runs_tokens_per_sec": [round(plain_a, 1), round(plain_b, 1)],
                "model": {"n_layers": args.layers, "d_model": args.d_model, "vocab": args.vocab},
                "seq_len": args.seq_len,
                "batch": args.batch,
                "steps": args.steps,
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
