"""Scoring generation_task_with_answers: greedy continuations, checked against the answer aliases.

The metric follows llm-foundry's InContextLearningGenerationExactMatchAccuracy
(llmfoundry/eval/metrics/nlp.py): greedy output, cut at the first stop string, then after the last
`cot_delimiter`, optionally normalized; correct when it starts with any answer alias.
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from evaluation.batching import Throughput, device_of
from evaluation.prompts import GenerationItem


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

    device = device_of(model)
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
