"""Recipe `compute` sections the Kubernetes tests render and run, as a user would write them."""

from __future__ import annotations

import json

from infra.config import ComputeConfig

IMAGE = "registry.example.com/tessera/train:0.1.0"

CPU_ONE_NODE = {
    "backend": "kubernetes",
    "procs_per_node": 2,
    "kubernetes": {
        "image": IMAGE,
        "namespace": "tessera",
        "nodes": 1,
        "cpu": "4",
        "memory": "16Gi",
        "shm_size": "2Gi",
        "s3_credentials": {"name": "tessera-s3"},
    },
}

GPU_TWO_NODES = {
    "backend": "kubernetes",
    "max_preemptions": 5,
    "kubernetes": {
        "image": IMAGE,
        "namespace": "training",
        "nodes": 2,
        "gpus_per_node": 8,
        "cpu": "96",
        "memory": "1600Gi",
        "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east5-a"]}
                            ]
                        }
                    ]
                }
            }
        },
        "priority_class_name": "training-high",
        "service_account_name": "tessera-trainer",
        "image_pull_secrets": ["registry-creds"],
        "s3_credentials": {
            "name": "tessera-s3",
            "keys": {"AWS_ACCESS_KEY_ID": "access-key", "AWS_SECRET_ACCESS_KEY": "secret-key"},
        },
        "mlflow_credentials": {"name": "mlflow-auth"},
        "secrets": [
            {"name": "wandb", "keys": {"WANDB_API_KEY": "api-key"}},
            {"name": "hf-hub", "keys": {"HF_TOKEN": "token"}},
        ],
        "env": {"AWS_ENDPOINT_URL": "https://s3.example.com", "NCCL_DEBUG": "WARN"},
        "cache": {"size": "500Gi"},
        "max_restarts": 4,
    },
}

GPU_KUEUE = {
    **GPU_TWO_NODES,
    "kubernetes": {**GPU_TWO_NODES["kubernetes"], "queue_name": "team-a", "avoid_slow_nodes": True},
}

INDEXED_JOB = {
    **GPU_TWO_NODES,
    "kubernetes": {**GPU_TWO_NODES["kubernetes"], "api": "indexed-job", "cache": {"claim_name": "streaming-cache"}},
}

VARIANTS = {
    "cpu-1-node": CPU_ONE_NODE,
    "gpu-2x8": GPU_TWO_NODES,
    "gpu-2x8-kueue": GPU_KUEUE,
    "indexed-job-2x8": INDEXED_JOB,
}


def compute(raw: dict) -> ComputeConfig:
    return ComputeConfig.model_validate(raw)


def job_json(run: str = "tiny", save_folder: str = "/flow/.tessera/runs/tiny/checkpoints") -> str:
    """A job file as the flow writes it (only the fields the launcher reads matter here)."""
    return json.dumps(
        {
            "run_name": run,
            "save_folder": save_folder,
            "seq_len": 128,
            "streams": {"literary": "s3://data/literary-abc/train"},
            "train": {"stream_cache_limit": None},
        }
    )
