"""The one error type the gauntlet raises for bad input: a one-line error (trainers.contract.OneLineError), exit 2."""

from __future__ import annotations

from trainers.contract import OneLineError


class GauntletError(OneLineError, ValueError):
    """Bad gauntlet input. `str()` is one line that names the file and line, or the task and field."""

    def __init__(self, message: str):
        # One line, so a CLI can print it verbatim and a log grep finds it whole.
        super().__init__(" ".join(message.split("\n")))
