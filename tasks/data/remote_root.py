"""An `s3://` data root: outputs are prepared in a local working copy, then published to the bucket.

Everything that writes (staging, leases, the done-marker rule) happens in the local copy exactly as
for a local root. A finished output is then uploaded object by object, its done-marker last, so a
reader of the bucket (a training pod streaming it with Streaming's `remote`) never sees a partial
output as finished. An output already finished in the bucket is reused without being downloaded.
Two hosts preparing the same output at once each upload the same bytes (outputs are deterministic);
the done-marker is written only after a complete copy, whichever lands last.
"""

from __future__ import annotations

import json
import os

from tasks.data import storage
from tasks.data.errors import DataError
from trainers.format import s3
from trainers.format.s3 import DONE

PROVENANCE = "provenance.json"


def is_remote(root: str) -> bool:
    return storage.is_s3(root)


def default_cache(root: str) -> str:
    """Where the working copy of an s3:// root lives when data.local_cache is not set."""
    bucket, prefix = storage._split_s3(root.rstrip("/"))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tessera", "data", bucket, prefix)


def _key(uri: str) -> tuple[str, str]:
    return storage._split_s3(uri.rstrip("/"))


def is_done(uri: str) -> bool:
    try:
        return s3.folder_done(uri.rstrip("/"))
    except s3.StoreError as exc:
        raise DataError(uri, f"cannot read the data root ({exc.__cause__})") from exc


def withdraw(uri: str) -> bool:
    """Take back a published output's done-marker (a trainer found its bytes damaged). Whether it had one."""
    if not is_done(uri):
        return False
    bucket, key = _key(uri)
    storage._s3_client().delete_object(Bucket=bucket, Key=f"{key}/{DONE}")
    return True


def read_provenance(uri: str) -> dict:
    bucket, key = _key(uri)
    body = storage._s3_client().get_object(Bucket=bucket, Key=f"{key}/{PROVENANCE}")["Body"].read()
    return json.loads(body)


def publish(local: str, uri: str) -> None:
    """Upload a finished local output: every file, then the done-marker (the format's one way to publish a folder)."""
    try:
        s3.publish_folder(local, uri.rstrip("/"))
    except s3.StoreError as exc:
        cause = exc.__cause__
        raise DataError(uri, f"cannot upload prepared data ({type(cause).__name__}: {cause})") from exc
