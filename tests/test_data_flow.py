"""The prepare_data flow: the demo recipe end to end, Prefect caching, skip and redo-one."""

from __future__ import annotations

import os
import shutil

import numpy as np

from flows.prepare import prepare_sources
from tasks.data.results import summarize
from tests.test_data_helpers import ROOT, SHAKESPEARE, expected_tokens, make_config, prov, read_tokens

STORIES_VAL = ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt"


def _task_states(state) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=50,
        )
    return {r.name: r.state.name for r in runs}


def _artifact_rows(state) -> list[dict]:
    import json

    from prefect.client.orchestration import get_client

    # Raw filter body: this client version sends null sub-filters that the server rejects.
    with get_client(sync_client=True) as client:
        arts = client.request(
            "POST",
            "/artifacts/filter",
            json={
                "artifacts": {
                    "key": {"any_": ["prepared-data"]},
                    "flow_run_id": {"any_": [str(state.state_details.flow_run_id)]},
                },
                "limit": 5,
                "offset": 0,
            },
        ).json()
    assert len(arts) == 1 and arts[0]["type"] == "table"
    data = arts[0]["data"]
    return json.loads(data) if isinstance(data, str) else data


def _run(data):
    state = prepare_sources(data, return_state=True)
    return state.result(), _task_states(state)


def test_demo_recipe_in_parallel(tmp_path, prefect_harness):
    sources = [
        {"name": "tinyshakespeare", "paths": [str(SHAKESPEARE)], "separator": "\n\n"},
        {"name": "tinystories", "paths": [str(STORIES_VAL)], "separator": "\n\n"},
    ]
    # Small chunks so both sources are cut into parts and go through the process pool.
    data = make_config(tmp_path / "data", sources, seq_len=128, workers=2, chunk_bytes=300_000)
    state = prepare_sources(data, return_state=True)
    prepared = state.result()
    assert prepared.tokenizer.eos_token_id == 0 and prepared.tokenizer.vocab_size == 50277
    assert list(prepared.sources) == ["tinyshakespeare", "tinystories"]
    for path, s in ((SHAKESPEARE, prepared.sources["tinyshakespeare"]), (STORIES_VAL, prepared.sources["tinystories"])):
        docs = [d for d in path.read_text().split("\n\n") if d.strip()]
        total = expected_tokens(docs)
        assert s.documents == len(docs)
        assert s.samples == total // 128 and s.tokens == s.samples * 128
        assert prov(s.root)["counts"]["train"]["tokens_dropped"] == total % 128
        assert prov(s.root)["format"]["parts"] > 1
        rows = read_tokens(s.path)
        assert rows.shape == (s.samples, 128)
        assert int((rows == 0).sum()) <= s.documents
    assert os.path.basename(prepared.sources["tinystories"].root).startswith("tinystories-")
    assert "tinyshakespeare" in summarize(prepared)

    rows = _artifact_rows(state)
    assert [(r["source"], r["documents"], r["tokens"], r["skipped"]) for r in rows] == [
        (s.name, s.documents, s.tokens, 0) for s in prepared.sources.values()
    ]
    assert rows[0]["path"] == prepared.sources["tinyshakespeare"].root


def test_rerun_is_cached_and_one_change_redoes_one_source(tmp_path, prefect_harness):
    """The only cache is each output's _DONE: a rerun reuses finished outputs (its task runs complete at once,
    reporting each source cached), one changed source is redone, and a deleted output is written again."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Alpha paragraph one.\n\nAlpha paragraph two, somewhat longer than one.")
    b.write_text("Bravo paragraph one.\n\nBravo two.\n\nBravo three.")
    data = make_config(
        tmp_path / "data",
        [
            {"name": "a", "paths": [str(a)], "separator": "\n\n"},
            {"name": "b", "paths": [str(b)], "separator": "\n\n"},
        ],
        seq_len=4,
    )
    first, states = _run(data)
    assert states == {
        "prepare-tokenizer": "Completed",
        "plan-sources": "Completed",
        "prepare-a": "Completed",
        "prepare-b": "Completed",
    }
    assert not any(s.cached for s in first.sources.values())
    written = {n: os.stat(os.path.join(s.root, "_DONE")).st_mtime_ns for n, s in first.sources.items()}

    second, states = _run(data)
    assert set(states.values()) == {"Completed"}
    assert all(s.cached for s in second.sources.values())
    assert {n: s.root for n, s in second.sources.items()} == {n: s.root for n, s in first.sources.items()}
    assert {n: os.stat(os.path.join(s.root, "_DONE")).st_mtime_ns for n, s in second.sources.items()} == written

    b.write_text("Bravo rewritten.\n\nWith new words.")
    third, _ = _run(data)
    assert third.sources["a"].cached and not third.sources["b"].cached
    assert third.sources["a"].root == first.sources["a"].root
    assert third.sources["b"].root != first.sources["b"].root
    assert third.sources["b"].documents == 2
    assert os.path.isdir(first.sources["b"].root)  # nothing already prepared is lost

    # A deleted output is rebuilt: no record anywhere else says it is there.
    shutil.rmtree(third.sources["a"].root)
    fourth, _ = _run(data)
    assert not fourth.sources["a"].cached and os.path.isfile(os.path.join(fourth.sources["a"].root, "_DONE"))
    expected = expected_tokens(["Alpha paragraph one.", "Alpha paragraph two, somewhat longer than one."])
    assert np.array_equal(read_tokens(fourth.sources["a"].path).shape, (expected // 4, 4))
