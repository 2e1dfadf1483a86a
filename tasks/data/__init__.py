from tasks.data.config import DataConfig

__all__ = ["DataConfig"]
