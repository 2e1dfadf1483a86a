"""The metrics journal's format, and the one reader that delivers what it holds.

The trainer's Outbox (trainers/metrics_outbox.py) writes it; a relaunch and, after the last stage, the flow read
it back. Files in the save folder:
- `<run>-metrics-pending.jsonl`, the journal: {"seq": n, "run_id": r, "tokens": t | null, "metrics": [[key, value,
  timestamp_ms, step], ...], "tags": [[key, value], ...]} and {"ack": n} (rows up to seq n delivered or dropped),
  appended and fsynced; gone once nothing journaled is left;
- `<run>-metrics-logged.json`, the marker: {"mlflow_run_id": r, "tokens": t}, the last step journaled, so a
  relaunch that re-trains the steps after its checkpoint does not record them again.
With an s3:// save folder a pod's disk dies with it, so both are also kept as one object
`metrics/<run>-metrics-outbox.json` in the mirror (`RemoteCopy`: one PUT replaces it whole, so the two never
disagree).

Each row keeps the wall-clock time it was recorded at. MLflow's SQL stores key a metric by (key, timestamp, step,
value) and skip one already stored, so a chunk sent twice (delivered, then a kill before its ack) is stored once.

`deliver` is a relaunch's and the flow's delivery of a journal's leftovers: no thread and no queue, only this
format. No torch, Composer or Prefect imports.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainers.config import MlflowTarget, TrainJob
from trainers.format.atomic import CutShort, append_record, atomic_write, atomic_write_json, read_json
from trainers.format.store import S3Checkpoints

log = logging.getLogger("tessera.train")

# How long a stage's end (and a delivery of leftovers) waits for MLflow to take what is journaled.
CLOSE_WAIT_ENV = "TESSERA_METRICS_CLOSE_WAIT_S"
DEFAULT_CLOSE_WAIT_S = 120.0
# MLflow refuses larger batches (log_batch limits).
MAX_METRICS, MAX_TAGS = 1000, 100
FIRST_RETRY_S = 1.0
# The cap bounds how stale the dashboard stays once the server is back; a failing attempt against a dead server
# costs one refused connection, so retrying every 10 s costs nothing.
MAX_RETRY_S = 10.0
# Error codes that mean "never": sending the same chunk again would fail the same way.
_PERMANENT = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST"}


def close_wait_s() -> float:
    return float(os.environ.get(CLOSE_WAIT_ENV, DEFAULT_CLOSE_WAIT_S))


def journal_path(folder: str | Path, run_name: str) -> Path:
    return Path(folder) / f"{run_name}-metrics-pending.jsonl"


def marker_path(folder: str | Path, run_name: str) -> Path:
    return Path(folder) / f"{run_name}-metrics-logged.json"


def read_marker(path: Path, run_id: str) -> int:
    """Tokens up to which an earlier launch journaled or delivered the metrics of MLflow run `run_id`."""
    try:
        marker = read_json(path)
    except CutShort as why:
        # Written whole and fsynced now (atomic_write); one cut short by a power loss before that is read as
        # "nothing logged": the relaunch then logs again the few steps it re-trains after its checkpoint (a
        # second point at those steps in MLflow) rather than failing a run whose metrics are all safe.
        log.warning("%s; read as no metrics logged yet", why)
        return 0
    if marker is None:
        return 0
    return int(marker["tokens"]) if marker.get("mlflow_run_id") == run_id else 0


def marker_or_none(path: Path) -> dict | None:
    try:
        return read_json(path)
    except CutShort:  # as read_marker reads it: nothing logged
        return None


@dataclass
class Row:
    """One journal line of metrics and tags: one step's, or a run's tags."""

    run_id: str
    tokens: int | None  # the step; None for tags
    metrics: list[tuple[str, float, int, int]]  # (key, value, timestamp_ms, step)
    tags: list[tuple[str, str]]
    seq: int = 0
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.metrics) + len(self.tags)

    def to_json(self) -> str:
        return json.dumps(
            {"seq": self.seq, "run_id": self.run_id, "tokens": self.tokens, "metrics": self.metrics, "tags": self.tags}
        )

    @classmethod
    def from_record(cls, record: dict) -> Row:
        metrics = [(str(k), float(v), int(ts), int(step)) for k, v, ts, step in record["metrics"]]
        tags = [(str(k), str(v)) for k, v in record["tags"]]
        return cls(record["run_id"], record["tokens"], metrics, tags, int(record["seq"]))


def lines(rows: list[Row]) -> str:
    return "".join(row.to_json() + "\n" for row in rows)


def read_pending(journal: Path) -> tuple[list[Row], int]:
    """(rows not acked, the highest seq the journal names). A line torn by a kill mid-append is cut off the file:
    it was never fsynced, so no marker counts its steps, and the next append would glue onto it."""
    if not journal.exists():
        return [], 0
    data = journal.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(journal, "r+b") as f:
            f.truncate(len(whole))
    rows, acked, unreadable = [], 0, 0
    for line in whole.splitlines():
        try:
            record = json.loads(line)
            if "ack" in record:
                acked = max(acked, int(record["ack"]))
            else:
                rows.append(Row.from_record(record))
        except (ValueError, KeyError, TypeError):  # not ours to repair, and no reason to stop training
            unreadable += 1
    if unreadable:
        log.warning("metrics: skipped %d unreadable line(s) of %s", unreadable, journal)
    return [r for r in rows if r.seq > acked], max([acked, *(r.seq for r in rows)])


def ack(journal: Path, seq: int) -> None:
    append_record(journal, {"ack": seq})


def head_chunk(rows: list[Row]) -> list[Row]:
    """The first rows of one MLflow run, within log_batch's limits."""
    chunk: list[Row] = []
    metrics = tags = 0
    for row in rows:
        if chunk and (
            row.run_id != chunk[0].run_id or metrics + len(row.metrics) > MAX_METRICS or tags + len(row.tags) > MAX_TAGS
        ):
            break
        chunk.append(row)
        metrics += len(row.metrics)
        tags += len(row.tags)
    return chunk


def send(client, chunk: list[Row]) -> None:
    """One log_batch of a chunk, synchronous: it is in when this returns."""
    from mlflow.entities import Metric, RunTag

    client.log_batch(
        chunk[0].run_id,
        metrics=[Metric(k, v, ts, step) for row in chunk for k, v, ts, step in row.metrics],
        tags=[RunTag(k, v) for row in chunk for k, v in row.tags],
        synchronous=True,
    )


def permanent(exc: BaseException) -> bool:
    """Whether MLflow refused for good (sending the same chunk again would fail the same way)."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.error_code in _PERMANENT


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class RemoteCopy:
    """A run's journal and marker as one object in its s3 save folder (see the module docstring)."""

    def __init__(self, mirror: S3Checkpoints, run_name: str):
        self.mirror = mirror
        self.name = f"metrics/{run_name}-metrics-outbox.json"
        self.uri = f"{mirror.uri}/{self.name}"

    def read(self) -> dict | None:
        """{"marker": {...} | None, "journal": "<jsonl>"}, or None where no launch wrote one yet."""
        try:
            return json.loads(self.mirror.read_text(self.name))  # one GET: a missing object is the answer too
        except FileNotFoundError:
            return None

    def write(self, marker: dict | None, journal: str) -> None:
        self.mirror.put_text(self.name, json.dumps({"marker": marker, "journal": journal}))

    def restore(self, folder: str | Path, run_name: str) -> bool:
        """Put the copy on this disk where the disk knows less (a fresh pod's knows nothing); True if it did.

        The copy is only ever written from some disk's journal, so a disk whose marker is ahead (or as far,
        with rows of its own still pending) is the one that wrote it, or wrote more since.
        """
        copy = self.read()
        if copy is None:
            return False
        journal, marker = journal_path(folder, run_name), marker_path(folder, run_name)
        mine = marker_or_none(marker)
        local_tokens = int(mine["tokens"]) if mine else -1
        remote_tokens = int(copy["marker"]["tokens"]) if copy["marker"] else -1
        behind = remote_tokens > local_tokens or (
            remote_tokens == local_tokens and bool(copy["journal"]) and not journal.exists()
        )
        if not behind:
            return False
        # The journal before the marker, as the outbox writes them: a kill between the two leaves this
        # disk behind the copy, and the next launch restores again.
        if copy["journal"]:
            atomic_write(journal, copy["journal"])
        else:
            journal.unlink(missing_ok=True)
        if copy["marker"] is not None:
            atomic_write_json(marker, copy["marker"])
        log.info("metrics: restored the journal and marker of %s from %s", run_name, self.uri)
        return True


def remote_copy(job: TrainJob) -> RemoteCopy | None:
    """The journal's copy in the job's s3 save folder; None for a local save folder (the journal is safe there)."""
    if job.mlflow is None or not job.remote_folder:
        return None
    return RemoteCopy(S3Checkpoints(job.remote_folder), job.run_name)


def deliver(
    target: MlflowTarget, folder: str | Path, run_name: str, wait_s: float | None = None, copy: RemoteCopy | None = None
) -> int:
    """Deliver what a run's journal still holds, retrying a failing server for up to `wait_s` (default: the stage end's
    wait, close_wait_s); returns the rows left.

    With `copy` (an s3 save folder), the copy is restored into `folder` first where it knows more, and what is left
    is written back to it. The caller holds the run's folder lock (no trainer appends meanwhile).
    """
    from mlflow.tracking import MlflowClient

    if copy is not None:
        copy.restore(folder, run_name)
    journal = journal_path(folder, run_name)
    if not journal.exists():
        return 0
    rows, _ = read_pending(journal)
    if not rows:  # every row acked: the journal goes, and the copy says so too (or a fresh disk would resend them)
        journal.unlink(missing_ok=True)
        if copy is not None:
            copy.write(marker_or_none(marker_path(folder, run_name)), "")
        return 0
    log.info("metrics: %d row(s) journaled by an earlier launch go to MLflow first (%s)", len(rows), journal)
    wait_s = close_wait_s() if wait_s is None else wait_s
    client, deadline, delay = MlflowClient(target.tracking_uri), time.monotonic() + max(wait_s, 0.0), FIRST_RETRY_S
    while rows:
        chunk = head_chunk(rows)
        try:
            send(client, chunk)
        except Exception as exc:  # noqa: BLE001 - whatever MLflow raises, the rows stay journaled
            if not permanent(exc):
                if time.monotonic() + delay > deadline:
                    log.warning(
                        "metrics: %d row(s) not delivered to MLflow at %s within %.0f s (%s); they stay in %s",
                        len(rows),
                        target.tracking_uri,
                        wait_s,
                        one_line(exc),
                        journal,
                    )
                    break
                time.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_S)
                continue
            log.warning("metrics: MLflow refused %d row(s) for good, dropping them: %s", len(chunk), one_line(exc))
        rows = rows[len(chunk) :]
        ack(journal, chunk[-1].seq)
    if not rows:
        journal.unlink(missing_ok=True)
    if copy is not None:
        copy.write(marker_or_none(marker_path(folder, run_name)), lines(rows))
    return len(rows)
