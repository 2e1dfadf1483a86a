"""A model whose weights are about to be loaded: its parameters on the meta device, then allocated uninitialised.

Part of the checkpoint format package because loading a checkpoint for evaluation or export (this
package's export.py) builds the model this way, as the trainer does for a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device: no memory and no init kernels.

    Buffers stay real, because some are computed in __init__ and never saved (RoPE's inv_freq is a
    non-persistent buffer): a checkpoint would not bring them back. (accelerate's
    `init_empty_weights(include_buffers=False)` does this; accelerate is not a dependency.)
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_like_meta(model: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Allocate the meta parameters of `model` on `device`, uninitialised, keeping tied ones tied.

    For a model whose weights a checkpoint is about to overwrite: the memory is needed (every DDP
    rank holds a replica), the init is not (at 7B it is minutes of normal_ on every rank).
    """
    allocated: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in allocated:  # a tied weight is one Parameter in two modules
                allocated[id(param)] = torch.nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
            module._parameters[name] = allocated[id(param)]
    return model
