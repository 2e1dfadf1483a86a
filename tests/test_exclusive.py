"""One live flow run per run name (tasks/runs/run_slot.py), against a real temporary Prefect API.

The slot is a Prefect global concurrency limit. These tests hold it from a small flow, the same
context manager the pipeline uses, so they need no trainer.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prefect import flow, tags
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from tasks.runs.flow_outcome import REFUSED, run_or_end
from tasks.runs.run_slot import RunBusy, holder_tag, limit_name, one_per_run, run_tag
from tasks.slots import ensure_limit


@flow(name="hold-run-name")
def hold(run_name: str, hold_s: float = 0.0) -> str:
    from prefect.runtime import flow_run

    with one_per_run(run_name, "refuse", flow_run.id):
        time.sleep(hold_s)
    return "held"


def slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(limit_name(name)).active_slots


def flow_run_logs(flow_run_id) -> str:
    with get_client(sync_client=True) as client:
        rows = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(r.message for r in rows)


def run_held(name: str, hold_s: float = 0.0):
    with tags(run_tag(name)):  # as the pipeline tags its flow runs
        return hold(name, hold_s, return_state=True)


def test_a_slot_no_live_flow_run_holds_is_reclaimed_and_the_run_goes_ahead(prefect_harness):
    name = f"orphan-{uuid.uuid4().hex[:8]}"
    ensure_limit(limit_name(name))
    with get_client(sync_client=True) as client:  # what a lost lease leaves: a slot counted, no holder
        client.increment_concurrency_slots(names=[limit_name(name)], slots=1, mode="concurrency")
    assert slots(name) == 1

    state = run_held(name)
    assert state.is_completed(), state.message
    assert slots(name) == 0  # reclaimed, taken, and released at the end
    flow_run_id = state.state_details.flow_run_id
    deadline = time.monotonic() + 30  # the API log handler ships batches in the background
    while f"reclaimed the slot of concurrency limit {limit_name(name)}" not in (text := flow_run_logs(flow_run_id)):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    with get_client(sync_client=True) as client:
        assert holder_tag(name) in client.read_flow_run(flow_run_id).tags


def test_a_free_slot_the_server_grants_late_is_asked_for_again_not_refused(prefect_harness, monkeypatch):
    """Prefect's acquisition timeout also counts the server's answer: a loaded server slower than the refusal's
    patience times out a slot nobody holds (a CI run refused a lone run so). With a patience no HTTP call can
    meet, the run still goes ahead: the slot is seen free, asked for again with SLOW_SERVER_S, and the log says
    why; a held slot is still refused at once (the test after this one)."""
    from tasks.runs import run_slot

    monkeypatch.setattr(run_slot, "REFUSE_AFTER_S", 0.000_001)
    name = f"slow-{uuid.uuid4().hex[:8]}"
    state = run_held(name)
    assert state.is_completed(), state.message
    assert slots(name) == 0
    flow_run_id = state.state_details.flow_run_id
    said = f"the Prefect server did not grant the free slot of concurrency limit {limit_name(name)} within 0 s"
    deadline = time.monotonic() + 30  # the API log handler ships batches in the background
    while said not in (text := flow_run_logs(flow_run_id)):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def test_a_slot_a_live_flow_run_holds_is_never_reclaimed(prefect_harness):
    name = f"busy-{uuid.uuid4().hex[:8]}"
    first: dict = {}
    holder = threading.Thread(target=lambda: first.setdefault("state", run_held(name, hold_s=12.0)))
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # until the first run has the slot and says so
            with get_client(sync_client=True) as client:
                from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

                held = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[holder_tag(name)]))
                )
            if held:
                break
            assert time.monotonic() < deadline, "the first run never took the slot"
            time.sleep(0.2)
        second = run_held(name)
        assert slots(name) == 1  # still the first run's
    finally:
        holder.join()
    assert second.is_failed()
    with pytest.raises(RunBusy) as refused:
        second.result()
    assert str(refused.value).startswith(f"run {name!r} is already running in flow run {held[0].name!r} ({held[0].id}")
    assert first["state"].is_completed()
    assert slots(name) == 0


@flow(name="refused-probe")
def refused_probe() -> str:
    def body() -> str:
        raise RunBusy("run 'x' is already running in flow run 'y'")

    return run_or_end("x", body)


def test_a_refusal_ends_the_flow_run_refused_with_its_reason_and_no_error_log(prefect_harness):
    from prefect.exceptions import Abort

    with pytest.raises(Abort) as ended:
        refused_probe()
    state = ended.value.state
    assert (state.type.value, state.name, state.message) == (
        "CANCELLED",
        REFUSED,
        "run 'x' is already running in flow run 'y'",
    )
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(flow_run_id).state
    assert (stored.type.value, stored.name, stored.message) == ("CANCELLED", REFUSED, state.message)
    deadline = time.monotonic() + 30
    while "Finished in state Refused(" not in (text := flow_run_logs(flow_run_id)):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert "exited with unexpected exception" not in text and "Traceback" not in text


@flow(name="stopped-probe")
def stopped_probe(during_stop: bool) -> str:
    from prefect.exceptions import TerminationSignal

    def body() -> str:
        if not during_stop:
            raise RuntimeError("release unlocked lock")
        try:
            raise TerminationSignal(signal=15)  # Prefect's SIGTERM handler, in the flow's main thread
        except TerminationSignal:
            raise RuntimeError("release unlocked lock")  # noqa: B904 -- as CPython raises it: context, no cause

    return run_or_end("x", body, stays=lambda: "its checkpoint at 1,024 tokens stays")


def test_a_stop_that_broke_a_lock_on_its_way_out_still_ends_cancelled_with_its_explanation(prefect_harness):
    """CI at 2d8ddb8: a cancel from the UI ended the flow Failed with "RuntimeError('release unlocked lock')" and
    no explanation. An error raised while a stop unwinds is the stop; the same error without a stop is an error."""
    from prefect.exceptions import Abort

    with pytest.raises(Abort) as ended:
        stopped_probe(True)
    state = ended.value.state
    assert (state.type.value, state.name, state.message) == (
        "CANCELLED",
        "Cancelled",
        "cancelled: every rank of run 'x' was stopped; its checkpoint at 1,024 tokens stays",
    )
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        stopped_probe(False)


def test_a_holder_whose_process_is_gone_is_marked_crashed_and_its_slot_freed(prefect_harness):
    """What a `tessera run` killed with -9 leaves: its flow run Running for ever, the slot counted, no lease. The next
    run of the name sees the holder's process is gone, marks it Crashed, frees the slot with a log line, and runs."""
    import socket
    import subprocess

    import psutil
    from prefect.states import Running

    name = f"dead-{uuid.uuid4().hex[:8]}"
    ensure_limit(limit_name(name))
    gone = subprocess.Popen(["sleep", "60"])
    started = int(psutil.Process(gone.pid).create_time())
    gone.kill()
    gone.wait()
    with get_client(sync_client=True) as client:
        client.increment_concurrency_slots(names=[limit_name(name)], slots=1, mode="concurrency")
        tags_ = [run_tag(name), holder_tag(name), f"proc:{socket.gethostname()}:{gone.pid}:{started}"]
        dead = client.create_flow_run(hold, parameters={"run_name": name}, tags=tags_)
        client.set_flow_run_state(dead.id, Running(), force=True)

    state = run_held(name)
    assert state.is_completed(), state.message
    assert slots(name) == 0
    with get_client(sync_client=True) as client:
        ended = client.read_flow_run(dead.id).state
    assert (
        ended.type.value == "CRASHED" and f"its process {gone.pid} on {socket.gethostname()} is gone" in ended.message
    )
    deadline = time.monotonic() + 30
    flow_run_id = state.state_details.flow_run_id
    said = ("was left Running", f"reclaimed the slot of concurrency limit {limit_name(name)}")
    while not all(line in (text := flow_run_logs(flow_run_id)) for line in said):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


@pytest.mark.slow
def test_tessera_run_killed_with_its_whole_process_group_reruns_at_once_and_resumes_bitwise(tmp_path):
    """kill -9 of the whole `tessera run` process group (flow, temporary Prefect server, trainer) after the first
    checkpoint, as a crashed or OOM-killed node would: the rerun starts at once, with no hand work, resumes, and
    ends with the weights of an uninterrupted run of the same recipe."""
    import os
    import signal
    import subprocess
    import sys

    import torch
    import yaml

    from tests.conftest import ROOT, tiny_recipe
    from tests.support.training import model_tensors
    from trainers.format.checkpoints import list_complete

    recipe = tiny_recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    raw["train"]["stages"] = [{"name": "only", "tokens": 16384, "mixture": {"literary": 0.5, "stories": 0.5}}]
    raw["eval"]["every"] = 8192
    recipe.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def tessera(run: str, **kw):
        cmd = [sys.executable, "-m", "cli.main", "run", str(recipe), "--run-name", run]
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
        )

    killed = tessera("kills", start_new_session=True)
    save = tmp_path / "work" / "runs" / "kills" / "checkpoints"
    deadline = time.monotonic() + 600
    while not list_complete(save):
        assert killed.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    rerun = tessera("kills")
    out, _ = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, out[-3000:]
    assert "was left Running" in out and "is already running" not in out
    assert "resuming run kills from the checkpoint at 8,192 tokens" in out

    reference = tessera("ref")
    out, _ = reference.communicate(timeout=900)
    assert reference.returncode == 0, out[-3000:]
    mine = model_tensors(list_complete(save)[-1].path)
    theirs = model_tensors(list_complete(tmp_path / "work" / "runs" / "ref" / "checkpoints")[-1].path)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
