"""A model whose weights are about to be loaded: its parameters on the meta device, then allocated uninitialised.

Part of the checkpoint format package because loading a checkpoint for evaluation or export (this
package's export.py) builds the model this way, as the trainer does for a resume.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()  # how deep this thread is in parameters_on_meta()
_install_lock = threading.Lock()
_original_register = torch.nn.Module.register_parameter


def _register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    _original_register(module, name, param)
    if getattr(_local, "depth", 0) and param is not None and param.device.type != "meta":
        module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside, by this thread, get their parameters on the meta device: no memory and no init kernels.

    Buffers stay real, because some are computed in __init__ and never saved (RoPE's inv_freq is a
    non-persistent buffer): a checkpoint would not bring them back. (accelerate's
    `init_empty_weights(include_buffers=False)` does this; accelerate is not a dependency.)

    Only the calling thread is affected. The flow process exports one checkpoint while its gauntlet loads another
    in a second thread: swapping `Module.register_parameter` in and out per call, as init_empty_weights does, built
    the other thread's model on meta ("Cannot copy out of meta tensor"), and two overlapping calls could restore
    each other's patch and leave every later model in the process on meta. The hook is installed once and asks a
    thread-local depth.
    """
    with _install_lock:
        if torch.nn.Module.register_parameter is not _register_parameter:
            torch.nn.Module.register_parameter = _register_parameter
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


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
