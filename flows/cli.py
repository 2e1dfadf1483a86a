"""`tessera`: run the pipeline or one of its stages from a shell.

Known bad-input errors print one line naming the file, line or field and exit 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _quiet_environment() -> None:
    # Offline by design: never let HF libraries reach for the hub.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # The temporary Prefect server migrates a fresh database on first start; 20 s is not enough on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry


def _work_prefect_home(work_dir: str) -> None:
    """Keep Prefect's database in the work dir, so `prefect server start` there shows these runs."""
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        home = Path(work_dir).resolve() / "prefect"
        home.mkdir(parents=True, exist_ok=True)  # the server's sqlite cannot create its own folder
        os.environ["PREFECT_HOME"] = str(home)
        # profiles live under PREFECT_HOME by default: keep the user's (an API URL set with
        # `prefect config set`, a Cloud login) instead of silently dropping them
        profiles = Path("~/.prefect/profiles.toml").expanduser()
        if profiles.is_file():
            os.environ.setdefault("PREFECT_PROFILES_PATH", str(profiles))


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from flows.recipe import RecipeError
    from tasks.data.errors import DataError
    from tasks.tracking import TrackingError
    from evaluation.errors import GauntletError
    from tasks.train import TrainingFailed

    # TrainingFailed is here for its one-line message; only the fatal kind counts as bad input
    return (RecipeError, DataError, TrackingError, TrainingFailed, GauntletError)


class _NoTracebackForBadInput(logging.Filter):
    """Prefect logs every task failure with its traceback; for bad input the one-line message is the story."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], _bad_input_types()):
            record.exc_info, record.exc_text = None, None
        return True


def _install_log_filter() -> None:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, _NoTracebackForBadInput) for f in handler.filters):
                handler.addFilter(_NoTracebackForBadInput())


def cmd_run(args: argparse.Namespace) -> int:
    from flows.recipe import NAME_PATTERN, RecipeError, load_recipe

    recipe = load_recipe(args.recipe)  # fail on a bad recipe before any engine starts
    if args.run_name is not None and not re.fullmatch(NAME_PATTERN, args.run_name):
        raise RecipeError(f"--run-name: {args.run_name!r} must match {NAME_PATTERN}")
    _work_prefect_home(recipe.work_dir)
    from flows.pipeline import PipelineParams, pretrain_pipeline

    _install_log_filter()

    result = pretrain_pipeline(PipelineParams(recipe=args.recipe, run_name=args.run_name))
    last = result.registrations[-1] if result.registrations else None
    print(
        f"run {result.run_name}: {len(result.registrations)} model versions"
        + (f"; latest-checkpoint=v{last.latest} best=v{last.best}" if last else "")
        + f"; mlflow run {result.mlflow_run_id}"
    )
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from flows.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    _work_prefect_home(recipe.work_dir)
    from flows.prepare import prepare_data, summarize

    _install_log_filter()
    print(summarize(prepare_data(recipe.data)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _work_prefect_home(args.work_dir)
    from flows.evaluate import eval_command

    _install_log_filter()
    outcome = eval_command(
        args.model, args.tasks, args.gauntlet, args.data_root,
        batch_size=args.batch_size, max_seq_len=args.max_seq_len, seed=args.seed, strict=args.strict,
        tracking_uri=args.tracking_uri, compare_to=args.compare_to, output_dir=args.output_dir,
    )  # fmt: skip
    print(f"average: {outcome.average:.4f}" + (f" (baseline {outcome.baseline_average:.4f})"
                                                if outcome.baseline_average is not None else ""))  # fmt: skip
    for path in outcome.files:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM pretraining pipeline on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run the whole pipeline on a recipe.")
    run.add_argument("recipe", help="Recipe YAML, e.g. configs/tiny.yaml.")
    run.add_argument("--run-name", default=None, help="Run name (default: the recipe's name); reusing it resumes.")
    run.set_defaults(func=cmd_run)

    prep = sub.add_parser("prepare", help="Tokenize the recipe's sources into MDS shards, and nothing else.")
    prep.add_argument("recipe")
    prep.set_defaults(func=cmd_prepare)

    ev = sub.add_parser("eval", help="Score a model on an Eval Gauntlet task list.")
    ev.add_argument("--model", required=True,
                    help="Composer checkpoint, HF model directory, or models:/name@alias | models:/name/N.")
    ev.add_argument("--tasks", required=True, help="ICL task list YAML (Mosaic Eval Gauntlet format).")
    ev.add_argument("--gauntlet", default=None, help="Gauntlet YAML (categories, weighting, averages).")
    ev.add_argument("--data-root", default=".", help="Root that each task's dataset_uri resolves against.")
    ev.add_argument("--batch-size", type=int, default=16)
    ev.add_argument("--max-seq-len", type=int, default=None, help="Left-truncate contexts (default: the model's).")
    ev.add_argument("--seed", type=int, default=1234, help="Few-shot sampling seed.")
    ev.add_argument("--strict", action="store_true", help="A missing task file is an error, not a warning.")
    ev.add_argument("--tracking-uri", default=None, help="MLflow URI used to resolve models:/ URIs.")
    ev.add_argument("--compare-to", default=None, help="A second model; the report shows per-task deltas.")
    ev.add_argument("--output-dir", default=None, help="Write report.md/.json/.html here.")
    ev.add_argument("--work-dir", default=".tessera", help="Where Prefect keeps its local database.")
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_environment()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _bad_input_types() as exc:
        from tasks.train import TrainingFailed, TrainingFatal

        print(f"tessera: error: {exc}", file=sys.stderr)
        # a crash that outlived its retries is not bad input: a rerun resumes from the last checkpoint
        return EXIT_FAILED if isinstance(exc, TrainingFailed) and not isinstance(exc, TrainingFatal) else EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
