"""What an evaluation pod and the flow that started it agree on, as trainers/contract.py is for the trainer.

The pod (`python -m evaluation`, evaluation/__main__.py) prints its result as its last line, `tessera.eval {json}`,
which the flow's evaluate and score tasks read back from the pod's log (`parse_summary`). It exits 0 when done;
EXIT_FATAL (the trainer's FATAL, 78) on bad gauntlet input, whose one line on stderr starts with BAD_INPUT (a retry
would fail the same way, and the Job's FailJob rule reads both pods alike); 1 on anything else.
"""

from __future__ import annotations

import json

from trainers.contract import FATAL

SUMMARY_PREFIX = "tessera.eval"
BAD_INPUT = "tessera.eval: bad input: "  # what a bad-input exit's one line starts with, on stderr
# Bad input in the pod (a damaged checkpoint, a missing task file) exits with the trainer's FATAL code, so the
# Job's FailJob rule and the flow read both pods alike. (The `tessera` CLI's bad-input exit code is 2.)
EXIT_FATAL = FATAL


def summary_line(summary: dict) -> str:
    """The pod's last line: `tessera.eval` and the summary as compact JSON."""
    return f"{SUMMARY_PREFIX} {json.dumps(summary, separators=(',', ':'))}"


def parse_summary(line: str) -> dict | None:
    """The summary of a `tessera.eval {json}` line, or None for any other line."""
    text = line.strip()
    if not text.startswith(SUMMARY_PREFIX + " "):
        return None
    try:
        summary = json.loads(text[len(SUMMARY_PREFIX) + 1 :])
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None
