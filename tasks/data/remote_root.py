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


class BucketError(DataError):
    """The bucket did not answer as asked (a read, a listing, an upload): unlike bad input, a retry may succeed."""


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


def withdraw(uri: str, part: str | None = None) -> bool:
    """Take back a published output's done-marker (a trainer found its bytes damaged), and that of partition `part`
    (the one holding the damaged shard), so the next prepare writes it again. Whether the output had its marker."""
    bucket, key = _key(uri)
    if part is not None:
        storage._s3_client().delete_object(Bucket=bucket, Key=f"{key}/parts/{part}/{DONE}")
    if not is_done(uri):
        return False
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


def reader(uri: str):
    """An output's files in the bucket by relative path (tasks.data.merge.Read): their bytes, or None if absent."""
    bucket, key = _key(uri)
    client = storage._s3_client()

    def read(rel: str) -> bytes | None:
        try:
            return client.get_object(Bucket=bucket, Key=f"{key}/{rel}")["Body"].read()
        except Exception as exc:  # botocore's types vary; anything but "not found" is an error to report
            if s3.is_missing(exc):
                return None
            raise BucketError(f"{uri}/{rel}", f"cannot read the data root ({exc})") from exc

    return read


def put(uri: str, rel: str, body: bytes) -> None:
    bucket, key = _key(uri)
    try:
        storage._s3_client().put_object(Bucket=bucket, Key=f"{key}/{rel}", Body=body)
    except Exception as exc:  # boto3 raises many types; all mean the bucket cannot take it
        raise BucketError(f"{uri}/{rel}", f"cannot upload prepared data ({type(exc).__name__}: {exc})") from exc


def partitions_done(uri: str) -> set[int]:
    """The partitions of the output at `uri` whose done-marker is in the bucket: one listing."""
    bucket, key = _key(uri)
    try:
        pages = storage._s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{key}/parts/")
        names = [o["Key"][len(key) + len("/parts/") :] for page in pages for o in page.get("Contents", [])]
    except Exception as exc:  # botocore's types vary; each one means "cannot list"
        raise BucketError(uri, f"cannot read the data root ({exc})") from exc
    return {int(n.split("/")[0]) for n in names if n.endswith(f"/{DONE}") and n.split("/")[0].isdigit()}


def publish_partition(local_out: str, uri: str, folder: str) -> None:
    """Upload one partition a pod prepared in its working copy: its splits' files and its record, then its
    done-marker, so the bucket never shows a partition done before its shards are there."""
    bucket, key = _key(uri)
    client = storage._s3_client()
    files = []
    for sub in (f"train/{folder}", f"val/{folder}", f"parts/{folder}"):
        base = os.path.join(local_out, sub)
        for dirpath, _, names in os.walk(base):
            files += [os.path.join(dirpath, n) for n in sorted(names)]
    marker = os.path.join(local_out, "parts", folder, DONE)
    try:
        for path in sorted(f for f in files if f != marker) + [marker]:
            client.upload_file(path, bucket, f"{key}/{os.path.relpath(path, local_out)}")
    except Exception as exc:  # boto3 raises many types; all mean the bucket cannot take the partition
        raise BucketError(uri, f"cannot upload partition {folder} ({type(exc).__name__}: {exc})") from exc


def finish(uri: str, indexes: dict[str, bytes], provenance: dict) -> None:
    """Write an output's merged indexes and provenance into the bucket, then its done-marker."""
    for split, raw in indexes.items():
        put(uri, f"{split}/index.json", raw)
    put(uri, PROVENANCE, json.dumps(provenance, indent=2, sort_keys=True).encode())
    put(uri, DONE, json.dumps({"finished": provenance["finished"]}).encode())
