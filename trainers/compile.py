"""Compiling the model for training (`train.compile`): each decoder block's forward, by inductor.

Why: eager HF Llama is thousands of small kernels a step, RMSNorm, RoPE, SwiGLU and the residuals each
several unfused elementwise passes in fp32, and the CPU cannot launch them fast enough to keep a GPU busy.
Compiled, the same model runs at twice the throughput (bench/mfu.py measures it against a plain compiled
loop).

Why per block (torchtitan's pattern) and not the whole model:
- One graph serves every block: the blocks share one `forward`, dynamo treats their parameters as inputs,
  so a 24-block model compiles one block once (per microbatch shape), in seconds, not the unrolled model.
- Only `forward` is compiled, not the module's call: hooks stay outside the graphs. FSDP2's all-gather and
  reshard hooks, and activation checkpointing's wrapper, run around each compiled block exactly as they run
  around an eager one, whatever order Composer wraps them in, and the state dict's names do not change
  (a compiled run's checkpoints are an eager run's, and resume into either).
- DDP's gradient hooks fire as each block's compiled backward produces its gradients.
The embeddings, the final norm and the head stay eager; the head and the loss are trainers/lm_loss.py.

Shapes are static (`dynamic=False`): a microbatch size is compiled once, and the next one Composer's
`device_microbatch_size: auto` tries after an out-of-memory is one more compile, never a loop of them.

Compiled artifacts outlive the process in inductor's caches (its FX graph and AOTAutograd caches, and
Triton's kernels), in a folder keyed by everything that could make an artifact stale: tessera's trainer
code, the torch, transformers and Triton versions, Python's, and the device. A relaunch with the same key
loads instead of compiling; anything else compiles into a folder of its own. The folder lives where a
relaunch finds it again: $TESSERA_COMPILE_CACHE_DIR if set, else the node's cache volume on Kubernetes
($TESSERA_CACHE_DIR), else the run's own folder (TrainJob.compile_cache_dir), else the temp dir.

While dynamo or inductor compiles, this rank's heartbeat says `compile`: the watchdog gives that phase its
own budget (a minute of compiling is neither a hang nor a slow step), and the goodput ledger its own bucket.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from trainers import heartbeat
from trainers.contract import CACHE_DIR_ENV, COMPILE_CACHE_ENV
from trainers.exit_codes import FatalError

log = logging.getLogger("tessera.compile")


def wanted(setting: bool | Literal["auto"], on_gpu: bool) -> bool:
    """train.compile: `auto` compiles on CUDA only (CPU compiles cost more than they gain on the small models CPUs
    train)."""
    return on_gpu if setting == "auto" else setting


def _device_id() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"cuda:{props.name}:sm{props.major}{props.minor}:cuda{torch.version.cuda}"
    return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}"


def _code_digest() -> str:
    """The trainer's own code: the model it builds and how it wraps it are inputs of every graph."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted(here.rglob("*.py")):
        digest.update(path.relative_to(here).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key() -> str:
    """A folder name that differs whenever a cached artifact could be stale."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    parts = [
        f"torch={torch.__version__}",
        f"git={torch.version.git_version}",
        f"transformers={installed('transformers')}",
        f"triton={installed('triton')}",
        f"python={sys.version.split()[0]}",
        f"device={_device_id()}",
        f"code={_code_digest()}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_root(job_dir: str | None) -> Path:
    explicit = os.environ.get(COMPILE_CACHE_ENV)
    if explicit:
        return Path(explicit)
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]) / "compile"
    if job_dir:
        return Path(job_dir)
    return Path(tempfile.gettempdir()) / "tessera-compile"


def use_cache(job_dir: str | None) -> Path:
    """Point inductor's and Triton's caches at this build's keyed folder (before anything compiles)."""
    folder = cache_root(job_dir) / cache_key()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return folder


class Guard:
    """What a failure to compile does (`train.compile`): with `auto`, training goes on eager, said once in a
    warning and to MLflow (`on_fallback`); with `true` it is one fatal line.

    Nothing compiles before a compiled function's first call (the first step), so the guard stands at each call:
    dynamo and inductor raise their errors there, the backward's included (static shapes: AOTAutograd compiles
    the backward with the forward). Only their errors count: an out-of-memory error from a compiled kernel is
    Composer's to handle as it would an eager one's. The seconds a failed compile took stay in the compile
    phase (the heartbeat's and the goodput ledger's), and after a fallback every guarded call runs eager."""

    def __init__(self, fatal: bool):
        self.fatal = fatal
        self.fallback: str | None = None  # why compiling failed, once it has
        self.on_fallback = None  # called with the reason, once (trainers/build.py: the MLflow tag)

    def call(self, compiled, eager, *args, **kwargs):
        if self.fallback is None:
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:
                if not isinstance(exc, _compile_errors()):
                    raise
                if _WATCH and _WATCH[0]._started is not None:  # dynamo's end callback did not run
                    _WATCH[0].end()
                self._failed(exc)
        return eager(*args, **kwargs)

    def wrap(self, fn, **options):
        """`fn` compiled with `options`, behind this guard."""
        compiled = torch.compile(fn, **options)
        return functools.wraps(fn)(functools.partial(self.call, compiled, fn))

    def _failed(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        if self.fatal:
            raise FatalError(f"train.compile is true and compiling failed: {reason}") from None
        self.fallback = reason
        log.warning("train.compile is auto and compiling failed, so this launch trains eager: %s", reason)
        if self.on_fallback is not None:
            self.on_fallback(reason)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's and inductor's errors (imported at the first failure: inductor is not imported to train eager)."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return (TorchDynamoException, InductorError)


def compile_blocks(model: torch.nn.Module, backend="inductor", guard: Guard | None = None) -> int:
    """Compile each decoder block's forward in place, behind `guard` (none: fatal on failure); returns how many.
    `model` is the HF causal LM; `backend` a torch.compile backend, by name or callable."""
    guard = guard or Guard(fatal=True)
    blocks = model.get_decoder().layers
    for block in blocks:
        block.forward = guard.wrap(block.forward, backend=backend, fullgraph=True, dynamic=False)
    return len(blocks)


class CompileWatch:
    """Counts compiles and their seconds, and keeps this rank's heartbeat in `compile` while one runs.

    Dynamo runs these callbacks around each frame it compiles, and inductor around each graph it compiles,
    a lazily compiled backward included; nested ones count once."""

    def __init__(self):
        self.compiles = 0
        self.seconds = 0.0
        self._started: float | None = None
        self._resume_phase: str | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._started = time.monotonic()
            beat = heartbeat.current()
            if beat is not None:
                self._resume_phase = beat.record["phase"]
                beat.phase("compile")

    def end(self) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.monotonic() - self._started
                self.compiles += 1
                self._started = None
            beat = heartbeat.current()
            if beat is not None and self._resume_phase is not None:
                beat.phase(self._resume_phase)
                self._resume_phase = None


_WATCH: list[CompileWatch] = []


def watch() -> CompileWatch:
    """The process's one CompileWatch, registered with dynamo on first use."""
    if not _WATCH:
        import torch._dynamo

        found = CompileWatch()
        torch._dynamo.callback_handler.register_start_callback(found.start)
        torch._dynamo.callback_handler.register_end_callback(found.end)
        _WATCH.append(found)
    return _WATCH[0]


def summary() -> str:
    """What compiling cost this process so far, and how much of it the caches saved."""
    from torch._dynamo.utils import counters

    seen = _WATCH[0] if _WATCH else CompileWatch()
    hits, misses = counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]
    graphs = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return (
        f"compiled for {seen.seconds:.1f} s ({seen.compiles} compiles); from the cache: {hits} of {hits + misses} "
        f"graphs, {graphs[0]} of {sum(graphs)} kernels"
    )


class CompileReport(Callback):
    """Says in the launch's log what compiling cost, after the first step and at the end: a relaunch that finds
    its kernels in the cache shows it here."""

    def __init__(self):
        self.said = False

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self.said:
            self.said = True
            log.info("first step: %s", summary())

    def fit_end(self, state: State, logger: Logger) -> None:
        log.info("stage end: %s", summary())


def compiled_seconds() -> float:
    """Seconds this process has spent compiling so far (0 when nothing is watched)."""
    return _WATCH[0].seconds if _WATCH else 0.0
