"""A run's checkpoints in object storage (`train.save_folder: s3://...`), for pods whose disk dies with them.

The trainer always works in a local folder with layout.py's names, plan.py's repair rules and
Composer autoresume. With a remote save folder, rank 0 also keeps `<uri>/<run_name>/` in step with it:

- after a checkpoint is published locally, its .pt is uploaded by a background thread (training
  does not wait), and only once that upload has finished is its manifest uploaded. The remote
  manifest is the remote done-marker: a remote .pt without one is never trusted, exactly as locally.
  Keep-last-K rotates the remote the same way (manifest first, then the .pt);
- before a launch plans its start point, the run files (stage ledger, rollback records) are
  pulled, local complete checkpoints the remote lacks are uploaded (a kill between the local
  publish and the upload), and the checkpoint this launch starts from is downloaded when the
  local folder lacks it (a new node, a wiped work_dir). Autoresume then proceeds locally.

Object names mirror the local ones: `<run>-s<K>-tok<T>-rank0.pt`, `manifests/tok-<T>.json`
(whose `path` is the object's s3:// URI), `<run>-stages.json`, `<run>-rollbacks.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from trainers import heartbeat
from trainers.config import Stage, TrainJob
from trainers.exit_codes import FatalError, RetryableError
from trainers.format import checkpoints
from trainers.format.atomic import CutShort, atomic_write_json, read_json
from trainers.format.checkpoints import CheckpointInfo, is_intact
from trainers.layout import RunFolder, discard

log = logging.getLogger("tessera.remote")

DONE = "_DONE"  # the data root's done-marker (tasks/data/outputs.py)
STAGING_DIR = ".uploading"  # hard links of checkpoints being uploaded; what a kill leaves there is dropped


def _manifest_name(tokens: int) -> str:
    return checkpoints.manifest_path("", tokens).as_posix()


class RemoteFolder:
    """The s3:// mirror of one run's checkpoint folder. Rank 0 only."""

    def __init__(self, uri: str):
        from composer.utils import parse_uri
        from composer.utils.object_store import S3ObjectStore

        backend, bucket, path = parse_uri(uri)
        if backend != "s3" or not bucket:
            raise FatalError(f"train.save_folder: {uri} is not an s3://bucket/prefix URI")
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = bucket, path.strip("/")
        self.store = S3ObjectStore(bucket=bucket, prefix=self.prefix)
        self._uploader = None
        # (upload future, info, whether this process publishes its manifest), in save order
        self._pending: list[tuple[object, CheckpointInfo, bool]] = []

    @classmethod
    def for_job(cls, job: TrainJob) -> RemoteFolder | None:
        return cls(job.remote_folder) if job.remote_folder else None

    # ------------------------------------------------------------ plumbing

    def _names(self, sub: str = "") -> set[str]:
        """Object names (relative to the folder) under `sub`; the first call also checks the bucket."""
        try:
            keys = self.store.list_objects(sub)
        except Exception as exc:
            text = str(exc)
            if "NoSuchBucket" in text or "does not exist" in text:
                raise FatalError(f"train.save_folder: {self.uri}: bucket {self.bucket!r} does not exist") from None
            raise RetryableError(f"train.save_folder: {self.uri}: cannot list objects: {text}") from exc
        cut = len(self.prefix) + 1 if self.prefix else 0
        return {k[cut:] for k in keys}

    def _get_text(self, name: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "obj"
            self.store.download_object(name, str(local))
            return local.read_text()

    def _put_text(self, name: str, text: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "obj"
            local.write_text(text)
            self.store.upload_object(name, str(local))

    def _delete(self, name: str) -> None:
        self.store.client.delete_object(Bucket=self.bucket, Key=self.store.get_key(name))

    # ------------------------------------------------------------ run files

    def pull_json_list(self, local: Path) -> None:
        """Take the remote copy of an append-only JSON list (ledger, rollbacks) when it knows more."""
        if local.name not in self._names(local.name):
            return
        try:
            remote = json.loads(self._get_text(local.name))
        except ValueError:  # never expected (uploads are of whole files); the local copy decides then
            log.warning("%s/%s does not parse: the local copy is used", self.uri, local.name)
            return
        try:
            mine = read_json(local, missing=[])
        except CutShort:  # a power loss cut the local copy short: the mirror's, uploaded whole, knows more
            mine = []
        if len(remote) > len(mine):
            atomic_write_json(local, remote, indent=1)

    def push_file(self, local: Path) -> None:
        self.store.upload_object(local.name, str(local))

    # ------------------------------------------------------------ checkpoints

    def complete(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest is in the remote folder, oldest first."""
        names = self._names(checkpoints.MANIFEST_DIR + "/")
        found = []
        for name in names:
            if name.endswith(".json") and Path(name).name.startswith("tok-"):
                found.append(CheckpointInfo.model_validate_json(self._get_text(name)))
        return sorted(found, key=lambda c: c.tokens)

    def upload_now(self, info: CheckpointInfo) -> None:
        """Blocking upload of a local complete checkpoint: the .pt (or the folder's files), then its manifest.

        A sharded checkpoint saved on node-local disks has only this node's shards here: what the others
        wrote must be in the mirror already, or no manifest goes up (the checkpoint is whole nowhere)."""
        for name, local in _objects(info):
            if local.is_file():
                self.store.upload_object(name, str(local))
        if self._all_up(info):
            self._put_manifest(info)
        else:
            log.warning("%s: not every shard is here or in %s; not mirrored", info.path, self.uri)

    def _put_manifest(self, info: CheckpointInfo) -> None:
        remote = info.model_copy(update={"path": f"{self.uri}/{Path(info.path).name}"})
        self._put_text(_manifest_name(info.tokens), remote.model_dump_json())

    def download(self, info: CheckpointInfo, folder: Path) -> CheckpointInfo:
        """Fetch a remote checkpoint into the local folder and publish it there."""
        name = Path(info.path).name
        target = folder / name
        log.info("downloading %s (%d tokens) from %s", name, info.tokens, self.uri)
        if info.sharded:
            return self._download_folder(info, target, folder)
        size = 0
        with contextlib.suppress(Exception):  # the size only sizes the watchdog's budget
            size = int(self.store.get_object_size(name))
        heartbeat.phase("download", hint_bytes=size)
        # download_object writes a temp file and renames: a kill mid-download leaves no .pt behind.
        self.store.download_object(name, str(target), overwrite=True)
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
                self.store.download_object(f"{target.name}/{name}", str(target / name), overwrite=True)
        except Exception as exc:
            raise RetryableError(f"train.save_folder: {self.uri}/{target.name}: cannot download: {exc}") from exc
        heartbeat.phase("plan")
        if checkpoints.missing(local):
            raise RetryableError(f"train.save_folder: {self.uri}/{target.name} downloaded incomplete")
        return checkpoints.publish(folder, local)

    def _all_up(self, info: CheckpointInfo) -> bool:
        """Whether every file of the checkpoint is an object in the mirror (an S3 object appears only whole)."""
        if not info.sharded:
            return True
        there = self._names(f"{Path(info.path).name}/")
        return all(name in there for name, _ in _objects(info))

    def upload_async(self, info: CheckpointInfo, written_by: set[int] | None = None, publish: bool = True) -> None:
        """Start uploading a just-published checkpoint; poll() uploads its manifest once the .pt is up.

        Sharded, on several nodes: each node's first rank uploads the files its node's ranks wrote
        (`written_by`: their global ranks), and global rank 0 (`publish`) puts the manifest up once every
        file of the folder is in the mirror, its own and the other nodes'.

        A thread, not Composer's RemoteUploader: its spawned worker processes outlive a SIGKILLed
        trainer (holding its pipes and the staged copy), and each costs a Composer import at start.
        boto3 releases the GIL while it moves bytes, so the thread costs training little. The file is
        hard-linked into `.uploading/` first, so keep-last-K may delete the published name meanwhile.
        """
        if self._uploader is None:
            from concurrent.futures import ThreadPoolExecutor

            self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-upload")
        staged = []
        for name, source in _objects(info, written_by):
            link = Path(info.path).parent / STAGING_DIR / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            os.link(source, link)
            staged.append((name, link))

        def upload() -> None:
            for name, link in staged:
                self.store.upload_object(name, str(link))
                link.unlink(missing_ok=True)

        self._pending.append((self._uploader.submit(upload), info, publish))

    def pending_bytes(self) -> int:
        """What is still to upload, for the watchdog's budget of the stage's last uploads."""
        return sum(info.size for _, info, _ in self._pending)

    def poll(self, keep: int | None, block: bool = False, wait_s: float = 3600) -> None:
        """Publish remote manifests for finished uploads, in save order; raise an upload's error.

        A sharded checkpoint's manifest also waits for the other nodes' files to appear in the mirror;
        `block` waits for them up to `wait_s` (the watchdog's upload budget bounds the stage's end anyway).
        """
        deadline = time.monotonic() + wait_s
        while self._pending:
            future, info, publish = self._pending[0]
            if not block and not future.done():
                return
            future.result()  # re-raises a failed upload (boto3 has already retried transient errors)
            if publish:
                while not self._all_up(info):
                    if not block:
                        return
                    if time.monotonic() > deadline:
                        raise RetryableError(f"{self.uri}: the other nodes' shards of {info.path} never arrived")
                    time.sleep(1)
                self._put_manifest(info)
            self._pending.pop(0)
            if publish:
                self.keep_last(keep)

    def retire(self, info: CheckpointInfo) -> None:
        """The one place a remote checkpoint is removed: the done-marker first, as locally (layout.py)."""
        self._delete(_manifest_name(info.tokens))
        if info.sharded:
            for entry in info.files:
                self._delete(f"{Path(info.path).name}/{entry.name}")
        else:
            self._delete(Path(info.path).name)

    def keep_last(self, keep: int | None) -> None:
        if keep is None:
            return
        for old in self.complete()[:-keep]:
            self.retire(old)

    def close(self) -> None:
        if self._uploader is not None:
            self._uploader.shutdown(wait=True)
            self._uploader = None


def _objects(info: CheckpointInfo, written_by: set[int] | None = None) -> list[tuple[str, Path]]:
    """(object name, local path) of each file of a checkpoint: the .pt, or a sharded folder's files (the
    `.metadata` last, so a listing never shows an index before the shards it indexes); with `written_by`,
    only the files those global ranks wrote (`__<rank>_<n>.distcp`; `.metadata` is rank 0's)."""
    path = Path(info.path)
    if not info.sharded:
        return [(path.name, path)]
    names = sorted((f.name for f in info.files), key=lambda n: n == checkpoints.SHARD_METADATA)
    if written_by is not None:
        names = [n for n in names if _writer(n) in written_by]
    return [(f"{path.name}/{name}", path / name) for name in names]


def _writer(name: str) -> int:
    """The global rank that wrote a file of a sharded checkpoint."""
    if name == checkpoints.SHARD_METADATA:
        return 0
    return int(name.removeprefix("__").split("_", 1)[0])


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
            remote.upload_now(info)
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
    """A folder published under an s3:// data root (its done-marker uploaded last), copied to `dest` once.

    Every rank of a node may call this at once: each downloads into its own staging folder and the
    first rename wins, so `dest` is only ever a complete copy.
    """
    from composer.utils import parse_uri
    from composer.utils.object_store import S3ObjectStore

    if (dest / DONE).is_file():
        return dest
    _, bucket, path = parse_uri(uri)
    store = S3ObjectStore(bucket=bucket, prefix=path)  # keys are relative to `path/` from here on
    try:
        names = sorted(k[len(store.prefix) :] for k in store.list_objects(""))
    except Exception as exc:
        raise RetryableError(f"{uri}: cannot list objects: {exc}") from exc
    if DONE not in names:
        raise FatalError(f"{uri}: not a published folder (no {DONE}); prepare the data again")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent if dest.parent.is_dir() else None))
    try:
        for name in names:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            store.download_object(name, str(staging / name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, dest)
        except OSError:
            if not (dest / DONE).is_file():
                raise
    except FatalError:
        raise
    except Exception as exc:
        raise RetryableError(f"{uri}: cannot download: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
