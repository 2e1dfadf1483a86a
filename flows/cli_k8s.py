"""`tessera k8s render` and `tessera k8s status`: the Kubernetes backend's objects, read without running a flow."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.runtime import EXIT_FAILED


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
