"""What Composer's launcher says about its ranks, read back from its output.

When one rank fails, the launcher terminates the others and then exits with the lowest failing
rank's code: rank 0's answer to that SIGTERM (76, retryable) would hide rank 1's fatal 78. The
launcher logs the rank it saw crash first, and that is the code that says what happened. Used by
the local backend on its log file and by the pod entrypoint (infra/pod_launch.py) on its stream.
"""

from __future__ import annotations

import re

_CRASH = re.compile(r"Rank \d+ crashed with exit code (-?\d+)")


def first_crash(text: str) -> int | None:
    """The exit code of the first rank the launcher reported crashed in `text`, or None."""
    match = _CRASH.search(text)
    return int(match[1]) if match else None
