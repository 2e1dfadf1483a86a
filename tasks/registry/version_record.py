"""What the registry knows about a version beyond its few tags: a JSON record and an append-only decision history.

Registry rows show every version tag, so about twenty per version made each row a screen tall.
The tags now hold only what people filter and sort on (`TAGS`); the rest lives as artifacts of the
version's run, where it can grow without crowding the registry:
- `registry/<model>/v<N>/version.json`: the static facts (checkpoint, storage, model URI, batch,
  recipe hash, per-category scores), written once at registration;
- `registry/<model>/v<N>/history/<UTC time to the ns>-<short uuid>.json`: one file per decision
  (a promotion verdict, a bootstrap, a move by hand, an alias moved outside tessera), never
  rewritten: the time and a random suffix name it, so two decisions in the same second both stay.

Versions registered before this layout carry all of it as tags (`checkpoint`, `score/...`,
`promotion.history.<stamp>`, `champion.why`, ...); the readers here fall back to those tags, so
old versions keep working without a migration.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

# The tags people filter or sort on in the registry UI; `best` is chosen among versions with the same
# `gauntlet_hash`, and `promotion` is the latest verdict a version took part in.
TAGS = ("run", "stage", "tokens", "gauntlet_average", "headline", "gauntlet_hash", "promotion", "continued_from")
# Run-less versions (made outside tessera) have no artifact store: their history falls back to tags.
HISTORY_TAG_PREFIX = "history."
_LEGACY_HISTORY_PREFIX = "promotion.history."
_LEGACY_FACTS = (
    "checkpoint",
    "storage",
    "model_uri",
    "batch",
    "recipe_hash",
    "promotion.summary",
    "champion.why",
    "previous_champion.why",
)


def folder(name: str, version: str | int) -> str:
    return f"registry/{name}/v{version}"


def now() -> tuple[str, str]:
    """(stamp, ISO time): the stamp sorts as text and is unique to the nanosecond."""
    ns = time.time_ns()
    moment = dt.datetime.fromtimestamp(ns // 10**9, dt.UTC)
    return (
        moment.strftime("%Y%m%dT%H%M%S") + f".{ns % 10**9:09d}Z",
        moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % 10**9 // 1000:06d}Z",
    )


@contextlib.contextmanager
def _download(client, run_id: str, path: str):
    """The artifact at `path` in a temporary directory, without MLflow's progress bar: descriptions are
    rebuilt from records on every alias move, and a bar per file would bury the flow's log."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    chosen = os.environ.get(key)
    os.environ[key] = chosen if chosen is not None else "false"
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-record-") as tmp:
            yield Path(client.download_artifacts(run_id, path, tmp))
    finally:
        if chosen is None:
            os.environ.pop(key, None)


def write_version_record(client, name: str, version: str | int, facts: dict) -> None:
    """Write the version's static facts as `version.json` in its run's artifacts."""
    mv = client.get_model_version(name, str(version))
    client.log_text(mv.run_id, json.dumps(facts, indent=1, sort_keys=True), f"{folder(name, version)}/version.json")


def has_version_record(client, name: str, version: str | int, run_id: str) -> bool:
    return any(f.path.endswith("/version.json") for f in client.list_artifacts(run_id, folder(name, version)))


def _legacy_facts(tags: dict[str, str]) -> dict:
    facts: dict = {k: tags[k] for k in _LEGACY_FACTS if k in tags}
    if "batch" in facts:
        facts["batch"] = int(facts["batch"])
    scores = {k.removeprefix("score/"): float(v) for k, v in tags.items() if k.startswith("score/")}
    return facts | ({"scores": scores} if scores else {})


def version_record(client, name: str, version: str | int) -> dict:
    """The version's facts: its kept tags, then its `version.json` (or, for older versions, the tags that held them)."""
    mv = client.get_model_version(name, str(version))
    tags = dict(mv.tags)
    record: dict = {k: tags[k] for k in TAGS if k in tags} | {"name": name, "version": str(mv.version)}
    record |= _legacy_facts(tags)
    if mv.run_id and has_version_record(client, name, mv.version, mv.run_id):
        with _download(client, mv.run_id, f"{folder(name, mv.version)}/version.json") as path:
            record |= json.loads(path.read_text())
    return record


def checkpoint_of(client, name: str, version: str | int) -> str | None:
    """Where the version's training checkpoint (weights and optimizer state) lives, or None if not recorded."""
    return version_record(client, name, version).get("checkpoint") or None


def append_decision(client, name: str, version: str | int, entry: dict) -> str:
    """Add one decision to the version's history as a new file; returns its stamp."""
    stamp, at = now()
    entry = {"stamp": stamp, "at": at, "version": str(version), **entry}
    key = f"{stamp}-{uuid.uuid4().hex[:8]}"
    mv = client.get_model_version(name, str(version))
    if mv.run_id:
        client.log_text(
            mv.run_id, json.dumps(entry, indent=1, sort_keys=True), f"{folder(name, version)}/history/{key}.json"
        )
    else:
        client.set_model_version_tag(name, str(version), HISTORY_TAG_PREFIX + key, json.dumps(entry, sort_keys=True))
    return stamp


def _legacy_entry(key: str, text: str) -> dict:
    """A `promotion.history.<YYYYmmddTHHMMSSZ>` tag as a history entry (second precision, text only)."""
    stamp = key.removeprefix(_LEGACY_HISTORY_PREFIX)
    at = dt.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "stamp": stamp.removesuffix("Z") + ".000000000Z",
        "at": at,
        "kind": text.split(":", 1)[0],
        "text": text,
        "legacy": True,
    }


def decision_history(client, name: str, version: str | int) -> list[dict]:
    """Every decision recorded on the version, oldest first (tags of older versions included)."""
    mv = client.get_model_version(name, str(version))
    tags = dict(mv.tags)
    entries = [_legacy_entry(k, v) for k, v in tags.items() if k.startswith(_LEGACY_HISTORY_PREFIX)]
    entries += [json.loads(v) for k, v in tags.items() if k.startswith(HISTORY_TAG_PREFIX)]
    where = f"{folder(name, mv.version)}/history"
    if mv.run_id and client.list_artifacts(mv.run_id, where):
        with _download(client, mv.run_id, where) as local:
            entries += [json.loads(p.read_text()) for p in local.glob("*.json")]
    return sorted(entries, key=lambda e: e["stamp"])


def why_of(alias: str, history: list[dict], tags: dict[str, str]) -> str | None:
    """Why the version holds `alias`: the newest decision that said so (older versions: their `<alias>.why` tag)."""
    for entry in reversed(history):
        if alias in entry.get("why", {}):
            return entry["why"][alias]
    return tags.get(f"{alias.replace('-', '_')}.why")
