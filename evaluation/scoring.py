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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evaluation.prompts import ChoiceItem, GenerationItem


@dataclass
class Throughput:
    """What a scoring call pushed through the model, for examples/s and tokens/s."""

    examples: int = 0
    tokens: int = 0  # real (unpadded) tokens fed to the model
    seconds: float = 0.0

    def add(self, other: Throughput) -> None:
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
    # One tensor built from padded lists: a slice assignment per row costs more than the rows.
    ids = torch.tensor([[*r, *[pad_id] * (width - len(r))] for r in rows], dtype=torch.long).reshape(len(rows), width)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long).reshape(
        len(rows), width
    )
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


def token_index(lengths: torch.Tensor, cont_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, predicting position) of every continuation token, flattened: [N], [N]."""
    n = int(cont_lens.sum())
    row = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), cont_lens)
    first = torch.repeat_interleave(torch.cumsum(cont_lens, 0) - cont_lens, cont_lens)
    pos = torch.repeat_interleave(lengths - cont_lens - 1, cont_lens) + (torch.arange(n, device=lengths.device) - first)
    return row, pos


def distinct_positions(
    ids: torch.Tensor, mask: torch.Tensor, row: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predicting positions with distinct hidden states: row [U], position [U], and token -> index [N].

    A causal model's hidden state at position q depends only on tokens 0..q, so the choices of one
    example predict their first continuation token (and any leading tokens they share) from the
    same state. Each such state is projected to the vocabulary once: on ARC and COPA that saves a
    fifth of the projections, which outweigh the transformer body on a small model.
    """
    B, T = ids.shape
    # [B, B, T] booleans: half a megabyte at 16 rows of 2048 tokens
    differ = (ids[:, None] != ids[None]) | (mask[:, None] != mask[None])  # [B, B, T]
    common = torch.where(differ.any(-1), differ.to(torch.uint8).argmax(-1), T)  # [B, B] common prefix length
    # representative: the first row that shares the token's row up to and including its position
    rep = (common[:, row] > pos).to(torch.uint8).argmax(0)  # [N]
    keys, inverse = torch.unique(rep * T + pos, return_inverse=True)
    return keys // T, keys % T, inverse


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
    device = _device(model)
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
