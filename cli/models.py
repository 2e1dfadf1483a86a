"""`tessera eval`, `compare`, `promote` and `continue`: the commands about models rather than runs.

Each parses nothing itself (cli/main.py's parser does) and returns the command's exit code; bad input
raises the one-line errors cli/main.py's main() prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.runs.runtime import install_log_filter, temporary_server_apart, work_prefect_home

if TYPE_CHECKING:  # the flows import Prefect: `tessera --help` does not wait for it
    from flows.evaluate import EvalOutcome


def cmd_eval(args: argparse.Namespace) -> int:
    from evaluation.models import refuse_early

    for model in filter(None, (args.model, args.compare_to)):  # what the files tell: before any server starts
        refuse_early(model, trust=args.trust_checkpoint)
    work_prefect_home(args.work_dir)
    outcome = eval_command(
        args.model,
        args.tasks,
        args.gauntlet,
        args.data_root,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        strict=args.strict,
        tracking_uri=args.tracking_uri,
        compare_to=args.compare_to,
        output_dir=args.output_dir,
        trust_checkpoint=args.trust_checkpoint,
    )
    print(
        f"average: {outcome.average:.4f}"
        + (f" (baseline {outcome.baseline_average:.4f})" if outcome.baseline_average is not None else "")
    )
    for path in outcome.files:
        print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Score two models on one gauntlet and keep the delta tables and plot."""
    from evaluation.models import refuse_early
    from tasks.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    for model in (args.a, args.b):  # what the files tell: before any server starts
        refuse_early(model, trust=args.trust_checkpoint)
    work_prefect_home(recipe.work_dir)
    from tasks.artifacts import artifact_key
    from tasks.mlflow_run import resolved_uri

    out = args.output_dir or str(Path(recipe.work_dir) / "compare" / artifact_key(args.a, "vs", args.b))
    ev = recipe.eval
    outcome = eval_command(
        args.b,
        ev.tasks,
        ev.gauntlet,
        ev.data_root,
        batch_size=ev.batch_size,
        max_seq_len=ev.max_seq_len or recipe.data.seq_len,
        seed=ev.seed,
        strict=True,
        tracking_uri=resolved_uri(recipe.tracking.tracking_uri),
        compare_to=args.a,
        output_dir=out,
        trust_checkpoint=args.trust_checkpoint,
    )
    gain = outcome.average - outcome.baseline_average
    noise = ""
    if outcome.gain_interval is not None:
        low, high = outcome.gain_interval
        within = " within noise" if low <= 0 <= high else ""
        noise = f", {outcome.confidence:.0%} interval {low:+.4f} to {high:+.4f}{within}"
    print(f"{args.a}: {outcome.baseline_average:.4f}  {args.b}: {outcome.average:.4f}  ({gain:+.4f}{noise})")
    for path in outcome.files:
        print(f"wrote {path}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Move `champion` by hand, recorded on the versions like a rule's decision."""
    from tasks.mlflow_run import client_for
    from tasks.recipe import RecipeError, load_recipe
    from tasks.registry.promote import promote_by_hand

    recipe = load_recipe(args.recipe)
    ref = args.model.removeprefix("models:/")
    name, _, version = ref.rpartition("/")
    if not args.model.startswith("models:/") or not name or not version.isdigit():
        raise RecipeError(f"{args.model}: expected models:/NAME/N (a version number, not an alias)")
    work_prefect_home(recipe.work_dir)  # the promotion lock is a Prefect concurrency limit
    client = client_for(recipe.tracking)
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, version)
    except MlflowException:
        raise RecipeError(f"{args.model}: no such model version in {recipe.tracking.tracking_uri}") from None
    from tasks.registry.aliases import reconcile_registry

    for line in reconcile_registry(recipe.tracking, "tessera promote"):
        print(line)
    old = promote_by_hand(client, name, version, args.note)
    print(f"{name}: champion v{version}" + (f" (was v{old}; now previous-champion)" if old and old != version else ""))
    return 0


def cmd_continue(args: argparse.Namespace) -> int:
    from tasks.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    work_prefect_home(recipe.work_dir)
    from flows.continued import ContinueParams, continued_pretraining

    install_log_filter()
    temporary_server_apart()
    result = continued_pretraining(
        ContinueParams(
            recipe=args.recipe,
            base=args.base,
            new_data=args.new_data,
            tokens=args.tokens,
            name_prefix=args.name_prefix,
            replay_fraction=args.replay_fraction,
            if_running=args.if_running,
        )
    )
    if not result.trained:
        print(f"{result.base}: no new data; nothing trained")
        return 0
    verdict = (
        "no champion to compare with"
        if result.decision is None
        else (f"{'accepted' if result.decision.accepted else 'rejected'}: {result.decision.summary()}")
    )
    print(
        f"run {result.run_name}: continued {result.base} on {result.new_files} new file(s); challenger "
        f"v{result.challenger}: {verdict}; champion v{result.champion}"
    )
    return 0


def eval_command(model: str, tasks: str, gauntlet: str | None = None, data_root: str = ".", **more) -> EvalOutcome:
    """What `tessera eval` and `compare` call: the eval flow on EvalParams (whose fields are the ones `more` may name,
    and their defaults). Raises evaluation.GauntletError (one line) on bad input."""
    from flows.evaluate import EvalParams, eval_flow

    install_log_filter()  # after Prefect's import: the filter goes on the handlers its logging set-up made
    if unknown := sorted(set(more) - set(EvalParams.model_fields)):  # the form ignores extra keys; a caller may not
        raise TypeError(f"eval_command() got unexpected keyword arguments {unknown}")
    temporary_server_apart()
    return eval_flow(EvalParams(model=model, tasks=tasks, gauntlet=gauntlet, data_root=data_root, **more))
