"""Scoring continuations by their cross-entropy: language_modeling, multiple_choice and schema.

Metric definitions follow llm-foundry's llmfoundry/eval/metrics/nlp.py:
- language_modeling (InContextLearningLMAccuracy): correct when the argmax at every
  continuation position equals the continuation token;
- multiple_choice and schema (InContextLearningMultipleChoiceAccuracy): each choice's
  perplexity is exp(mean cross-entropy over its continuation tokens); the choice with the
  lowest perplexity is picked, the first one on ties.

Only the logits that predict a continuation token are computed, one forward pass per batch
(evaluation/batching.py says which rows and positions); generation_task_with_answers is
evaluation/generation.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from evaluation.batching import Throughput, collate_rows, device_of, distinct_positions, length_batches, token_index
from evaluation.prompts import ChoiceItem


def _gathering_head(model: Any, row: torch.Tensor, pos: torch.Tensor, shape: tuple[int, int]):
    """Make the output projection see only the hidden states at (row, pos).

    For a tiny model the vocabulary projection costs far more than the transformer body, and
    only continuation positions are scored. A pre-hook on `get_output_embeddings()` keeps any
    elementwise post-processing a model applies to logits (scaling, soft-capping) intact.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None

    def gather(_module: Any, args: tuple) -> tuple | None:
        hidden = args[0]  # [B, T, d]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != shape:
            return None  # an unfamiliar layout: leave the head alone, the caller sees full logits
        return (hidden[row, pos].unsqueeze(0), *args[1:])  # [1, N, d]

    return head.register_forward_pre_hook(gather)


def _forward_at(model: Any, row: torch.Tensor, pos: torch.Tensor, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """The model's output and its logits at (row, pos) only: [N, V]."""
    shape = tuple(inputs["input_ids"].shape)
    hook = _gathering_head(model, row, pos, shape)
    try:
        out = model(**inputs)
    finally:
        if hook is not None:
            hook.remove()
    logits = out.logits
    if hook is not None and tuple(logits.shape[:2]) == (1, len(row)):
        return out, logits[0]
    if tuple(logits.shape[:2]) == shape:
        return out, logits[row, pos]
    # the head ran more than once or reshaped its output
    raise ValueError(f"logits of shape {tuple(logits.shape)} for inputs of shape {shape}")


# Rows of logits reduced at a time: a block stays in cache across log_softmax, amax and the gathers.
SCORE_CHUNK = 32


def _token_scores(
    logits: torch.Tensor, inverse: torch.Tensor, target: torch.Tensor, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-entropy [N] and greedy miss [N] of tokens whose predicting logits are logits[inverse] ([U, V]).

    Per chunk: log_softmax then a gather, which is what F.cross_entropy computes, to the bit.
    """
    ce = torch.empty(len(target), device=logits.device)
    miss = torch.empty(len(target), dtype=torch.bool, device=logits.device) if greedy else None
    for s in range(0, len(logits), SCORE_CHUNK):
        x = logits[s : s + SCORE_CHUNK].float()
        k = ((inverse >= s) & (inverse < s + len(x))).nonzero()[:, 0]  # tokens scored from this chunk
        local, t = inverse[k] - s, target[k]
        ce[k] = -x.log_softmax(-1)[local, t]
        if miss is not None:
            # argmax is a scalar reduction on CPU, ten times slower than amax: only a token whose
            # logit is not below the maximum can be the argmax, so only those rows (NaN included)
            # go to argmax, which settles ties as the first maximum.
            contender = ~(x[local, t] < x.amax(-1)[local])
            row_miss = torch.ones(len(k), dtype=torch.bool, device=x.device)
            row_miss[contender] = x[local[contender]].argmax(-1) != t[contender]
            miss[k] = row_miss
    return ce, miss


def _per_row(
    ce: torch.Tensor, miss: torch.Tensor | None, row: torch.Tensor, cont_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B = len(cont_lens)
    mean_ce = torch.zeros(B, device=ce.device).index_add_(0, row, ce) / cont_lens
    if miss is None:
        return mean_ce, None
    return mean_ce, torch.zeros(B, device=ce.device).index_add_(0, row, miss.float()) == 0


@torch.inference_mode()
def score_rows(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    cont_lens: torch.Tensor,
    gather: bool = True,
    greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row: mean continuation cross-entropy [B] and whether greedy argmax hits every token [B].

    Row i's continuation is tokens [len_i - c_i, len_i); the logits that predict them sit one
    position earlier. Index tensors are built with torch ops: no Python loop over tokens.
    greedy=False skips the argmax (multiple choice needs only the cross-entropy) and returns None.
    """
    row, pos = token_index(lengths, cont_lens)  # [N], [N]
    target = ids[row, pos + 1]  # [N]
    u_row, u_pos, inverse = distinct_positions(ids, mask, row, pos)
    # The last column holds only final tokens, which predict nothing scored.
    inputs = dict(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=False)
    if gather:
        try:
            _, logits = _forward_at(model, u_row, u_pos, **inputs)
        except ValueError:
            return score_rows(model, ids, mask, lengths, cont_lens, gather=False, greedy=greedy)
    else:
        logits = model(**inputs).logits[u_row, u_pos]
    return _per_row(*_token_scores(logits, inverse, target, greedy), row, cont_lens)


@torch.inference_mode()
def score_rows_shared(
    model: Any, items: Sequence[ChoiceItem], pad_id: int, device: torch.device, greedy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like score_rows over all rows of `items`, but each item's shared prefix runs once.

    Pass 1 runs the prefixes (one row per item) and keeps the KV cache; pass 2 runs every
    choice's remaining tokens against its item's cache rows, with explicit position ids so
    padding between a short prefix and the suffix shifts nothing. A continuation token's
    logits come from pass 1 when its predicting position is the prefix's last one.
    """
    n_rows = [len(it.rows) for it in items]
    rows = [r for it in items for r in it.rows]
    P = torch.tensor([it.prefix for it in items], device=device)  # [I]
    item_of = torch.repeat_interleave(
        torch.arange(len(items), device=device), torch.tensor(n_rows, device=device)
    )  # [R]
    lengths = torch.tensor([len(r) for r in rows], device=device)
    cont = torch.tensor([c for it in items for c in it.cont_lens], device=device)
    full, fmask = (t.to(device) for t in collate_rows(rows, pad_id))
    row, pos = token_index(lengths, cont)  # absolute predicting positions
    target = full[row, pos + 1]  # target of absolute predicting position q is token q + 1 of the full row
    u_row, u_pos, inverse = distinct_positions(full, fmask, row, pos)
    Prow = P[item_of]  # [R]
    in_prefix = u_pos < Prow[u_row]  # only the prefix's last position, when the prefix is the whole context
    p_item = item_of[u_row[in_prefix]]  # one per item at most: its rows share that position's tokens

    pids, pmask = (t.to(device) for t in collate_rows([it.rows[0][: it.prefix] for it in items], pad_id))
    out, first = _forward_at(model, p_item, P[p_item] - 1, input_ids=pids, attention_mask=pmask, use_cache=True)
    blocks = [(first, in_prefix)]
    s_row = u_row[~in_prefix]
    if len(s_row):  # else one-token continuations: the prefix pass already predicted them all
        cache = out.past_key_values
        cache.batch_select_indices(item_of)  # one cache row per choice
        sids, smask = (
            t.to(device) for t in collate_rows([r[p:] for it, p in zip(items, P.tolist()) for r in it.rows], pad_id)
        )
        # The last suffix column holds only final tokens, which predict nothing scored.
        sids, smask = sids[:, :-1], smask[:, :-1]
        _, second = _forward_at(
            model,
            s_row,
            u_pos[~in_prefix] - Prow[s_row],
            input_ids=sids,
            attention_mask=torch.cat([pmask[item_of], smask], dim=1),
            position_ids=Prow[:, None] + torch.arange(sids.shape[1], device=device),
            past_key_values=cache,
            use_cache=True,
        )
        blocks.append((second, ~in_prefix))

    ce = torch.empty(len(row), device=device)
    miss = torch.empty(len(row), dtype=torch.bool, device=device) if greedy else None
    for logits, part in blocks:
        k = part[inverse].nonzero()[:, 0]  # tokens predicted from this pass
        local = torch.cumsum(part, 0) - 1  # distinct position -> row of this pass's logits
        ce_k, miss_k = _token_scores(logits, local[inverse[k]], target[k], greedy)
        ce[k] = ce_k
        if miss is not None:
            miss[k] = miss_k
    return _per_row(ce, miss, row, cont)


# Sharing costs a second forward call and a cache gather; below this fraction of tokens saved
# (short zero-shot contexts, e.g. COPA) one pass over the full rows is faster.
MIN_SHARED_FRACTION = 0.4


def _worth_sharing(items: Sequence[ChoiceItem]) -> bool:
    if not all(it.prefix > 0 for it in items):
        return False
    saved = sum((len(it.rows) - 1) * it.prefix for it in items)
    return saved >= MIN_SHARED_FRACTION * sum(len(r) for it in items for r in it.rows)


def _item_correct(group: Sequence[ChoiceItem], mean_ce: torch.Tensor, all_hit: torch.Tensor | None) -> list[bool]:
    """LM accuracy from each item's first row when all_hit is given, else the lowest-perplexity choice."""
    n = torch.tensor([len(it.rows) for it in group])
    start = torch.cumsum(n, 0) - n
    if all_hit is not None:
        return all_hit.cpu()[start].tolist()
    # One argmin over a [items, choices] table; +inf padding sits after the real choices, so the
    # first lowest perplexity wins ties exactly as a per-item torch.argmin would.
    item = torch.repeat_interleave(torch.arange(len(group)), n)
    table = torch.full((len(group), int(n.max())), float("inf"))
    table[item, torch.arange(len(item)) - start[item]] = torch.exp(mean_ce).cpu()
    picked = table.argmin(1).tolist()
    return [p == it.gold for p, it in zip(picked, group)]


def score_choice_items(
    model: Any,
    items: Sequence[ChoiceItem],
    batch_size: int,
    pad_id: int,
    kind: str,
    share_prefix: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[bool], Throughput]:
    """Correctness per item: LM accuracy for language_modeling, lowest perplexity otherwise."""
    device = device_of(model)
    greedy = kind == "language_modeling"
    correct = [False] * len(items)
    stats = Throughput(examples=len(items))
    t0 = time.perf_counter()
    for batch in length_batches(items, batch_size):
        group = [items[i] for i in batch]
        rows = [r for it in group for r in it.rows]
        scored = None
        if share_prefix and _worth_sharing(group):
            try:
                scored = score_rows_shared(model, group, pad_id, device, greedy)
            except (TypeError, ValueError, AttributeError, NotImplementedError, RuntimeError):
                share_prefix = False  # this model cannot take a cache and position ids this way
        if scored is None:
            ids, mask = collate_rows(rows, pad_id)
            lengths = torch.tensor([len(r) for r in rows])
            cont = torch.tensor([c for it in group for c in it.cont_lens])
            scored = score_rows(
                model, ids.to(device), mask.to(device), lengths.to(device), cont.to(device), greedy=greedy
            )
        stats.tokens += sum(len(r) for r in rows)
        for i, ok in zip(batch, _item_correct(group, *scored)):
            correct[i] = ok
        if on_batch is not None:
            on_batch(len(batch))
    stats.seconds = time.perf_counter() - t0
    return correct, stats
