"""Fresh MLflow sqlite stores without MLflow's migrations, for tests.

MLflow builds a new sqlite store by running its whole Alembic history, one commit per revision: 1.4 s of CPU and
about 3 s of wall time per store on the CI machine, paid by every test that makes one (and by each `tessera run`,
trainer or `mlflow server` that first opens a test's store). The suite makes dozens. `sqlite_store` instead
copies a store migrated once per session, minus its default experiment: the first client to open the copy finds
the tables at the head revision and creates the default experiment itself, with its own artifact root, exactly
as it would in a new file.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from functools import cache
from pathlib import Path


@cache
def _template() -> Path:
    from filelock import FileLock
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.version import VERSION

    folder = Path(tempfile.gettempdir()) / "tessera-test-mlflow-template"
    folder.mkdir(exist_ok=True)
    done = folder / f"mlflow-{VERSION}.db"
    with FileLock(str(folder / f"mlflow-{VERSION}.lock")):  # both xdist workers may ask at once
        if not done.exists():
            building = folder / f"building-{os.getpid()}.db"
            building.unlink(missing_ok=True)
            store = SqlAlchemyStore(f"sqlite:///{building}", str(folder / "artifacts"))
            store.engine.dispose()
            with sqlite3.connect(building) as conn:
                conn.execute("DELETE FROM experiments")  # the opener makes its own, with its artifact root
            os.replace(building, done)
    return done


def sqlite_store(db: Path) -> str:
    """An MLflow tracking/registry URI for a new store at `db` (made now unless `db` exists)."""
    db = Path(db)
    if not db.exists():
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            return f"sqlite:///{db}"  # a test of a folder that is a file: what opens it meets that, as in a real run
        shutil.copyfile(_template(), db)
    return f"sqlite:///{db}"
