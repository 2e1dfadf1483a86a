"""The pipeline's MLflow run: found or created once per run name, so retries and reruns reuse it."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.tracking_config import TrackingConfig

RUN_NAME_TAG = "tessera.run_name"


class TrackingError(RuntimeError):
    """The tracking server or store cannot be used; str() is one line naming the URI."""


def resolved_uri(uri: str) -> str:
    """Make a relative `sqlite:///` URI absolute, so subprocesses in other directories agree on it."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def client_for(tracking: TrackingConfig):
    """An MlflowClient for the tracking URI; raises TrackingError at once if it is unreachable."""
    from mlflow.tracking import MlflowClient

    uri = resolved_uri(tracking.tracking_uri)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    # MLflow's REST client retries for minutes by default; a dead server should fail in seconds.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means the store is unusable
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackingError(f"tracking.tracking_uri: cannot use MLflow at {uri}: {reason[:200]}") from None
    return client


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def open_run(tracking: TrackingConfig, run_name: str, tags: dict[str, str], params: dict[str, str]) -> str:
    """Return the id of the MLflow run for `run_name`, creating it (and the experiment) if needed."""
    client = client_for(tracking)
    experiment = client.get_experiment_by_name(tracking.experiment)
    if experiment is None:
        location = tracking.artifact_location
        if location and "://" not in location:
            location = Path(location).resolve().as_uri()
        experiment_id = client.create_experiment(tracking.experiment, artifact_location=location)
    else:
        experiment_id = experiment.experiment_id
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1
    )
    if found:
        run_id = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
    else:
        run = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **tags})
        run_id = run.info.run_id
        for key, value in params.items():
            client.log_param(run_id, key, value)
    return run_id


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def close_run(tracking: TrackingConfig, run_id: str, status: str) -> None:
    client_for(tracking).set_terminated(run_id, status=status)
