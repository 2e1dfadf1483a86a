"""What reading a unit dropped and why, under the source's `on_error` policy.

Bad input goes through `Tally.bad`: under `on_error: fail` it raises a one-line `DataError`
naming the file and line (or row, or field); under `skip` it is counted by reason. Each unit keeps
its own tally (in a pool process); the parent sums them into provenance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tasks.data.errors import DataError


@dataclass
class Tally:
    """Per-unit counts of what was dropped and why; summed into provenance."""

    policy: str = "fail"
    filtered: int = 0  # by design: empty or shorter than min_chars
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    # (path, bytes) of files a separator was meant to split but that hold no separator at all
    unsplit: list = field(default_factory=list)

    def bad(self, where: str, what: str, reason: str) -> None:
        if self.policy == "fail":
            raise DataError(where, what)
        self.skipped[reason] += 1

    def add(self, other: Tally) -> None:
        self.filtered += other.filtered
        self.truncated += other.truncated
        self.skipped.update(other.skipped)
        self.unsplit.extend(other.unsplit)
