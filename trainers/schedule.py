"""The learning-rate schedule: one global curve over the whole run's tokens, across stages.

It is a pure function of the token count, applied by a callback before every step. Being
stateless is the point: a resumed job, a job entering stage 2, and an uninterrupted run all
compute the same LR for the same token, with no scheduler state that could drift or be
restored from the wrong stage.
"""

from __future__ import annotations

import math

from composer.core import Callback, State
from composer.loggers import Logger

from trainers.config import TrainConfig, stage_bounds


def _base(train: TrainConfig, done: int) -> float:
    """The global warmup + decay curve at `done` tokens, before stage scaling."""
    optim = train.optim
    horizon = optim.decay_tokens or sum(s.tokens for s in train.stages)
    if optim.warmup_tokens and done <= optim.warmup_tokens:
        return done / optim.warmup_tokens
    span = max(horizon - optim.warmup_tokens, 1)
    progress = min(max((done - optim.warmup_tokens) / span, 0.0), 1.0)
    floor = optim.min_lr_ratio
    if optim.schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if optim.schedule == "linear":
        return 1 - (1 - floor) * progress
    return 1.0


def lr_multiplier(train: TrainConfig, tokens: int, step_tokens: int) -> float:
    """Multiplier of the peak LR for the step that starts at `tokens` and trains `step_tokens` tokens."""
    optim = train.optim
    done = tokens + step_tokens  # the step is "at" its end, so the first warmup step is not a zero-LR no-op
    base = _base(train, done)
    for stage, (start, end) in zip(train.stages, stage_bounds(train)):
        if start <= tokens < end:
            if stage.anneal:
                at_start = _base(train, start)
                progress = (done - start) / (end - start)
                base = at_start + (optim.min_lr_ratio - at_start) * progress
            return base * stage.lr_scale
    return base * train.stages[-1].lr_scale


class GlobalLRSchedule(Callback):
    """Sets every param group's LR from the token count at the start of each batch."""

    def __init__(self, train: TrainConfig, tokens_per_step: int):
        self.train = train
        self.tokens_per_step = tokens_per_step
        self.lr = 0.0

    def batch_start(self, state: State, logger: Logger) -> None:
        tokens = int(state.timestamp.token.value)
        self.lr = self.train.optim.lr * lr_multiplier(self.train, tokens, self.tokens_per_step)
        for optimizer in state.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr
