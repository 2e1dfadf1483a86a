"""Entrypoint of a training pod: `python -m infra.pod_launch composer -n G ... -m trainers.train ...`.

Runs the command (Composer's launcher) and exits with the code of the rank that failed first
(infra/ranks.py), so the Job's pod failure policy sees the trainer's fatal 78 even when another
local rank answered the launcher's SIGTERM with 76 first and the launcher reported that.

As a container's PID 1 it would ignore SIGTERM by default: it forwards SIGTERM and SIGINT to the
launcher, which stops its ranks (they exit 76, "stopped from outside").

When the flow asks for a watchdog (TESSERA_WATCHDOG, trainers.config.WatchdogConfig's budgets), it
runs here, outside the rank processes, as the local backend's does in the launching task: it
judges the heartbeats of this node's ranks (infra/watchdog.py), and on a hang writes the line and
every rank's Python stacks to the pod's log, kills the launcher's whole process group (SIGCONT
first) and exits HUNG (79) with the line in the pod's termination message. The pod failure policy
turns 79 into a group restart that does not count against maxRestarts (infra/manifests.py).
The standard library, and pydantic for the watchdog's budgets (the image has it: the trainer validates with it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from infra.ranks import first_crash
from infra.watchdog import Budgets, Hang, Watchdog, fresh_folder, signal_group
from trainers.contract import HEARTBEAT_DIR_ENV, HUNG, TERMINATION_LOG, TERMINATION_LOG_ENV, WATCHDOG_ENV

# The launcher's crash lines come near the end; keep a bounded window of the output to search.
_WINDOW = 256 * 1024
# The pod's own scratch: heartbeats live only as long as the launch.
HEARTBEAT_DIR = "/tmp/tessera-heartbeats"


def node_ranks(argv: list[str]) -> list[int]:
    """The global ranks Composer's launcher starts on this node: `-n G` of them from `--node_rank N` * G."""

    def value(flag: str, default: int) -> int:
        return int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else default

    per_node = value("-n", 1)
    return [value("--node_rank", 0) * per_node + i for i in range(per_node)]


class PodWatchdog:
    """The watchdog of one pod's ranks, on a thread; `hang` is what it found once it killed the group."""

    def __init__(self, watchdog: Watchdog, group: int, say):
        self.watchdog, self.group, self.say = watchdog, group, say
        self.hang: Hang | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-pod-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.watchdog.budgets.poll_s):
            hang = self.watchdog.check()
            if hang is None:
                continue
            self.hang = hang
            stacks = self.watchdog.stacks()  # before any rank is woken: see its docstring
            self.say(f"tessera.watchdog: {hang.line()}; every rank's stacks follow, then the group is killed\n")
            self.say(stacks + "\n")
            self.say(
                "tessera.watchdog: killed the group; the pod exits 79 and the group restarts from the last checkpoint\n"
            )
            signal_group(self.group, signal.SIGCONT)
            signal_group(self.group, signal.SIGKILL)
            return

    def stop(self) -> None:
        self.done.set()


def _terminate(code_or_line: str) -> None:
    """The pod's termination message: what the flow reads from the pod's status."""
    try:
        with open(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG), "w") as f:
            f.write(code_or_line[:4000])  # the kubelet keeps at most 4096 bytes of it
    except OSError:
        pass  # outside a container there may be none


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m infra.pod_launch COMMAND [ARGS...]", file=sys.stderr)
        return 2
    env = dict(os.environ)
    budgets = Budgets.from_json(env.get(WATCHDOG_ENV))
    beats = None
    if budgets is not None:
        beats = fresh_folder(Path(env.get(HEARTBEAT_DIR_ENV) or HEARTBEAT_DIR))
        env[HEARTBEAT_DIR_ENV] = str(beats)
    # Its own process group, so a hung group is killed whole: the launcher and every rank it started.
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    out = sys.stdout.buffer
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            out.write(text.encode())
            out.flush()

    dog = None
    if budgets is not None and beats is not None:
        dog = PodWatchdog(Watchdog(beats, budgets, node_ranks(argv)), child.pid, say)
    window = b""
    assert child.stdout is not None
    for line in iter(child.stdout.readline, b""):
        with lock:
            out.write(line)
            out.flush()
        window = (window + line)[-_WINDOW:]
    code = child.wait()
    if dog is not None:
        dog.stop()
        if dog.hang is not None:
            line = f"the watchdog found {dog.hang.line()}"
            say(f"tessera.pod: {line}; exiting {HUNG}\n")
            _terminate(line)
            return HUNG
    if code != 0:
        first = first_crash(window.decode(errors="replace"))
        if first is not None and first != code:
            print(f"tessera.pod: the launcher exited {code}; rank that failed first exited {first}", flush=True)
            code = first
    # Killed by signal N reads as -N here; a container reports 128+N, as a shell does.
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
