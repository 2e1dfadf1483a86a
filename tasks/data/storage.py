"""Listing, fingerprinting and reading input files, local or on S3.

S3 goes through boto3 with the endpoint from `S3_ENDPOINT_URL` (or `AWS_ENDPOINT_URL`), the same
variable Streaming honours, so a local S3-compatible server works unchanged.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from tasks.data.errors import DataError

BLOCK = 1 << 20  # bytes per read


@dataclass(frozen=True)
class FileRef:
    """One input file and what identifies its contents without reading them."""

    path: str
    size: int
    version: str  # mtime_ns locally, the ETag on S3


def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key


def _s3_client():
    """The client for the endpoint and credentials the environment names now: one each, kept (the prepare stage
    makes many small reads), but never one made for an endpoint the environment no longer names (one cached
    regardless of it outlived a test's S3 server into the next test's reads)."""
    endpoint = os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
    return _client_for(endpoint, os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_PROFILE"))


@lru_cache(maxsize=8)
def _client_for(endpoint: str | None, key_id: str | None, profile: str | None):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint)


def _has_magic(p: str) -> bool:
    return glob.has_magic(p)


def _list_s3(pattern: str) -> list[FileRef]:
    bucket, key = _split_s3(pattern)
    magic = _has_magic(key)
    prefix = key[: min((key.find(c) for c in "*?[" if c in key), default=len(key))] if magic else key
    out = []
    try:
        for page in _s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                k = obj["Key"]
                if k.endswith("/"):
                    continue
                if magic and not fnmatch.fnmatchcase(k, key):
                    continue
                # A plain prefix names either one object or a "folder" of them.
                if not magic and k != key and not (key == "" or key.endswith("/") or k.startswith(key + "/")):
                    continue
                out.append(FileRef(f"s3://{bucket}/{k}", int(obj["Size"]), obj["ETag"].strip('"')))
    except Exception as exc:  # botocore raises many types; all mean "cannot list"
        raise DataError(pattern, f"cannot list S3 objects ({type(exc).__name__}: {exc})") from exc
    return out


def expand(patterns: list[str]) -> list[FileRef]:
    """Resolve files, globs and S3 prefixes to files, sorted within each pattern, deduplicated."""
    seen: dict[str, FileRef] = {}
    for pattern in patterns:
        if is_s3(pattern):
            refs = _list_s3(pattern)
            if not refs:
                raise DataError(pattern, "no S3 objects match")
        else:
            if _has_magic(pattern):
                names = sorted(glob.glob(pattern, recursive=True))
                names = [n for n in names if not os.path.isdir(n)]
                if not names:
                    raise DataError(pattern, "glob matches no files" + relative_note(pattern))
            else:
                names = [pattern]
            refs = [_stat(n) for n in names]
        for r in refs:
            seen.setdefault(r.path, r)
    return list(seen.values())


def relative_note(path: str) -> str:
    """For a relative path that was not found: the directory it was resolved against."""
    return "" if os.path.isabs(path) or is_s3(path) else f" (relative to {os.getcwd()})"


def _stat(path: str) -> FileRef:
    if not os.path.exists(path):
        raise DataError(path, "no such file" + relative_note(path))
    if os.path.isdir(path):
        raise DataError(path, "is a directory, not a file (use a glob such as dir/*.txt)")
    if not os.access(path, os.R_OK):
        raise DataError(path, "cannot read file (permission denied)")
    st = os.stat(path)
    return FileRef(path, st.st_size, str(st.st_mtime_ns))


def read_blocks(path: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Yield the bytes of [start, end) in blocks, without holding the whole range."""
    if is_s3(path):
        bucket, key = _split_s3(path)
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            body = _s3_client().get_object(Bucket=bucket, Key=key, Range=rng)["Body"]
        except Exception as exc:
            raise DataError(path, f"cannot read S3 object ({type(exc).__name__}: {exc})") from exc
        yield from body.iter_chunks(BLOCK)
        return
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise DataError(path, f"cannot read file ({exc.strerror})") from exc
    with f:
        remaining = None if end is None else end - start
        while remaining is None or remaining > 0:
            try:
                f.seek(start)
                block = f.read(BLOCK if remaining is None else min(BLOCK, remaining))
            except OSError as exc:
                raise DataError(path, f"cannot read file at byte {start} ({exc.strerror})") from exc
            if not block:
                return
            start += len(block)
            if remaining is not None:
                remaining -= len(block)
            yield block


def read_range(path: str, start: int, length: int) -> bytes:
    return b"".join(read_blocks(path, start, start + length))


def local_copy(path: str, dest_dir: str) -> str:
    """A local path for `path`: itself when local, else a download into dest_dir."""
    if not is_s3(path):
        return path
    bucket, key = _split_s3(path)
    dest = os.path.join(dest_dir, key.replace("/", "_"))
    try:
        _s3_client().download_file(bucket, key, dest)
    except Exception as exc:
        raise DataError(path, f"cannot read S3 object ({type(exc).__name__}: {exc})") from exc
    return dest


def find_boundaries(ref: FileRef, sep: bytes, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut a file into byte ranges of about chunk_bytes that each end just after a `sep`, at the
    very places where `bytes.split(sep)` of the whole file would cut it.

    UTF-8 is self-synchronising, so a byte match of an encoded separator is always at a
    character boundary and every range decodes on its own. A separator that can overlap itself
    ("\n\n" in a run of three newlines) is the catch: split pairs a run's newlines from its
    start, so a match found mid-run may not be one split uses. A match is taken only when no
    other match starts within the separator's length before it: then no match split uses can
    cover it, and split, scanning on from the previous cut, takes it.
    """
    if ref.size <= chunk_bytes:
        return [(0, ref.size)]
    cuts = [0]
    while cuts[-1] + chunk_bytes < ref.size:
        found = _next_cut(ref, sep, cuts[-1], cuts[-1] + chunk_bytes)
        if found is None or found >= ref.size:
            break
        cuts.append(found)
    cuts.append(ref.size)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _next_cut(ref: FileRef, sep: bytes, prev_cut: int, target: int, window: int = 1 << 16) -> int | None:
    """The end of the first match at or after `target` that split would use (see find_boundaries)."""
    n = len(sep)
    # Matches that could shadow one at `target` start up to n-1 bytes before it, never before the
    # previous cut: split restarts there.
    pos = max(prev_cut, target - (n - 1))
    last = None  # start of the previous match seen, overlapping ones included
    while pos < ref.size:
        buf = read_range(ref.path, pos, window + n - 1)
        i = buf.find(sep)
        while 0 <= i < window:
            at = pos + i
            if at >= target and (last is None or at - last >= n):
                return at + n
            last = at
            i = buf.find(sep, i + 1)
        pos += window
    return None


def line_of(path: str, offset: int) -> int:
    """1-based line number of byte `offset`; only used to word error messages."""
    n = 1
    for block in read_blocks(path, 0, offset):
        n += block.count(b"\n")
    return n
