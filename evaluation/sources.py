"""Where gauntlet files come from: local paths or `s3://`, and jsonl parsing with line numbers."""

from __future__ import annotations

import atexit
import json
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Any

from evaluation.errors import GauntletError


def is_remote(uri: str) -> bool:
    return "://" in uri


def resolve(root: str, uri: str) -> str:
    """`uri` as given when absolute or remote, else joined onto `root` (itself local or s3://)."""
    if is_remote(uri) or os.path.isabs(uri):
        return uri
    if is_remote(root):
        return posixpath.join(root.rstrip("/"), uri)
    return str(Path(root) / uri)


def exists(uri: str) -> bool:
    if uri.startswith("hf://"):
        raise GauntletError(f"{uri}: hf:// datasets are not supported; point dataset_uri at a jsonl file")
    if not is_remote(uri):
        return Path(uri).is_file()
    try:
        _fetch(uri)
        return True
    except FileNotFoundError:
        return False


_FETCHED: dict[str, str] = {}


def _fetch(uri: str) -> str:
    """Download a remote file once per process; Composer's object stores know s3://, gs://, oci://."""
    if uri in _FETCHED:
        return _FETCHED[uri]
    from composer.utils import get_file

    folder = tempfile.mkdtemp(prefix="tessera-eval-")
    atexit.register(shutil.rmtree, folder, True)  # cached for the process's life, gone with it
    dest = Path(folder) / posixpath.basename(uri)
    try:
        get_file(uri, str(dest), overwrite=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # object stores raise their own types for a missing key
        if "not found" in str(exc).lower() or "404" in str(exc) or "NoSuchKey" in str(exc):
            raise FileNotFoundError(uri) from exc
        raise
    _FETCHED[uri] = str(dest)
    return str(dest)


def read_bytes(uri: str) -> bytes:
    return Path(_fetch(uri) if is_remote(uri) else uri).read_bytes()


def read_text(uri: str) -> str:
    try:
        return read_bytes(uri).decode("utf-8")
    except FileNotFoundError as exc:
        raise GauntletError(f"{uri}: file not found") from exc
    except UnicodeDecodeError as exc:
        raise GauntletError(f"{uri}: not UTF-8 at byte {exc.start}") from exc


def read_jsonl(uri: str) -> list[tuple[int, dict[str, Any]]]:
    """Records with their 1-based line numbers; blank lines are skipped.

    Splits on '\\n' only: str.splitlines() also breaks on U+0085 and U+2028, which occur
    inside strings of real task files (triviaqa_sm_sub.jsonl).
    """
    records = []
    for lineno, line in enumerate(read_text(uri).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GauntletError(f"{uri}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from exc
        if not isinstance(record, dict):
            raise GauntletError(f"{uri}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append((lineno, record))
    return records
