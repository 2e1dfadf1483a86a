"""`tessera`: run the pipeline or one of its stages from a shell.

Known bad-input errors print one line naming the file, line or field and exit 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from flows.runtime import bad_input_types, install_log_filter, quiet_environment

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _work_prefect_home(work_dir: str) -> None:
    """Keep Prefect's database in the work dir, so `prefect server start` there shows these runs."""
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        home = Path(work_dir).resolve() / "prefect"
        try:
            home.mkdir(parents=True, exist_ok=True)  # the server's sqlite cannot create its own folder
        except OSError as exc:  # a file in the way, a read-only disk: no retry or traceback helps
            from flows.recipe import RecipeError

            raise RecipeError(
                f"work_dir {work_dir}: cannot hold Prefect's database in {home} ({exc.strerror or exc})"
            ) from None
        os.environ["PREFECT_HOME"] = str(home)
        # profiles live under PREFECT_HOME by default: keep the user's (an API URL set with
        # `prefect config set`, a Cloud login) instead of silently dropping them
        profiles = Path("~/.prefect/profiles.toml").expanduser()
        if profiles.is_file():
            os.environ.setdefault("PREFECT_PROFILES_PATH", str(profiles))


def _usable_data_root(recipe) -> None:
    """A data root that is a file or read-only fails here in one line, not after Prefect has started."""
    from tasks.data.outputs import ensure_root

    ensure_root(recipe.data.local_root)


def cmd_run(args: argparse.Namespace) -> int:
    from flows.recipe import NAME_PATTERN, RecipeError, load_recipe

    recipe = load_recipe(args.recipe)  # fail on a bad recipe before any engine starts
    if args.run_name is not None and not re.fullmatch(NAME_PATTERN, args.run_name):
        raise RecipeError(f"--run-name: {args.run_name!r} must match {NAME_PATTERN}")
    _work_prefect_home(recipe.work_dir)
    _usable_data_root(recipe)
    from flows.pipeline import PipelineParams, pretrain_pipeline

    install_log_filter()

    result = pretrain_pipeline(PipelineParams(recipe=args.recipe, run_name=args.run_name, if_running=args.if_running))
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
    _usable_data_root(recipe)
    from flows.prepare import PrepareParams, prepare_data, warm_up
    from tasks.data import interrupt

    install_log_filter()
    warm_up(recipe.data)  # overlaps Prefect's server start-up
    with interrupt.stop_on_signals():  # Ctrl-C/SIGTERM: stop within seconds, exit 130/143
        print(prepare_data(PrepareParams(recipe=args.recipe)).summary())
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _work_prefect_home(args.work_dir)
    from flows.evaluate import eval_command

    install_log_filter()
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
    from flows.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    _work_prefect_home(recipe.work_dir)
    from flows.evaluate import eval_command
    from tasks.artifacts import artifact_key
    from tasks.mlflow_run import resolved_uri

    install_log_filter()
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
    )
    print(
        f"{args.a}: {outcome.baseline_average:.4f}  {args.b}: {outcome.average:.4f}  "
        f"({outcome.average - outcome.baseline_average:+.4f})"
    )
    for path in outcome.files:
        print(f"wrote {path}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Move `champion` by hand, recorded on the versions like a rule's decision."""
    from flows.recipe import RecipeError, load_recipe
    from tasks.mlflow_run import client_for
    from tasks.promote import promote_by_hand

    recipe = load_recipe(args.recipe)
    ref = args.model.removeprefix("models:/")
    name, _, version = ref.rpartition("/")
    if not args.model.startswith("models:/") or not name or not version.isdigit():
        raise RecipeError(f"{args.model}: expected models:/NAME/N (a version number, not an alias)")
    client = client_for(recipe.tracking)
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, version)
    except MlflowException:
        raise RecipeError(f"{args.model}: no such model version in {recipe.tracking.tracking_uri}") from None
    from tasks.aliases import reconcile_registry

    for line in reconcile_registry(recipe.tracking, "tessera promote"):
        print(line)
    old = promote_by_hand(client, name, version, args.note)
    print(f"{name}: champion v{version}" + (f" (was v{old}; now previous-champion)" if old and old != version else ""))
    return 0


def cmd_continue(args: argparse.Namespace) -> int:
    from flows.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    _work_prefect_home(recipe.work_dir)
    from flows.continued import ContinueParams, continued_pretraining

    install_log_filter()
    result = continued_pretraining(
        ContinueParams(
            recipe=args.recipe,
            base=args.base,
            new_data=args.new_data,
            tokens=args.tokens,
            run_name=args.run_name,
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


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import DeployError, deploy

    try:
        deployed = deploy(args.names, args.pool)
    except DeployError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for d in deployed:
        print(f"{d.flow_name}/{d.name}  {d.url}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from flows.up import UpError, UpOptions, up

    options = UpOptions(
        recipe=args.recipe,
        work_dir=args.work_dir,
        host=args.host,
        prefect_port=args.prefect_port,
        mlflow_port=args.mlflow_port,
        deploy=not args.no_deploy,
    )
    try:
        return up(options)
    except UpError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return exc.code


def _kubernetes_recipe(path: str):
    from flows.recipe import RecipeError, load_recipe

    recipe = load_recipe(path)
    if recipe.compute.backend != "kubernetes":
        raise RecipeError(f"{path}: compute.backend: is {recipe.compute.backend!r}; `tessera k8s` needs kubernetes")
    return recipe


def cmd_k8s_render(args: argparse.Namespace) -> int:
    """Print the manifests of one stage's launch, exactly as the launcher would create them."""
    from flows.recipe import RecipeError
    from infra.k8s_views import render_stage

    recipe = _kubernetes_recipe(args.recipe)
    run = args.run_name or recipe.name
    job = Path(args.job) if args.job else Path(recipe.work_dir) / "runs" / run / "job.json"
    if not job.is_file():
        raise RecipeError(f"{job}: no job file; `tessera run` writes it after preparing the data (or pass --job)")
    if not 0 <= args.stage < len(recipe.train.stages):
        raise RecipeError(f"--stage: {args.stage} is not a stage of {args.recipe} (0..{len(recipe.train.stages) - 1})")
    print(render_stage(recipe.compute, job, args.stage, args.attempt), end="")
    return 0


def cmd_k8s_status(args: argparse.Namespace) -> int:
    """The live objects of a run: JobSets or Jobs, their pods, Services and ConfigMaps."""
    from infra.k8s_views import run_status
    from infra.kube_api import Kube, KubeError

    namespace = args.namespace or (
        _kubernetes_recipe(args.recipe).compute.kubernetes.namespace if args.recipe else "default"
    )
    try:
        print(run_status(Kube(namespace), args.run))
    except KubeError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM pretraining pipeline on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run the whole pipeline on a recipe.")
    run.add_argument("recipe", help="Recipe YAML, e.g. configs/tiny.yaml.")
    run.add_argument("--run-name", default=None, help="Run name (default: the recipe's name); reusing it resumes.")
    run.add_argument(
        "--if-running",
        choices=["refuse", "wait"],
        default="refuse",
        help="When a run of the same name is live: refuse (default) or wait for it to end.",
    )
    run.set_defaults(func=cmd_run)

    prep = sub.add_parser("prepare", help="Tokenize the recipe's sources into MDS shards, and nothing else.")
    prep.add_argument("recipe")
    prep.set_defaults(func=cmd_prepare)

    ev = sub.add_parser("eval", help="Score a model on an Eval Gauntlet task list.")
    ev.add_argument(
        "--model",
        required=True,
        help="Composer checkpoint, HF model directory, or models:/name@alias | models:/name/N.",
    )
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

    cont = sub.add_parser("continue", help="Continue pretraining a registered model on new data; promote if better.")
    cont.add_argument("recipe", help="The recipe the model was trained with (its sources are replayed).")
    cont.add_argument(
        "--from",
        dest="base",
        default=None,
        help="Registry URI of the base model (default models:/<registered_model>@champion).",
    )
    cont.add_argument("--new-data", required=True, help="Directory, glob or s3:// prefix of new text files.")
    cont.add_argument("--tokens", type=int, default=None, help="Token budget (default: one pass over the new data).")
    cont.add_argument("--replay-fraction", type=float, default=0.2, help="Share of the recipe's own sources (0.2).")
    cont.add_argument("--run-name", default=None, help="Default: derived from the base version and the new files.")
    cont.add_argument("--if-running", choices=["refuse", "wait"], default="refuse")
    cont.set_defaults(func=cmd_continue)

    prom = sub.add_parser("promote", help="Make a model version the champion by hand (recorded on the versions).")
    prom.add_argument("model", help="models:/NAME/N")
    prom.add_argument("--recipe", default="configs/tiny.yaml", help="Recipe whose tracking section names the registry.")
    prom.add_argument("--note", default="promoted from the command line", help="Why; recorded on the version.")
    prom.set_defaults(func=cmd_promote)

    cmp_ = sub.add_parser("compare", help="Score two models on a recipe's gauntlet: per-category and per-task deltas.")
    cmp_.add_argument("a", help="Baseline: Composer checkpoint, HF directory or models:/ URI.")
    cmp_.add_argument("b", help="Candidate, same forms; deltas are b - a.")
    cmp_.add_argument("--recipe", default="configs/tiny.yaml", help="Recipe whose eval and tracking sections apply.")
    cmp_.add_argument("--output-dir", default=None, help="Default: <work_dir>/compare/<a>-vs-<b>.")
    cmp_.set_defaults(func=cmd_compare)

    dep = sub.add_parser("deploy", help="Publish prefect.yaml's deployments to the Prefect server in PREFECT_API_URL.")
    dep.add_argument(
        "names", nargs="*", metavar="NAME", help="Deployments to publish (default: all of prefect.yaml's)."
    )
    dep.add_argument(
        "--pool", default=None, help="Work pool for all of them instead of prefect.yaml's (created if missing)."
    )
    dep.set_defaults(func=cmd_deploy)

    k8s = sub.add_parser("k8s", help="The Kubernetes backend's objects: render a stage's manifests, show a run's.")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    render = k8s_sub.add_parser("render", help="Print a stage's manifests (for review or `kubectl apply -f -`).")
    render.add_argument("recipe", help="A recipe with compute.backend: kubernetes.")
    render.add_argument("--stage", type=int, required=True, help="0-based curriculum stage.")
    render.add_argument("--run-name", default=None, help="Run name (default: the recipe's name).")
    render.add_argument("--attempt", type=int, default=0, help="Launch number, as in the objects' names (default 0).")
    render.add_argument("--job", default=None, help="Job file (default: <work_dir>/runs/<run>/job.json).")
    render.set_defaults(func=cmd_k8s_render)
    status = k8s_sub.add_parser("status", help="Show the live objects of a run in the recipe's namespace.")
    status.add_argument("run", help="Run name.")
    status.add_argument("--recipe", default=None, help="Recipe whose compute.kubernetes.namespace to look in.")
    status.add_argument("--namespace", default=None, help="Namespace (instead of --recipe; default: default).")
    status.set_defaults(func=cmd_k8s_status)

    upp = sub.add_parser(
        "up", help="Run Prefect server, a worker and MLflow locally, with the deployments, until Ctrl-C."
    )
    upp.add_argument("recipe", nargs="?", default="configs/tiny.yaml", help="Recipe whose MLflow store to serve.")
    upp.add_argument(
        "--work-dir", default=None, help="Prefect's database and the logs (default: the recipe's work_dir)."
    )
    upp.add_argument("--host", default="127.0.0.1", help="Interface the servers listen on.")
    upp.add_argument("--prefect-port", type=int, default=4200)
    upp.add_argument("--mlflow-port", type=int, default=5000)
    upp.add_argument("--no-deploy", action="store_true", help="Start the services only; publish no deployments.")
    upp.set_defaults(func=cmd_up)
    return parser


def _flow_run_ended() -> type[BaseException]:
    # evaluated only when an exception reaches main(): `tessera --help` need not import Prefect
    from prefect.exceptions import Abort

    return Abort


def main(argv: list[str] | None = None) -> int:
    quiet_environment()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _flow_run_ended() as exc:  # refused (the run name is live elsewhere) or stopped: flows/outcome.py
        from flows.outcome import ended_message

        ended = ended_message(exc)
        if ended is None:
            raise
        print(f"tessera: error: {ended[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT if ended[1] else EXIT_FAILED
    except bad_input_types() as exc:
        from tasks.mlflow_run import TrackingUnavailable
        from tasks.train import TrainingFailed, TrainingFatal

        print(f"tessera: error: {exc}", file=sys.stderr)
        # A crash that outlived its retries, or a tracking server that went away mid-run, is not bad
        # input: a rerun resumes from the last checkpoint.
        transient = isinstance(exc, TrackingUnavailable) or (
            isinstance(exc, TrainingFailed) and not isinstance(exc, TrainingFatal)
        )
        return EXIT_FAILED if transient else EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
