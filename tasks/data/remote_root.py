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
from pathlib import Path

from tasks.data import storage
from tasks.data.errors import DataError

DONE = "_DONE"
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
    from botocore.exceptions import ClientError

    bucket, key = _key(uri)
    try:
        storage._s3_client().head_object(Bucket=bucket, Key=f"{key}/{DONE}")
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise DataError(uri, f"cannot read the data root ({exc})") from exc


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
    """Upload a finished local output: every file, then the done-marker."""
    bucket, key = _key(uri)
    client = storage._s3_client()
    files = [p for p in sorted(Path(local).rglob("*")) if p.is_file() and p.name != DONE]
    try:
        for path in files:
            client.upload_file(str(path), bucket, f"{key}/{path.relative_to(local).as_posix()}")
        client.upload_file(str(Path(local) / DONE), bucket, f"{key}/{DONE}")
    except Exception as exc:  # boto3 raises many types; all mean the bucket cannot take the output
        raise DataError(uri, f"cannot upload prepared data ({type(exc).__name__}: {exc})") from exc
