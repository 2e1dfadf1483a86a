"""What the trainer and the processes that start it agree on: the environment it reads, the codes it exits with.

Nothing of tessera but this, and pydantic for the one section both sides read (`train.watchdog`: the trainer
compares its ranks by it, the watchdog beside them judges hangs by it): infra/ starts the trainer as a command
and never imports it, yet it sets these variables and reads these codes, so it imports this module alone
(tests/test_structure.py holds that edge to this module). tasks/ and the trainer itself use the same
names, so a renamed variable cannot leave one side reading what the other no longer sets.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

# The `tessera` command's exit codes: 2 is bad input the message names (a recipe, a form value, a refused run), 1 a
# failure a rerun may get past. (A trainer's and an evaluation pod's own codes are below.)
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class OneLineError(Exception):
    """An error whose str() is one line that says it all: the `tessera` command and a flow run's log print it without
    a traceback, and the command exits `exit_code`: EXIT_BAD_INPUT for bad input the line names (the default),
    EXIT_FAILED for a failure a rerun may get past. It lives here, the one module every package may import, so that
    the gauntlet's errors (evaluation/ imports nothing of tasks/) share it."""

    exit_code = EXIT_BAD_INPUT


# Where a node caches streamed data and fetched tokenizers; on Kubernetes, the pod's cache volume.
CACHE_DIR_ENV = "TESSERA_CACHE_DIR"
# Where compiled kernels are kept across launches (trainers/compile.py), over every other choice of folder.
COMPILE_CACHE_ENV = "TESSERA_COMPILE_CACHE_DIR"
# The process whose death stops every rank within a second (trainers/supervisor.py); set by infra/local.py.
SUPERVISOR_PID_ENV = "TESSERA_SUPERVISOR_PID"
# Who started this trainer (a flow run and its URL): a second trainer refused the run's folder names it.
HOLDER_ENV = "TESSERA_HOLDER"
# Rank 0's pod address on Kubernetes: where the pods' launchers (infra/launcher.py) meet.
MASTER_ADDR_ENV = "TESSERA_MASTER_ADDR"
# The address rank 0's rendezvous store listens on (trainers/rendezvous.py); on Kubernetes the pod's own IP
# (the downward API), elsewhere unset: MASTER_ADDR, the address the launcher gave every rank.
STORE_BIND_ENV = "TESSERA_STORE_BIND"

# How long a rank waits in a collective (and the process group's store) before the launch fails: the watchdog keeps
# every budget of a multi-rank launch's training loop below it, so a hang is caught as a hang, not a failure.
DIST_TIMEOUT_ENV = "TESSERA_DIST_TIMEOUT"
DIST_TIMEOUT_S = 300.0

# Where each rank writes its heartbeat (`rank<R>.json`, trainers/heartbeat.py) and, asked by SIGUSR1, its Python
# stacks (`stacks-rank<R>.txt`), for the watchdog beside the ranks (infra/watchdog.py); set per launch by the launcher.
HEARTBEAT_DIR_ENV = "TESSERA_HEARTBEAT_DIR"
# The watchdog's budgets (JSON of trainers.config.WatchdogConfig's fields), handed by the flow to the launcher.
WATCHDOG_ENV = "TESSERA_WATCHDOG"
# What a rank is doing, as its heartbeat says: each phase has its own budget for going without progress.
PHASES = (
    "startup",
    "plan",
    "download",
    "load",
    "first_step",
    "compile",
    "data",
    "step",
    "eval",
    "save",
    "upload",
    "close",
)
HEARTBEAT_BYTES = 2048  # a heartbeat file's fixed size: rewritten in place, never truncated under a reader
STACK_SIGNAL = "SIGUSR1"  # asks a rank to write every thread's Python stack (faulthandler)

# Exit codes (trainers/exit_codes.py says what each means); the values avoid 1 (an uncaught exception),
# 2 (argparse usage) and 128+N (killed by signal N).
OK, RETRYABLE, INTERRUPTED, FATAL = 0, 75, 76, 78
# A training pod whose watchdog killed its hung ranks, its restarts in place spent (infra/launcher.py), exits HUNG:
# the Job's pod failure policy fails the Job on it and the JobSet restarts the group without counting it against
# maxRestarts, as a preemption.
HUNG = 79

# The modules a launch's ranks fork from (infra/warm.py): what `python -m trainers.train` imports before its first
# step, imported once per launch by the forkserver instead of once per rank (~8.6 s of CPU each).
WARM_MODULES = ("trainers.build", "trainers.metrics_journal", "trainers.rollback", "trainers.data_check")
# Where a pod writes the one line saying why it ended (the kubelet's terminationMessagePath): the flow reads it
# from the pod's status, so a hang is named in the run's log without fetching the pod's log.
TERMINATION_LOG_ENV = "TESSERA_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"


class WatchdogConfig(BaseModel):
    """How long each phase of a launch may go without progress before the watchdog beside the ranks declares it
    hung, dumps every rank's stacks, kills the group and relaunches it from the last checkpoint (a preemption).

    Budgets come from the work (infra/watchdog.Budgets.of): a step, an eval batch and a wait for a batch get
    step_factor x the 99th percentile of the launch's recent ones, a save or a load size_factor x its bytes at
    the write speed this launch's saves measured, never under step_floor_s and never over the phase's own
    ceiling (`<phase>_s`, plus the bytes at bytes_per_s for a size-bound phase: a 7B model's 84 GB save may be
    silent up to 600 s + 28 min). A save that is writing beats as its files grow. With several ranks no phase
    of the training loop may outlast the process group's collective timeout (TESSERA_DIST_TIMEOUT, 300 s), so
    a rank frozen anywhere is caught as a hang before its peers fail as lost.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Watch the ranks; off: only a collective's own timeout notices a hang.")
    startup_s: float = Field(
        1800, gt=0, description="Process start to the rendezvous and the start plan (imports, peers arriving)."
    )
    plan_s: float = Field(900, gt=0, description="The start plan, plus its checkpoint download and data check.")
    download_s: float = Field(600, gt=0, description="Fetching a checkpoint from the s3 save folder, plus its bytes.")
    load_s: float = Field(600, gt=0, description="Loading the checkpoint the launch resumes from, plus its bytes.")
    first_step_s: float = Field(
        900, gt=0, description="The launch's first step: first batch, memory allocated (compiling has its own)."
    )
    compile_s: float = Field(
        1800, gt=0, description="One torch.compile of a block's graph (forward or backward), with train.compile."
    )
    data_s: float = Field(
        600, gt=0, description="The most a wait for one batch may be given (a shard fetched from s3 included)."
    )
    step_floor_s: float = Field(
        60, gt=0, description="The least a learned budget (a step, an eval batch, a wait for a batch, a save) can be."
    )
    step_factor: float = Field(
        10,
        gt=1,
        description="A step's, an eval batch's and a wait for a batch's budget is this times the 99th percentile of "
        "the launch's recent ones (an eval batch not yet timed: a step's).",
    )
    eval_s: float = Field(900, gt=0, description="The most one held-out batch may be given.")
    save_s: float = Field(
        600, gt=0, description="The most a checkpoint save may go without progress, plus its bytes at bytes_per_s."
    )
    upload_s: float = Field(600, gt=0, description="The stage's last uploads to the s3 save folder, plus their bytes.")
    close_s: float = Field(900, gt=0, description="The stage's end: metrics delivered, uploads finished.")
    bytes_per_s: float = Field(
        50e6,
        gt=0,
        description="The slowest disk or network a size-bound phase is allowed (bytes per second): the ceiling of a "
        "save or load is its base budget plus its bytes at this speed, and a save's speed before one is measured.",
    )
    size_factor: float = Field(
        3,
        gt=1,
        description="A save or load may go without progress this many times its bytes at the write speed this "
        "launch's saves measured (at least step_floor_s, at most its ceiling). A save that is writing beats as its "
        "files grow, so a slow but moving save is never judged by this.",
    )
    poll_s: float = Field(2, gt=0, description="How often the watchdog reads the heartbeats.")
    no_progress_launches: PositiveInt = Field(
        3,
        description="Launches of a stage in a row that end without a new checkpoint before the stage stops as "
        "fatal instead of relaunching again.",
    )
    slow_rank_factor: float = Field(
        1.5, gt=1, description="A rank whose steps compute this much slower than the median rank's is reported."
    )
    slow_rank_every_steps: PositiveInt = Field(
        50, description="Steps between two comparisons of the ranks' timings (through the store, off the hot path)."
    )
