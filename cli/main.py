"""`tessera`: run the pipeline or one of its stages from a shell.

Known bad-input errors print one line naming the file, line or field and exit 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from cli.k8s import cmd_k8s_render, cmd_k8s_status
from cli.models import cmd_compare, cmd_continue, cmd_eval, cmd_promote
from cli.stopping import Stopped, say_last, stop_line
from tasks.runs.runtime import (
    install_log_filter,
    quiet_environment,
    temporary_server_apart,
    usable_data_root,
    work_prefect_home,
)
from trainers.contract import EXIT_BAD_INPUT, EXIT_FAILED, OneLineError


def cmd_run(args: argparse.Namespace) -> int:
    from tasks.recipe import RecipeError, load_recipe, run_folder

    recipe = load_recipe(args.recipe)  # fail on a bad recipe before any engine starts
    if args.run_name is not None:
        try:
            run_folder(recipe.work_dir, args.run_name)
        except RecipeError as exc:
            raise RecipeError(f"--run-name: {exc}") from None
    work_prefect_home(recipe.work_dir)
    usable_data_root(recipe)
    from flows.pipeline import PipelineParams, pretrain_pipeline

    install_log_filter()
    temporary_server_apart()
    result = pretrain_pipeline(PipelineParams(recipe=args.recipe, run_name=args.run_name, if_running=args.if_running))
    last = result.registrations[-1] if result.registrations else None
    print(
        f"run {result.run_name}: {len(result.registrations)} model versions"
        + (f"; latest-checkpoint=v{last.latest} best=v{last.best}" if last else "")
        + f"; mlflow run {result.mlflow_run_id}"
    )
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from tasks.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    work_prefect_home(recipe.work_dir)
    usable_data_root(recipe)
    from flows.prepare import PrepareParams, prepare_data
    from tasks.data import interrupt
    from tasks.prepare import warm_up

    install_log_filter()
    warm_up(recipe.data)  # overlaps Prefect's server start-up
    temporary_server_apart()
    with interrupt.stop_on_signals():  # Ctrl-C/SIGTERM: stop within seconds, exit 130/143
        print(prepare_data(PrepareParams(recipe=args.recipe)).summary())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Where a recipe's prepared data stands and where a run's wall time went (its goodput ledger), from files."""
    from tasks.recipe import RecipeError, load_recipe, run_folder
    from tasks.training.goodput import BUCKETS, WORDS, for_job
    from tasks.training.train import TrainJob

    recipe = load_recipe(args.recipe)
    run_dir = run_folder(recipe.work_dir, args.run)
    job_file = run_dir / "job.json"
    if not job_file.is_file():
        raise RecipeError(f"{job_file}: no such run in {recipe.work_dir} (`tessera run` writes it)")
    goodput = for_job(run_dir, TrainJob.model_validate_json(job_file.read_text()))
    if not goodput.launches:
        print(f"run {args.run}: no launch recorded yet")
        _print_prepared(recipe.data)
        return 0
    print(
        f"run {args.run}: goodput {goodput.ratio:.1%} over {goodput.wall_s:,.0f} s of wall time, "
        f"{goodput.launches} launch(es), {goodput.tokens:,} tokens"
    )
    width = max(len(WORDS[b]) for b in BUCKETS)
    for bucket in BUCKETS:
        seconds = goodput.buckets[bucket]
        print(f"  {WORDS[bucket]:<{width}}  {seconds:>10,.1f} s  {seconds / goodput.wall_s:6.1%}")
    for stage, buckets in goodput.stages.items():
        wall = sum(buckets.values())
        print(f"  stage {stage}: {buckets['productive'] / wall if wall else 0:.1%} productive of {wall:,.0f} s")
    _print_prepared(recipe.data)
    return 0


def _print_prepared(data) -> None:
    """Where the recipe's prepared data stands: each output done, or how many partitions a rerun skips."""
    from tasks.data.errors import DataError
    from tasks.data.pipeline import output_states

    print("prepared data:")
    try:
        for line in output_states(data):
            print(f"  {line}")
    except DataError as exc:
        print(f"  cannot tell: {exc}")


def cmd_deploy(args: argparse.Namespace) -> int:
    from cli.deploy import DeployError, deploy

    if args.recipe:
        from tasks.recipe import load_recipe

        load_recipe(args.recipe)  # a form default that does not load: one line, before anything is published
    try:
        deployed = deploy(args.names, args.pool, recipe=args.recipe)
    except DeployError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for d in deployed:
        print(f"{d.flow_name}/{d.name}  {d.url}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from cli.up import UpError, UpOptions, up

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


TRUST_HELP = (
    "Load Composer checkpoints even if they need more than tensors and plain values to unpickle, which can run "
    "code they carry. Without it such a file is refused in one line. Only for files you made or trust."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM pretraining pipeline on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_commands(sub)
    _model_commands(sub)
    _service_commands(sub)
    return parser


def _run_commands(sub) -> None:
    """`run` and `prepare`: a recipe's pipeline, or its data alone."""
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


def _model_commands(sub) -> None:
    """`eval`, `continue`, `promote` and `compare`: the commands about models (cli/models.py)."""
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
    ev.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
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
    cont.add_argument(
        "--name-prefix",
        "--run-name",
        dest="name_prefix",
        default=None,
        help="Prefix of the run's name, which is always <prefix>-cpt-v<base version>-<digest of the new files>, so "
        "each batch of new data is its own run and a retry resumes it (default prefix: the recipe's name).",
    )
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
    cmp_.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    cmp_.set_defaults(func=cmd_compare)


def _service_commands(sub) -> None:
    """`status`, `deploy`, `k8s` and `up`: a run's goodput, the deployments, the cluster, the local stack."""
    stat = sub.add_parser("status", help="Where a run's wall time went: its goodput ledger.")
    stat.add_argument("run", help="The run's name.")
    stat.add_argument("--recipe", default="configs/tiny.yaml", help="Recipe whose work_dir holds the run.")
    stat.set_defaults(func=cmd_status)

    dep = sub.add_parser("deploy", help="Publish prefect.yaml's deployments to the Prefect server in PREFECT_API_URL.")
    dep.add_argument(
        "names", nargs="*", metavar="NAME", help="Deployments to publish (default: all of prefect.yaml's)."
    )
    dep.add_argument(
        "--pool", default=None, help="Work pool for all of them instead of prefect.yaml's (created if missing)."
    )
    dep.add_argument(
        "--recipe",
        default=None,
        help="Make this recipe every form's default (the one whose MLflow store your server shows); "
        "default: prefect.yaml's.",
    )
    dep.set_defaults(func=cmd_deploy)

    k8s = sub.add_parser("k8s", help="The Kubernetes backend's objects: render a stage's manifests, show a run's.")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    render = k8s_sub.add_parser(
        "render", help="Print a stage's manifests, or the prepare Job (for review or `kubectl apply -f -`)."
    )
    render.add_argument("recipe", help="A recipe with compute.backend: kubernetes.")
    which = render.add_mutually_exclusive_group(required=True)
    which.add_argument("--stage", type=int, help="0-based curriculum stage.")
    which.add_argument(
        "--prepare", action="store_true", help="The prepare stage's Indexed Job (one index per partition to prepare)."
    )
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


def _flow_run_ended() -> type[BaseException] | tuple[()]:
    """Prefect's Abort (a refused or stopped flow run), evaluated only when an exception reaches main(). Only a
    process that imported Prefect can have raised it: a refusal made before any flow (a model file read, 1.2 s of
    Prefect's import spared) matches nothing here and goes on to its own clause."""
    exceptions = sys.modules.get("prefect.exceptions")
    return exceptions.Abort if exceptions is not None else ()


def _work_dir(args: argparse.Namespace) -> str:
    """The work dir a command writes under: its --work-dir, or its recipe's."""
    if getattr(args, "work_dir", None):
        return args.work_dir
    try:
        from tasks.recipe import load_recipe

        return load_recipe(args.recipe).work_dir
    except Exception:  # noqa: BLE001 - only to name a folder in an error message
        return "."


def main(argv: list[str] | None = None) -> int:
    quiet_environment()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Stopped as stop:  # a stop signal, from the `tessera` script's supervision (cli/stopping.py)
        say_last(f"tessera: {stop_line(stop.signum)}")
        return 0 if args.command == "up" else stop.exit_code  # `tessera up` exits 0 after any stop
    except _flow_run_ended() as exc:  # refused (the run name is live elsewhere) or stopped: tasks/runs/flow_outcome.py
        from tasks.runs.flow_outcome import ended_message, stop_signal

        ended = ended_message(exc)
        if ended is None:
            raise
        signum = stop_signal(exc)
        if signum is not None:  # Prefect's engine took the SIGTERM and the flow ended Cancelled, saying so
            say_last(f"tessera: {stop_line(signum, ended[0])}")
            return 128 + signum
        print(f"tessera: error: {ended[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT if ended[1] else EXIT_FAILED
    except OneLineError as exc:  # bad input (exit 2), or a failure a rerun may get past (exit 1): the class says
        print(f"tessera: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        # A full disk anywhere under the work dir (prepared data, Prefect's results, a registration's copy):
        # one line naming where, not a traceback per process that noticed.
        from tasks.disk import full_disk

        said = full_disk(exc, _work_dir(args))
        if said is None:
            raise
        print(f"tessera: error: {said}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # supervised, as the `tessera` script (cli/entry.py) runs it, once this module is in
    from cli.stopping import supervise

    supervise()
    sys.exit(main())
