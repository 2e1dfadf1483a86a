"""A launch's warm start: its ranks fork from one process that has imported the trainer's modules once.

torch's elastic agent (infra/launcher.py) starts the ranks with multiprocessing; with the "forkserver" start method
they fork from a server process, which imports the modules `multiprocessing.set_forkserver_preload` names before it
forks anything. This module is the first of them, and it holds that process to two rules:

- It never initialises CUDA: a forked child of a process with a CUDA context cannot use the GPU. Here
  PYTORCH_NVML_BASED_CUDA_CHECK=1 is set before torch loads (torch.cuda.is_available() then asks NVML, not the
  driver), and torch.cuda's lazy initialisation is wrapped so that a module that calls it anyway is caught.
- It runs no torch computation on several threads: OpenMP is not fork-safe (a child of a process whose OpenMP pool
  started can hang in its first parallel region). Here torch's intra-op threads are set to 1 before the other
  modules load, so a computation a module runs at import stays on the calling thread, and a module that raises the
  count is caught; each rank sets the count back to what torch chose for this launch before anything else runs.

`verdict()` names the rule the server broke, or is None; infra/warm_seal.py, the server's last preload, records it
once every module is in and hands it to the launcher, which then starts that launch's ranks as fresh interpreters
(torch's spawn) instead of forking them, and says so in the launch log. Standard library and torch only: it loads
before anything else in the server.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

# Before torch loads, in the server; a rank inherits it, which changes nothing but how torch asks whether a GPU exists.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

import torch  # after the variable above, which torch reads when it loads

# What torch chose for this process (OMP_NUM_THREADS or the cores), restored in each rank.
_THREADS = torch.get_num_threads()
_CUDA_CALLS: list[str] = []
_SEALED: list[str | None] = []  # the server's verdict once every preload was imported (seal)


def _guard_cuda() -> None:
    lazy_init = torch.cuda._lazy_init

    def caught(*args, **kwargs):
        import traceback

        _CUDA_CALLS.append(traceback.format_stack(limit=4)[0].strip().splitlines()[0])
        return lazy_init(*args, **kwargs)

    torch.cuda._lazy_init = caught


_guard_cuda()
torch.set_num_threads(1)


def verdict() -> str | None:
    """The rule this process broke since it loaded this module (see the module docstring), or None."""
    if _CUDA_CALLS or torch.cuda.is_initialized():
        where = f" ({_CUDA_CALLS[0]})" if _CUDA_CALLS else ""
        return f"the warm process initialised CUDA{where}"
    if torch.get_num_threads() != 1:
        return f"the warm process raised torch's threads to {torch.get_num_threads()} before forking (OpenMP)"
    return None


def seal() -> None:
    """The server's verdict, taken after its last preload and before it forks anything."""
    _SEALED[:] = [verdict()]


def sealed() -> str | None:
    return _SEALED[0] if _SEALED else "the warm process was not sealed (infra/warm_seal.py)"


def _as_composer_expects() -> None:
    """Composer reads NODE_RANK, which torch's agent calls GROUP_RANK (it sets LOCAL_WORLD_SIZE itself)."""
    os.environ["NODE_RANK"] = os.environ.get("GROUP_RANK", "0")


def _own_resource_tracker() -> None:
    """This rank gets a multiprocessing resource tracker of its own, as a rank in its own interpreter had.

    A forked or spawned child inherits its launcher's, and Streaming's shared memory registers with it (the node's
    first rank creates the segments, `<prefix>_locals` and the rest). A rank killed -9, or ending as every
    multiprocessing child does (os._exit: Streaming's atexit cleanup never runs), leaves its segments registered
    there until the launcher exits. trainers/shm.py meanwhile finds them stale and frees their prefix for another
    launch on the host; the launcher's exit then unlinks those names under that launch's live ranks. A rank's own
    tracker unlinks what the rank left as soon as it ends, before anyone can take the prefix.
    """
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    inherited, tracker._fd = tracker._fd, None  # the next registration starts this rank's own (ensure_running)
    if inherited is not None:
        os.close(inherited)


def run_rank(module: str, argv: list[str], local_rank: str) -> None:
    """A rank's entry: `python -m module argv` in this process, forked from the warm server. Local rank 0 writes
    which start was used to the launch log."""
    gc.enable()  # off in the server since infra/warm_open.py; its imports were frozen before this fork (warm_seal)
    _own_resource_tracker()
    say_start = local_rank == "0"
    _as_composer_expects()
    problem = sealed()
    if problem is not None:  # the launcher forks only from a server that kept the rules: never seen, but never run on
        raise RuntimeError(f"a rank was forked from a warm process that broke its rules: {problem}")
    torch.set_num_threads(_THREADS)
    if say_start:
        warm = sorted(m for m in sys.modules if m.split(".")[0] in ("trainers", "composer", "transformers"))
        print(
            f"tessera.launcher: ranks forked from a warm process ({len(warm)} trainer modules imported once)",
            flush=True,
        )
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_cold(module: str, argv: list[str], local_rank: str) -> None:
    """A rank's entry in a fresh interpreter (start method spawn): the same command. The launcher says why."""
    _own_resource_tracker()
    _as_composer_expects()
    torch.set_num_threads(_THREADS)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
