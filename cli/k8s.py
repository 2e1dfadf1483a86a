"""`tessera k8s render` and `tessera k8s status`: the Kubernetes backend's objects, read without running a flow."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.contract import EXIT_FAILED


def _kubernetes_recipe(path: str):
    from tasks.recipe import RecipeError, load_recipe

    recipe = load_recipe(path)
    if recipe.compute.backend != "kubernetes":
        raise RecipeError(f"{path}: compute.backend: is {recipe.compute.backend!r}; `tessera k8s` needs kubernetes")
    return recipe


# What a path holds where only `tessera prepare` can know it: the content hash it names each prepared source and the
# tokenizer with (tasks/data/hashing.py), and the MLflow run `tessera run` opens.
HASH = "{prepare-hash}"
MLFLOW_RUN = "{mlflow-run-id}"


def planned_job(recipe, recipe_path: str, run: str):
    """The job `tessera run` would write for `run`, from the recipe alone: every field the launcher and the pods
    read as the run will have it, except what only the prepare stage and the run can know (HASH, MLFLOW_RUN),
    which are placeholders that say so. A tokenizer trained on the sources has no ids before that stage: refused."""
    from tasks.data.errors import DataError
    from tasks.data.results import PreparedData, PreparedSource
    from tasks.data.tokenizer import peek, token_dtype
    from tasks.mlflow_run import resolved_uri
    from tasks.recipe import RecipeError
    from tasks.training.train_job import make_job
    from trainers.config import MlflowTarget

    try:
        tokenizer = peek(recipe.data.tokenizer)
    except DataError as exc:
        raise RecipeError(f"{recipe_path}: data.tokenizer: {exc}") from None
    if tokenizer is None:
        raise RecipeError(
            f"{recipe_path}: data.tokenizer.train: its ids exist only once `tessera prepare` has trained it; "
            "prepare first, or pass --job"
        )
    root = recipe.data.root.rstrip("/")
    tokenizer = tokenizer.model_copy(update={"hf_dir": f"{root}/tokenizer-{HASH}", "uri": None})

    def prepared(name: str, seq_len: int, val: bool) -> PreparedSource:
        folder = f"{root}/{name}-{HASH}"  # each length its own hash: seq_len is part of what it covers
        return PreparedSource(
            name=name,
            path=f"{folder}/train",
            val_path=f"{folder}/val" if val else None,
            root=folder,
            hash=HASH,
            documents=0,
            tokens=0,
            samples=0,
            dtype=token_dtype(tokenizer.vocab_size),
        )

    sources = {s.name: prepared(s.name, recipe.data.seq_len, s.val_fraction > 0) for s in recipe.data.sources}
    lengths = {st.seq_len for st in recipe.train.stages if st.seq_len and st.seq_len != recipe.data.seq_len}
    seq_len_streams = {
        n: {s.name: prepared(s.name, n, False).path for s in recipe.data.sources if s.name in _mixed(recipe, n)}
        for n in sorted(lengths)
    }
    return make_job(
        run,
        recipe.model,
        recipe.train,
        recipe.data.seq_len,
        PreparedData(tokenizer=tokenizer, seq_len=recipe.data.seq_len, sources=sources),
        seq_len_streams,
        recipe.eval.every,
        Path(recipe.work_dir) / "runs" / run,
        MlflowTarget(tracking_uri=resolved_uri(recipe.tracking.tracking_uri), run_id=MLFLOW_RUN),
    )


def _mixed(recipe, seq_len: int) -> set[str]:
    return {name for st in recipe.train.stages if st.seq_len == seq_len for name in st.mixture}


def _refuse_another_runs_job(job: Path, raw: dict, recipe, recipe_path: str, run: str) -> None:
    """A job file is the recipe's run's, or refused in one line: rendering the demo's job under a 1B recipe would
    print manifests that hold the tiny model and local paths."""
    from tasks.recipe import RecipeError

    theirs_model = raw.get("model")
    ours_model = recipe.model.model_dump(mode="json")
    differences = [
        (field, raw[field], ours)
        for field, ours in (("run_name", run), ("seq_len", recipe.data.seq_len))
        if field in raw and raw[field] != ours
    ]
    if isinstance(theirs_model, dict):
        differences += [
            (f"model.{k}", theirs_model.get(k), v)
            for k, v in ours_model.items()
            if k in theirs_model and theirs_model[k] != v
        ]
    stages = [s.get("name") for s in (raw.get("train") or {}).get("stages") or []]
    ours_stages = [s.name for s in recipe.train.stages]
    if stages and stages != ours_stages[: len(stages)]:
        differences.append(("train.stages", stages, ours_stages))
    if differences:
        field, theirs, ours = differences[0]
        raise RecipeError(
            f"{job}: {field} is {theirs!r} where {recipe_path} says {ours!r}: the job file of another run; pass this "
            "recipe's run's job file, or no --job to render from the recipe alone"
        )


def cmd_k8s_render(args: argparse.Namespace) -> int:
    """Print the manifests of one stage's launch, exactly as the launcher would create them: from the run's job file
    when there is one, else from the recipe alone (a fresh checkout); the first line says which."""
    import json
    import tempfile

    from infra.k8s_views import render_stage
    from tasks.recipe import RecipeError

    recipe = _kubernetes_recipe(args.recipe)
    run = args.run_name or recipe.name
    if args.prepare:
        return _render_prepare(recipe, args.recipe, run, args.attempt)
    if not 0 <= args.stage < len(recipe.train.stages):
        raise RecipeError(f"--stage: {args.stage} is not a stage of {args.recipe} (0..{len(recipe.train.stages) - 1})")
    job = Path(args.job) if args.job else Path(recipe.work_dir) / "runs" / run / "job.json"
    if args.job and not job.is_file():
        raise RecipeError(f"--job: {job}: no such file")
    if job.is_file():
        try:
            raw = json.loads(job.read_text())
        except ValueError as exc:
            raise RecipeError(f"{job}: not a job file ({exc})") from None
        _refuse_another_runs_job(job, raw, recipe, args.recipe, run)
        print(f"# tessera: from the job file {job}")
        print(render_stage(recipe.compute, job, args.stage, args.attempt), end="")
        return 0
    planned = planned_job(recipe, args.recipe, run)
    print(
        f"# tessera: from {args.recipe} alone (no job file at {job} yet): {HASH} stands for the content hash "
        f"`tessera prepare` names each prepared source and the tokenizer with, {MLFLOW_RUN} for the MLflow run "
        "`tessera run` opens"
    )
    with tempfile.TemporaryDirectory(prefix="tessera-render-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(planned.model_dump_json(indent=2))
        print(render_stage(recipe.compute, path, args.stage, args.attempt), end="")
    return 0


def _render_prepare(recipe, recipe_path: str, run: str, attempt: int) -> int:
    """The prepare Job `tessera prepare` would submit: planned from the sources when this machine reads them."""
    from infra.k8s_views import render_prepare
    from tasks.data.cluster import pod_command, preview

    job = preview(recipe.data)
    if job.unread is None:
        print(f"# tessera: from {recipe_path}: {job.completions} partitions left to prepare, planned from the data")
    else:
        print(
            f"# tessera: from {recipe_path} alone: the sources could not be planned here ({job.unread}); "
            f"{job.key} stands for the key `tessera prepare` names the Job's index file with, and completions for "
            "the number of partitions left to prepare"
        )
    print(
        render_prepare(
            recipe.compute,
            run=run,
            key=job.key,
            completions=job.completions,
            argv=pod_command(job.index_uri),
            env={},
            fail_fast=job.fail_fast,
            attempt=attempt,
        ),
        end="",
    )
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
