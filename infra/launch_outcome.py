"""How a launch ended, the one typed answer a launched job gives the stage task, on any backend.

The launcher (infra/launcher.py) writes a `tessera.launcher.record {json}` line for each restart in place and one of
kind "end" last; `read_records` reads them back from a launch's log (locally the job log, on Kubernetes pod 0's).
The backends add what only they know (pending time in a cluster's queue, the group restarts a JobSet made, the
node to avoid) when they build the `LaunchOutcome`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from infra.watchdog import Hang

RECORD_PREFIX = "tessera.launcher.record "


@dataclass(frozen=True)
class Restart:
    """One restart of a node's ranks in place: why (a rank `crashed`, was `hung`, or a `peer` node's ranks
    failed), which rank and exit code, and when."""

    attempt: int
    cause: str
    rank: int | None
    code: int | None
    at: float
    hung: dict | None = None

    def line(self) -> str:
        if self.cause == "hung" and self.hung:
            what = f"the watchdog found {Hang(**self.hung).line()}"
        elif self.cause == "peer":
            what = "another node's ranks failed"
        else:
            what = f"rank {self.rank} exited with code {self.code}"
        return f"restart {self.attempt} in place: {what}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LaunchOutcome:
    """What the stage task reads of an ended launch."""

    code: int  # the first failing rank's exit code (-N: killed by signal N), 0 when every rank succeeded
    hung: Hang | None = None  # what the watchdog saw before it killed the ranks, when that ended the launch
    restarts: list[Restart] = field(default_factory=list)  # in place, in the launcher
    preemptions: int = 0  # evictions the job restarted through by itself (a JobSet's)
    group_restarts: int = 0  # the cluster recreated the whole group after failures (a JobSet's)
    group_restarts_spent: bool = False
    pending_s: float = 0.0  # in the cluster's queue
    avoid_node: str | None = None


def read_records(text: str) -> tuple[list[Restart], dict | None]:
    """The restarts and the end record a launcher wrote in `text` (a log, or the part of it one launch wrote)."""
    restarts: list[Restart] = []
    end = None
    for line in text.splitlines():
        at = line.find(RECORD_PREFIX)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(RECORD_PREFIX) :])
        except ValueError:
            continue
        kind = record.pop("kind", None)
        if kind == "restart":
            restarts.append(Restart(**{k: record.get(k) for k in Restart.__dataclass_fields__}))
        elif kind == "end":
            end = record
    return restarts, end


def hang_of(end: dict | None) -> Hang | None:
    return Hang(**end["hung"]) if end and end.get("hung") else None
