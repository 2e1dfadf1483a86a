from infra.local import backend_for, cancel_all

__all__ = ["backend_for", "cancel_all"]
