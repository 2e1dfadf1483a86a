"""A migrated store file built once per machine and library version, for tests (tests/support/mlflow_store.py,
tests/support/prefect_home.py): each new store is a copy of it instead of a run of the library's whole migration
history."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def built_once(kind: str, version: str, build: Callable[[Path], None]) -> Path:
    """The file `build(path)` writes, built unless this machine already has it for `kind` at `version`."""
    from filelock import FileLock

    folder = Path(tempfile.gettempdir()) / f"tessera-test-{kind}-template"
    folder.mkdir(exist_ok=True)
    done = folder / f"{kind}-{version}.db"
    with FileLock(str(folder / f"{kind}-{version}.lock")):  # both xdist workers may ask at once
        if not done.exists():
            building = folder / f"building-{os.getpid()}.db"
            building.unlink(missing_ok=True)
            build(building)
            os.replace(building, done)  # whole or absent: a build killed midway leaves no template
    return done
