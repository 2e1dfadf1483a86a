"""Container entrypoint of a checkpoint's evaluation pod, free of Prefect:

    python -m evaluation --checkpoint s3://bucket/prefix/run/tiny-s0-tok16384-rank0.pt \
        --tasks configs/gauntlet/tiny_tasks.yaml --gauntlet configs/gauntlet/tiny_gauntlet.yaml \
        --data-root data/gauntlet --context-len 128 --strict \
        --tracking-uri http://mlflow:5000 --run-id RUN_ID --step 16384 --stage literary

Scores the checkpoint on the gauntlet (on the GPU when there is one) and logs to the training run
what tasks/gauntlet/evaluate.py logs in-process: the metrics with step = tokens, the per-task table and the
JSON and HTML reports. Its last line is `tessera.eval {json}`, the summary the flow's evaluate
task reads back from the pod's log to make its artifact and the register task's input.

With --report-only it logs nothing and packages nothing: it scores any model spec (a models:/ URI too)
and its summary line carries the whole GauntletReport under `report` (per-task results and each
example's outcome, which promotion's paired intervals need), so promotion scores in a pod as well.

Exit codes and the summary line: evaluation/protocol.py, which the flow's tasks read it by.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from evaluation.protocol import BAD_INPUT, EXIT_FATAL, summary_line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation", description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint", required=True, help="Composer checkpoint (path or s3:// URI), HF dir or models:/ URI."
    )
    p.add_argument("--tasks", required=True, help="ICL task list YAML (Mosaic Eval Gauntlet format).")
    p.add_argument("--gauntlet", default=None, help="Gauntlet YAML (categories, weighting, averages).")
    p.add_argument("--data-root", default=".", help="Root each task's dataset_uri resolves against (local or s3://).")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="The gauntlet's max_seq_len setting (eval.max_seq_len)."
    )
    p.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="Left-truncate contexts to this many tokens (default: --max-seq-len, else the model's).",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--strict", action="store_true", help="A missing task file is an error.")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="Where the model is scored (eval.device): auto = the GPU when there is one.",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="Score and print the full report in the summary line; log nothing to a run (promotion's scoring).",
    )
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI of the training run (and of models:/).")
    p.add_argument("--run-id", default=None, help="The training run to log into.")
    p.add_argument("--step", type=int, default=None, help="Tokens seen by the checkpoint (the MLflow step).")
    p.add_argument("--stage", default="", help="Curriculum stage that produced the checkpoint (for the title).")
    p.add_argument(
        "--timestamp-ms",
        type=int,
        default=None,
        help="Timestamp of every metric point; the same value on a retry adds no duplicate points.",
    )
    p.add_argument(
        "--sha256",
        default=None,
        help="SHA-256 the trainer published for a Composer checkpoint (its manifest). A mismatch, or "
        "without it a zip CRC mismatch, refuses the checkpoint (exit 78): a flipped byte loads silently.",
    )
    p.add_argument(
        "--files",
        default=None,
        help="A sharded checkpoint (--checkpoint names its folder): the manifest's file list as JSON, "
        "[{name, size, sha256}, ...]; each file is downloaded and verified against it.",
    )
    p.add_argument(
        "--package-to",
        default=None,
        help="Also write the scored model as an MLflow Model (transformers flavor) to this s3:// URI, "
        "for registration by reference.",
    )
    args = p.parse_args(argv)
    if not args.report_only:
        missing = [f"--{k.replace('_', '-')}" for k in ("tracking_uri", "run_id", "step") if getattr(args, k) is None]
        if missing:
            p.error(f"the following arguments are required without --report-only: {', '.join(missing)}")
    elif args.package_to:
        p.error("--package-to writes beside a training run's checkpoint; --report-only has none")
    return args


def _local_checkpoint(spec: str, into: Path, files: list[dict] | None = None) -> str:
    """An s3:// checkpoint is downloaded first (the loaders read local files); anything else as given. A
    sharded one is a folder: each of the manifest's files is downloaded into it."""
    if not spec.startswith("s3://"):
        return spec
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)
    bucket, _, key = spec[len("s3://") :].partition("/")
    local = into / Path(key).name
    if files is None:
        client.download_file(bucket, key, str(local))
        return str(local)
    local.mkdir(parents=True, exist_ok=True)
    for entry in files:
        client.download_file(bucket, f"{key.rstrip('/')}/{entry['name']}", str(local / entry["name"]))
    return str(local)


def _verified(path: str, args: argparse.Namespace) -> str:
    """The checkpoint as downloaded, if it is every byte the trainer published: the same check as in-process."""
    from evaluation.models import check_checkpoint

    # an HF dir or a models:/ URI has no manifest to check against
    if Path(path).is_file() or args.files or (Path(path) / ".metadata").is_file():
        check_checkpoint(path, args.sha256, shown=args.checkpoint, files=_files(args))
    return path


def _files(args: argparse.Namespace) -> list | None:
    from trainers.format.checkpoints import ShardFile

    return [ShardFile.model_validate(e) for e in json.loads(args.files)] if args.files else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from evaluation.config import EvalConfig
    from evaluation.errors import GauntletError
    from evaluation.identity import gauntlet_hash
    from evaluation.mlflow_report import log_report

    cfg = EvalConfig(
        every=max(1, args.step or 0),
        tasks=args.tasks,
        gauntlet=args.gauntlet,
        data_root=args.data_root,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        strict=args.strict,
        device=args.device,
    )
    if args.report_only:
        return _report_only(args, cfg)
    title = f"Gauntlet at {args.step:,} tokens" + (f" (stage {args.stage})" if args.stage else "")
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-eval-") as tmp:
            loaded, report = _score(args, cfg, Path(tmp))
            model_uri = _package(loaded.model, loaded.tokenizer, args, Path(tmp)) if args.package_to else None
        stamp = args.timestamp_ms if args.timestamp_ms is not None else int(time.time() * 1000)
        paths = log_report(args.tracking_uri, args.run_id, report, step=args.step, title=title, timestamp_ms=stamp)
    except GauntletError as exc:
        print(f"{BAD_INPUT}{exc}", file=sys.stderr, flush=True)
        return EXIT_FATAL
    summary = {
        "tokens": args.step,
        "checkpoint": args.checkpoint,
        "average": report.average,
        "headline": report.headline,
        "gauntlet_hash": gauntlet_hash(cfg),
        "metrics": report.metrics(),
        "report_json": paths.json,
        "report_html": paths.html,
        "table": paths.table,
        "markdown": report.to_markdown(title),
        "examples": report.examples,
        "seconds": report.seconds,
        "model_uri": model_uri,
    }
    print(summary_line(summary), flush=True)
    return 0


def _score(args: argparse.Namespace, cfg, tmp: Path):
    """(loaded model, its report): the model downloaded and verified first when it is a checkpoint."""
    from evaluation.models import load_model
    from evaluation.runner import run_gauntlet

    files = json.loads(args.files) if args.files else None
    loaded = load_model(
        _verified(_local_checkpoint(args.checkpoint, tmp, files), args), args.tracking_uri, verified=True
    )
    report = run_gauntlet(
        loaded.model, loaded.tokenizer, cfg, args.context_len or args.max_seq_len or loaded.max_seq_len
    )
    return loaded, report


def _report_only(args: argparse.Namespace, cfg) -> int:
    from dataclasses import asdict

    from evaluation.errors import GauntletError
    from evaluation.identity import gauntlet_hash

    try:
        with tempfile.TemporaryDirectory(prefix="tessera-eval-") as tmp:
            _, report = _score(args, cfg, Path(tmp))
    except GauntletError as exc:
        print(f"{BAD_INPUT}{exc}", file=sys.stderr, flush=True)
        return EXIT_FATAL
    summary = {
        "model": args.checkpoint,
        "average": report.average,
        "headline": report.headline,
        "gauntlet_hash": gauntlet_hash(cfg),
        "examples": report.examples,
        "seconds": report.seconds,
        "report": asdict(report),
    }
    print(summary_line(summary), flush=True)
    return 0


def _package(model, tokenizer, args: argparse.Namespace, tmp: Path) -> str:
    """The loaded model as an MLflow Model, uploaded beside its checkpoint: registration never loads it again."""
    from trainers.format.export import never_emit_padding
    from trainers.format.mlflow_model import publish, save_mlflow_model

    hf_dir = tmp / "hf"
    never_emit_padding(model, tokenizer)
    model.to("cpu").save_pretrained(hf_dir, safe_serialization=True)
    tokenizer.save_pretrained(hf_dir)
    card = f"# tessera checkpoint\n\nStage {args.stage or '?'}, after {args.step:,} tokens (run {args.run_id})."
    return publish(save_mlflow_model(hf_dir, tmp / "mlflow-model", card), args.package_to)


if __name__ == "__main__":
    sys.exit(main())
