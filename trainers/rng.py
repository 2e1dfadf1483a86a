"""Random state across a resume inside a stage.

Composer saves every rank's RNG state (python, numpy, torch) in each checkpoint, but gives it back
only at an epoch start, or while it spins the dataloader up to the saved batch. tessera resumes the
data position through Streaming (`spin_dataloaders=False`) and a stage is one epoch, so a resume
inside a stage went on from the seed's state: dropout, or any op that draws random numbers, drew
other numbers than the uninterrupted run, and resumption stopped being exact.

The state is put back just before the first batch's forward pass (AFTER_DATALOADER), the point at
which an uninterrupted run holds exactly the state it saved: building the dataloader's iterator
draws a seed from torch's generator, and it does so again on every launch.
"""

from __future__ import annotations

from typing import Any

from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import reproducibility


class RestoreRng(Callback):
    """Gives a resumed trainer the RNG state of its checkpoint before its first forward pass."""

    def __init__(self) -> None:
        self.pending: list[dict[str, Any]] | None = None

    def take_from(self, trainer: Trainer) -> bool:
        """Take over the checkpoint's RNG state when Composer would not restore it (mid-epoch); True if taken.

        At an epoch start (a fresh run, a stage entered) Composer restores it itself, and the state is
        left to it. `_rng_state` is Composer's holder for the loaded state; it has no public accessor.
        """
        loaded = getattr(trainer, "_rng_state", None)
        if loaded is None or int(trainer.state.timestamp.batch_in_epoch) == 0:
            return False
        self.pending, trainer._rng_state = loaded, None
        return True

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self.pending is not None:
            reproducibility.load_rng_state(self.pending)
            self.pending = None
