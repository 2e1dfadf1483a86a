"""The checkpoint contract between the trainer and whoever watches it (the flow, `tessera eval`).

Composer writes `<save_folder>/<name>.pt` (one rank, DDP), or a folder `<save_folder>/<name>/` in which each
rank writes its own shard and rank 0 the DCP `.metadata` (sharded, trainers/sharding.py). Only after every
byte of it is on disk does the trainer publish a manifest `<save_folder>/manifests/tok-<tokens>.json`
(trainers/format/atomic.py: temp file, fsync, rename, folder fsync), so a watcher never sees a half-written
checkpoint. The manifest is the done-marker: a checkpoint without one is treated as incomplete. For a
folder it lists every file with its size and SHA-256.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, Field

from trainers.format.atomic import CutShort, atomic_write, fsync_path, read_json

MANIFEST_DIR = "manifests"


SHARD_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint, written last


class ShardFile(BaseModel):
    """One file of a sharded checkpoint folder."""

    name: str = Field(..., description="File name inside the checkpoint folder.")
    size: int = Field(..., description="Bytes.")
    sha256: str = Field(..., description="SHA-256 of the file, taken by the rank that wrote it.")


class CheckpointInfo(BaseModel):
    """A complete checkpoint, as published by the trainer."""

    path: str = Field(..., description="Absolute path of the Composer checkpoint file, or of a sharded one's folder.")
    tokens: int = Field(..., description="Tokens seen since the start of the run.")
    batch: int = Field(..., description="Optimizer steps since the start of the run.")
    stage: str = Field(..., description="Name of the curriculum stage that produced it.")
    stage_index: int = Field(..., description="0-based index of that stage.")
    sha256: str | None = Field(
        None,
        description="SHA-256 of the file, taken when it was published; what resuming and evaluating verify. "
        "Null for a sharded folder (see files), and in manifests written before it was recorded (their files are "
        "checked by zip CRCs).",
    )
    files: list[ShardFile] | None = Field(
        None, description="A sharded checkpoint's files (its shards and .metadata); null for a single file."
    )

    @property
    def sharded(self) -> bool:
        return self.files is not None

    @property
    def size(self) -> int:
        """Bytes of the checkpoint; 0 when unknown (an old single-file manifest whose file is gone)."""
        if self.files is not None:
            return sum(f.size for f in self.files)
        try:
            return Path(self.path).stat().st_size
        except OSError:
            return 0


def manifest_path(save_folder: str | Path, tokens: int) -> Path:
    return Path(save_folder) / MANIFEST_DIR / f"tok-{tokens:012d}.json"


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def publish(save_folder: str | Path, info: CheckpointInfo) -> CheckpointInfo:
    """Write the manifest for a checkpoint that is already complete on disk; returns what it says.

    The file's SHA-256 goes into the manifest unless `info` carries one already (a download keeps
    the one taken where the checkpoint was saved). The checkpoint's bytes and its directory entry
    reach the disk before the manifest names it, and the manifest's rename before this returns:
    after a power loss or a node crash a manifest never describes a file the page cache had not
    yet written.
    """
    if info.files is None and info.sha256 is None:  # the file was just written: read back from the page cache
        info = info.model_copy(update={"sha256": file_sha256(info.path)})
    fsync_path(info.path)  # a sharded folder's entries; its files were fsynced by the ranks that wrote them
    fsync_path(Path(info.path).parent)
    # Only now the manifest, itself fsynced and renamed in, its folder fsynced after (atomic_write).
    atomic_write(manifest_path(save_folder, info.tokens), info.model_dump_json())
    return info


def list_complete(save_folder: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under save_folder, oldest first; skips manifests whose file is gone."""
    folder = Path(save_folder) / MANIFEST_DIR
    if not folder.is_dir():
        return []
    found = []
    for manifest in folder.glob("tok-*.json"):
        try:
            record = read_json(manifest)
        except CutShort:
            # Written before manifests were fsynced, then a power loss: its file counts as unpublished,
            # so the next launch's repair (trainers/plan.py) re-derives this manifest if the file
            # verifies, or discards a file that is cut short too. Never a reason to fail a watcher or a launch.
            continue
        if record is None:  # a keep-last-K cleanup deleted it between the glob and the read
            continue
        info = CheckpointInfo.model_validate(record)
        if Path(info.path).is_dir() if info.sharded else Path(info.path).is_file():
            found.append(info)
    # by value, not name: the zero padding stops helping past 10^12 tokens
    return sorted(found, key=lambda c: c.tokens)


def shard_files(folder: str | Path, names: list[str]) -> list[ShardFile]:
    """The entries a manifest lists for files of a sharded checkpoint folder: each fsynced, sized, hashed."""
    found = []
    for name in names:
        path = Path(folder) / name
        fsync_path(path)
        found.append(ShardFile(name=name, size=path.stat().st_size, sha256=file_sha256(path)))
    return found


def is_intact(path: str | Path) -> bool:
    """Cheap integrity check: a torch.save zip cut short by a kill has no central directory; a sharded folder
    cut short has no `.metadata` (DCP writes it after every rank's shard).

    It reads the directory at the end of the file, not the payload, so it stays O(1) for a 7B
    checkpoint; bit rot inside the payload is left to torch.load to report.
    """
    if Path(path).is_dir():
        return (Path(path) / SHARD_METADATA).is_file()
    try:
        with zipfile.ZipFile(path) as zf:
            return any(name.endswith("data.pkl") for name in zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def missing(info: CheckpointInfo) -> list[str]:
    """Files of a published checkpoint that are absent here, or not of their published size (cheap: no
    hashing). A sharded checkpoint on node-local disks is whole on no node until fetched from s3."""
    if info.files is None:
        return [] if Path(info.path).is_file() else [Path(info.path).name]
    absent = []
    for entry in info.files:
        try:
            if (Path(info.path) / entry.name).stat().st_size == entry.size:
                continue
        except OSError:
            pass
        absent.append(entry.name)
    return absent


def damage_of(info: CheckpointInfo) -> str | None:
    """What is wrong with a published checkpoint, file or folder, or None if every byte is as published."""
    if info.files is None:
        return damage(info.path, info.sha256)
    return folder_damage(info.path, info.files)


def folder_damage(folder: str | Path, files: list[ShardFile]) -> str | None:
    """What is wrong with a sharded checkpoint folder against its manifest's file list, or None."""
    for entry in files:
        path = Path(folder) / entry.name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{entry.name} is missing"
        if size != entry.size:
            return f"{entry.name} has {size} bytes, not the {entry.size} published"
        why = damage(path, entry.sha256)
        if why is not None:
            return f"{entry.name}: {why}"
    return None


def damage(path: str | Path, sha256: str | None = None) -> str | None:
    """What is wrong with a checkpoint file, or None if every byte is as written.

    torch.load checks nothing: a flipped byte in a tensor loads silently (a loss of 3e8 after
    resuming) and one in the pickle fails on every relaunch. With the manifest's SHA-256 the whole
    file is hashed and compared, which also catches a file replaced by another valid checkpoint;
    without one (a file with no manifest yet, an old manifest) the CRC-32 that torch.save records
    for each member of its zip is checked. Either way the file is read once: a cost of the same
    order as the load that follows, which then reads from the page cache.
    """
    if sha256 is not None:
        try:
            actual = file_sha256(path)
        except OSError as exc:
            return f"unreadable ({type(exc).__name__}: {exc})"
        return None if actual == sha256 else f"SHA-256 {actual} is not the {sha256} published"
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (OSError, zipfile.BadZipFile, RuntimeError, ValueError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None if bad is None else f"CRC-32 mismatch in {bad}"


class DamagedCheckpoint(Exception):
    """A checkpoint whose bytes are not those published. It is never loaded."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: damaged checkpoint, not loaded: {why}")
        self.name, self.why = name, why


def manifest_of(path: str | Path) -> CheckpointInfo | None:
    """The manifest that published checkpoint `path` (a file, or a sharded folder), read from the manifests
    beside it (`<save_folder>/manifests/`, as saved, or as fetched from a bucket), or None when none names it."""
    target = Path(path)
    for manifest in sorted((target.parent / MANIFEST_DIR).glob("tok-*.json")):
        try:
            record = read_json(manifest)
        except CutShort:
            continue
        if record is not None and Path(record.get("path", "")).name == target.name:
            return CheckpointInfo.model_validate({**record, "path": str(target)})
    return None


class Checked(NamedTuple):
    line: str  # how it was checked, for the log
    by_manifest: bool  # against what its manifest published; False: no manifest names it (a log warning)


def verify(
    path: str | Path, *, shown: str | None = None, sha256: str | None = None, files: list[ShardFile] | None = None
) -> Checked:
    """Check a checkpoint tessera wrote before anything loads it; returns how it was checked.

    Against the `sha256` (a file) or `files` (a sharded folder) its manifest published, given by the caller or
    read from the manifest beside it (`manifest_of`). Without a manifest: a file's zip CRCs, a folder nothing,
    and the line says so. Anything that differs raises DamagedCheckpoint naming the checkpoint (`shown`, when it
    was fetched from elsewhere) and what differs: the expected and found SHA-256, a size, a missing file."""
    name = shown or str(path)
    how = "the SHA-256 its manifest published" if files is None else "the file hashes its manifest published"
    if sha256 is None and files is None:
        info = manifest_of(path)
        if info is not None:
            sha256, files, how = info.sha256, info.files, f"its manifest tok-{info.tokens:012d}.json"
        elif Path(path).is_file():
            how = "its zip CRCs only: no manifest names it"
        else:
            return Checked(f"{name}: not verified: no manifest names it, and without one a folder has no hashes", False)
    why = folder_damage(path, files) if files is not None else damage(path, sha256)
    if why is not None:
        raise DamagedCheckpoint(name, why)
    return Checked(f"{name}: verified against {how}", sha256 is not None or files is not None)
