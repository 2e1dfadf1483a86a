"""What the trainer and the processes that start it agree on: the environment it reads, the codes it exits with.

Standard library only, nothing else of tessera: infra/ starts the trainer as a command and never
imports it, yet it sets these variables and reads these codes, so it imports this module alone
(tests/test_structure.py holds that edge to this module). tasks/ and the trainer itself use the same
names, so a renamed variable cannot leave one side reading what the other no longer sets.
"""

from __future__ import annotations

# Where a node caches streamed data and fetched tokenizers; on Kubernetes, the pod's cache volume.
CACHE_DIR_ENV = "TESSERA_CACHE_DIR"
# Where compiled kernels are kept across launches (trainers/compile.py), over every other choice of folder.
COMPILE_CACHE_ENV = "TESSERA_COMPILE_CACHE_DIR"
# The process whose death stops every rank within a second (trainers/supervisor.py); set by infra/local.py.
SUPERVISOR_PID_ENV = "TESSERA_SUPERVISOR_PID"
# Who started this trainer (a flow run and its URL): a second trainer refused the run's folder names it.
HOLDER_ENV = "TESSERA_HOLDER"
# Rank 0's pod address on Kubernetes, which the pod entrypoint hands Composer's launcher.
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
# A training pod whose watchdog killed its hung ranks (infra/pod_launch.py) exits HUNG: the Job's pod failure
# policy and the JobSet's rules restart the group on it without counting it against maxRestarts, as a preemption.
HUNG = 79
# Where a pod writes the one line saying why it ended (the kubelet's terminationMessagePath): the flow reads it
# from the pod's status, so a hang is named in the run's log without fetching the pod's log.
TERMINATION_LOG_ENV = "TESSERA_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"
