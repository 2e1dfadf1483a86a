"""The local backend starts N ranks through torch's elastic agent (infra/launcher.py), reports exit codes and can be
cancelled."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from infra import backend_for
from infra.config import ComputeConfig
from tests.conftest import ROOT


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_two_ranks_get_distributed_env_and_exit_code(tmp_path, monkeypatch):
    """Rank 0 exits 75 in every attempt: the launcher restarts the ranks in place compute.restarts_in_place (2)
    times, then the launch ends with 75 for the flow, which relaunches as before; nothing of the group is left."""
    from tests.support.training import live_group_members

    monkeypatch.chdir(ROOT)
    backend = backend_for(ComputeConfig(procs_per_node=2, restarts_in_place=2))
    job = backend.launch("tests.launch_probe", ["exit", "75"], log_dir=tmp_path, warm=("tests.launch_probe",))
    assert job.wait(timeout=120) == 75  # rank 0's retryable code reaches the supervisor unchanged
    result = job.result()
    assert [(r.attempt, r.cause, r.rank, r.code) for r in result.restarts] == [
        (1, "crashed", 0, 75),
        (2, "crashed", 0, 75),
    ]
    assert result.code == 75 and result.hung is None
    log = job.log_path.read_text()
    assert log.count("rank=0 world=2 master=127.0.0.1") == 3 and "ranks forked from a warm process" in log
    assert "rank=1 world=2 master=127.0.0.1" in (tmp_path / "rank1.stdout.log").read_text()
    assert "rank=1 world=2 master=127.0.0.1" in (tmp_path / "rank1.restart2.stdout.log").read_text()
    deadline = time.monotonic() + 10  # the forkserver leaves when the launcher is gone
    while live_group_members(job.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_group_members(job.process.pid) == []


@pytest.mark.parametrize("warm", [True, False], ids=["forked", "spawned"])
def test_a_ranks_shared_memory_goes_with_it_and_the_launchers_end_unlinks_no_one_elses(tmp_path, monkeypatch, warm):
    """Rank 0 makes shared memory, as Streaming's first rank of a node does, and is killed -9; the ranks restart in
    place. Its segment is unlinked by then (its own resource tracker), not when the launcher exits. A segment
    another process then makes under that name (another launch on the host, given the freed prefix) outlives the
    launcher."""
    from multiprocessing.shared_memory import SharedMemory

    monkeypatch.chdir(ROOT)
    name, go = f"tessera-test-{os.getpid()}-{warm}", tmp_path / "go"
    segment = Path("/dev/shm") / name
    job = backend_for(ComputeConfig(procs_per_node=2, restarts_in_place=1)).launch(
        "tests.launch_probe",
        ["shm", "120"],
        log_dir=tmp_path,
        env={"TESSERA_TEST_SHM": name, "TESSERA_TEST_GO": str(go)},
        warm=("tests.launch_probe",) if warm else (),
    )
    other = None
    try:
        deadline = time.monotonic() + 120
        while "rank=0 made its shared memory" not in job.log_path.read_text():
            assert job.poll() is None and time.monotonic() < deadline, job.tail()
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while segment.exists():
            assert time.monotonic() < deadline, "rank 0 was killed and its segment stays until the launcher exits"
            time.sleep(0.1)
        assert job.poll() is None  # the launcher lives on: its restarted ranks wait
        other = SharedMemory(name, create=True, size=64)
        go.touch()
        assert job.wait(timeout=120) == 0, job.tail()
        assert [(r.cause, r.rank, r.code) for r in job.restarts] == [("crashed", 0, -9)]
        assert segment.exists()  # the launcher's end left it alone
    finally:
        job.cancel()  # only does something if an assertion above failed
        if other is not None:
            other.close()
            other.unlink()


def test_the_first_failing_rank_sets_the_exit_code(tmp_path, monkeypatch):
    """Rank 1 fails fatally; the agent then SIGTERMs rank 0, which answers 76 (interrupted). The job and the launcher
    report rank 1's 78, so no retry is wasted, and a fatal exit is never restarted in place."""
    monkeypatch.chdir(ROOT)
    backend = backend_for(ComputeConfig(procs_per_node=2))
    backend.launch("tests.launch_probe", ["exit", "75"], log_dir=tmp_path).wait(timeout=120)  # an earlier launch
    job = backend.launch("tests.launch_probe", ["peer", "78"], log_dir=tmp_path)  # appends to the same log
    assert job.wait(timeout=120) == 78
    assert job.process.returncode == 78 and job.restarts == []  # restarts_in_place is 3: none for a fatal exit
    assert "rank 1 failed first with exit code 78" in job.tail(50)


def test_cancel_stops_every_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = backend_for(ComputeConfig(procs_per_node=2)).launch("tests.launch_probe", ["sleep", "600"], log_dir=tmp_path)
    rank1_log = tmp_path / "rank1.stdout.log"
    deadline = time.monotonic() + 60
    while not (rank1_log.exists() and "rank=1" in rank1_log.read_text()):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    group = [int(p) for p in os.popen(f"pgrep -g {job.process.pid}").read().split()]
    assert len(group) >= 3  # the launcher and two ranks
    job.cancel(grace_s=5)
    assert job.poll() is not None
    time.sleep(0.5)
    assert _pids_alive(group) == []


def test_after_cancel_all_nothing_new_is_launched(tmp_path, monkeypatch):
    """A flow that is stopping its jobs must not see a supervisor thread relaunch one behind its back."""
    from infra import LaunchRefused, allow_launches, cancel_all, stopping

    monkeypatch.chdir(ROOT)
    backend = backend_for(ComputeConfig(procs_per_node=1))
    job = backend.launch("tests.launch_probe", ["sleep", "600"], log_dir=tmp_path)
    try:
        assert cancel_all(grace_s=5) >= 1  # earlier tests' finished jobs may still be on the list
        assert job.stopped and job.poll() is not None and stopping()
        with pytest.raises(LaunchRefused):
            backend.launch("tests.launch_probe", ["exit", "0"], log_dir=tmp_path)
    finally:
        allow_launches()
    assert not stopping()
    assert backend.launch("tests.launch_probe", ["exit", "0"], log_dir=tmp_path).wait(timeout=120) == 0
