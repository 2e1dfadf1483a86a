"""Entrypoint of a training pod: `python -m infra.pod_launch composer -n G ... -m trainers.train ...`.

Runs the command (Composer's launcher) and exits with the code of the rank that failed first
(infra/ranks.py), so the Job's pod failure policy sees the trainer's fatal 78 even when another
local rank answered the launcher's SIGTERM with 76 first and the launcher reported that.

As a container's PID 1 it would ignore SIGTERM by default: it forwards SIGTERM and SIGINT to the
launcher, which stops its ranks (they exit 76, "stopped from outside"). Standard library only.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from infra.ranks import first_crash

# The launcher's crash lines come near the end; keep a bounded window of the output to search.
_WINDOW = 256 * 1024


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m infra.pod_launch COMMAND [ARGS...]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    window = b""
    out = sys.stdout.buffer
    assert child.stdout is not None
    for line in iter(child.stdout.readline, b""):
        out.write(line)
        out.flush()
        window = (window + line)[-_WINDOW:]
    code = child.wait()
    if code != 0:
        first = first_crash(window.decode(errors="replace"))
        if first is not None and first != code:
            print(f"tessera.pod: the launcher exited {code}; rank that failed first exited {first}", flush=True)
            code = first
    # Killed by signal N reads as -N here; a container reports 128+N, as a shell does.
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
