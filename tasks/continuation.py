"""What a continued run trains: its base version, its tokenizer, its budget, and its recipe derived from the base's.

The continued_pretraining flow sequences these; they do the work (registry look-ups, the tokenizer download,
the budget and recipe arithmetic), so the flow holds none.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from tasks.consumed_files import Consumed
from tasks.data.config import DataConfig
from tasks.mlflow_run import client_for
from tasks.recipe import Recipe, RecipeError
from tasks.recipe_form import COMPILE_CHOICES
from tasks.registry.register import CHAMPION_ALIAS
from tasks.tracking_config import TrackingConfig
from trainers.contract import EXIT_FAILED, OneLineError
from trainers.format.s3 import StoreError, fetch_folder


class ContinuationError(OneLineError, ValueError):
    """A continued run that cannot start as asked; str() is one line naming the field."""


def per_step(recipe: Recipe) -> int:
    """Tokens one optimizer step of the recipe trains: a stage's budget and its rewarm are whole steps of it."""
    return recipe.train.global_batch_size * recipe.data.seq_len


def whole_steps(recipe: Recipe, tokens: int) -> int:
    """`tokens` rounded down to whole steps, at least one step."""
    step = per_step(recipe)
    return max(step, tokens // step * step)


def one_pass(new_tokens: int, replay_fraction: float) -> int:
    """Tokens of one pass over `new_tokens` of new data, grown by the replay share so the new data is seen once."""
    return int(new_tokens / (1.0 - replay_fraction))


def new_source(run_name: str, files: list[Consumed], kind: str, separator: str | None, text_field: str) -> dict:
    """The recipe source of the new files (raw), named after the run's digest so each week's data is its own."""
    source = {"name": f"new-{run_name.rsplit('-', 1)[-1]}", "kind": kind, "paths": [f.path for f in files]}
    return source | ({"separator": separator} if kind == "text" else {"text_field": text_field})


def challenger(tracking: TrackingConfig, name: str, mlflow_run_id: str) -> int | None:
    """The run's best registered version of `name`, the challenger the promotion rule weighs; None if it has none."""
    from tasks.registry.register import run_best

    best = run_best(tracking, name, mlflow_run_id)
    return int(best) if best else None


def base_version(tracking: TrackingConfig, base: str | None):
    """The model version `base` names (default: the registered model's champion); one line when it names none."""
    from mlflow.exceptions import MlflowException

    uri = base or f"models:/{tracking.registered_model}@{CHAMPION_ALIAS}"
    ref = uri.removeprefix("models:/")
    client = client_for(tracking)
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            return client.get_model_version_by_alias(name, alias)
        name, _, number = ref.rpartition("/")
        return client.get_model_version(name, number)
    except MlflowException:
        hint = " (run pretrain_pipeline first, or `tessera promote models:/NAME/N`)" if base is None else ""
        raise ContinuationError(f"base: {uri} names no model version in {tracking.tracking_uri}{hint}") from None


def pinned_tokenizer(data: DataConfig, tracking: TrackingConfig, base_run_id: str) -> dict:
    """The base run's tokenizer: a `train:` tokenizer would otherwise be retrained with the new data in it."""
    raw = data.tokenizer.model_dump(mode="json")
    if data.tokenizer.train is None:
        return raw
    client = client_for(tracking)
    with tempfile.TemporaryDirectory() as tmp:
        job = json.loads(Path(client.download_artifacts(base_run_id, "recipe/job.json", tmp)).read_text())
    path = job["tokenizer_dir"]
    if "://" in path:  # published beside the data under an s3:// root; the working copy is usually still here
        try:
            path = str(fetch_folder(path, Path(data.local_root) / Path(path).name))
        except StoreError as exc:
            error = OneLineError(f"the base run's tokenizer: {exc}")
            if not exc.lasting:
                error.exit_code = EXIT_FAILED
            raise error from exc
    return {**raw, "path": path, "train": None}


def run_name(prefix: str, version: str, files: list[Consumed]) -> str:
    """`<prefix>-cpt-v<version>-<digest of the new files>`, never a name the user fixes: one fixed name reused
    every week would make week 2's stage spec identical to week 1's (nothing trained, or a refused edit of a
    trained stage). Deterministic, so a retry or rerun of the same continuation resumes it."""
    digest = hashlib.sha256("\n".join(f"{p}|{s}|{v}" for p, s, v in sorted(f.key for f in files)).encode())
    return f"{prefix}-cpt-v{version}-{digest.hexdigest()[:8]}"


# What the form says of how to continue, as `derive` takes it.
HOW = ("replay_fraction", "rewarm_fraction", "lr", "schedule", "min_gain", "max_category_drop", "compile")


def describe(run_name: str, recipe: Recipe, continued: Recipe, budget: int, replay_fraction: float) -> str:
    """The line that says what the continued run trains."""
    optim = continued.train.optim
    return (
        f"continued run {run_name}: {budget} tokens ({100 * replay_fraction:.0f}% replay of "
        f"{', '.join(recipe.train.stages[-1].mixture)}), LR {optim.lr:g} "
        + (f"rewarmed over {optim.warmup_tokens:,} tokens" if optim.warmup_tokens else "from its first step, no rewarm")
        + f", then {optim.schedule} decay"
    )


def continued_recipe(recipe: Recipe, recipe_path: str, **how) -> Recipe:
    """The continued run's Recipe (`derive`'s arguments in `how`), validated; one line when it is not a valid one."""
    try:
        return Recipe.model_validate(derive(recipe.model_dump(mode="json"), per_step(recipe), **how))
    except ValueError as exc:  # pydantic's ValidationError: the inputs were inconsistent
        raise RecipeError(f"{recipe_path}: the continued run's recipe is invalid: {str(exc).splitlines()[0]}") from None


def derive(
    raw: dict,
    step: int,
    *,
    base_uri: str,
    checkpoint: str | None,
    source: dict,
    tokenizer: dict,
    budget: int,
    replay_fraction: float,
    rewarm_fraction: float,
    lr: float | None,
    schedule: str,
    min_gain: float | None,
    max_category_drop: float | None,
    compile: str = "recipe",
) -> dict:
    """The continued run's recipe (raw; `step` the tokens of one step): one stage over the new source plus
    replay of the last stage's mixture, from the base's weights (and its checkpoint's optimizer state), LR rewarmed
    then decayed over `budget`."""
    raw = json.loads(json.dumps(raw))  # a copy: the caller's recipe stays as it was
    raw["data"]["sources"].append(source)
    raw["data"]["tokenizer"] = tokenizer
    mixture = {source["name"]: 1.0 - replay_fraction}
    if replay_fraction > 0:
        mixture |= {name: replay_fraction * share for name, share in raw["train"]["stages"][-1]["mixture"].items()}
    rewarm = int(budget * rewarm_fraction) // step * step
    raw["train"]["stages"] = [{"name": "continued", "tokens": budget, "mixture": mixture}]
    raw["train"]["optim"] |= {
        "lr": lr or raw["train"]["optim"]["lr"],
        "warmup_tokens": rewarm,
        "schedule": schedule,
        "decay_tokens": budget,
    }
    raw["model"]["init_from"] = base_uri
    raw["train"]["init_optimizer_from"] = checkpoint or None
    raw["eval"]["every"] = min(raw["eval"]["every"], budget)  # at least the stage end is evaluated either way
    if min_gain is not None:
        raw["promote"]["min_gain"] = min_gain
    if max_category_drop is not None:
        raw["promote"]["max_category_drop"] = max_category_drop
    if COMPILE_CHOICES[compile] is not None:  # the form's choice; `recipe` keeps the base recipe's
        raw["train"]["compile"] = COMPILE_CHOICES[compile]
    return raw
