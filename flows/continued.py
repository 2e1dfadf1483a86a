"""`continued_pretraining`: keep a model current as new data arrives, and promote it only if it is better.

1. The base is a registry version (default `models:/<registered_model>@champion`): its weights
   start the run (`model.init_from`), and its checkpoint's optimizer state when the shapes match.
2. Only input files no finished continued run of this model has consumed are used (tasks/consumed_files.py).
   None: the run says "no new data since <run>" and trains and registers nothing.
3. The run trains one stage over the new data plus a replay fraction of the recipe's own sources
   (its last stage's mixture), with a rewarm-then-decay LR schedule, through the same
   `run_pipeline` as `pretrain_pipeline`: the gauntlet every eval.every tokens, registration.
4. The challenger (this run's best version) and the champion are scored now, on the same gauntlet
   with the same code and seed, and the recipe's `promote` rule decides (tasks/registry/promote.py). With the
   kubernetes backend each is scored in an evaluation pod, never in the flow's own process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.pipeline import PipelineResult, RecipeTarget, run_pipeline
from flows.prepare import prepare_sources
from tasks import consumed_files, continuation
from tasks.artifacts import artifact_key
from tasks.mlflow_run import client_for
from tasks.recipe import NAME_PATTERN, Recipe, load_recipe
from tasks.recipe_form import COMPILE_HELP, CompileChoice, PeakLR, form_input
from tasks.registry.aliases import reconcile_registry
from tasks.registry.promote import Decision, champion_version, promote_challenger
from tasks.registry.register import CHAMPION_ALIAS, checkpoint_of
from tasks.runs.flow_outcome import form_values, run_or_end
from tasks.runs.run_record import record_flow_run_end, rename_flow_run, stays_of, tag_flow_run
from tasks.runs.runtime import prepare_process


class ContinueParams(RecipeTarget):
    """A continued-pretraining run: the recipe the model was trained with and where the new files are. Every
    field left empty keeps its default. The run's name is derived, never given: see Run name prefix."""

    name_prefix: Annotated[str | None, *form_input({"type": "string", "pattern": NAME_PATTERN})] = Field(
        None,
        pattern=NAME_PATTERN,
        title="Run name prefix",
        # backticks: the UI renders descriptions as markdown, where a bare <prefix> is an HTML tag and vanishes
        description="The continued run is always named `PREFIX-cpt-vN-DIGEST`: PREFIX this field, N the base "
        "version, DIGEST that of the new files. So every week's new data is a run of its own, and a retry of the same "
        "continuation resumes it. Empty: the recipe's name.",
    )

    new_data: str = Field(
        ...,
        min_length=1,
        description="New data: a directory (every file under it), a glob, or an s3:// prefix. Files an earlier "
        "continued run of this model consumed are skipped.",
    )
    base: Annotated[str | None, *form_input({"type": "string", "minLength": 1})] = Field(
        None,
        title="Base model",
        description="Registry URI of the model to continue, e.g. `models:/tessera-tiny/3` or "
        "`models:/tessera-tiny@best`. Empty: the champion of the recipe's registered model.",
    )
    new_data_format: Literal["text", "jsonl"] = Field("text", description="How the new files are read.")
    separator: str | None = Field(
        "\n\n", description="text: split each file into documents on this; null: one per file."
    )
    text_field: str = Field("text", description="jsonl: the field holding the document text.")
    tokens: Annotated[int | None, *form_input({"type": "integer", "minimum": 1})] = Field(
        None,
        gt=0,
        title="Token budget",
        description="Tokens to train: a positive integer. Empty: one pass over the new data (plus the replay share).",
    )
    replay_fraction: float = Field(
        0.2, ge=0, lt=1, description="Share of each batch drawn from the recipe's own sources, against forgetting."
    )
    lr: PeakLR = Field(
        None, description="Peak LR of the rewarm: above 0 and at most 1. Empty: the recipe's train.optim.lr."
    )
    rewarm_fraction: float = Field(
        0.1, ge=0, lt=1, description="Share of the budget spent warming the LR back up from zero."
    )
    schedule: Literal["cosine", "linear"] = Field("cosine", description="Decay after the rewarm, to min_lr_ratio.")
    min_gain: Annotated[float | None, *form_input({"type": "number"})] = Field(
        None,
        description="The lower bound of the headline gain's interval must be above this (a gain within noise never "
        "promotes). Empty: the recipe's promote.min_gain.",
    )
    max_category_drop: Annotated[float | None, *form_input({"type": "number", "minimum": 0})] = Field(
        None,
        ge=0,
        description="No category may fall significantly further than this, 0 or more. Empty: the recipe's "
        "promote.max_category_drop.",
    )
    compile: CompileChoice = Field("recipe", title="Compile the model", description=COMPILE_HELP)
    if_running: Literal["refuse", "wait"] = Field(
        "refuse",
        title="If a run of this name is live",
        description="refuse: end at once as Refused, naming the live run; wait: start when it has ended.",
    )


class ContinueResult(BaseModel):
    run_name: str
    base: str = Field(..., description="The version continued, as models:/name/N.")
    new_files: int
    trained: bool
    pipeline: PipelineResult | None = None
    challenger: int | None = None
    decision: Decision | None = None
    champion: int | None = Field(None, description="The champion version after this run.")


def _prefix(params: dict) -> str:
    return str(params.get("name_prefix") or Path(str(params.get("recipe", "tessera"))).stem)


def _flow_run_name() -> str:
    """`<prefix>-cpt` until the run's name is derived; then the flow run is renamed after it."""
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params")
    params = params.model_dump() if isinstance(params, BaseModel) else dict(params or {})
    return f"{_prefix(params)}-cpt"


def _record_end(flow, flow_run, state) -> None:
    """on_crashed / on_cancellation: mark the continued run's MLflow run, as pretrain_pipeline's hook does.

    Prefect's runner passes the hook's arguments by keyword (`flow`, `flow_run`, `state`): the names are its API.

    The run name was derived inside the flow; the flow run carries it as its `run:<name>` tag once it has
    started the run, and before that no MLflow run was opened.
    """
    from prefect.client.orchestration import get_client

    from tasks.runs.flow_outcome import REFUSED, keep_last_word

    if state.name == REFUSED:
        return
    if state.is_cancelling() or state.is_cancelled():  # first: the runner's own Cancelled comes after the hooks
        keep_last_word(flow_run.id)
    try:
        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(flow_run.id).tags
        run_name = next((t.removeprefix("run:") for t in tags if t.startswith("run:")), None)
        recipe = load_recipe(dict(flow_run.parameters["params"])["recipe"])
    except Exception:  # noqa: BLE001 - nothing the hook can do; the flow run's own state says what happened
        return
    if run_name:
        record_flow_run_end(flow_run, state, recipe.tracking, run_name)


@flow(
    name="continued_pretraining",
    flow_run_name=_flow_run_name,
    log_prints=True,
    validate_parameters=False,
    on_crashed=[_record_end],
    on_cancellation=[_record_end],
)
def continued_pretraining(params: ContinueParams) -> ContinueResult:
    """Continue pretraining the champion on data that arrived since the last run; promote it only if better."""
    prepare_process()
    params = form_values(ContinueParams, params)  # one line, also with the UI's validation switched off
    logger = get_run_logger()
    recipe = load_recipe(params.recipe)
    name = recipe.tracking.registered_model
    # alias moves made in MLflow's UI since tessera last looked go into the versions' history first
    for line in reconcile_registry(recipe.tracking, f"continued_pretraining flow run {flow_run.name}"):
        logger.warning("%s", line)
    # What is new comes first: a scheduled run with nothing new says so and ends, champion or not.
    inputs = consumed_files.list_inputs(params.new_data)
    seen, last_run = consumed_files.consumed(recipe.tracking, name)
    fresh = consumed_files.new_inputs(inputs, seen)
    if not fresh:
        return _nothing_new(recipe, params, len(inputs), last_run)
    base_mv = continuation.base_version(recipe.tracking, params.base)
    name, version = base_mv.name, str(base_mv.version)
    base_uri = f"models:/{name}/{version}"
    run_name = continuation.run_name(params.name_prefix or recipe.name, version, fresh)
    rename_flow_run(flow_run.id, run_name)
    logger.info(
        "continuing %s (run %s) on %d new file(s) of %d under %s",
        base_uri,
        run_name,
        len(fresh),
        len(inputs),
        params.new_data,
    )

    source = continuation.new_source(run_name, fresh, params.new_data_format, params.separator, params.text_field)
    tokenizer = continuation.pinned_tokenizer(recipe.data, recipe.tracking, base_mv.run_id)
    budget = continuation.whole_steps(
        recipe, params.tokens or _one_pass(recipe, source, tokenizer, params.replay_fraction)
    )
    how = params.model_dump(include=set(continuation.HOW))  # replay, rewarm, LR, schedule, promotion bounds
    checkpoint = checkpoint_of(client_for(recipe.tracking), base_mv.name, base_mv.version)
    continued = continuation.continued_recipe(
        recipe, params.recipe, base_uri=base_uri, checkpoint=checkpoint, source=source, tokenizer=tokenizer,
        budget=budget, **how,
    )  # fmt: skip
    logger.info("%s", continuation.describe(run_name, recipe, continued, budget, params.replay_fraction))

    run_tags = {
        consumed_files.MODEL_TAG: name,
        "tessera.continued_from": base_uri,
        "tessera.new_data": params.new_data,
        "tessera.new_files": str(len(fresh)),
    }
    result = run_or_end(
        run_name,
        lambda: run_pipeline(
            continued, run_name, params.recipe, params.if_running, run_tags, {"continued_from": f"v{version}"}
        ),
        stays=lambda: stays_of(continued, run_name),
    )
    challenger, decision, champion = _promote(continued, name, run_name, result.mlflow_run_id)
    # Only now do the files count as consumed: a run that failed before here trains on them again.
    consumed_files.record(
        continued.tracking,
        result.mlflow_run_id,
        [f.model_copy(update={"run": run_name}) for f in fresh],
        str(flow_run.id) if flow_run.id else None,
    )
    outcome = ContinueResult(
        run_name=run_name,
        base=base_uri,
        new_files=len(fresh),
        trained=True,
        pipeline=result,
        challenger=challenger,
        decision=decision,
        champion=champion,
    )
    return outcome if decision is None else _verdict_state(outcome)


def _nothing_new(recipe: Recipe, params: ContinueParams, files: int, last_run: str | None) -> ContinueResult:
    """A run with no new data says so (log, artifact, the flow run's name) and ends, training nothing."""
    name = recipe.tracking.registered_model
    since = f"since {last_run}" if last_run else "(no continued run yet)"
    message = f"no new data {since}: {files} file(s) under {params.new_data}, all consumed; nothing trained"
    get_run_logger().info(message)
    create_markdown_artifact(
        key=artifact_key(recipe.name, "continued", "no-new-data"),
        markdown=f"{message}\n",
        description=f"Continued pretraining of {name}",
    )
    champion = champion_version(client_for(recipe.tracking), name)
    rename_flow_run(flow_run.id, f"{_prefix(params.model_dump())}-cpt-no-new-data")
    return ContinueResult(
        run_name="",
        base=params.base or f"models:/{name}@{CHAMPION_ALIAS}",
        new_files=0,
        trained=False,
        champion=int(champion) if champion else None,
    )


def _promote(continued: Recipe, name: str, run_name: str, mlflow_run_id: str):
    """(challenger, decision, champion after): the run's best version against the champion, by the recipe's rule;
    all None when the run registered nothing."""
    challenger = continuation.challenger(continued.tracking, name, mlflow_run_id)
    if challenger is None:
        return None, None, None
    decision, champion = promote_challenger(
        continued.eval,
        continued.tracking,
        continued.promote,
        run_name,
        mlflow_run_id,
        challenger,
        continued.data.seq_len,
        continued.compute,
    )
    return challenger, decision, champion


PROMOTED, NOT_PROMOTED = "Promoted", "Not promoted"


def _verdict_state(outcome: ContinueResult):
    """The flow run's last state says the verdict, where a person looks first: *Not promoted* (still of type
    Completed: the run did what it was asked, and a schedule or an automation keyed on success is unaffected) with
    the one-line reason, or *Promoted*; a `promotion:` tag says it in the runs list and its filters too."""
    from prefect.states import Completed

    decision = outcome.decision
    word = "accepted" if decision.accepted else "rejected"
    tag_flow_run(flow_run.id, [f"promotion:{word}"])
    if decision.accepted:
        message = f"challenger v{outcome.challenger} is the champion now: {decision.summary()}"
    else:
        message = (  # why, last: "within noise", "less than promote.min_gain", a category's fall
            f"REJECTED: challenger v{outcome.challenger} not promoted, v{outcome.champion} stays champion: "
            f"{decision.summary()}" + "".join(f"; {reason}" for reason in decision.reasons)
        )
    return Completed(name=PROMOTED if decision.accepted else NOT_PROMOTED, message=message, data=outcome)


def _one_pass(recipe: Recipe, source: dict, tokenizer: dict, replay_fraction: float) -> int:
    """Tokens of one pass over the new data (prepared now, so a budget left empty is known), with the replay share."""
    from tasks.data.config import DataConfig

    raw = recipe.data.model_dump(mode="json") | {"sources": [source], "tokenizer": tokenizer}
    prepared = prepare_sources.with_options(flow_run_name="prepare-new-data")(
        DataConfig.model_validate(raw), recipe.compute, f"{recipe.name}-new-data"
    )
    return continuation.one_pass(prepared.sources[source["name"]].tokens, replay_fraction)
