"""Continued pretraining: start a fresh run's optimizer from another run's checkpoint when it fits.

Adam's moments carry what the base run learned about each parameter's gradient scale; starting
them at zero makes the first steps of a continued run noisier than they need to be. They are
taken only when every parameter's state has the shape of the parameter it will drive;
otherwise the optimizer starts fresh, and the run says which happened and why.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from trainers.exit_codes import FatalError
from trainers.format.checkpoints import MANIFEST_DIR, Checked, DamagedCheckpoint, verify
from trainers.format.s3 import s3_client, split_uri
from trainers.format.safe_load import UnsafeCheckpoint, load
from trainers.format.sharded import read_values

log = logging.getLogger("tessera.train")


def _local(uri: str, tmp: str) -> str:
    """A local path of checkpoint file `uri`: itself, or a download with the save folder's manifests beside it,
    so that it is verified against what its run published (trainers/format/checkpoints.verify)."""
    if "://" not in uri:
        return uri
    from composer.utils import get_file

    dest = Path(tmp) / Path(uri).name
    get_file(uri, str(dest), overwrite=True)
    if uri.startswith("s3://"):
        bucket, key = split_uri(uri.rsplit("/", 1)[0] + f"/{MANIFEST_DIR}")
        client = s3_client()
        (Path(tmp) / MANIFEST_DIR).mkdir(exist_ok=True)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{key}/"):
            for item in page.get("Contents", []):
                client.download_file(bucket, item["Key"], str(Path(tmp) / MANIFEST_DIR / Path(item["Key"]).name))
    return str(dest)


def _say_checked(checked: Checked) -> None:
    (log.info if checked.by_manifest else log.warning)("train.init_optimizer_from: %s", checked.line)


def seed_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str, *, trust: bool = False
) -> str:
    """Load the checkpoint's optimizer state into `optimizer` if it fits `model`; returns what happened, in words.

    `checkpoint` is a file, an s3:// URI of one, or a local sharded checkpoint folder. Composer saves
    optimizer state keyed by parameter name (torch.distributed.checkpoint's format),
    so it is matched to this model by name and shape, and loaded with torch's own setter. The file is
    read weights-only (trainers/format/safe_load.py): one that needs more is a FatalError naming it,
    not a fresh start, unless `trust` (train.trust_checkpoints).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    try:
        if Path(checkpoint).is_dir():  # sharded: the optimizer's keys only; a refused index is UnsafeCheckpoint
            _say_checked(verify(checkpoint))
            optimizers = read_values(checkpoint, "state.optimizers", trust=trust)
        else:
            with tempfile.TemporaryDirectory(prefix="tessera-optim-") as tmp:
                local = _local(checkpoint, tmp)
                _say_checked(verify(local, shown=checkpoint))
                optimizers = load(local, trust=trust, shown=checkpoint)["state"]["optimizers"]
        saved = next(iter(optimizers.values()))
    except (UnsafeCheckpoint, DamagedCheckpoint) as exc:  # never a fresh start: the run asked for this state
        raise FatalError(f"train.init_optimizer_from: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint means a fresh optimizer, said plainly
        return f"fresh: cannot read the optimizer state of {checkpoint} ({type(exc).__name__}: {exc})"
    params = dict(model.named_parameters())
    names = [name for group in saved.get("param_groups", []) for name in group["params"]]
    if sorted(names) != sorted(params):
        return f"fresh: {checkpoint} holds optimizer state for other parameters ({len(names)} vs {len(params)})"
    for name, moments in saved["state"].items():
        for key, value in moments.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != params[name].shape:
                return (
                    f"fresh: {checkpoint} has {key} of {name} shaped {tuple(value.shape)}, "
                    f"the model's is {tuple(params[name].shape)}"
                )
    lrs = [g["lr"] for g in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):  # the new run's schedule sets the LR
        group["lr"] = lr
    return f"restored from {checkpoint}"
