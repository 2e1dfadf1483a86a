"""Continued pretraining on the real engine: bootstrap champion, accept, no new data, reject, the ledger.

One small pretraining run, then three continued runs on a folder of new text files, all through
Prefect (temporary server), Composer, Streaming, the gauntlet and a sqlite MLflow registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

STORIES = ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt"


def _recipe(tmp: Path) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["work_dir"] = str(tmp / "work")
    raw["data"]["root"] = str(tmp / "work" / "data")
    raw["tracking"] |= {
        "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "artifact_location": str(tmp / "art"),
        "registered_model": "cpt-tiny",
    }
    raw["train"]["stages"][0]["tokens"] = 8192  # 8 steps per stage, a checkpoint every 8: small and quick
    raw["train"]["stages"][1]["tokens"] = 8192
    raw["eval"]["every"] = 8192
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _new_text(folder: Path, name: str, paragraphs: slice) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(STORIES.read_text().split("\n\n")[paragraphs])
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, prefect_harness):
    from flows.pipeline import PipelineParams, pretrain_pipeline

    tmp = tmp_path_factory.mktemp("cpt")
    recipe = _recipe(tmp)
    result = pretrain_pipeline(PipelineParams(recipe=str(recipe)))
    return tmp, recipe, result


def _client(recipe: Path):
    from flows.recipe import load_recipe
    from tasks.mlflow_run import client_for

    return client_for(load_recipe(recipe).tracking)


def test_continued_pretraining_promotes_by_the_rule_and_consumes_each_file_once(pretrained, monkeypatch):
    from flows.continued import ContinueParams, continued_pretraining
    from tasks.register import checkpoint_of
    from tasks.version_record import decision_history

    tmp, recipe, base = pretrained
    monkeypatch.chdir(ROOT)
    client = _client(recipe)
    name = "cpt-tiny"

    # the first run bootstrapped the champion: its own best version, recorded as such
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.run_id == base.mlflow_run_id and champion.tags["promotion"] == "bootstrap"
    assert "(bootstrap)" in champion.description
    first_champion = str(champion.version)

    new = tmp / "incoming"
    a = _new_text(new, "a.txt", slice(0, 400))
    accept = ContinueParams(recipe=str(recipe), new_data=str(new), tokens=4096, min_gain=-1.0, max_category_drop=1.0)
    one = continued_pretraining(accept)
    assert one.trained and one.new_files == 1 and one.decision is not None and one.decision.accepted
    challenger = client.get_model_version(name, str(one.challenger))
    assert challenger.run_id == one.pipeline.mlflow_run_id and challenger.tags["continued_from"] == f"v{first_champion}"
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(one.challenger)
    assert str(client.get_model_version_by_alias(name, "previous-champion").version) == first_champion
    assert challenger.tags["promotion"] == "accepted"
    # the tags are those people filter on; the checkpoint and the decision's numbers are in the record
    assert set(challenger.tags) == {
        "run",
        "stage",
        "tokens",
        "gauntlet_average",
        "headline",
        "gauntlet_hash",
        "continued_from",
        "promotion",
    }
    # Adam's moments came from the champion's checkpoint (same shapes), and the run says so
    run_tags = client.get_run(one.pipeline.mlflow_run_id).data.tags
    assert run_tags["tessera.optimizer_state"] == f"restored from {checkpoint_of(client, name, first_champion)}"
    assert run_tags["tessera.continued_from"] == f"models:/{name}/{first_champion}"
    assert decision_history(client, name, one.challenger)[-1]["rule"] == (
        "core_average gain >= -1.0000 and no category below -1.0000"
    )
    assert "champion: champion since" in challenger.description and f"(v{first_champion})" in challenger.description
    old = client.get_model_version(name, first_champion)
    assert "previous-champion: champion until" in old.description and old.tags["promotion"] == "accepted"
    # the comparison report is on the continued run, and the decision with both scores
    decision = json.loads(
        Path(client.download_artifacts(one.pipeline.mlflow_run_id, "promotion/decision.json", str(tmp))).read_text()
    )
    assert decision["accepted"] and set(decision["category_deltas"]) == {
        "commonsense_reasoning",
        "language_understanding",
    }
    html = Path(
        client.download_artifacts(one.pipeline.mlflow_run_id, "promotion/comparison.html", str(tmp))
    ).read_text()
    assert "data:image/png;base64," in html and "ACCEPTED" in html

    # nothing new: no training, no version, and it says since when
    versions = len(client.search_model_versions(f"name = '{name}'"))
    idle = continued_pretraining(accept)
    assert not idle.trained and idle.new_files == 0
    assert len(client.search_model_versions(f"name = '{name}'")) == versions

    # a new file: only it is read, and a rule no gain can meet rejects the challenger
    b = _new_text(new, "b.txt", slice(400, 700))
    reject = accept.model_copy(update={"min_gain": 1.0})
    two = continued_pretraining(reject)
    assert two.trained and two.new_files == 1 and not two.decision.accepted
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(one.challenger)  # did not move
    loser = client.get_model_version(name, str(two.challenger))
    assert loser.tags["promotion"] == "rejected" and "less than promote.min_gain +1.0000" in " ".join(
        e["text"] for e in decision_history(client, name, two.challenger)
    )
    ledger = json.loads(
        Path(client.download_artifacts(two.pipeline.mlflow_run_id, "ledger/consumed.json", str(tmp / "l2"))).read_text()
    )
    assert [e["path"] for e in ledger] == [str(b.resolve())]
    job = json.loads((tmp / "work" / "runs" / two.run_name / "job.json").read_text())
    new_source = next(p for n, p in job["streams"].items() if n.startswith("new-"))
    provenance = json.loads((Path(new_source).parent / "provenance.json").read_text())
    assert [i[0] for i in provenance["inputs"]] == [str(b.resolve())]
    assert a.exists()

    # the champion is an MLflow Model that generates text
    import mlflow.transformers

    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    mlflow.set_registry_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    pipe = mlflow.transformers.load_model(f"models:/{name}@champion")
    out = pipe("Once upon a time", max_new_tokens=5)
    assert out[0]["generated_text"].startswith("Once upon a time")
