"""Metrics to MLflow off the training step's critical path: a queue, a write-ahead journal, a shipper thread.

Why: a tracking-server blip (a restart, a network partition, a sqlite store busy under load)
must never cost a training restart, nor hold a step for more than a few milliseconds, nor lose
or double a metric.

How:
- The training thread `put`s rows (one step's metrics, or run tags) into an in-memory queue.
- Queued rows are appended to the journal `<save_folder>/<run>-metrics-pending.jsonl` (fsynced)
  before any attempt to send them, and whenever the trainer asks (`persist`, at every checkpoint
  boundary). The marker `<run>-metrics-logged.json` then records the last step journaled: a
  relaunch re-trains the steps after its checkpoint and must not record those again, while what
  the journal still holds is delivered first, in order, by the relaunch's outbox.
- A daemon thread sends the journaled rows in order with `MlflowClient.log_batch` and appends an
  ack once a chunk is in; when nothing journaled is left the journal is removed. While the server
  fails it retries with a capped backoff, logging one warning when delivery starts failing and one
  when it recovers. MLflow's own HTTP retries and timeouts (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
  MLFLOW_HTTP_REQUEST_TIMEOUT) only ever stall this thread.
- Each row keeps the wall-clock time it was recorded at. MLflow's SQL stores key a metric by
  (key, timestamp, step, value) and skip one already stored, so a chunk sent twice (delivered, then
  a kill before its ack; or a request that timed out on our side after the server committed it)
  is stored once.
- A chunk the server refuses for good (a deleted run, an invalid value) is dropped with a warning,
  so one bad row never holds back the rows after it.

The journal's lines, the marker and the remote copy are trainers/metrics_journal.py's format.
Rows are delivered to the current job's tracking URI, under the run id they were recorded for.

With an s3:// save folder the local folder is a pod's scratch disk, gone with the pod, so the outbox
also keeps a `RemoteCopy`: one object `<save>/<run>/metrics/<run>-metrics-outbox.json` holding the
marker and the journal's undelivered rows together (one PUT replaces an object whole, so the two
never disagree). It is written
- at every checkpoint boundary (`persist`), after the local fsync and before the checkpoint is saved,
  so a relaunch that resumes from that checkpoint on a fresh disk finds every row up to it;
- by the shipper before it sends a row of a step the copy's marker does not yet cover, so a relaunch
  on a fresh disk never re-records a step that may have reached MLflow;
- when the outbox closes, so a finished stage leaves the copy as empty as its journal.
A relaunch restores the copy onto its disk (`RemoteCopy.restore`) before anything reads the marker;
rows delivered since the last write are sent again from it, and stored once (timestamps, above).

No torch or Composer imports. A journal's leftovers, which no outbox of this launch will send (a finished
stage's, delivered by the flow), go through metrics_journal.deliver, the format's own reader.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from trainers.config import MlflowTarget
from trainers.exit_codes import RetryableError
from trainers.format.atomic import atomic_write_json
from trainers.metrics_journal import (
    FIRST_RETRY_S,
    MAX_RETRY_S,
    RemoteCopy,
    Row,
    ack,
    head_chunk,
    journal_path,
    lines,
    marker_or_none,
    marker_path,
    one_line,
    permanent,
    read_pending,
    send,
)

log = logging.getLogger("tessera.train")
THREAD_NAME = "tessera-mlflow-outbox"


class _QuietShipper(logging.Filter):
    """urllib3 warns on every retry of every request; for the shipper, one line per outage says it (below)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


logging.getLogger("urllib3.connectionpool").addFilter(_QuietShipper())


class Outbox:
    """Rows for one MLflow run, delivered in order by a background thread; see the module docstring.

    `logged_until` is where the marker stands for this launch (0 when the caller re-logs on
    purpose, after a rollback); it only moves forward from there. With `copy`, the journal and the
    marker are also kept in the s3 save folder.
    """

    def __init__(
        self,
        target: MlflowTarget,
        folder: str | Path,
        run_name: str,
        logged_until: int = 0,
        copy: RemoteCopy | None = None,
    ):
        self.target = target
        self.journal = journal_path(folder, run_name)
        self.marker = marker_path(folder, run_name)
        self.copy = copy
        # The marker moved since the copy was written; unknown until this launch first writes it.
        self._marker_uncopied = copy is not None
        self._copy_stale = copy is not None  # the journal changed since the copy was written
        self._copy_failing = False
        self._cond = threading.Condition()  # guards the queue; never held across I/O
        self._io = threading.Lock()  # serialises journal and marker writes (training thread vs shipper)
        self._queue: deque[Row] = deque()
        self._journaled = 0  # the queue's first rows that are in the journal (journaled in order)
        self._seq = 0
        self._accounted = logged_until
        self._wake = False
        self._stopping = False
        self._failing_since: float | None = None
        self._client = None
        self._load_journal()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread: memory and local disk (and, at a
    # checkpoint, one PUT of the remote copy)

    def put(
        self, tokens: int | None, metrics: Mapping[str, float] | None = None, tags: Mapping[str, str] | None = None
    ) -> None:
        """Queue one step's metrics (step = tokens) and/or run tags, stamped now; non-finite values are left out."""
        now = int(time.time() * 1000)
        step = tokens or 0
        values = [(k, float(v), now, step) for k, v in (metrics or {}).items() if math.isfinite(v)]
        row = Row(self.target.run_id, tokens, values, list((tags or {}).items()))
        if not row.size:
            return
        with self._cond:
            self._seq += 1
            row.seq = self._seq
            self._queue.append(row)

    def flush(self) -> None:
        """Ask the shipper to deliver what is queued now; returns at once."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def persist(self) -> None:
        """Journal every queued row (fsynced) and move the marker: after this a kill loses none of them.

        With a remote copy, also one PUT of it (the caller is about to checkpoint, and a relaunch on a fresh
        disk resumes from that checkpoint); a failed PUT raises RetryableError, since the checkpoint must not
        become the resume point of a relaunch that cannot find the rows before it.
        """
        with self._io:
            self._journal_queued()
            if self._copy_stale:
                try:
                    self._write_copy()
                except Exception as exc:  # boto3's and the store's errors alike
                    raise RetryableError(f"metrics: cannot write {self.copy.uri}: {one_line(exc)}") from exc

    def close(self, wait_s: float) -> int:
        """Persist, wait up to wait_s for delivery, stop the shipper; returns the rows left in the journal."""
        try:
            self.persist()
        except RetryableError as exc:  # every checkpoint's rows are in the copy already; the rest is re-trained
            log.warning("%s", exc)
        deadline = time.monotonic() + max(wait_s, 0.0)
        with self._cond:
            self._wake = True
            self._cond.notify_all()
            while self._queue and time.monotonic() < deadline:
                self._cond.wait(timeout=deadline - time.monotonic())
            left = len(self._queue)
            self._stopping = True
            self._cond.notify_all()
        self._final_copy()
        if left:
            # One line, and no join: the thread may sit in an HTTP call for MLFLOW_HTTP_REQUEST_TIMEOUT.
            log.warning(
                "metrics: %d row(s) not delivered to MLflow at %s within %.0f s; they stay in %s for the next launch",
                left,
                self.target.tracking_uri,
                wait_s,
                self.journal,
            )
        else:
            self._thread.join(timeout=5)
        return left

    def _final_copy(self) -> None:
        """The remote copy as the journal ends this launch: emptied once everything is in."""
        with self._io:
            if not self._copy_stale:
                return
            try:
                self._write_copy()
            except Exception as exc:  # noqa: BLE001 - it held every row at the last write; they are sent again
                log.warning("metrics: cannot write %s at the close: %s", self.copy.uri, one_line(exc))

    # ------------------------------------------------------------ journal and marker (callers hold self._io)

    def _write_copy(self) -> None:
        """One PUT of the marker and the journaled rows not yet delivered (what a relaunch needs of the journal)."""
        with self._cond:
            rows = list(itertools.islice(self._queue, self._journaled))
        self.copy.write(marker_or_none(self.marker), lines(rows))
        self._copy_stale = self._marker_uncopied = False

    def _journal_queued(self) -> None:
        with self._cond:
            rows = list(itertools.islice(self._queue, self._journaled, None))
        if not rows:
            return
        with open(self.journal, "a") as f:
            f.write(lines(rows))
            f.flush()
            os.fsync(f.fileno())
        with self._cond:
            self._journaled += len(rows)
        self._copy_stale = self.copy is not None
        steps = [r.tokens for r in rows if r.tokens is not None and r.run_id == self.target.run_id]
        if steps and max(steps) > self._accounted:
            self._accounted = max(steps)
            atomic_write_json(self.marker, {"mlflow_run_id": self.target.run_id, "tokens": self._accounted})
            self._marker_uncopied = self.copy is not None

    def _retire(self, chunk: list[Row]) -> None:
        """The chunk is delivered (or dropped): out of the queue, acked in the journal."""
        with self._io:
            with self._cond:
                for _ in chunk:
                    self._queue.popleft()
                self._journaled -= len(chunk)
                journaled_left = self._journaled
                self._cond.notify_all()
            self._copy_stale = self.copy is not None
            if not journaled_left:  # everything the journal holds is in: it has nothing left to say
                self.journal.unlink(missing_ok=True)
                return
            ack(self.journal, chunk[-1].seq)

    def _load_journal(self) -> None:
        """Queue what an earlier launch journaled but could not deliver, ahead of anything new."""
        pending, self._seq = read_pending(self.journal)
        if not pending:
            self.journal.unlink(missing_ok=True)
            return
        self._queue.extend(pending)
        self._journaled = len(pending)
        self._wake = True
        log.info(
            "metrics: %d row(s) journaled by an earlier launch go to MLflow first (%s)", len(pending), self.journal
        )

    # ------------------------------------------------------------ shipper thread

    def _run(self) -> None:
        delay = 0.0
        while True:
            with self._cond:
                if delay:  # failing: retry on the backoff schedule, whether or not more rows came
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                else:
                    self._cond.wait_for(lambda: self._stopping or (self._wake and bool(self._queue)))
                if self._stopping:
                    return
                self._wake = False
            delay = 0.0 if self._ship() else min(max(2 * delay, FIRST_RETRY_S), MAX_RETRY_S)

    def _ship(self) -> bool:
        """Deliver everything queued; False when the server failed (the rest waits for the next try)."""
        while not self._stopping:
            with self._io:
                self._journal_queued()  # write-ahead: nothing is sent that a kill could then lose track of
                if not self._copy_ahead():
                    return False
            chunk = self._head_chunk()
            if not chunk:
                return True
            try:
                self._send(chunk)
            except Exception as exc:  # noqa: BLE001 - whatever MLflow raises, training must not see it
                if not permanent(exc):
                    self._failed(exc)
                    return False
                log.warning(
                    "metrics: MLflow at %s refused %d row(s) for good, dropping them: %s",
                    self.target.tracking_uri,
                    len(chunk),
                    one_line(exc),
                )
            else:
                self._recovered()
            self._retire(chunk)
        return True

    def _copy_ahead(self) -> bool:
        """Write-ahead to the remote copy too: its marker covers every step about to be sent (caller holds _io)."""
        if not self._marker_uncopied:
            return True
        try:
            self._write_copy()
        except Exception as exc:  # noqa: BLE001 - the rows wait in the journal; the next try writes it again
            if not self._copy_failing:
                self._copy_failing = True
                log.warning(
                    "metrics: cannot write %s (%s); rows wait for it before they go to MLflow",
                    self.copy.uri,
                    one_line(exc),
                )
            return False
        if self._copy_failing:
            self._copy_failing = False
            log.warning("metrics: %s is written again", self.copy.uri)
        return True

    def _head_chunk(self) -> list[Row]:
        """The first journaled rows of one MLflow run, within log_batch's limits."""
        with self._cond:
            return head_chunk(list(itertools.islice(self._queue, self._journaled)))

    def _send(self, chunk: list[Row]) -> None:
        from mlflow.tracking import MlflowClient

        if self._client is None:
            self._client = MlflowClient(self.target.tracking_uri)
        send(self._client, chunk)

    def _failed(self, exc: BaseException) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "metrics: MLflow at %s is not accepting metrics (%s); training goes on, metrics are kept "
                "in %s and retried every %.0f s at most",
                self.target.tracking_uri,
                one_line(exc),
                self.journal,
                MAX_RETRY_S,
            )

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.warning(
                "metrics: MLflow at %s accepts metrics again after %.0f s; delivering the rows held back",
                self.target.tracking_uri,
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
