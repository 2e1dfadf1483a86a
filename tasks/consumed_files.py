"""Consumed files: which input files continued pretraining has already trained on, kept in MLflow.

(Not to be confused with trainers/trained_stages.py, the stages a run has trained on.)

Append-only: each finished continued flow run logs one record, `ledger/consumed-<flow run id>.json`
(the files it trained on, with their size and mtime or S3 ETag), onto its MLflow run, tagged
`tessera.continues_model=<registered model>`. No record is ever rewritten: the files a model has
consumed are the union of every record on every such run, whatever the run's status (a later
failed attempt under the same run name must not hide an earlier record). A file is new when no
record holds it with the same fingerprint, so an edited file counts as new data.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

from tasks.data import storage
from tasks.data.errors import DataError
from tasks.tracking_config import TrackingConfig

# the folder (named `ledger` before the word meant only the goodput ledger: kept, the registry's history is there);
# records are consumed-<flow run id>.json
CONSUMED_ARTIFACT = "ledger/consumed.json"
MODEL_TAG = "tessera.continues_model"


class Consumed(BaseModel):
    """One input file a continued run trained on."""

    path: str = Field(..., description="Local path or s3:// URI.")
    size: int = Field(..., description="Bytes.")
    version: str = Field(..., description="mtime_ns locally, the ETag on S3.")
    run: str = Field("", description="The continued run that consumed it.")

    @property
    def key(self) -> tuple[str, int, str]:
        return self.path, self.size, self.version


def list_inputs(new_data: str) -> list[Consumed]:
    """Files under a directory (recursively, hidden files skipped), matching a glob, or under an s3:// prefix.

    An empty directory or a prefix with nothing under it is simply no new data; a path that does
    not exist at all is a mistake and says so.
    """
    if storage.is_s3(new_data):
        try:
            refs = storage.expand([new_data])
        except DataError as exc:
            if "no S3 objects match" in str(exc):
                return []
            raise
    elif os.path.isdir(new_data):
        names = sorted(
            str(p)
            for p in Path(new_data).rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(new_data).parts)
        )
        refs = storage.expand(names) if names else []
    elif any(c in new_data for c in "*?["):
        try:
            refs = storage.expand([new_data])
        except DataError:
            return []
    elif os.path.isfile(new_data):
        refs = storage.expand([new_data])
    else:
        raise DataError(new_data, f"new data: no such directory, file or glob (resolved against {os.getcwd()})")
    return [
        Consumed(
            path=str(Path(r.path).resolve()) if not storage.is_s3(r.path) else r.path, size=r.size, version=r.version
        )
        for r in refs
    ]


def _client(tracking: TrackingConfig):
    from tasks.mlflow_run import client_for

    return client_for(tracking)


def _records(client, run_id: str) -> list[str]:
    """Its consumed-files records: consumed-*.json (and consumed.json, written before records were per flow run)."""
    folder = str(Path(CONSUMED_ARTIFACT).parent)
    return sorted(
        f.path
        for f in client.list_artifacts(run_id, folder)
        if not f.is_dir and Path(f.path).name.startswith("consumed") and f.path.endswith(".json")
    )


def consumed(tracking: TrackingConfig, registered_model: str) -> tuple[list[Consumed], str | None]:
    """(every file any continued run of the model recorded as consumed, the name of the latest such run)."""
    client = _client(tracking)
    experiment = client.get_experiment_by_name(tracking.experiment)
    if experiment is None:
        return [], None
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{MODEL_TAG}` = '{registered_model}'",
        order_by=["attributes.start_time DESC"],
        max_results=1000,
    )
    out: list[Consumed] = []
    latest = None
    for run in runs:
        records = _records(client, run.info.run_id)
        if records and latest is None:
            latest = run.data.tags.get("tessera.run_name", run.info.run_name)
        for record in records:
            with tempfile.TemporaryDirectory(prefix="tessera-consumed-") as tmp:
                local = client.download_artifacts(run.info.run_id, record, tmp)
                out += [Consumed.model_validate(entry) for entry in json.loads(Path(local).read_text())]
    return out, latest


def new_inputs(inputs: list[Consumed], seen: list[Consumed]) -> list[Consumed]:
    done = {c.key for c in seen}
    return [c for c in inputs if c.key not in done]


def record(tracking: TrackingConfig, run_id: str, files: list[Consumed], flow_run_id: str | None) -> str:
    """Log one flow run's consumed files as a record of its own; called only once the run has trained and
    registered them. Returns the record's artifact path. Never overwrites a record: the name is the flow
    run's (a retry of one flow run writes the same files again) or, outside Prefect, a fresh one."""
    import uuid

    from tasks.mlflow_run import retrying

    client = _client(tracking)
    name = f"consumed-{flow_run_id or uuid.uuid4().hex}.json"
    folder = str(Path(CONSUMED_ARTIFACT).parent)
    with tempfile.TemporaryDirectory(prefix="tessera-consumed-") as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps([f.model_dump() for f in files], indent=1))
        retrying("logging the consumed-files record", lambda: client.log_artifact(run_id, str(path), folder))
    return f"{folder}/{name}"
