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
            why = err.get("ctx", {}).get("error", msg)
            if not text.strip("\x00 \t\r\n") or why.startswith("EOF while parsing"):
                # Cut short: a power loss before job files were written durably (tasks/training/train.py write_job
                # now uses trainers/format/atomic.py). Only the flow knows the job, and it writes the file
                # again as it starts, before any launch: so fatal for this launch (the same file fails every
                # relaunch), while a rerun of the flow resumes the run from its checkpoints.
                raise FatalError(
                    f"{path}: empty or cut short ({why}); a rerun of the flow writes it again and resumes the run"
                ) from None
            msg = f"not valid JSON ({why})"
        raise FatalError(f"{path}: {where}: {msg}") from None
