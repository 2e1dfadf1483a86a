"""The backend a recipe's compute section names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from infra.config import ComputeConfig
from infra.local import LocalBackend

if TYPE_CHECKING:
    from infra.kubernetes import KubernetesBackend


def backend_for(cfg: ComputeConfig) -> LocalBackend | KubernetesBackend:
    if cfg.backend == "local":
        return LocalBackend(cfg)
    if cfg.backend == "kubernetes":
        from infra.kubernetes import KubernetesBackend  # the kubernetes client loads only when used

        return KubernetesBackend(cfg)
    raise ValueError(f"compute.backend: unsupported backend {cfg.backend!r}")
