"""A run's checkpoints in object storage (`train.save_folder: s3://...`), for pods whose disk dies with them.

The trainer always works in a local folder with layout.py's names, plan.py's repair rules and
Composer autoresume. With a remote save folder, rank 0 also keeps `<uri>/<run_name>/` in step with it:

- after a checkpoint is published locally, its .pt is uploaded by a background thread (training
  does not wait), and only once every object of it is up is its manifest uploaded. The remote
  manifest is the remote done-marker: a remote .pt without one is never trusted, exactly as locally.
  A failed upload is retried in the background with backoff while training goes on; only the stage's
  end, which waits for the uploads, gives up on one (a one-line error that names it and the S3 error).
  Keep-last-K rotates the remote the same way (manifest first, then the .pt), never touching a checkpoint
  that is pinned (`pins/<name>`: the flow's evaluation pod is reading it) or whose upload is under way;
- before a launch plans its start point, the run files (trained-stages record, rollback records) are
  pulled, local complete checkpoints the remote lacks are uploaded (a kill between the local
  publish and the upload), and the checkpoint this launch starts from is downloaded when the
  local folder lacks it (a new node, a wiped work_dir). Autoresume then proceeds locally.

What the mirror is (object names, listing, pins, retire, publish) is the checkpoint format's s3 face,
`trainers/format/store.py:S3Checkpoints`, which the flow reads too; this module adds what only the trainer
does: background uploads with their retries, keep-last-K, reconcile before a launch and the download.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from trainers import heartbeat
from trainers.config import Stage, TrainJob
from trainers.exit_codes import FatalError, InfrastructureError, RetryableError
from trainers.format import checkpoints, s3
from trainers.format.atomic import CutShort, atomic_write_json, read_json
from trainers.format.checkpoints import CheckpointInfo, is_intact
from trainers.format.s3 import StoreError
from trainers.format.store import S3Checkpoints, objects_of
from trainers.layout import RunFolder, discard

log = logging.getLogger("tessera.remote")

STAGING_DIR = ".uploading"  # hard links of checkpoints being uploaded; what a kill leaves there is dropped
# A failed upload's backoff: doubling from a second (a blip) up to a minute (an outage: one try a minute is cheap).
FIRST_RETRY_S, LAST_RETRY_S = 1.0, 60.0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _exit_error(exc: StoreError) -> Exception:
    """The trainer's exit code for a store that failed: fatal when waiting cannot help, else a relaunch."""
    kind = FatalError if exc.lasting else RetryableError
    return kind(f"train.save_folder: {exc}")


class _Stopped(Exception):
    """close() (or a stage that gave up waiting) ended the retries of an upload."""


@dataclass(eq=False)
class _Upload:
    """One checkpoint on its way to the mirror: what is left to upload, and how its attempts went."""

    info: CheckpointInfo
    publish: bool  # whether this process puts its manifest up (rank 0), or only its node's shards
    keep: int | None
    left: list[tuple[str, Path]]  # (object name, staged hard link) not up yet; a retry resumes here
    attempts: int = 0  # failed attempts so far
    error: str | None = None  # the last attempt's failure, while the next one waits its turn
    waiting_for_shards: bool = False  # every local object is up; the other nodes' are not all there yet
    up: bool = False  # every object, and the manifest when this process publishes it
    future: Future | None = None

    @property
    def name(self) -> str:
        return Path(self.info.path).name


class RemoteFolder(S3Checkpoints):
    """The trainer's side of the s3 mirror (trainers/format/store.py's S3Checkpoints, which the flow reads): rank 0
    keeps it in step with the local folder, uploading in the background. Its store errors are exit codes."""

    def __init__(self, uri: str):
        try:
            super().__init__(uri)
        except StoreError as exc:
            raise FatalError(f"train.save_folder: {uri} is not an s3://bucket/prefix URI") from exc
        self._uploader = None
        self._stop = threading.Event()
        self._pending: list[_Upload] = []  # in save order; the one worker thread takes them in that order

    @classmethod
    def for_job(cls, job: TrainJob) -> RemoteFolder | None:
        return cls(job.remote_folder) if job.remote_folder else None

    def listing(self, sub: str = "") -> dict[str, str]:
        try:
            return super().listing(sub)
        except StoreError as exc:
            raise _exit_error(exc) from exc.__cause__

    # ------------------------------------------------------------ run files

    def pull_json_list(self, local: Path) -> None:
        """Take the remote copy of an append-only JSON list (trained stages, rollbacks) when it knows more."""
        if local.name not in self.names(local.name):
            return
        try:
            remote = json.loads(self.read_text(local.name))
        except ValueError:  # never expected (uploads are of whole files); the local copy decides then
            log.warning("%s/%s does not parse: the local copy is used", self.uri, local.name)
            return
        try:
            mine = read_json(local, missing=[])
        except CutShort:  # a power loss cut the local copy short: the mirror's, uploaded whole, knows more
            mine = []
        if len(remote) > len(mine):
            atomic_write_json(local, remote, indent=1)

    def push_file(self, local: Path, best_effort: bool = False) -> None:
        """Upload a run file whole. `best_effort` (the time records, pushed whole again with its next record): a
        failure is a line in the log, never the launch's end. The trained-stages record and the rollback records must
        reach the mirror before the launch goes on, so theirs raise."""
        try:
            self.put_file(local.name, local)
        except Exception as exc:
            if not best_effort:
                raise
            log.warning("cannot push %s to %s (its next push carries it): %s", local.name, self.uri, _one_line(exc))

    # ------------------------------------------------------------ checkpoints

    def download(self, info: CheckpointInfo, folder: Path) -> CheckpointInfo:
        """Fetch a remote checkpoint into the local folder and publish it there."""
        name = Path(info.path).name
        target = folder / name
        log.info("downloading %s (%d tokens) from %s", name, info.tokens, self.uri)
        if info.sharded:
            return self._download_folder(info, target, folder)
        size = 0
        with contextlib.suppress(Exception):  # the size only sizes the watchdog's budget
            size = self.size(name)
        heartbeat.phase("download", hint_bytes=size)
        self.get_file(name, target)  # a temp file renamed in: a kill mid-download leaves no .pt behind
        heartbeat.phase("plan")
        if not is_intact(target):
            discard(target)
            raise RetryableError(f"train.save_folder: {self.uri}/{name} downloaded incomplete")
        # The manifest keeps the SHA-256 taken where it was saved: the plan verifies the copy against it.
        return checkpoints.publish(folder, info.model_copy(update={"path": str(target.resolve())}))

    def _download_folder(self, info: CheckpointInfo, target: Path, folder: Path) -> CheckpointInfo:
        """A sharded checkpoint's files this node lacks (all of them on a fresh node; the other nodes' shards
        on one whose disk has its own), each downloaded whole (temp file, rename); the manifest's hashes
        stay those taken where it was saved, and the plan verifies the copy against them."""
        local = info.model_copy(update={"path": str(target.resolve())})
        absent = checkpoints.missing(local)
        heartbeat.phase("download", hint_bytes=sum(f.size for f in info.files if f.name in absent))
        target.mkdir(parents=True, exist_ok=True)
        try:
            for name in absent:
                self.get_file(f"{target.name}/{name}", target / name)
        except Exception as exc:
            raise RetryableError(f"train.save_folder: {self.uri}/{target.name}: cannot download: {exc}") from exc
        heartbeat.phase("plan")
        if checkpoints.missing(local):
            raise RetryableError(f"train.save_folder: {self.uri}/{target.name} downloaded incomplete")
        return checkpoints.publish(folder, local)

    def upload_async(
        self,
        info: CheckpointInfo,
        written_by: set[int] | None = None,
        publish: bool = True,
        keep: int | None = None,
    ) -> None:
        """Start uploading a just-published checkpoint; its manifest goes up once every object of it is up, and
        then the mirror keeps its last `keep`.

        Sharded, on several nodes: each node's first rank uploads the files its node's ranks wrote
        (`written_by`: their global ranks), and global rank 0 (`publish`) puts the manifest up once every
        file of the folder is in the mirror, its own and the other nodes'.

        A failed attempt (boto3 has already retried it) is logged and tried again, from the object it failed on,
        after a backoff that doubles from FIRST_RETRY_S up to LAST_RETRY_S; training never waits for it. Only
        poll(block=True) at the stage's end gives up on it.

        A thread, not Composer's RemoteUploader: its spawned worker processes outlive a SIGKILLed
        trainer (holding its pipes and the staged copy), and each costs a Composer import at start.
        boto3 releases the GIL while it moves bytes, so the thread costs training little. The file is
        hard-linked into `.uploading/` first, so keep-last-K may delete the published name meanwhile.
        """
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-upload")
        staged = []
        for name, source in objects_of(info, written_by):
            link = Path(info.path).parent / STAGING_DIR / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            os.link(source, link)
            staged.append((name, link))
        upload = _Upload(info, publish, keep, staged)
        upload.future = self._uploader.submit(self._mirror, upload)
        self._pending.append(upload)

    def _mirror(self, upload: _Upload) -> None:
        """The worker thread: one checkpoint up, its attempts retried with backoff until it is, or until stopped."""
        delay = FIRST_RETRY_S
        while True:
            try:
                self._mirror_once(upload)
                upload.up = True
                break
            except _Stopped:
                return
            except Exception as exc:  # noqa: BLE001 - any failure of an attempt is retried; the stage's end decides
                upload.attempts += 1
                upload.error = _one_line(exc)
                log.warning(
                    "upload of %s (%d tokens) to %s failed (attempt %d), retrying in %.0f s: %s",
                    upload.name,
                    upload.info.tokens,
                    self.uri,
                    upload.attempts,
                    delay,
                    upload.error,
                )
                if self._stop.wait(delay):
                    return
                delay = min(2 * delay, LAST_RETRY_S)
        if upload.attempts:
            log.info("%s is up after %d failed attempt(s)", upload.name, upload.attempts)
        if upload.publish:
            try:
                self.keep_last(upload.keep)
            except Exception as exc:  # noqa: BLE001 - the next checkpoint's rotation catches up
                log.warning(
                    "keep-last-K in %s failed (the next checkpoint's tries again): %s", self.uri, _one_line(exc)
                )

    def _mirror_once(self, upload: _Upload) -> None:
        upload.error = None
        while upload.left:
            name, link = upload.left[0]
            self.put_file(name, link)
            link.unlink(missing_ok=True)
            upload.left.pop(0)
        if not upload.publish:
            return
        # The manifest is the remote done-marker: only once every object it names is up, the other nodes' too.
        while not self.all_up(upload.info):
            upload.waiting_for_shards = True
            if self._stop.wait(1):
                raise _Stopped
        upload.waiting_for_shards = False
        self.put_manifest(upload.info)

    def pending_bytes(self) -> int:
        """What is still to upload, for the watchdog's budget of the stage's last uploads."""
        return sum(upload.info.size for upload in self._pending)

    def poll(self, block: bool = False, wait_s: float = 3600) -> None:
        """Forget the checkpoints that are up. With `block` (the stage's end), wait until all are; after `wait_s`,
        one still failing (or a sharded one whose other nodes' files never arrived) ends the launch in one line.

        An upload that is still moving bytes without error is waited for past `wait_s`: the watchdog's upload
        budget, sized by the pending bytes, bounds that.
        """
        deadline = time.monotonic() + wait_s
        while True:
            self._pending = [u for u in self._pending if not u.future.done()]
            if not self._pending or not block:
                return
            head = self._pending[0]
            if time.monotonic() > deadline and (head.error is not None or head.waiting_for_shards):
                self._stop.set()  # no retry outlives the launch
                if head.error is None:
                    raise RetryableError(f"{self.uri}: the other nodes' shards of {head.name} never arrived")
                raise InfrastructureError(
                    f"{self.uri}: checkpoint {head.name} ({head.info.tokens} tokens) is still not uploaded after "
                    f"{head.attempts} attempts in {wait_s:.0f} s at the stage's end: {head.error}"
                )
            wait([head.future], timeout=1)

    # ------------------------------------------------------------ rotation

    def keep_last(self, keep: int | None) -> None:
        """Retire all but the newest `keep` complete checkpoints in the mirror, except the pinned ones and any
        whose upload is under way here (a checkpoint re-saved at the same tokens after a rollback)."""
        if keep is None:
            return
        held = self.pinned() | {u.name for u in list(self._pending) if not u.future.done()}
        for old in self.complete()[:-keep]:
            if Path(old.path).name not in held:
                self.retire(old)

    def close(self) -> None:
        """Stop retrying; what is not up is named in the log (the next launch uploads the local complete
        checkpoints the mirror lacks)."""
        if self._uploader is None:
            return
        self._stop.set()
        self._uploader.shutdown(wait=True, cancel_futures=True)
        self._uploader = None
        self._stop.clear()
        for upload in self._pending:
            if not upload.up:
                log.warning("%s was not mirrored to %s before the launch ended", upload.name, self.uri)
        self._pending = []


def reconcile(
    remote: RemoteFolder, folder: RunFolder, keep: int | None, stage: Stage, local: list[CheckpointInfo]
) -> list[CheckpointInfo]:
    """Bring local and remote into step before planning; returns the local complete checkpoints.

    Uploads local ones the remote lacks, then downloads the one this launch would start from
    (the stage's newest, or the previous stage's end) when only the remote has it.
    """
    shutil.rmtree(folder.path / STAGING_DIR, ignore_errors=True)
    remote_done = {c.tokens: c for c in remote.complete()}
    for info in local:
        if info.tokens not in remote_done:
            log.info("uploading %s, published before a kill interrupted its upload", Path(info.path).name)
            remote.publish(info)  # blocking: files, then the manifest
    remote.keep_last(keep)
    have = {c.tokens for c in local}
    own_local = max((c.tokens for c in local if c.stage_index == stage.index), default=-1)
    own_remote = [c for c in remote_done.values() if c.stage_index == stage.index and c.tokens > own_local]
    if own_remote:
        wanted = max(own_remote, key=lambda c: c.tokens)
    elif own_local < 0 and stage.index > 0:  # entering: the previous stage's end, where this one starts
        wanted = remote_done.get(stage.start) if stage.start not in have else None
    else:
        wanted = None
    if wanted is not None and wanted.tokens not in have:
        local = sorted([*local, remote.download(wanted, folder.path)], key=lambda c: c.tokens)
    return local


def fetch_folder(uri: str, dest: Path) -> Path:
    """A folder published under an s3:// data root, copied to `dest` once (the format's fetch_folder), its failure
    an exit code."""
    try:
        return s3.fetch_folder(uri, dest)
    except StoreError as exc:
        raise (FatalError if exc.lasting else RetryableError)(str(exc)) from exc
