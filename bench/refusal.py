"""How long `tessera` takes to refuse a model it must not load, before any server starts (issue 42: <= 5 s).

The refusal: `tessera eval --model legacy.pt` on a torch file whose pickle would call `print` when loaded. tessera
reads the file with the weights-only unpickler before it starts a temporary Prefect server, so the command ends with
one `tessera: error:` line and nothing runs. Timed from the command's start to its exit, in a fresh interpreter each
time (the console script, as a person runs it), `--repeats` times; the first run is reported on its own: it is the
one a person meets after `make install` (the page cache may still be warm from the install on this machine: it
cannot be dropped without root on the host).

Anchor, in the same run: `tessera --help`, the command line's own cost (the script, its supervisor and argparse).
refusal_over_help says how much the refusal adds to what any command costs.

Prints one JSON line last: {"bench": "refusal", "first_s", "min_s", "help_s", "refusal_over_help", ...}.
Goal: first_s <= 5.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import json
import subprocess
import tempfile
import time

import torch

GOAL_S = 5.0
SCRIPT = Path(sys.executable).parent / "tessera"


class _Runs:
    """A pickle that calls print("EXECUTED") when loaded with the full unpickler."""

    def __reduce__(self):
        return (print, ("EXECUTED",))


def timed(args: list[str], expect: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    said = proc.stdout + proc.stderr
    if proc.returncode != expect:
        raise SystemExit(f"tessera {' '.join(args)} exited {proc.returncode}, not {expect}:\n{said[-3000:]}")
    return elapsed, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        legacy = Path(tmp) / "legacy.pt"
        torch.save({"state": _Runs()}, legacy)
        refuse = ["eval", "--model", str(legacy), "--tasks", "configs/gauntlet/tiny_gauntlet.yaml"]
        refusals, lines = [], []
        for _ in range(args.repeats):
            elapsed, said = timed(refuse, 2)
            if "EXECUTED" in said or "Traceback" in said:
                raise SystemExit(f"the refusal ran the pickle or printed a traceback:\n{said[-3000:]}")
            lines = [line for line in said.splitlines() if line.strip()]
            if len(lines) != 1 or not lines[0].startswith("tessera: error:"):
                raise SystemExit(f"not one tessera: error: line:\n{said[-3000:]}")
            refusals.append(elapsed)
        helps = [timed(["--help"], 0)[0] for _ in range(args.repeats)]
    result = {
        "bench": "refusal",
        "first_s": round(refusals[0], 2),
        "min_s": round(min(refusals), 2),
        "runs_s": [round(t, 2) for t in refusals],
        "help_s": round(min(helps), 2),
        "refusal_over_help": round(min(refusals) / min(helps), 2),
        "said": lines[0][:160],
        "goal_first_s": GOAL_S,
        "met": refusals[0] <= GOAL_S,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
