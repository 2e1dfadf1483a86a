"""The registry's aliases: tessera's moves, a record of them, the moves made elsewhere, and the descriptions.

MLflow keeps no history of alias moves (mlflow#2169), and its UI can move any alias (the alias
pencil, "Promote model") without tessera knowing. So tessera records, as registered-model tags,
the version it last set each alias to (`tessera.alias.<alias>`, one tag per alias so that two
processes moving different aliases never overwrite each other's record). `reconcile_aliases`
compares the aliases with that record; what differs was done outside tessera and is written into
the decision history of the versions involved (tasks/registry/version_record.py). Every `set_aliases`
reconciles first, so tessera's own move never hides an earlier one made elsewhere.
"""

from __future__ import annotations

import logging

from tasks.registry.version_record import append_decision, decision_history, now, version_record, why_of

# MLflow reserves the alias `latest` (models:/name/latest is built in and means the highest version
# number), so the moving "latest" pointer is this alias instead.
LATEST_ALIAS = "latest-checkpoint"
BEST_ALIAS = "best"
CHAMPION_ALIAS = "champion"
PREVIOUS_CHAMPION_ALIAS = "previous-champion"
# The record began (and the model's aliases then were adopted as tessera's): without it, a model
# registered before the record existed would have every alias reported as moved outside tessera.
RECORD_TAG = "tessera.aliases"
ALIAS_TAG_PREFIX = "tessera.alias."
OUTSIDE = "outside tessera"
# How far `best` stands from the runner-up, in words with its interval (tasks/registry/register.py writes it as a
# registered-model tag): `best` is the point estimate, and its description says when that is within noise.
BEST_MARGIN_TAG = "tessera.best.margin"

log = logging.getLogger("tessera.aliases")


# ------------------------------------------------------------------ descriptions


def _alias_reason(alias: str, tags: dict[str, str], history: list[dict], note: str | None = None) -> str:
    headline = tags.get("headline", "gauntlet_average")
    if alias == LATEST_ALIAS:
        return f"{alias}: the furthest checkpoint of run {tags.get('run', '?')}"
    if alias == BEST_ALIAS:
        margin = f" ({note})" if note else ""
        return (
            f"{alias}: the highest {headline} among versions scored on gauntlet {tags.get('gauntlet_hash', '?')}"
            + margin
        )
    why = why_of(alias, history, tags)
    if alias == CHAMPION_ALIAS:
        return f"{alias}: {why or 'set before promotion was recorded'}"
    if alias == PREVIOUS_CHAMPION_ALIAS:
        return f"{alias}: {why or 'the champion before the current one'}"
    return f"{alias}: {why}" if why else alias


def describe(
    record: dict, aliases: list[str], history: list[dict] | None = None, notes: dict[str, str] | None = None
) -> str:
    """What a version is, in words: run, stage, tokens, score, where it is stored, each alias it holds and why,
    and the last decision it took part in. `record` is `version_record`'s dict, `history` `decision_history`'s,
    `notes` what an alias's reason adds (the best version's margin over the runner-up)."""
    notes = notes or {}
    history = history or []
    tags = {k: str(v) for k, v in record.items() if isinstance(v, str)}
    headline = record.get("headline", "gauntlet average")
    score = record.get("gauntlet_average")
    lines = [
        f"Run {record.get('run', '?')}, stage {record.get('stage', '?')}, {int(record.get('tokens', 0)):,} tokens"
        + (f", continued from {record['continued_from']}" if record.get("continued_from") else "")
        + ".",
        f"{headline} {float(score):.4f} on gauntlet {record.get('gauntlet_hash', '?')}." if score else "Not scored.",
    ]
    if record.get("storage"):
        lines.append(
            f"Stored {'by reference at ' if record['storage'] == 'reference' else 'in the run at '}"
            f"{record.get('model_uri', '?')}."
        )
    if record.get("checkpoint"):
        lines.append(f"Training checkpoint (weights and optimizer state): {record['checkpoint']}.")
    if aliases:
        lines.append(
            "Aliases: " + "; ".join(_alias_reason(a, tags, history, notes.get(a)) for a in sorted(aliases)) + "."
        )
    if history:
        last = history[-1]
        text = str(last.get("text", last.get("kind", "?"))).rstrip(".")
        lines.append(f"Last promotion decision ({last['at'][:10]}): {text}.")
    elif record.get("promotion"):
        lines.append(f"Last promotion decision: {record['promotion']} ({tags.get('promotion.summary', '')}).")
    return "\n".join(lines)


def refresh_descriptions(client, name: str, versions: list[str] | None = None) -> None:
    """Rewrite the descriptions of `versions` (default all) from their records, histories and current aliases."""
    model = client.get_registered_model(name)
    held: dict[str, list[str]] = {}
    for alias, version in model.aliases.items():
        held.setdefault(str(version), []).append(alias)
    wanted = None if versions is None else {str(v) for v in versions}
    for mv in client.search_model_versions(f"name = '{name}'"):
        if wanted is None or str(mv.version) in wanted:
            record = version_record(client, name, mv.version)
            notes = {BEST_ALIAS: model.tags[BEST_MARGIN_TAG]} if BEST_MARGIN_TAG in model.tags else {}
            text = describe(record, held.get(str(mv.version), []), decision_history(client, name, mv.version), notes)
            if text != (mv.description or ""):
                client.update_model_version(name, mv.version, description=text)


# ------------------------------------------------------------------ the record of tessera's moves


def _aliases_of(model) -> dict[str, str]:
    return {a: str(v) for a, v in model.aliases.items()}


def recorded_aliases(model) -> dict[str, str] | None:
    """alias -> version as tessera last set it; None for a model registered before the record existed."""
    if RECORD_TAG not in model.tags:
        return None
    return {k.removeprefix(ALIAS_TAG_PREFIX): v for k, v in model.tags.items() if k.startswith(ALIAS_TAG_PREFIX) and v}


def record_started() -> dict[str, str]:
    """The tag that starts the record, for a model created by tessera (its aliases are all tessera's from then)."""
    return {
        RECORD_TAG: f"recorded since {now()[1]}: the version tessera set each alias to is the tag "
        f"{ALIAS_TAG_PREFIX}<alias>"
    }


def _record(client, name: str, alias: str, version: str | None) -> None:
    """An empty value stands for "no such alias": deleting a tag that is not there is an error in some stores."""
    client.set_registered_model_tag(name, ALIAS_TAG_PREFIX + alias, version or "")


def _adopt(client, name: str, current: dict[str, str]) -> None:
    for alias, version in current.items():
        _record(client, name, alias, version)
    for key, value in record_started().items():
        client.set_registered_model_tag(name, key, value)


def _version_exists(client, name: str, version: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, version)
    except MlflowException:  # deleted since: MLflow dropped its aliases with it
        return False
    return True


def _outside_move(client, name: str, alias: str, old: str | None, new: str | None, observer: str) -> tuple[str, set]:
    """Write one move made outside tessera into the history of the versions it involved."""
    _, at = now()
    detected = f"detected {at} by {observer}"
    if old is None:
        line = f"{name}: alias {alias} set on v{new} outside tessera ({detected})"
    elif new is None:
        line = f"{name}: alias {alias} removed from v{old} outside tessera ({detected})"
    else:
        line = f"{name}: alias {alias} moved from v{old} to v{new} outside tessera ({detected})"
    base = {"kind": OUTSIDE, "alias": alias, "from": old, "to": new, "detected_at": at, "detected_by": observer}
    involved = {v for v in (old, new) if v is not None and _version_exists(client, name, v)}
    for version in sorted(involved):
        entry = {**base, "role": "to" if version == new else "from", "text": line.split(": ", 1)[1]}
        # tessera computes latest-checkpoint and best itself (and moves them back at the next registration)
        if version == new and alias not in (LATEST_ALIAS, BEST_ALIAS):
            since = f"{alias} since {at[:10]}: " if alias == CHAMPION_ALIAS else ""
            entry["why"] = {
                alias: f"{since}moved here {'from v' + old + ' ' if old else ''}outside tessera "
                f"(MLflow UI or API), {detected}; no rule applied"
            }
        append_decision(client, name, version, entry)
        if alias == CHAMPION_ALIAS:
            client.set_model_version_tag(name, version, "promotion", OUTSIDE)
    return line, involved


def _reconcile(client, name: str, model, observer: str) -> tuple[list[str], set[str]]:
    current, recorded = _aliases_of(model), recorded_aliases(model)
    if recorded is None:
        _adopt(client, name, current)  # no history to invent: what is there now is the starting point
        return [], set()
    lines, involved = [], set()
    for alias in sorted(set(current) | set(recorded)):
        old, new = recorded.get(alias), current.get(alias)
        if old != new:
            line, versions = _outside_move(client, name, alias, old, new, observer)
            # after the history: a crash in between records the move twice rather than never
            _record(client, name, alias, new)
            lines.append(line)
            involved |= versions
    return lines, involved


def reconcile_aliases(client, name: str, observer: str) -> list[str]:
    """Record every alias created, moved or deleted outside tessera since tessera's last move; one line per move.

    `observer` names who noticed (a run, a command) and goes into each history entry. A second call
    finds nothing. A model registered before the record existed adopts its current aliases silently.
    """
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException:  # no model yet: nothing to reconcile
        return []
    lines, involved = _reconcile(client, name, model, observer)
    if involved:
        refresh_descriptions(client, name, sorted(involved))
    return lines


def reconcile_registry(tracking, observer: str) -> list[str]:
    """`reconcile_aliases` on the recipe's registered model, retried through a tracking-server blip; for flows and
    the CLI to call as they start and log the lines. `tracking` is a TrackingConfig."""
    from tasks.mlflow_run import client_for, retrying

    client = client_for(tracking)
    return retrying(
        "recording alias moves made outside tessera",
        lambda: reconcile_aliases(client, tracking.registered_model, observer),
    )


def set_aliases(client, name: str, moves: dict[str, str], observer: str = "tessera") -> None:
    """Point each alias at its version, record it, and rewrite the descriptions of every version whose aliases
    changed. Moves made outside tessera since its last one are recorded first (`observer` noticed them)."""
    model = client.get_registered_model(name)
    found, involved = _reconcile(client, name, model, observer)
    for line in found:
        log.warning("%s", line)
    before = _aliases_of(model)
    for alias, version in moves.items():
        if before.get(alias) != str(version):
            client.set_registered_model_alias(name, alias, str(version))
    after = _aliases_of(client.get_registered_model(name))
    changed = {a for a in set(before) | set(after) if before.get(a) != after.get(a)}
    for alias in changed & set(moves):
        # what is there now, not what was asked: a concurrent registration may have moved it since
        _record(client, name, alias, after.get(alias))
    touched = {v for a in changed for v in (before.get(a), after.get(a))}
    refresh_descriptions(client, name, sorted(v for v in (touched | involved) if v is not None))
