"""The published forms' schemas: the bounds only a recipe knows, and each field's bounds moved to where Prefect's
UI checks a form in place (cli/deploy.py publishes them)."""

from __future__ import annotations

from typing import Any


def recipe_schema(schema: dict[str, Any], recipe) -> dict[str, Any]:
    """A form's parameter schema with the bounds only its recipe knows, so Prefect's UI marks them in place and
    the server (the deployments enforce their schema) refuses them: the stage budgets' *Stage* is a choice of
    the recipe's stages, a budget and `eval_every` are multiples of the tokens a step trains
    (trainers/config.batch_alignment_error: each stage's own step for its budget, the run's for eval.every).
    A budget row's multiple differs per stage where stages differ in batch or length; the schema then says the
    multiple all of them share, and the flow refuses the rest in one line first thing."""
    import math

    seq_len, batch = recipe.data.seq_len, recipe.train.global_batch_size
    steps = [(s.global_batch_size or batch) * (s.seq_len or seq_len) for s in recipe.train.stages]

    def bound(props: dict[str, Any]) -> None:
        if "eval_every" in props:
            props["eval_every"]["multipleOf"] = batch * seq_len
        if {"stage", "tokens"} <= set(props):  # a stage budget row (tasks/recipe_form.StageBudget)
            props["stage"]["enum"] = [s.name for s in recipe.train.stages]
            props["tokens"]["multipleOf"] = math.gcd(*steps)

    return _edit_properties(schema, bound)


# What Prefect's UI (3.8, the default UI) sends its server to check a form: each property of the parameter schema
# mapped to a shape of its own that has no minimum, maximum, multipleOf, length or pattern, while `items` and `allOf`
# go as they are. A field's bounds written beside its type never reach the check that marks the form in place: lr 5
# passed it, and only the run's creation, refused by the enforced schema, said so in a toast. Under `allOf` they
# are the same JSON-schema constraints and reach both checks.
UI_DROPPED_BOUNDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
)


def bounds_the_ui_checks(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every property's bounds moved under its `allOf` (UI_DROPPED_BOUNDS): the same constraints,
    which Prefect's UI then marks in place on Submit instead of leaving them to the server's toast."""

    def move(props: dict[str, Any]) -> None:
        for prop in props.values():
            if isinstance(prop, dict):
                bounds = {k: prop.pop(k) for k in UI_DROPPED_BOUNDS if k in prop}
                if bounds:
                    prop["allOf"] = [*prop.get("allOf", []), bounds]

    return _edit_properties(schema, move)


def _edit_properties(schema: dict[str, Any], edit) -> dict[str, Any]:
    """A copy of `schema` with `edit` applied to every `properties` mapping in it, however deep."""
    import copy

    edited = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if isinstance(node.get("properties"), dict):
            edit(node["properties"])
        for value in node.values():
            walk(value)

    walk(edited)
    return edited
