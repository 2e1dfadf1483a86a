"""Process exit codes of `python -m trainers.train`, the contract with whoever relaunches it.

RETRYABLE (75): the trainer failed, and relaunching the same command can succeed because it
resumes from its last complete checkpoint (a peer died under a collective, a collective timed
out, a loss anomaly scheduled a rollback).
INTERRUPTED (76): the trainer did not fail, it was stopped from outside: SIGTERM or SIGINT (a
preemption, the launcher stopping the survivors after a peer died, a cancel), or the
process that launched it is gone (trainers/supervisor.py). A relaunch resumes as well; a
supervisor counts these against a separate, larger budget, since a spot node preempted many
times says nothing about the job itself.
FATAL (78): the failure reproduces on relaunch (bad job file, NaN loss that rollback could not
cure, an edited curriculum, another trainer already owns the run, out of memory, a full disk), so
retrying only burns compute.

The values avoid 1 (any uncaught Python exception), 2 (argparse usage errors) and 128+N
(killed by signal N), so a supervisor never confuses them.
"""

from __future__ import annotations

import errno
from enum import IntEnum

from trainers import contract
from trainers.disk import no_space, permanent_fault


class ExitCode(IntEnum):
    OK = contract.OK
    RETRYABLE = contract.RETRYABLE  # 75, EX_TEMPFAIL from sysexits.h: "try again later"
    INTERRUPTED = contract.INTERRUPTED  # 76: stopped from outside; next to 75, both read as "relaunch"
    FATAL = contract.FATAL  # 78, EX_CONFIG from sysexits.h: the input is wrong, do not retry


# Sets, so a supervisor writes `code in FATAL`; more codes may join either set later.
RETRYABLE: frozenset[int] = frozenset({ExitCode.RETRYABLE.value})
INTERRUPTED: frozenset[int] = frozenset({ExitCode.INTERRUPTED.value})
FATAL: frozenset[int] = frozenset({ExitCode.FATAL.value})


# What SIGTERM/SIGINT make a rank exit with (trainers/train.py installs the handlers): INTERRUPTED,
# unless this rank has already decided its own code and is on its way out. Then the signal is the
# launcher stopping the survivors of a failure this rank knows about (a lost peer's collective
# failed, or a setup failure that every rank re-raises, and a faster peer left first), and the
# decided code is the one a supervisor must read.
_ON_SIGNAL = [ExitCode.INTERRUPTED]


def decide_exit(code: ExitCode) -> None:
    """This rank will leave with `code`: a SIGTERM or SIGINT from now on exits with it too."""
    _ON_SIGNAL[0] = code


def code_on_signal() -> ExitCode:
    return _ON_SIGNAL[0]


class FatalError(Exception):
    """A failure that relaunching cannot fix. The message is printed as one line."""


class LossAnomaly(FatalError):
    """A bad loss. Fatal if it escapes; the entrypoint turns it into a rollback while budget lasts."""

    def __init__(self, message: str, tokens: int, resume_tokens: int, already_skipped: int, stage_index: int):
        super().__init__(message)
        self.tokens = tokens
        self.resume_tokens = resume_tokens
        self.already_skipped = already_skipped
        self.stage_index = stage_index


class RetryableError(Exception):
    """A failure that relaunching (which resumes from the last checkpoint) can fix."""


class InfrastructureError(Exception):
    """The node, not the job, is unwell (a preflight probe failed): relaunched as a preemption is, on the larger
    budget, since the job itself did nothing wrong. The message is printed as one line."""


# Substrings of messages raised by torch.distributed / gloo / NCCL when a peer goes away
# or a collective times out. They surface as RuntimeError / DistBackendError, so the type
# alone does not tell a lost peer from a bug.
_RETRYABLE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl error",
    "ncclremoteerror",
    "ncclsystemerror",
    "ncclinternalerror",
    "gloo",
    "socket",
    "store",
    "cuda out of memory",
    "ecc error",
    "uncorrectable",
)


def _distributed_error_types() -> tuple[type[BaseException], ...]:
    """torch.distributed's own error types (a lost peer, a dead store, a backend failure), if torch is here."""
    try:
        import torch.distributed as dist
    except ImportError:
        return ()
    return tuple(
        t
        for t in (
            getattr(dist, n, None) for n in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
        )
        if isinstance(t, type)
    )


def _out_of_memory_types() -> tuple[type[BaseException], ...]:
    try:
        import torch
    except ImportError:
        return (MemoryError,)
    return (MemoryError, torch.OutOfMemoryError)


def classify(exc: BaseException) -> ExitCode:
    """Map an exception that escaped training to the exit code a supervisor should see.

    Types first, messages last: a message match alone would retry `FileNotFoundError:
    /mnt/datastore/...` forever because its path says "store". Out of memory and a full disk
    reproduce on relaunch with the same job, so they are fatal.
    """
    if isinstance(exc, FatalError):
        return ExitCode.FATAL
    if no_space(exc) is not None or permanent_fault(exc) is not None:  # a relaunch meets the same disk
        return ExitCode.FATAL
    if isinstance(exc, InfrastructureError):
        return ExitCode.INTERRUPTED
    if isinstance(exc, RetryableError):
        return ExitCode.RETRYABLE
    if isinstance(exc, _distributed_error_types()):
        return ExitCode.RETRYABLE
    if isinstance(exc, _out_of_memory_types()):
        return ExitCode.FATAL
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ExitCode.RETRYABLE
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT):
        return ExitCode.RETRYABLE
    if isinstance(exc, (ValueError, TypeError, KeyError, FileNotFoundError)):
        return ExitCode.FATAL
    # Untyped RuntimeErrors from gloo and NCCL (a lost peer, a collective that timed out).
    text = f"{type(exc).__name__}: {exc}".lower()
    if any(marker in text for marker in _RETRYABLE_MARKERS):
        return ExitCode.RETRYABLE
    # Unknown errors are retried: the supervisor's retry budget bounds the cost, while a
    # wrongly fatal code would stop a long run for a transient fault.
    return ExitCode.RETRYABLE
