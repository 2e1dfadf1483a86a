"""The pipeline's MLflow run: found or created once per run name, so retries and reruns reuse it.

(evaluation/mlflow_report.py puts a gauntlet report on a run; this module owns the run itself.)

Two kinds of trouble with the tracking server, handled differently:
- at the start of a run (`open_run`) an unusable server is bad input: fail in seconds with one
  line, before any compute is spent;
- once the run is under way, a server that blips must not cost the run: calls retry with
  backoff for `TRACKING_RETRY_S` before giving up with `TrackingUnavailable`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.tracking_config import TrackingConfig
from trainers.contract import EXIT_FAILED, OneLineError
from trainers.disk import no_space

RUN_NAME_TAG = "tessera.run_name"
END_TAG = "tessera.end"
# The experiment's kind as MLflow's UI names it: "custom_model_development" is "Machine learning" (model
# training), whose landing tab is Runs, not GenAI's Traces. The 3.17 UI ships with its sidebar switch
# ("GenAI apps & agents" / "Model training") deciding instead, so tessera's links also ask for it (`_ui`).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Long enough to ride out a server restart; each attempt itself is bounded by MLFLOW_HTTP_REQUEST_TIMEOUT.
TRACKING_RETRY_S = float(os.environ.get("TESSERA_TRACKING_RETRY_S", "300"))

T = TypeVar("T")
log = logging.getLogger("tessera.tracking")


class TrackingError(OneLineError, RuntimeError):
    """The tracking server or store cannot be used; str() is one line naming the URI."""


class TrackingUnavailable(OneLineError, RuntimeError):
    """The tracking server stayed unreachable mid-run for longer than the retry budget."""

    exit_code = EXIT_FAILED


# `tessera up` tells its worker the MLflow store it serves: a run tracking into another one says so in its log.
SERVED_STORE_ENV = "TESSERA_SERVED_TRACKING_URI"


def served_elsewhere(tracking_uri: str) -> str | None:
    """One line when a run's store is not the one `tessera up` serves (its runs and models would not show in that
    MLflow), else None."""
    served, mine = os.environ.get(SERVED_STORE_ENV), resolved_uri(tracking_uri)
    if not served or served == mine:
        return None
    return (
        f"this run tracks into {mine}, not the MLflow store `tessera up` serves ({served}): its runs and models "
        "show in that store's MLflow, not at the MLflow link `tessera up` printed"
    )


def resolved_uri(uri: str) -> str:
    """Make a relative `sqlite:///` URI absolute, so subprocesses in other directories agree on it."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _bounded_http() -> None:
    """MLflow's REST client retries one request for minutes by default (7 tries, growing backoff): a dead
    server must fail a call in seconds, and `retrying` decides how long to keep trying. The trainer
    inherits these too."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def client_for(tracking: TrackingConfig):
    """An MlflowClient for the tracking URI; raises TrackingError at once if it is unreachable."""
    from mlflow.tracking import MlflowClient

    uri = resolved_uri(tracking.tracking_uri)
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    _bounded_http()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure here means the store is unusable
        raise TrackingError(f"tracking.tracking_uri: cannot use MLflow at {uri}: {_one_line(exc)}") from None
    return client


def retrying(what: str, fn: Callable[[], T], budget_s: float | None = None) -> T:
    """Call `fn` until it succeeds or `budget_s` has passed; MLflow errors that reject the request itself
    (a bad parameter, a missing resource: HTTP 4xx) are not outages and are raised at once."""
    from mlflow.exceptions import MlflowException

    budget = TRACKING_RETRY_S if budget_s is None else budget_s
    deadline, delay, warned = time.monotonic() + budget, 1.0, False
    while True:
        try:
            result = fn()
            if warned:
                log.warning("%s: MLflow answers again", what)
            return result
        except (MlflowException, OSError, ConnectionError, TimeoutError) as exc:
            if isinstance(exc, MlflowException) and exc.get_http_status_code() < 500:
                raise  # the server answered: the same request gets the same answer
            if no_space(exc) is not None:  # not an outage: waiting frees no disk
                raise TrackingError(f"{what}: MLflow's store has no space left ({_one_line(exc)})") from None
            if time.monotonic() + delay > deadline:
                raise TrackingUnavailable(f"{what}: MLflow unreachable for {budget:.0f} s: {_one_line(exc)}") from None
            if not warned:
                log.warning("%s: MLflow unreachable (%s); retrying for up to %.0f s", what, _one_line(exc), budget)
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


def _mlflow_client(tracking: TrackingConfig):
    """A client without the reachability probe, for calls that go through `retrying`."""
    from mlflow.tracking import MlflowClient

    _bounded_http()
    uri = resolved_uri(tracking.tracking_uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def open_run(tracking: TrackingConfig, run_name: str, tags: dict[str, str]) -> str:
    """Return the id of the MLflow run for `run_name`, creating it (and the experiment) if needed."""
    client = client_for(tracking)
    experiment = client.get_experiment_by_name(tracking.experiment)
    if experiment is None:
        location = tracking.artifact_location
        if location and "://" not in location:
            location = Path(location).resolve().as_uri()
        experiment_id = client.create_experiment(
            tracking.experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    else:
        experiment_id = experiment.experiment_id
        if EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind a person chose in the UI stays
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        if END_TAG in found[0].data.tags:  # it said how an earlier attempt ended; close_run writes this one's
            client.delete_tag(run_id, END_TAG)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        return run_id
    return client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **tags}).info.run_id


@task(cache_policy=NO_CACHE)
def record_run(
    tracking: TrackingConfig, run_id: str, params: dict[str, str], tags: dict[str, str], files: dict[str, str]
) -> list[str]:
    """Record what was run: params, tags and files (artifact dir -> local path) on the MLflow run.

    MLflow params cannot change once logged. A rerun of the same run name with a different value
    (say a new learning rate from the form) keeps the first value as the param and records the
    change as a `tessera.param_changed.<key>` tag; returns the changed keys.
    """
    from mlflow.entities import Param, RunTag

    client = _mlflow_client(tracking)
    logged = retrying("reading the run's params", lambda: client.get_run(run_id).data.params)
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
    fresh = [Param(k, v) for k, v in sorted(params.items()) if k not in logged]
    all_tags = {**tags, **{f"tessera.param_changed.{k}": f"{logged[k]} -> {params[k]}" for k in changed}}
    for i in range(0, max(len(fresh), 1), 100):  # log_batch takes at most 100 params
        retrying(
            "logging params and tags",
            lambda i=i: client.log_batch(
                run_id, params=fresh[i : i + 100], tags=[RunTag(k, v) for k, v in all_tags.items()] if i == 0 else []
            ),
        )
    for artifact_dir, path in files.items():
        retrying(f"logging {path}", lambda a=artifact_dir, p=path: client.log_artifact(run_id, p, artifact_path=a))
    return changed


@task(cache_policy=NO_CACHE)
def close_run(
    tracking: TrackingConfig, run_id: str, status: str, note: str | None = None, budget_s: float | None = None
) -> None:
    """End the run with `status` (FINISHED, FAILED, KILLED); `note` says why, as the `tessera.end` tag."""
    client = _mlflow_client(tracking)
    # always written: a reopened run had its earlier end's tag removed, and this end must not look unexplained
    text = note or status
    retrying("tagging the run's end", lambda: client.set_tag(run_id, END_TAG, text[:5000]), budget_s)
    retrying("closing the MLflow run", lambda: client.set_terminated(run_id, status=status), budget_s)


def _ui(tracking: TrackingConfig, page: str) -> str:
    """A page of the MLflow server itself, or of the UI `tessera up`/`mlflow ui` serves, in its model-training view.

    MLflow 3.17's UI takes GenAI or model training from the page's `workflowType` (then from the browser's last
    choice, GenAI by default), not from the experiment's kind tag; its GenAI view hides the Model registry."""
    uri = tracking.tracking_uri
    base = os.environ.get("TESSERA_MLFLOW_UI_URL") or (
        uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    )
    return f"{base.rstrip('/')}/#/{page}?workflowType=machine_learning"


def run_ui_url(tracking: TrackingConfig, run_id: str, experiment_id: str) -> str:
    """Where a person opens this run."""
    return _ui(tracking, f"experiments/{experiment_id}/runs/{run_id}")


def model_ui_url(tracking: TrackingConfig, name: str) -> str:
    """Where a person sees the registered model's versions, aliases and descriptions."""
    from urllib.parse import quote

    return _ui(tracking, f"models/{quote(name, safe='')}")


def find_run(tracking: TrackingConfig, run_name: str):
    """The MLflow run of `run_name`, or None (used by the flow's crash and cancel hooks)."""
    client = _mlflow_client(tracking)
    experiment = client.get_experiment_by_name(tracking.experiment)
    if experiment is None:
        return None
    found = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1
    )
    return found[0] if found else None
