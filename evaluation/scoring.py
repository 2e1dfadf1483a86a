"""Running a causal LM over prepared examples: batched by length, one forward pass per batch.

Metric definitions follow llm-foundry's llmfoundry/eval/metrics/nlp.py:
- language_modeling (InContextLearningLMAccuracy): correct when the argmax at every
  continuation position equals the continuation token;
- multiple_choice and schema (InContextLearningMultipleChoiceAccuracy): each choice's
  perplexity is exp(mean cross-entropy over its continuation tokens); the choice with the
  lowest perplexity is picked, the first one on ties;
- generation_task_with_answers (InContextLearningGenerationExactMatchAccuracy): greedy output,
  cut at the first stop string, then after the last `cot_delimiter`, optionally normalized;
  correct when it starts with any answer alias.
"""

from __future__ import annotations

import re
import string
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from evaluation.prompts import ChoiceItem, GenerationItem


@dataclass
class Throughput:
    """What a scoring call pushed through the model, for examples/s and tokens/s."""

    examples: int = 0
    tokens: int = 0  # real (unpadded) tokens fed to the model
    seconds: float = 0.0

    def add(self, other: "Throughput") -> None:
        self.examples += other.examples
        self.tokens += other.tokens
        self.seconds += other.seconds


def pad_id_of(tokenizer: Any) -> int:
    # The reference pads with EOS when a tokenizer has no pad token (GPT-2).
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def length_batches(items: Sequence[ChoiceItem], batch_size: int) -> Iterator[list[int]]:
    """Indices of items packed into batches of at most batch_size rows, longest first.

    All choices of one example stay in one batch, so one forward pass scores them all; an
    example with more choices than batch_size gets a batch of its own (as in the reference).
    """
    order = sorted(range(len(items)), key=lambda i: -max(len(r) for r in items[i].rows))
    batch: list[int] = []
    rows = 0
    for i in order:
        n = len(items[i].rows)
        if batch and rows + n > batch_size:
            yield batch
            batch, rows = [], 0
        batch.append(i)
        rows += n
    if batch:
        yield batch


def collate_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, T] and attention mask [B, T] (padding at the end keeps causal positions)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


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


@torch.inference_mode()
def score_rows(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, cont_lens: torch.Tensor, gather: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: mean continuation cross-entropy [B] and whether greedy argmax hits every token [B].

    Row i's continuation is tokens [len_i - c_i, len_i); the logits that predict them sit one
    position earlier. Index tensors are built with torch ops: no Python loop over tokens.
    """
    B = ids.shape[0]
    n = int(cont_lens.sum())
    row, pos = _token_index(lengths, cont_lens)  # [N], [N]
    target = ids[row, pos + 1]  # [N]

    hook = _gathering_head(model, row, pos, tuple(ids.shape)) if gather else None
    try:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        if hook is not None:
            hook.remove()
    if hook is not None and tuple(logits.shape[:2]) == (1, n):
        picked = logits[0].float()  # [N, V]
    elif tuple(logits.shape[:2]) == tuple(ids.shape):
        picked = logits[row, pos].float()
    else:  # the head ran more than once or reshaped its output: score without the shortcut
        return score_rows(model, ids, mask, lengths, cont_lens, gather=False)
    ce = F.cross_entropy(picked, target, reduction="none")  # [N]
    miss = (picked.argmax(dim=-1) != target).float()
    mean_ce = torch.zeros(B, device=ids.device).index_add_(0, row, ce) / cont_lens
    all_hit = torch.zeros(B, device=ids.device).index_add_(0, row, miss) == 0
    return mean_ce, all_hit


def _token_index(lengths: torch.Tensor, cont_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, predicting position) of every continuation token, flattened: [N], [N]."""
    n = int(cont_lens.sum())
    row = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), cont_lens)
    first = torch.repeat_interleave(torch.cumsum(cont_lens, 0) - cont_lens, cont_lens)
    pos = torch.repeat_interleave(lengths - cont_lens - 1, cont_lens) + (torch.arange(n, device=lengths.device) - first)
    return row, pos


@torch.inference_mode()
def score_rows_shared(
    model: Any, items: Sequence[ChoiceItem], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like score_rows over all rows of `items`, but each item's shared prefix runs once.

    Pass 1 runs the prefixes (one row per item) and keeps the KV cache; pass 2 runs every
    choice's remaining tokens against its item's cache rows, with explicit position ids so
    padding between a short prefix and the suffix shifts nothing. A continuation token's
    logits come from pass 1 when its predicting position is the prefix's last one.
    """
    n_rows = [len(it.rows) for it in items]
    rows = [r for it in items for r in it.rows]
    P = torch.tensor([it.prefix for it in items], device=device)  # [I]
    item_of = torch.repeat_interleave(torch.arange(len(items), device=device), torch.tensor(n_rows, device=device))  # [R]
    lengths = torch.tensor([len(r) for r in rows], device=device)
    cont = torch.tensor([c for it in items for c in it.cont_lens], device=device)

    pids, pmask = collate_rows([it.rows[0][: it.prefix] for it in items], pad_id)
    pids, pmask = pids.to(device), pmask.to(device)
    hook = _gathering_head(model, torch.arange(len(items), device=device), P - 1, tuple(pids.shape))
    try:
        out = model(input_ids=pids, attention_mask=pmask, use_cache=True)
    finally:
        if hook is not None:
            hook.remove()
    last = out.logits.reshape(-1, out.logits.shape[-1])  # [I, V] logits at each prefix's last position
    if last.shape[0] != len(items):
        last = out.logits[torch.arange(len(items), device=device), P - 1]
    cache = out.past_key_values
    cache.batch_select_indices(item_of)  # one cache row per choice

    sids, smask = collate_rows([r[p:] for it, p in zip(items, P.tolist()) for r in it.rows], pad_id)
    sids, smask = sids.to(device), smask.to(device)
    Prow = P[item_of]  # [R]
    row, pos = _token_index(lengths, cont)  # absolute predicting positions
    from_prefix = pos < Prow[row]  # only the first token, when the prefix is the whole context
    s_row, s_pos = row[~from_prefix], pos[~from_prefix] - Prow[row[~from_prefix]]
    if len(s_row) == 0:  # one-token continuations: the prefix pass already predicted them all
        suffix = last[:0]
    else:
        hook = _gathering_head(model, s_row, s_pos, tuple(sids.shape))
        try:
            logits = model(
                input_ids=sids,
                attention_mask=torch.cat([pmask[item_of], smask], dim=1),
                position_ids=Prow[:, None] + torch.arange(sids.shape[1], device=device),
                past_key_values=cache,
                use_cache=True,
            ).logits
        finally:
            if hook is not None:
                hook.remove()
        suffix = logits.reshape(-1, logits.shape[-1]) if logits.shape[:2] == (1, len(s_row)) else logits[s_row, s_pos]

    picked = torch.empty((len(row), last.shape[-1]), dtype=torch.float32, device=device)
    picked[from_prefix] = last[item_of[row[from_prefix]]].float()
    picked[~from_prefix] = suffix.float()
    # target of absolute predicting position q is token q + 1 of the full row
    full, _ = collate_rows(rows, pad_id)
    target = full.to(device)[row, pos + 1]
    ce = F.cross_entropy(picked, target, reduction="none")
    miss = (picked.argmax(dim=-1) != target).float()
    R = len(rows)
    mean_ce = torch.zeros(R, device=device).index_add_(0, row, ce) / cont
    all_hit = torch.zeros(R, device=device).index_add_(0, row, miss) == 0
    return mean_ce, all_hit


# Sharing costs a second forward call and a cache gather; below this fraction of tokens saved
# (short zero-shot contexts, e.g. COPA) one pass over the full rows is faster.
MIN_SHARED_FRACTION = 0.4


def _worth_sharing(items: Sequence[ChoiceItem]) -> bool:
    if not all(it.prefix > 0 for it in items):
        return False
    saved = sum((len(it.rows) - 1) * it.prefix for it in items)
    return saved >= MIN_SHARED_FRACTION * sum(len(r) for it in items for r in it.rows)


def score_choice_items(
    model: Any, items: Sequence[ChoiceItem], batch_size: int, pad_id: int, kind: str, share_prefix: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[bool], Throughput]:
    """Correctness per item: LM accuracy for language_modeling, lowest perplexity otherwise."""
    device = _device(model)
    correct = [False] * len(items)
    stats = Throughput(examples=len(items))
    t0 = time.perf_counter()
    for batch in length_batches(items, batch_size):
        rows = [r for i in batch for r in items[i].rows]
        lengths = torch.tensor([len(r) for r in rows])
        scored = None
        if share_prefix and _worth_sharing([items[i] for i in batch]):
            try:
                scored = score_rows_shared(model, [items[i] for i in batch], pad_id, device)
            except (TypeError, ValueError, AttributeError, NotImplementedError, RuntimeError):
                share_prefix = False  # this model cannot take a cache and position ids this way
        if scored is None:
            ids, mask = collate_rows(rows, pad_id)
            cont = torch.tensor([c for i in batch for c in items[i].cont_lens])
            scored = score_rows(model, ids.to(device), mask.to(device), lengths.to(device), cont.to(device))
        perplexity = torch.exp(scored[0]).cpu()
        all_hit = scored[1].cpu()
        stats.tokens += int(lengths.sum())
        k = 0
        for i in batch:
            n = len(items[i].rows)
            if kind == "language_modeling":
                correct[i] = bool(all_hit[k])
            else:
                correct[i] = int(torch.argmin(perplexity[k : k + n])) == items[i].gold
            k += n
        if on_batch is not None:
            on_batch(len(batch))
    stats.seconds = time.perf_counter() - t0
    return correct, stats


# --- generation ---------------------------------------------------------------------------


def normalize_answer(answer: str) -> str:
    """TriviaQA normalization, as in the reference: lower, punctuation to spaces, drop articles."""
    text = answer.replace("_", " ").lower()
    exclude = set(string.punctuation + "".join(["‘", "’", "´", "`"]))
    text = "".join(" " if ch in exclude else ch for ch in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split()).strip()


def _split_on_stops(text: str, stops: Sequence[str]) -> str:
    # The reference joins stop strings into a regex unescaped; published numbers used that.
    try:
        return re.split("|".join(stops), text)[0]
    except re.error:
        return re.split("|".join(map(re.escape, stops)), text)[0]


def generation_correct(
    output: str, answers: Sequence[str], stops: Sequence[str], cot_delimiter: str, do_normalization: bool
) -> bool:
    final = _split_on_stops(output, stops) if stops else output
    if cot_delimiter:
        final = final.split(cot_delimiter)[-1]
    if do_normalization:
        final = normalize_answer(final)
        labels = {normalize_answer(a) for a in answers}
    else:
        final = final.strip()
        labels = {a.strip() for a in answers}
    return any(final.startswith(label) for label in labels)


class _StopOnStrings:
    """Marks a row done once a stop string appears in its last few decoded tokens (reference rule)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int):
        self.tok = tokenizer
        self.stops = list(stops)
        self.prompt_len = prompt_len
        # One token more than the stop string needs: '\n\n' may come out as two '\n' tokens.
        self.lookback = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops) + 1

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        window = input_ids[:, max(self.prompt_len, input_ids.shape[1] - self.lookback) :]
        texts = self.tok.batch_decode(window)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


@torch.inference_mode()
def generate_items(
    model: Any,
    tokenizer: Any,
    items: Sequence[GenerationItem],
    batch_size: int,
    pad_id: int,
    max_new_tokens: int,
    stops: Sequence[str],
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[str], Throughput]:
    """Greedy continuations, left-padded in length-sorted batches."""
    from transformers import StoppingCriteriaList

    device = _device(model)
    outputs = [""] * len(items)
    stats = Throughput(examples=len(items))
    t0 = time.perf_counter()
    order = sorted(range(len(items)), key=lambda i: -len(items[i].context))
    for s in range(0, len(order), batch_size):
        batch = order[s : s + batch_size]
        width = max(len(items[i].context) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, i in enumerate(batch):
            ctx = items[i].context
            ids[k, width - len(ctx) :] = torch.as_tensor(ctx)
            mask[k, width - len(ctx) :] = 1
        criteria = StoppingCriteriaList([_StopOnStrings(tokenizer, stops, width)]) if stops else None
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
            stopping_criteria=criteria,
        )
        new = out[:, width:]
        for k, text in enumerate(tokenizer.batch_decode(new, skip_special_tokens=True)):
            outputs[batch[k]] = text
        stats.tokens += int(mask.sum()) + int((new != pad_id).sum())
        if on_batch is not None:
            on_batch(len(batch))
    stats.seconds = time.perf_counter() - t0
    return outputs, stats
