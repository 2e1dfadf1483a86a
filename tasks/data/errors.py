"""The one error type the prepare stage raises for bad input."""

from __future__ import annotations

from trainers.contract import OneLineError


class DataError(OneLineError, ValueError):
    """Bad input data or configuration; str() is one line naming the file and line or field.

    The CLI prints `str(exc)` and exits 2, so the message must stand on its own.
    """

    def __init__(self, where: str, what: str):
        self.where = where
        self.what = " ".join(str(what).split())
        super().__init__(f"{where}: {self.what}")

    def __reduce__(self):
        # Raised inside worker processes; the default pickling would call __init__ with one arg.
        return (DataError, (self.where, self.what))
