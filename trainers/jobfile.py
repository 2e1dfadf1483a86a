"""Read a TrainJob file. Kept free of torch/composer imports, so a bad job fails in well under a second."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from trainers.config import TrainJob
from trainers.exit_codes import FatalError


def load_job(path: str | Path) -> TrainJob:
    """Parse the job file; any problem becomes a one-line FatalError naming the field."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise FatalError(f"--job {path}: cannot read ({exc.strerror})") from None
    try:
        return TrainJob.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "json_invalid":
            msg = f"not valid JSON ({err.get('ctx', {}).get('error', msg)})"
        raise FatalError(f"{path}: {where}: {msg}") from None
