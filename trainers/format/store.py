"""Where a run's checkpoints are kept, read the same way on disk and in object storage.

A `CheckpointStore` is one run's save folder seen by whoever is not writing it (the gauntlet queue, the stage task,
goodput, continued pretraining, registration). `LocalCheckpoints` is the trainer's folder on this machine, where a
pin is a hard link in a pins folder (a copy across filesystems), so keep-last-K may delete the published name
meanwhile; `S3Checkpoints` the s3:// mirror pods keep in step with their disk, where a pin is a marker object
`pins/<checkpoint name>` the trainer's remote keep-last-K leaves alone. Both list the complete checkpoints (the
manifest is the done-marker), pin and unpin, read a run file, retire (manifest first) and publish (files first,
manifest last); `open_store` picks the face, so no caller branches on where the folder is. The trainer's uploader
(trainers/remote.py) is the s3 face plus its background uploads. Like the rest of this package it imports nothing
else of tessera; boto3 only when s3 is used (s3.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

from trainers.format import checkpoints
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.mlflow_model import model_uri_for
from trainers.format.s3 import StoreError, is_missing, s3_client, split_uri

log = logging.getLogger("tessera.store")

PINS_DIR = "pins"  # `pins/<checkpoint name>` in the mirror: held against keep-last-K while an evaluation reads it


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a sharded folder. A folder is renamed aside first, so a kill midway never
    leaves a partial folder under a checkpoint's name."""
    if path.is_dir() and not path.is_symlink():
        doomed = path.with_name(f".removing-{path.name}")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class CheckpointStore(ABC):
    """One run's complete checkpoints, wherever they are kept."""

    location: str  # the folder's path or s3:// URI

    @abstractmethod
    def complete(self) -> list[CheckpointInfo]:
        """The complete checkpoints (those with a manifest), oldest first."""

    def newest(self) -> CheckpointInfo | None:
        done = self.complete()
        return done[-1] if done else None

    @abstractmethod
    def pin(self, info: CheckpointInfo) -> CheckpointInfo | None:
        """Hold a complete checkpoint against keep-last-K while it is read; what to read then (locally the pin's
        own path), or None if it was retired first."""

    @abstractmethod
    def unpin(self, pinned: CheckpointInfo) -> None:
        """Release what `pin` returned."""

    @abstractmethod
    def drop_pins(self) -> list[str]:
        """Every pin, deleted; their names. For a flow that starts: one flow runs per run name, so any pin there is
        a crashed flow's."""

    @abstractmethod
    def read_text(self, name: str) -> str:
        """A run file of the folder (`<run>-time.jsonl`, ...); FileNotFoundError if there is none."""

    @abstractmethod
    def retire(self, info: CheckpointInfo) -> bool:
        """Remove a complete checkpoint, its manifest first; False if a pin keeps it."""

    @abstractmethod
    def publish(self, info: CheckpointInfo) -> CheckpointInfo:
        """Make a checkpoint complete here: its files first, then its manifest, the done-marker."""

    def where(self, info: CheckpointInfo) -> str:
        """Where the checkpoint itself lives for a reader elsewhere: a path, or the object's URI."""
        return f"{self.location}/{Path(info.path).name}"

    def model_home(self, tokens: int) -> str | None:
        """Where the MLflow Model of the checkpoint at `tokens` may be kept beside it, registered by reference;
        None where the run keeps nothing in object storage (the model is then copied into MLflow's store)."""
        return None


def open_store(
    folder: str | Path, mirror: str | None = None, pins: Path | None = None, folder_elsewhere: bool = False
) -> CheckpointStore:
    """The store a watcher reads. `folder_elsewhere`: the trainer's folder is on other machines' disks (pods), so
    only its s3 `mirror` can be read; otherwise the local folder, a working copy of the mirror when there is one.
    `pins`: where a local pin's links go."""
    if mirror and folder_elsewhere:
        return S3Checkpoints(mirror)
    return LocalCheckpoints(folder, pins, mirror)


# ---------------------------------------------------------------- on this machine's disk


class LocalCheckpoints(CheckpointStore):
    """A save folder on this machine's disk; pins are links in `pins` (default `<folder>/pins`). With a `mirror`
    (an s3:// save folder) it is the mirror's working copy: a checkpoint lasts there, and a run file this copy
    lacks (a fresh machine) is read from there."""

    def __init__(self, folder: str | Path, pins: Path | None = None, mirror: str | None = None):
        self.folder = Path(folder)
        self.location = str(self.folder)
        self.pins = Path(pins) if pins is not None else self.folder / PINS_DIR
        self.mirror = mirror

    def complete(self) -> list[CheckpointInfo]:
        return checkpoints.list_complete(self.folder)

    def where(self, info: CheckpointInfo) -> str:
        return f"{self.mirror.rstrip('/')}/{Path(info.path).name}" if self.mirror else info.path

    def model_home(self, tokens: int) -> str | None:
        return model_uri_for(self.mirror, tokens) if self.mirror else None

    def pin(self, info: CheckpointInfo) -> CheckpointInfo | None:
        held = self._link(Path(info.path))
        return None if held is None else info.model_copy(update={"path": str(held)})

    def _link(self, source: Path) -> Path | None:
        self.pins.mkdir(parents=True, exist_ok=True)
        target = self.pins / source.name
        if target.exists():
            return target
        if source.is_dir():  # a sharded checkpoint: a folder of links to its files, renamed into place whole
            staging = target.with_name(f".{target.name}.linking")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                for file in sorted(source.iterdir()):
                    _link_or_copy(file, staging / file.name)
            except FileNotFoundError:
                shutil.rmtree(staging, ignore_errors=True)
                return _gone(source)
            os.replace(staging, target)
            return target
        staging = self.pins / f".{source.name}.copying"  # a copy across filesystems is renamed in whole
        staging.unlink(missing_ok=True)
        try:
            _link_or_copy(source, staging)
            os.replace(staging, target)
        except FileNotFoundError:
            staging.unlink(missing_ok=True)
            return _gone(source)
        return target

    def unpin(self, pinned: CheckpointInfo) -> None:
        remove(Path(pinned.path))

    def drop_pins(self) -> list[str]:
        if not self.pins.is_dir():
            return []
        stale = sorted(p.name for p in self.pins.iterdir())
        for name in stale:
            remove(self.pins / name)
        return stale

    def read_text(self, name: str) -> str:
        try:
            return (self.folder / name).read_text()
        except FileNotFoundError:
            if self.mirror is None:
                raise
        return S3Checkpoints(self.mirror).read_text(name)

    def retire(self, info: CheckpointInfo) -> bool:
        # The manifest first: a watcher never reads one whose file is gone mid-read (a reader pins what it reads).
        checkpoints.manifest_path(self.folder, info.tokens).unlink(missing_ok=True)
        remove(Path(info.path))
        return True

    def publish(self, info: CheckpointInfo) -> CheckpointInfo:
        return checkpoints.publish(self.folder, info)


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link `source` as `target`, or copy it across filesystems."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copyfile(source, target)


def _gone(source: Path) -> None:
    log.warning(
        "checkpoint %s was deleted before it could be pinned (keep-last-K rotated it out): "
        "it will not be evaluated or registered",
        source,
    )


# ---------------------------------------------------------------- the s3 mirror


class S3Checkpoints(CheckpointStore):
    """The s3:// mirror of one run's checkpoint folder. Object names are the local ones: `<run>-s<K>-tok<T>-rank0.pt`
    (or a sharded folder's `<name>/<file>`), `manifests/tok-<T>.json` (whose `path` is the object's URI), the run
    files, and `pins/<checkpoint name>`."""

    def __init__(self, uri: str, client=None):
        self.bucket, self.prefix = split_uri(uri)
        if not uri.startswith("s3://") or not self.bucket:
            raise StoreError(uri, "not an s3://bucket/prefix URI", lasting=True)
        self.uri = self.location = uri.rstrip("/")
        self.client = client or s3_client()
        # Manifests already read, by object name: (ETag, what it says). A manifest is written once, whole, and only
        # deleted on retire, so a poll of the folder GETs only the ones it has not seen.
        self._manifests: dict[str, tuple[str, CheckpointInfo]] = {}

    def model_home(self, tokens: int) -> str | None:
        return model_uri_for(self.uri, tokens)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    # ------------------------------------------------------------ objects

    def listing(self, sub: str = "") -> dict[str, str]:
        """{object name (relative to the folder): ETag} under `sub`, every page of it."""
        cut = len(self.prefix) + 1 if self.prefix else 0
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(sub))
        try:
            return {o["Key"][cut:]: o.get("ETag", "") for page in pages for o in page.get("Contents", [])}
        except Exception as exc:  # botocore raises many types; each one means "cannot list"
            text = str(exc)
            if "NoSuchBucket" in text or "does not exist" in text:
                raise StoreError(self.uri, f"bucket {self.bucket!r} does not exist", lasting=True) from None
            raise StoreError(self.uri, f"cannot list objects: {text}") from exc

    def names(self, sub: str = "") -> set[str]:
        return set(self.listing(sub))

    def read_text(self, name: str) -> str:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:
            if is_missing(exc):
                raise FileNotFoundError(f"{self.uri}/{name}") from None
            raise
        return reply["Body"].read().decode()

    def put_text(self, name: str, text: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=text.encode())

    def put_file(self, name: str, local: str | Path) -> None:
        """Upload a file (boto3's managed transfer: multipart for a large checkpoint; an object appears only
        whole)."""
        self.client.upload_file(str(local), self.bucket, self.key(name))

    def get_file(self, name: str, local: str | Path) -> None:
        """Download an object to `local` through a temp file renamed in: a kill mid-download leaves no file."""
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.")
        os.close(fd)
        try:
            self.client.download_file(self.bucket, self.key(name), tmp)
            os.replace(tmp, local)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def size(self, name: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self.key(name))["ContentLength"])

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name))

    # ------------------------------------------------------------ checkpoints

    def complete(self) -> list[CheckpointInfo]:
        """One LIST, and a GET of each manifest not read before."""
        listed = {
            name: etag
            for name, etag in self.listing(checkpoints.MANIFEST_DIR + "/").items()
            if name.endswith(".json") and Path(name).name.startswith("tok-")
        }
        known = {name: seen for name, seen in self._manifests.items() if listed.get(name) == seen[0]}
        for name, etag in listed.items():
            if name in known:
                continue
            try:
                known[name] = (etag, CheckpointInfo.model_validate_json(self.read_text(name)))
            except FileNotFoundError:  # retired between the LIST and the GET
                continue
        self._manifests = known
        return sorted((info for _, info in known.values()), key=lambda c: c.tokens)

    def publish(self, info: CheckpointInfo) -> CheckpointInfo:
        """Upload a local complete checkpoint: the .pt (or the folder's files), then its manifest.

        A sharded checkpoint saved on node-local disks has only this node's shards here: what the others wrote
        must be in the mirror already, or no manifest goes up (the checkpoint is whole nowhere)."""
        for name, local in objects_of(info):
            if local.is_file():
                self.put_file(name, local)
        if self.all_up(info):
            return self.put_manifest(info)
        log.warning("%s: not every shard is here or in %s; not mirrored", info.path, self.uri)
        return info

    def put_manifest(self, info: CheckpointInfo) -> CheckpointInfo:
        """The remote done-marker, once every object it names is up; its `path` is the object's URI."""
        remote = info.model_copy(update={"path": self.where(info)})
        self.put_text(_manifest_name(info.tokens), remote.model_dump_json())
        return remote

    def all_up(self, info: CheckpointInfo) -> bool:
        """Whether every file of the checkpoint is an object in the mirror (an S3 object appears only whole)."""
        if not info.sharded:
            return True
        there = self.names(f"{Path(info.path).name}/")
        return all(name in there for name, _ in objects_of(info))

    # ------------------------------------------------------------ pins: checkpoints an evaluation is reading

    def pin(self, info: CheckpointInfo) -> CheckpointInfo | None:
        """The pin is written before the manifest is looked at, and retire() looks for a pin after it has deleted
        the manifest: whichever comes first, either this sees no manifest (and drops its pin) or retire sees the pin
        (and puts the manifest back), so a pinned checkpoint's files are never deleted."""
        name = Path(info.path).name
        self.put_text(f"{PINS_DIR}/{name}", f"{info.tokens}\n")
        if _manifest_name(info.tokens) in self.names(_manifest_name(info.tokens)):
            return info
        self.delete(f"{PINS_DIR}/{name}")
        _gone(Path(info.path))
        return None

    def unpin(self, pinned: CheckpointInfo) -> None:
        self.delete(f"{PINS_DIR}/{Path(pinned.path).name}")

    def pinned(self) -> set[str]:
        """Names of the pinned checkpoints."""
        return {name.removeprefix(f"{PINS_DIR}/") for name in self.names(f"{PINS_DIR}/")}

    def drop_pins(self) -> list[str]:
        stale = sorted(self.pinned())
        for name in stale:
            self.delete(f"{PINS_DIR}/{name}")
        return stale

    # ------------------------------------------------------------ rotation

    def retire(self, info: CheckpointInfo) -> bool:
        """The one place a remote checkpoint is removed: the done-marker first, as locally. A checkpoint pinned
        meanwhile keeps its files and gets its manifest back (pin() says why); False then."""
        name = Path(info.path).name
        self.delete(_manifest_name(info.tokens))
        self._manifests.pop(_manifest_name(info.tokens), None)
        if f"{PINS_DIR}/{name}" in self.names(f"{PINS_DIR}/{name}"):
            self.put_text(_manifest_name(info.tokens), info.model_dump_json())
            return False
        if info.sharded:
            for entry in info.files:
                self.delete(f"{name}/{entry.name}")
        else:
            self.delete(name)
        return True


def _manifest_name(tokens: int) -> str:
    return checkpoints.manifest_path("", tokens).as_posix()


def objects_of(info: CheckpointInfo, written_by: set[int] | None = None) -> list[tuple[str, Path]]:
    """(object name, local path) of each file of a checkpoint: the .pt, or a sharded folder's files (the `.metadata`
    last, so a listing never shows an index before the shards it indexes); with `written_by`, only the files those
    global ranks wrote (`__<rank>_<n>.distcp`; `.metadata` is rank 0's)."""
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
