"""Progress of a gauntlet run: a tqdm bar on a terminal, a plain line at most every `every_s` otherwise.

A real gauntlet on CPU scores for many minutes, much of it inside one task; nothing should sit
silent long enough for a person (or a log reader) to wonder whether it hangs.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("evaluation")


class EvalProgress:
    """Counts scored examples across the whole run; `advance` is cheap enough to call per batch."""

    def __init__(self, total: int, every_s: float = 20.0, desc: str = "gauntlet"):
        self.total, self.every_s, self.desc = total, every_s, desc
        self.done, self.task = 0, ""
        self._start = self._last = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=" ex", dynamic_ncols=True)

    def start_task(self, label: str) -> None:
        self.task = label
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=True)

    def advance(self, examples: int) -> None:
        self.done += examples
        if self._bar is not None:
            self._bar.update(examples)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            rate = self.done / max(now - self._start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            log.info(
                "%s: %d/%d examples (%.0f%%), now %s, %.1f ex/s, about %.0f s left",
                self.desc,
                self.done,
                self.total,
                100 * self.done / max(1, self.total),
                self.task,
                rate,
                left,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
