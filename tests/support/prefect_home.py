"""Prefect homes whose database is already migrated, for tests.

A `tessera` command with no Prefect server configured starts Prefect's temporary server on <work_dir>/prefect
(tasks/runs/runtime.work_prefect_home), and `tessera up` its server there too. On a new sqlite file the server first
runs Prefect's whole Alembic history, one revision at a time: a temporary server took about 8 CPU s on a new file and
about 5 on a copy of a migrated one (this 2-core machine, 2026-11-29), paid by each of the ~30 servers a suite
starts. `seed_prefect_home` instead copies a database migrated once per Prefect version into the home: the server
finds it at the head revision and goes on as it does on every start (block registration, services), exactly as on a
database an earlier run left there.

Only for homes a test means to start a server in: tests whose work dir must stay empty or be a disk of its own
(test_refusals.py's early refusals, test_flow_params.py's refused run names, test_disk_full.py) leave it alone.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from functools import cache
from pathlib import Path

from tests.support.store_template import built_once

_MIGRATE = """
import asyncio
from prefect.server.database import provide_database_interface

asyncio.run(provide_database_interface().create_db())
"""


@cache
def _template() -> Path:
    from importlib.metadata import version

    def build(path: Path) -> None:
        home = path.with_suffix(".home")
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        # a process of its own: the migrations' settings and engine stay out of the test's process
        subprocess.run([sys.executable, "-c", _MIGRATE], env=env, check=True, timeout=600, capture_output=True)
        with sqlite3.connect(home / "prefect.db") as conn:  # one self-contained file: the write-ahead log folded in
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
        os.replace(home / "prefect.db", path)
        shutil.rmtree(home, ignore_errors=True)

    return built_once("prefect", version("prefect"), build)


def seed_prefect_home(home: Path) -> Path:
    """`home` with a migrated Prefect database in it, unless it already has one."""
    home = Path(home)
    db = home / "prefect.db"
    if not db.exists():
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), db)
    return home
