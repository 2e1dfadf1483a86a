"""Progress lines: rank 0 prints `tessera.progress {json}` to stdout for whoever watches the job log.

The flow relays them (to the Prefect UI) by parsing the log with `parse_progress`; this module
imports neither torch nor Composer so that the flow can. The Composer callback that prints
them is trainers.callbacks.Progress.

Fields of a line:
    stage, stage_index      the stage being trained (name, 0-based index)
    step                    optimizer steps since the start of the run
    tokens                  tokens of the run trained so far
    stage_start, stage_end  the stage's token range [start, end) within the run
    loss                    the last step's loss (null if it was not finite)
    tokens_per_sec          over the window since the previous line of this launch
    elapsed_s               since this launch started training

A launch prints one after its first step, then at most every TESSERA_PROGRESS_S seconds
(default 10), and one after the step that ends the stage.

Before any of them, rank 0 prints one `tessera.start {json}` line saying where the launch starts:
    stage, stage_index      the stage this launch trains
    kind                    fresh | resume | enter (trainers/plan.py) | done (the stage was complete)
    tokens, step            the run's tokens and optimizer steps at the start point
    checkpoint              the checkpoint loaded (null when fresh), and `written`, its time (UTC ISO 8601)

With several ranks, rank 0 prints one `tessera.ranks {json}` line every train.watchdog.slow_rank_every_steps steps
(trainers/rank_timing.py):
    step, tokens, steps     where the comparison was made, over how many steps
    ranks                   each rank's mean data_s, compute_s and collective_s, with its host and node
    slowest                 the rank whose compute stands out (rank, host, node), slowest_over_median its ratio
    factor, slow            the recipe's slow_rank_factor, and whether the ratio is above it

A launch that finds its prepared data damaged (trainers/data_check.py) prints one `tessera.damaged {json}`
line before it exits fatal:
    source, path            the source and the MDS folder (local, or the s3:// URI it streams)
    shard, samples          the damaged shard and its samples [first, last] in that folder (null: the index)
    why                     what is wrong with it
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

PREFIX = "tessera.progress"
START_PREFIX = "tessera.start"
START_FIELDS = ("stage", "stage_index", "kind", "tokens", "step", "checkpoint", "written")
INTERVAL_ENV = "TESSERA_PROGRESS_S"
DEFAULT_INTERVAL_S = 10.0
RANKS_PREFIX = "tessera.ranks"
RANKS_FIELDS = ("step", "tokens", "ranks", "slowest", "slowest_over_median", "slow")
PREFLIGHT_PREFIX = "tessera.preflight"
PREFLIGHT_FIELDS = ("ranks", "matmul_gflops_median", "matmul_gflops_min", "allreduce_gb_per_s", "factor", "slow")
DAMAGE_PREFIX = "tessera.damaged"
DAMAGE_FIELDS = ("source", "path", "shard", "samples", "why")
FIELDS = ("stage", "stage_index", "step", "tokens", "stage_start", "stage_end", "loss", "tokens_per_sec", "elapsed_s")


def format_progress(record: Mapping[str, object]) -> str:
    """One line (no newline) for a record holding FIELDS; non-finite floats become null (strict JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return f"{PREFIX} {json.dumps(clean, separators=(',', ':'), allow_nan=False)}"


def _parse(line: str, prefix: str, fields: tuple[str, ...]) -> dict | None:
    text = line.strip()
    if not text.startswith(prefix + " "):
        return None
    try:
        record = json.loads(text[len(prefix) + 1 :])
    except ValueError:
        return None
    return record if isinstance(record, dict) and all(k in record for k in fields) else None


def parse_progress(line: str) -> dict | None:
    """The record of a progress line, or None for any other line (or a mangled one)."""
    return _parse(line, PREFIX, FIELDS)


def format_start(record: Mapping[str, object]) -> str:
    """The one start line of a launch, for a record holding START_FIELDS."""
    return f"{START_PREFIX} {json.dumps(dict(record), separators=(',', ':'))}"


def parse_start(line: str) -> dict | None:
    """The record of a start line, or None for any other line."""
    return _parse(line, START_PREFIX, START_FIELDS)


def format_damage(record: Mapping[str, object]) -> str:
    """The line naming damaged prepared data, for a record holding DAMAGE_FIELDS."""
    return f"{DAMAGE_PREFIX} {json.dumps(dict(record), separators=(',', ':'))}"


def parse_damage(line: str) -> dict | None:
    """The record of a damage line, or None for any other line."""
    return _parse(line, DAMAGE_PREFIX, DAMAGE_FIELDS)


def format_ranks(report: Mapping[str, object]) -> str:
    """The line comparing the ranks' step timings, for a report holding RANKS_FIELDS."""
    return f"{RANKS_PREFIX} {json.dumps(dict(report), separators=(',', ':'))}"


def parse_ranks(line: str) -> dict | None:
    return _parse(line, RANKS_PREFIX, RANKS_FIELDS)


def format_preflight(summary: Mapping[str, object]) -> str:
    """A launch's preflight figures (trainers/preflight.py), for a summary holding PREFLIGHT_FIELDS."""
    return f"{PREFLIGHT_PREFIX} {json.dumps(dict(summary), separators=(',', ':'))}"


def parse_preflight(line: str) -> dict | None:
    return _parse(line, PREFLIGHT_PREFIX, PREFLIGHT_FIELDS)
