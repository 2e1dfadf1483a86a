"""Retry conditions for Prefect tasks: retry what may be transient, never what fails the same way again."""

from __future__ import annotations

import errno
from collections.abc import Callable

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def retry_unless(*permanent: type[BaseException]) -> Callable[..., bool]:
    """A `retry_condition_fn` that retries any failure except the `permanent` exception types."""

    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except OSError as exc:
            # A full disk or quota is not freed by waiting a few seconds, and a retry that writes
            # again only fills it further: fail now, naming the path.
            return exc.errno not in DISK_FULL
        except Exception:  # noqa: BLE001 - crashes, I/O and lost peers may well pass on a second try
            return True
        return False

    return condition
