from infra.backends import backend_for
from infra.lifecycle import LaunchRefused, allow_launches, cancel_all, stopping

__all__ = ["LaunchRefused", "allow_launches", "backend_for", "cancel_all", "stopping"]
