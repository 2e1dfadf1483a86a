"""Object storage as tessera uses it: one way to make a client, one error, and published folders.

`publish_folder` and `fetch_folder` are the one way a staged folder (prepared data, a tokenizer) crosses to and
from a bucket: every file, its done-marker last; a fetch lands in a staging folder renamed into place, so no
partial copy ever has the name. The checkpoint store's s3 face (store.py) and the data root
(tasks/data/remote_root.py) use them. boto3 is imported only when a bucket is used.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DONE = "_DONE"  # a published folder's done-marker: written, or uploaded, last
_MISSING = ("NoSuchKey", "404", "NotFound")


class StoreError(Exception):
    """The object store could not do what was asked. `lasting`: waiting will not help (no such bucket)."""

    def __init__(self, where: str, why: str, lasting: bool = False):
        super().__init__(f"{where}: {why}")
        self.lasting = lasting


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at its ends) of an s3:// URI."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def s3_client():
    """A new S3 client, one per store as Composer's S3ObjectStore makes one (its event hooks and pool are its own).
    The endpoint comes from S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), the variable Composer and Streaming honour, so
    a local S3-compatible server works unchanged; retries are boto3's adaptive mode, Composer's default."""
    import boto3
    from botocore.config import Config

    endpoint = os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=Config(retries={"mode": "adaptive"}))


def is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None) or {}
    return response.get("Error", {}).get("Code") in _MISSING


def folder_done(uri: str) -> bool:
    """Whether a folder is published under `uri` (its done-marker is there)."""
    bucket, key = split_uri(uri)
    try:
        s3_client().head_object(Bucket=bucket, Key=f"{key}/{DONE}")
        return True
    except Exception as exc:  # botocore's types vary; anything but "not found" is "cannot read"
        if is_missing(exc):
            return False
        raise StoreError(uri, f"cannot read the bucket ({exc})") from exc


def publish_folder(local: str | Path, uri: str) -> None:
    """Upload a finished local folder: every file, then its done-marker (the local one, or a fresh one)."""
    bucket, key = split_uri(uri)
    client = s3_client()
    files = [p for p in sorted(Path(local).rglob("*")) if p.is_file() and p.name != DONE]
    try:
        for path in files:
            client.upload_file(str(path), bucket, f"{key}/{path.relative_to(local).as_posix()}")
        marker = Path(local) / DONE
        if marker.is_file():
            client.upload_file(str(marker), bucket, f"{key}/{DONE}")
        else:
            client.put_object(Bucket=bucket, Key=f"{key}/{DONE}", Body=b"{}")
    except Exception as exc:  # boto3 raises many types; all mean the bucket cannot take the folder
        raise StoreError(uri, f"cannot upload ({type(exc).__name__}: {exc})") from exc


def fetch_folder(uri: str, dest: Path) -> Path:
    """A folder published under `uri`, copied to `dest` once.

    Every rank of a node may call this at once: each downloads into its own staging folder and the first rename
    wins, so `dest` is only ever a complete copy. StoreError (`lasting`) when nothing is published there.
    """
    if (dest / DONE).is_file():
        return dest
    bucket, key = split_uri(uri)
    client = s3_client()
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{key}/")
        names = sorted(o["Key"][len(key) + 1 :] for page in pages for o in page.get("Contents", []))
    except Exception as exc:  # botocore's types vary; each one means "cannot list"
        raise StoreError(uri, f"cannot list objects: {exc}") from exc
    if DONE not in names:
        raise StoreError(uri, f"not a published folder (no {DONE}); prepare the data again", lasting=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent if dest.parent.is_dir() else None))
    try:
        for name in names:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, f"{key}/{name}", str(staging / name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, dest)
        except OSError:
            if not (dest / DONE).is_file():
                raise
    except Exception as exc:  # any failure mid-copy leaves no copy; the caller retries
        raise StoreError(uri, f"cannot download: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
