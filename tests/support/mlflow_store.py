"""Fresh MLflow sqlite stores without MLflow's migrations, for tests.

MLflow builds a new sqlite store by running its whole Alembic history, one commit per revision: 1.4 s of CPU and
about 3 s of wall time per store on the CI machine, paid by every test that makes one (and by each `tessera run`,
trainer or `mlflow server` that first opens a test's store). The suite makes dozens. `sqlite_store` instead
copies a store migrated once per session, minus its default experiment: the first client to open the copy finds
the tables at the head revision and creates the default experiment itself, with its own artifact root, exactly
as it would in a new file.
"""

from __future__ import annotations

import shutil
import sqlite3
from functools import cache
from pathlib import Path

from tests.support.store_template import built_once


@cache
def _template() -> Path:
    from mlflow.version import VERSION

    def build(path: Path) -> None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore(f"sqlite:///{path}", str(path.parent / "artifacts"))
        store.engine.dispose()
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM experiments")  # the opener makes its own, with its artifact root

    return built_once("mlflow", VERSION, build)


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
