"""How prepared examples become model inputs: which rows share a batch, how they are padded, and
the (row, position) of every logit that scores a continuation token.

Shared by the choice scorer (evaluation/scoring.py) and generation (evaluation/generation.py),
together with the throughput they both report.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evaluation.prompts import ChoiceItem


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


def device_of(model: Any) -> torch.device:
    """Where the model's inputs must go: the device of its parameters."""
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
