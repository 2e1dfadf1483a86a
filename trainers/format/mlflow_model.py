"""A checkpoint as an MLflow Model (transformers flavor, text generation), without Prefect.

Used by registration in the flow process (local backend) and by the evaluation pod on a cluster,
where the model is already loaded and the flow pod must never load it.
"""

from __future__ import annotations

from pathlib import Path

GENERATE_TOKENS = 64  # what pyfunc's predict generates unless the caller says otherwise


def save_mlflow_model(hf_dir: Path, out: Path, card: str = "") -> Path:
    """An MLflow Model of an HF directory, with pinned requirements, a signature that lets callers pass
    `max_new_tokens` and friends at predict time, and its own model card (so MLflow does not go looking
    for one on the Hugging Face hub)."""
    from importlib.metadata import version

    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.models import infer_signature

    signature = infer_signature("Once upon a time", "there was", params={"max_new_tokens": GENERATE_TOKENS})
    requirements = [f"{pkg}=={version(pkg)}" for pkg in ("torch", "transformers", "tokenizers", "safetensors")]
    mlflow.transformers.save_model(
        str(hf_dir),
        path=str(out),
        task="text-generation",
        signature=signature,
        # Pinned here rather than inferred: inference imports the model in a subprocess (slow, and it
        # would record whatever happens to be installed beside us).
        pip_requirements=requirements,
        model_config={"max_new_tokens": GENERATE_TOKENS},
        model_card=ModelCard(f"---\nlicense: other\ntags: [tessera]\n---\n{card or 'A tessera checkpoint.'}\n"),
    )
    return out


def weights_mb(hf_dir: Path) -> float:
    return sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors")) / 2**20


def publish(model_dir: Path, uri: str) -> str:
    """Upload an MLflow Model directory to object storage (MLflow's own S3 client); returns `uri`."""
    from mlflow.store.artifact.s3_artifact_repo import S3ArtifactRepository

    S3ArtifactRepository(uri).log_artifacts(str(model_dir))
    return uri


def model_uri_for(folder: str, tokens: int) -> str:
    """Where the MLflow Model of a run's checkpoint at `tokens` lives beside its checkpoints."""
    return f"{folder.rstrip('/')}/models/tok-{tokens:012d}"


def model_version_for(client, uri: str):
    """The model version a `models:/name@alias` or `models:/name/N` URI names (ValueError if malformed)."""
    ref = uri.removeprefix("models:/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return client.get_model_version_by_alias(name, alias)
    name, _, version = ref.rpartition("/")
    if not name or not version.isdigit():
        raise ValueError(f"{uri}: expected models:/name@alias or models:/name/<version>")
    return client.get_model_version(name, version)


def download_model(uri: str, tracking_uri: str, dest: str) -> str:
    """A local directory holding what a `models:/` or `runs:/` URI names.

    Resolved through a client bound to `tracking_uri` for both tracking and registry: MLflow's own
    `models:/` download path looks the run up in the process-default tracking store, which is
    ./mlflow.db in the working directory when none is set.
    """
    import mlflow.artifacts
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    source = uri if uri.startswith("runs:/") else model_version_for(client, uri).source
    if source.startswith("runs:/"):
        run_id, _, path = source.removeprefix("runs:/").partition("/")
        return client.download_artifacts(run_id, path, dest)
    if Path(source.removeprefix("file://")).is_dir():
        return source.removeprefix("file://")
    return mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=dest, tracking_uri=tracking_uri)
