"""One index of the prepare Job: prepare one partition into the s3 data root (`python -m tasks.data.pod INDEX_FILE`).

Runs anywhere given its environment: `JOB_COMPLETION_INDEX` (the Job controller sets it in every pod of an
Indexed Job) picks the (output, partition) pair from the Job's index file, whose output's plan file says the rest;
the s3 settings (S3_ENDPOINT_URL or AWS_ENDPOINT_URL, and credentials) reach the bucket. Nothing of the recipe, of
Prefect or of the flow's disk is read.

The partition is prepared in a working copy on the pod's scratch disk, exactly as a local prepare writes it (the
same code), then uploaded with its done-marker last. A partition already done in the bucket is not written again.
Bad input under on_error: fail is one line naming the file and line, and exit 78: the Job's pod failure policy
ends the Job at once on it (infra/prepare_job.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from infra.prepare_job import WORKERS_ENV  # the prepare pod's cores, set from its cpu request
from tasks.data import parallel, partition_run, remote_root
from tasks.data.errors import DataError
from tasks.data.partitions import folder
from tasks.data.spec import PLAN, Spec, entry
from trainers.contract import FATAL, RETRYABLE
from trainers.format.s3 import StoreError, fetch_folder

INDEX_ENV = "JOB_COMPLETION_INDEX"


class _OwnFolder:
    """The working copy is this process's alone: no other writer to lose a claim to."""

    def check(self) -> None:
        return None


def _read(uri: str) -> bytes:
    parent, _, name = uri.rstrip("/").rpartition("/")
    raw = remote_root.reader(parent)(name)
    if raw is None:
        raise DataError(uri, "no such object: the flow writes it before the prepare Job starts")
    return raw


def prepare_index(index_file: str, index: int, work: Path, workers: int | None = None) -> str:
    """Prepare the partition that index `index` of the Job names; the line saying what was done."""
    out, k = entry(_read(index_file), index)
    if k in remote_root.partitions_done(out):
        return f"{out}: partition {folder(k)} already prepared, nothing to do"
    spec = Spec.from_json(_read(f"{out}/{PLAN}"))
    if spec.tokenizer.uri is None:
        raise DataError(f"{out}/{PLAN}", "the tokenizer has no s3:// copy for the pods to read")
    try:
        hf_dir = fetch_folder(spec.tokenizer.uri, work / "tokenizer")
    except StoreError as exc:
        raise DataError(spec.tokenizer.uri, f"cannot read the tokenizer ({exc})") from exc
    tok = spec.tokenizer.model_copy(update={"hf_dir": str(hf_dir)})
    part = spec.partitions[k]
    local = work / "out"
    started = time.monotonic()
    (record,) = partition_run.run(
        str(local),
        [(part, partition_run.jobs_for(spec.source, part, spec.chunk, tok))],
        packing=spec.packing,
        workers=workers or parallel.default_workers(),
        lease=_OwnFolder(),
    )
    remote_root.publish_partition(str(local), out, folder(k))
    tokens = sum(record["counts"][s]["tokens_written"] for s in ("train", "val"))
    seconds = time.monotonic() - started
    return (
        f"{out}: partition {folder(k)} prepared by {record['writer']}: {record['units']} units, {tokens:,} tokens "
        f"in {seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.data.pod", description=__doc__.splitlines()[0])
    ap.add_argument("index_file", help="s3:// URI of the prepare Job's index file")
    ap.add_argument(
        "--workers", type=int, default=None, help=f"tokenizer processes (default: ${WORKERS_ENV}, else every core)"
    )
    args = ap.parse_args(argv)
    try:
        index = int(os.environ[INDEX_ENV])
    except (KeyError, ValueError):
        print(f"tessera: error: {INDEX_ENV} must name this pod's index (an Indexed Job sets it)", file=sys.stderr)
        return FATAL
    workers = args.workers or int(os.environ.get(WORKERS_ENV) or 0) or None
    try:
        # TMPDIR: the pod's scratch volume (infra/prepare_job.py), never its small root filesystem
        with tempfile.TemporaryDirectory(prefix="tessera-prepare-") as work:
            print(prepare_index(args.index_file, index, Path(work), workers), flush=True)
    except remote_root.BucketError as exc:  # the index's retry (backoffLimitPerIndex) may find the bucket well
        print(f"tessera: error: {exc}", file=sys.stderr, flush=True)
        return RETRYABLE
    except DataError as exc:  # bad input: the same on every try
        print(f"tessera: error: {exc}", file=sys.stderr, flush=True)
        return FATAL
    finally:
        parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
