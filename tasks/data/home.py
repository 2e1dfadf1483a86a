"""Where a prepared output lasts, the folder training reads: one choice, made from the folder's name.

On a local data root that is the output folder this machine wrote (`LocalHome`); on an `s3://` root it is the
bucket's copy, published from a local working copy (`S3Home`). The pipeline, the stage task that withdraws a
damaged output and the cache check all ask the home, so none of them branches on the root's kind: the
checkpoints' counterpart is trainers/format/store.py.
"""

from __future__ import annotations

import os

from tasks.data import outputs, remote_root


class LocalHome:
    """A local root: the output folder written here is the one training reads."""

    def __init__(self, folder: str):
        self.folder = folder
        self.where = os.path.abspath(folder)

    def is_done(self) -> bool:
        return outputs.is_done(self.folder)

    def provenance(self) -> dict:
        return outputs.read_provenance(self.folder)

    def publish(self, local: str) -> bool:
        """Nothing to move: the output was renamed into place here. Whether anything was published."""
        return False

    def resume_publish(self, local: str) -> dict | None:
        """Nothing is ever half-published on a local root: `is_done` is the whole answer."""
        return None

    def withdraw(self, shard: str | None = None) -> bool:
        """Take back the done-marker of an output found damaged, and its damaged partition's; whether it had one."""
        return outputs.withdraw(self.folder, shard)


class S3Home:
    """An s3:// root: the bucket's copy is the truth, a finished local working copy alone is not published."""

    def __init__(self, uri: str):
        self.where = uri.rstrip("/")

    def is_done(self) -> bool:
        return remote_root.is_done(self.where)

    def provenance(self) -> dict:
        return remote_root.read_provenance(self.where)

    def publish(self, local: str) -> bool:
        """Every file of the finished local output, then the done-marker."""
        remote_root.publish(local, self.where)
        return True

    def resume_publish(self, local: str) -> dict | None:
        """An output finished in the working copy whose upload was cut short (or withdrawn in the bucket as damaged)
        is published now, and its provenance returned; one whose bytes are damaged here too is withdrawn here, to
        be prepared afresh (damaged bytes are never published again)."""
        if not outputs.is_done(local):
            return None
        found = outputs.damage(local)
        if found is not None:
            outputs.withdraw(local, found.get("shard"))
            return None
        self.publish(local)
        return outputs.read_provenance(local)

    def withdraw(self, shard: str | None = None) -> bool:
        return remote_root.withdraw(self.where, outputs.damaged_partition(shard))


def home_at(folder: str) -> LocalHome | S3Home:
    """The home of the output at `folder`: `<data root>/<source>-<hash>`, or the tokenizer's folder beside them."""
    return S3Home(folder) if remote_root.is_remote(folder) else LocalHome(folder)


__all__ = ["LocalHome", "S3Home", "home_at"]
