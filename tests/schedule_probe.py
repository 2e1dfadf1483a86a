"""A flow for the scheduler test: a scheduled run of it proves that a cron schedule reaches a worker."""

from pathlib import Path

from prefect import flow


@flow(name="schedule-probe")
def schedule_probe(marker: str) -> str:
    Path(marker).mkdir(parents=True, exist_ok=True)
    (Path(marker) / "ran").touch()
    return "ran"
