"""Gauntlet scoring throughput against a raw batched forward pass of the same model on the same tensors.

For each scored task type (language_modeling, multiple_choice, schema) of the task list:
  gauntlet: score_choice_items end to end (collate, forward, continuation gather, metric);
  raw:      model(input_ids, attention_mask) on exactly the padded batches the gauntlet builds;
  body:     the same forward projecting one position per row to the vocabulary (logits_to_keep=1);
  floor:    the same forward without the head, then the head on exactly the positions the gauntlet
            must project: one per distinct hidden state that predicts a continuation token (the
            choices of one example predict their first token from one state, so it counts once).
ratio = gauntlet tokens/s / raw tokens/s (goal >= 0.8); tokens are the full rows either way.
The gauntlet projects only continuation positions to the vocabulary and runs a shared few-shot
prefix once, so on a small-d_model, 50k-vocabulary model it beats a raw forward that computes
every logit; `ratio_vs_body` is the stricter comparison against a forward that skips that work.
Scoring cannot skip all of it: a continuation token's cross-entropy needs its whole row of logits.
At d_model 64 one projected position costs as much as some 30 tokens of the 2-layer body (64 x 50k
multiply-adds against about 100k), and these tasks score one position per 3 to 60 tokens, so the
necessary projections take about as long as the body and `ratio_vs_body` cannot reach 0.8 however
lean the rest is. `ratio_vs_floor` = floor time / gauntlet time is the share of the gauntlet's time
spent on that necessary work; the rest is log_softmax, batching and Python. `projected` counts the
positions the floor projects, `continuation_tokens` the tokens scored.
Timings are the fastest of --repeats interleaved rounds, because the machine may be shared.

Prints one JSON line last: {"bench": "eval", "ratio": ..., ...}.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/eval.py`: bench/ must not shadow stdlib modules (bench/tokenize.py exists).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import json
import time

import torch
import transformers

from evaluation.batching import collate_rows, distinct_positions, length_batches, token_index
from evaluation.prompts import prepare_split, validate_records
from evaluation.scoring import score_choice_items
from evaluation.sources import read_jsonl, resolve
from evaluation.spec import load_tasks


def demo_model(vocab: int, device: str, d_model: int, layers: int, seq_len: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=(8 * d_model // 3 + 63) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(d_model // 16, 1),
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_of(fns, repeats: int, device: str) -> list[float]:
    """Fastest of `repeats` runs of each function, taken in interleaved rounds.

    The machine may be shared: interleaving gives every function the same chances at quiet
    moments, and the fastest run is the least disturbed one.
    """
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=str(ROOT / "data/gauntlet/yamls/tasks_v0.3.yaml"))
    ap.add_argument("--data-root", default=str(ROOT / "data/gauntlet"))
    ap.add_argument("--labels", default="lambada_openai,copa,arc_easy,winograd", help="comma-separated task labels")
    ap.add_argument("--limit", type=int, default=200, help="examples per task (0: all)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "data/tokenizers/gpt-neox-20b/tokenizer.json"),
        eos_token="<|endoftext|>",
        pad_token="<|padding|>",
    )
    model = demo_model(len(tok), args.device, args.d_model, args.layers, args.seq_len)
    pad = tok.pad_token_id
    wanted = args.labels.split(",")
    per_type: dict[str, dict[str, float]] = {}
    totals = {
        "examples": 0,
        "tokens": 0,
        "gauntlet_s": 0.0,
        "raw_s": 0.0,
        "body_s": 0.0,
        "floor_s": 0.0,
        "prep_s": 0.0,
        "projected": 0,
        "continuation_tokens": 0,
    }

    for task in load_tasks(args.tasks):
        if task.label not in wanted or task.icl_task_type not in ("language_modeling", "multiple_choice", "schema"):
            continue
        uri = resolve(args.data_root, task.dataset_uri)
        if not Path(uri).is_file():
            print(f"skip {task.label}: {uri} missing", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        records = validate_records(task, uri, read_jsonl(uri))
        records = records[: args.limit] if args.limit else records
        split = prepare_split(task, uri, records, tok, task.num_fewshot[0], args.seq_len, 1234)
        prep_s = time.perf_counter() - t0
        items = split.choice_items
        batches = [
            tuple(t.to(args.device) for t in collate_rows([r for i in b for r in items[i].rows], pad))
            for b in length_batches(items, args.batch_size)
        ]
        tokens = sum(len(r) for it in items for r in it.rows)
        projected = []  # per batch: (row, position) of each distinct continuation-predicting state
        for b, (ids, mask) in zip(length_batches(items, args.batch_size), batches):
            lengths = torch.tensor([len(r) for i in b for r in items[i].rows], device=args.device)
            cont = torch.tensor([c for i in b for c in items[i].cont_lens], device=args.device)
            projected.append(distinct_positions(ids, mask, *token_index(lengths, cont))[:2])

        def gauntlet():
            score_choice_items(model, items, args.batch_size, pad, task.icl_task_type)

        @torch.inference_mode()
        def raw():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False)

        @torch.inference_mode()
        def body():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

        @torch.inference_mode()
        def floor():
            for (ids, mask), (row, pos) in zip(batches, projected):
                hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
                model.lm_head(hidden[row, pos])

        gauntlet(), raw(), floor()  # warm up kernels and allocator
        g, r, b, f = best_of([gauntlet, raw, body, floor], args.repeats, args.device)
        stats = per_type.setdefault(
            task.icl_task_type,
            {"examples": 0, "tokens": 0, "gauntlet_s": 0.0, "raw_s": 0.0, "body_s": 0.0, "floor_s": 0.0},
        )
        for d in (stats, totals):
            d["examples"] += len(items)
            d["tokens"] += tokens
            d["gauntlet_s"] += g
            d["raw_s"] += r
            d["body_s"] += b
            d["floor_s"] += f
        totals["prep_s"] += prep_s
        totals["projected"] += sum(len(row) for row, _ in projected)
        totals["continuation_tokens"] += sum(c for it in items for c in it.cont_lens)
        print(
            f"{task.label} ({task.icl_task_type}, {split.num_fewshot}-shot): {len(items)} examples, {tokens} tokens; "
            f"gauntlet {tokens / g:,.0f} tok/s, raw {tokens / r:,.0f} tok/s, body {tokens / b:,.0f} tok/s, "
            f"floor {tokens / f:,.0f} tok/s, prep {prep_s:.2f}s",
            file=sys.stderr,
        )

    types = {
        k: {
            "examples_per_s": round(v["examples"] / v["gauntlet_s"], 1),
            "tokens_per_s": round(v["tokens"] / v["gauntlet_s"]),
            "raw_tokens_per_s": round(v["tokens"] / v["raw_s"]),
            "ratio": round(v["raw_s"] / v["gauntlet_s"], 3),
            "ratio_vs_floor": round(v["floor_s"] / v["gauntlet_s"], 3),
        }
        for k, v in per_type.items()
    }
    g = totals["gauntlet_s"] or float("nan")
    print(
        json.dumps(
            {
                "bench": "eval",
                "ratio": round(totals["raw_s"] / g, 3),
                "ratio_vs_body": round(totals["body_s"] / g, 3),
                "ratio_vs_floor": round(totals["floor_s"] / g, 3),
                "min_type_ratio": min((t["ratio"] for t in types.values()), default=None),
                "examples_per_s": round(totals["examples"] / g, 1),
                "tokens_per_s": round(totals["tokens"] / g),
                "raw_tokens_per_s": round(totals["tokens"] / totals["raw_s"]) if totals["raw_s"] else None,
                "examples": totals["examples"],
                "tokens": totals["tokens"],
                "continuation_tokens": totals["continuation_tokens"],
                "projected": totals["projected"],
                "prep_s": round(totals["prep_s"], 2),
                "types": types,
                "device": args.device,
                "model": f"llama {args.layers}x{args.d_model}, vocab {len(tok)}",
                "batch_size": args.batch_size,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
