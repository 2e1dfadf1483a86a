from infra.local import backend_for

__all__ = ["backend_for"]
