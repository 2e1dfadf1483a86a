"""How a stage's launch ends: which budget its exit code draws on (tasks/training/train.py's docstring says why
there are two), and the one-line errors a stage fails with, each with the exit code the `tessera` command returns.
"""

from __future__ import annotations

from typing import Literal

from trainers.contract import EXIT_BAD_INPUT, EXIT_FAILED, FATAL, INTERRUPTED, OneLineError

USAGE_ERROR = 2  # argparse


class TrainingFailed(OneLineError, RuntimeError):
    """A training job exited non-zero; relaunching it resumes from its last checkpoint."""

    exit_code = EXIT_FAILED


class TrainingFatal(TrainingFailed):
    """A training job failed in a way a relaunch would repeat (bad job, divergence, edited stage)."""

    exit_code = EXIT_BAD_INPUT


class DiskFull(TrainingFatal):
    """The disk holding the save folder cannot take another checkpoint: a relaunch would fail the same way."""


class DataDamaged(TrainingFatal):
    """The trainer found prepared data whose bytes are not what its index records; its done-marker is withdrawn."""


class NoProgress(TrainingFatal):
    """Relaunches that keep ending without a new checkpoint: the stage stops instead of burning its budget."""


class RestartsSpent(TrainingFailed):
    """A Kubernetes group failed after the cluster restarted it compute.kubernetes.max_restarts times: that budget
    counted these failures, and a retry of the task would start it over with a fresh one."""


class PreemptionBudgetSpent(TrainingFailed):
    """Stopped from outside more than compute.max_preemptions times; a rerun resumes, a retry would not help now."""


def exit_kind(code: int) -> Literal["ok", "preempted", "failed", "fatal"]:
    """Which budget a job's exit code draws on (see the module docstring)."""
    if code == 0:
        return "ok"
    if code == FATAL or code == USAGE_ERROR:
        return "fatal"
    if code < 0 or code >= 128 or code == INTERRUPTED:  # Popen reports -N, shells 128+N, for signal N
        return "preempted"
    return "failed"
