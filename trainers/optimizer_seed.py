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
from trainers.format.safe_load import UnsafeCheckpoint, load
from trainers.format.sharded import read_values

log = logging.getLogger("tessera.train")


def _local(uri: str, tmp: str) -> str:
    if "://" not in uri:
        return uri
    from composer.utils import get_file

    dest = str(Path(tmp) / Path(uri).name)
    get_file(uri, dest, overwrite=True)
    return dest


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
            optimizers = read_values(checkpoint, "state.optimizers", trust=trust)
        else:
            with tempfile.TemporaryDirectory(prefix="tessera-optim-") as tmp:
                optimizers = load(_local(checkpoint, tmp), trust=trust, shown=checkpoint)["state"]["optimizers"]
        saved = next(iter(optimizers.values()))
    except UnsafeCheckpoint as exc:
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
