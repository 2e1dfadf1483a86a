"""Shared test fixtures: one Prefect harness per session, real MLflow stores under tmp dirs."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"

# Keep Prefect, HF and MLflow quiet and offline for every test process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """A real, temporary Prefect API (sqlite) shared by every test in the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def mlflow_uri(tmp_path) -> str:
    """A fresh sqlite-backed MLflow tracking store and registry."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture()
def moto_s3(monkeypatch):
    """A real S3-compatible server (moto's server mode) on localhost; yields a boto3 client for it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its buckets in process-wide state that outlives a server: start every test empty.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
    for k, v in {"S3_ENDPOINT_URL": url, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    yield boto3.client("s3", endpoint_url=url)
    server.stop()
