"""Continued pretraining on the real engine: bootstrap champion, accept, no new data, reject, the ledger.

One small pretraining run, then three continued runs on a folder of new text files, all through
Prefect (temporary server), Composer, Streaming, the gauntlet and a sqlite MLflow registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, tiny_raw
from tests.support.mlflow_store import sqlite_store

pytestmark = pytest.mark.slow

STORIES = ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt"


def _recipe(tmp: Path) -> Path:
    raw = tiny_raw()
    raw["work_dir"] = str(tmp / "work")
    raw["data"]["root"] = str(tmp / "work" / "data")
    raw["tracking"] |= {
        "tracking_uri": sqlite_store(tmp / "mlflow.db"),
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


class _Ran:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(capsys, *args: str) -> _Ran:
    """`tessera ARGS` through the CLI's own main(): its exit code, what it printed and what it wrote to stderr.
    In this process (a fresh one per command would cost seconds of imports each); the session's Prefect API."""
    from cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return _Ran(code, out.out, out.err)


def _tracking(recipe: Path):
    from tasks.recipe import load_recipe

    return load_recipe(recipe).tracking


def _client(recipe: Path):
    from tasks.mlflow_run import client_for
    from tasks.recipe import load_recipe

    return client_for(load_recipe(recipe).tracking)


def test_continued_pretraining_promotes_by_the_rule_and_consumes_each_file_once(pretrained, monkeypatch, capsys):
    from flows.continued import ContinueParams, continued_pretraining
    from tasks.consumed_files import consumed
    from tasks.registry.register import checkpoint_of
    from tasks.registry.version_record import decision_history

    tmp, recipe, base = pretrained
    monkeypatch.chdir(ROOT)
    client = _client(recipe)
    name = "cpt-tiny"

    # the first run bootstrapped the champion: its own best version, recorded as such
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.run_id == base.mlflow_run_id and champion.tags["promotion"] == "bootstrap"
    assert "(bootstrap)" in champion.description
    first_champion = str(champion.version)
    # best is the point estimate, and its description says how far it stands from the runner-up
    best = client.get_model_version_by_alias(name, "best")
    assert "the runner-up: core_average " in best.description and " over 381 examples" in best.description
    assert ("within noise of v" in best.description) != ("clear of v" in best.description)

    new = tmp / "incoming"
    a = _new_text(new, "a.txt", slice(0, 400))
    # a weekly deployment's parameters: the same name prefix every week, here a fixed token budget too
    accept = ContinueParams(
        recipe=str(recipe),
        new_data=str(new),
        name_prefix="weekly",
        tokens=4096,
        min_gain=-1.0,
        max_category_drop=1.0,
    )
    one = continued_pretraining(accept)
    assert one.trained and one.new_files == 1 and one.decision is not None and one.decision.accepted
    assert one.run_name.startswith(f"weekly-cpt-v{first_champion}-")
    # the flow run was renamed after the run it derived (it started as weekly-cpt)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as prefect:
        named = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[one.run_name])))
    assert [(r.state.type.value, r.state.name) for r in named] == [("COMPLETED", "Promoted")]
    assert "promotion:accepted" in named[0].tags
    # measured intervals: the gain's interval holds the gain, over every example of the gauntlet
    low, high = one.decision.gain_interval
    assert low <= one.decision.gain <= high and one.decision.examples > 0
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
        "core_average gain's 95% lower bound above -1.0000 and no category's drop significantly beyond -1.0000 "
        "(paired bootstrap over the gauntlet's examples, 2000 resamples, seed 0)"
    )
    assert "champion: champion since" in challenger.description and f"(v{first_champion})" in challenger.description
    old = client.get_model_version(name, first_champion)
    assert "previous-champion: champion until" in old.description and old.tags["promotion"] == "replaced"
    assert "champion since" not in old.description  # it lost: nothing stale says why it is champion
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
    assert "data:image/png;base64," in html and "ACCEPTED" in html and "95% interval" in html
    assert decision["gain_interval"] == [low, high] and decision["examples"] == one.decision.examples

    # nothing new: no training, no version, and it says since when
    versions = len(client.search_model_versions(f"name = '{name}'"))
    idle = continued_pretraining(accept)
    assert not idle.trained and idle.new_files == 0
    assert len(client.search_model_versions(f"name = '{name}'")) == versions

    # week 2, same prefix, no fixed budget (one pass): only the new file is read, under a run of its own, and a
    # rule no gain can meet rejects the challenger
    b = _new_text(new, "b.txt", slice(400, 700))
    reject = accept.model_copy(update={"min_gain": 1.0, "tokens": None})
    two = continued_pretraining(reject)
    assert two.trained and two.new_files == 1 and not two.decision.accepted
    assert two.run_name.startswith(f"weekly-cpt-v{one.challenger}-") and two.run_name != one.run_name
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(one.challenger)  # did not move
    # where a person looks first: the flow run's state and tags, not only its log
    with get_client(sync_client=True) as prefect:
        (run2,) = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[two.run_name])))
    assert (run2.state.type.value, run2.state.name) == ("COMPLETED", "Not promoted")
    assert run2.state.message.startswith(
        f"REJECTED: challenger v{two.challenger} not promoted, v{one.challenger} stays champion: "
    ) and run2.state.message.endswith(f"{two.decision.summary()}; {'; '.join(two.decision.reasons)}")
    assert "less than promote.min_gain +1.0000" in run2.state.message  # why, in the state a person reads first
    assert "promotion:rejected" in run2.tags
    loser = client.get_model_version(name, str(two.challenger))
    assert loser.tags["promotion"] == "rejected" and "less than promote.min_gain +1.0000" in " ".join(
        e["text"] for e in decision_history(client, name, two.challenger)
    )
    # one record per flow run, never rewritten; consumed is their union: each file exactly once
    records = [f.path for f in client.list_artifacts(two.pipeline.mlflow_run_id, "ledger")]
    assert len(records) == 1 and records[0].startswith("ledger/consumed-")
    ledger = json.loads(
        Path(client.download_artifacts(two.pipeline.mlflow_run_id, records[0], str(tmp / "l2"))).read_text()
    )
    assert [e["path"] for e in ledger] == [str(b.resolve())]
    seen, last = consumed(_tracking(recipe), name)
    assert sorted(c.path for c in seen) == sorted([str(a.resolve()), str(b.resolve())]) and last == two.run_name
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

    # the CLI talks to the session's Prefect API (work_prefect_home leaves PREFECT_HOME alone then)
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    # week 3 from the command line, the same prefix and a fixed budget: only the third file trains
    c = _new_text(new, "c.txt", slice(700, 1000))
    week3 = _cli(capsys, "continue", str(recipe), "--new-data", str(new), "--name-prefix", "weekly", "--tokens", "4096")
    assert week3.returncode == 0, week3.stderr
    line = week3.stdout.strip().splitlines()[-1]
    assert line.startswith(f"run weekly-cpt-v{one.challenger}-") and " on 1 new file(s); challenger v" in line
    challenger3 = line.split("challenger v")[1].split(":")[0]
    verdict = decision_history(client, name, challenger3)[-1]
    assert f": {verdict['kind']}: " in line  # what it printed is what it recorded
    champion_now = str(client.get_model_version_by_alias(name, "champion").version)
    assert champion_now == (challenger3 if verdict["kind"] == "accepted" else str(one.challenger))
    seen, last = consumed(_tracking(recipe), name)
    assert sorted(c_.path for c_ in seen) == sorted(str(f.resolve()) for f in (a, b, c))  # each exactly once
    assert last.startswith("weekly-cpt-") and last == line.split()[1].rstrip(":")

    # nothing new: exit 0, said in one line
    idle_cli = _cli(capsys, "continue", str(recipe), "--new-data", str(new), "--name-prefix", "weekly")
    assert idle_cli.returncode == 0 and idle_cli.stdout.strip().splitlines()[-1].endswith(
        "no new data; nothing trained"
    )
    # a new-data path that does not exist: exit 2, one line naming it
    missing = _cli(capsys, "continue", str(recipe), "--new-data", str(tmp / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"tessera: error: {tmp / 'nowhere'}: new data: no such directory, file or glob (resolved against {ROOT})"
    ]

    # promote by hand: recorded; bad references are one line and exit 2
    hand = _cli(capsys, "promote", f"models:/{name}/{first_champion}", "--recipe", str(recipe), "--note", "cli")
    assert hand.returncode == 0, hand.stderr
    assert hand.stdout.strip().splitlines() == [
        f"{name}: champion v{first_champion} (was v{champion_now}; now previous-champion)"
    ]
    assert decision_history(client, name, first_champion)[-1]["text"].startswith("manual: champion since ")
    for ref, error in (
        (f"models:/{name}", f"models:/{name}: expected models:/NAME/N (a version number, not an alias)"),
        (f"models:/{name}/999", f"models:/{name}/999: no such model version in sqlite:///{tmp / 'mlflow.db'}"),
    ):
        bad = _cli(capsys, "promote", ref, "--recipe", str(recipe))
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"tessera: error: {error}"]

    # compare two versions: the headline of each, the delta with its interval, the reports written
    out = tmp / "cmp"
    cmp_ = _cli(
        capsys,
        "compare",
        f"models:/{name}/{first_champion}",
        f"models:/{name}/{one.challenger}",
        "--recipe",
        str(recipe),
        "--output-dir",
        str(out),
    )
    assert cmp_.returncode == 0, cmp_.stderr
    line = next(x for x in cmp_.stdout.splitlines() if x.startswith(f"models:/{name}/{first_champion}: "))
    assert f"  models:/{name}/{one.challenger}: " in line and ", 95% interval " in line
    assert (out / "comparison.html").is_file() and (out / "comparison.png").is_file()
    assert "95% interval of the delta" in (out / "comparison.md").read_text()
    nothing = _cli(
        capsys, "compare", f"models:/{name}/998", f"models:/{name}/{one.challenger}", "--recipe", str(recipe)
    )
    assert nothing.returncode == 2 and len(nothing.stderr.strip().splitlines()) == 1
    assert f"models:/{name}/998" in nothing.stderr
