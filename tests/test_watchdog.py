"""A run that stalls is caught: heartbeats, the watchdog's budgets, the kill and the relaunch, the no-progress stop.

The slow tests run the stage task itself (`tasks.training.train.train_stage`, in a Prefect flow on the session's
API) over real 2-rank trainers (Composer's launcher, gloo), freeze ranks with SIGSTOP or hang a save with a
fault hook, and check what the watchdog did, what the flow said, and the weights the run ended with.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from infra.watchdog import Budgets, Watchdog, collective_budget, process_state
from trainers.config import StageConfig, WatchdogConfig

SEQ, BATCH = 32, 8
STEP = SEQ * BATCH


# ------------------------------------------------------------------ budgets and judgement, without training


def _beat(folder: Path, rank: int, **fields) -> None:
    record = {"rank": rank, "pid": None, "host": "h", "node": "n", "phase": "step", "beat": time.time(), **fields}
    (folder / f"rank{rank}.json").write_text(json.dumps(record).ljust(2048))


def test_each_phase_has_its_budget_and_the_step_budget_is_learned():
    b = Budgets()
    assert b.of({"phase": "step", "step_p99_s": 0.05}) == (60, "the step floor; 10 x p99 0.05 s is less")
    assert b.of({"phase": "step", "step_p99_s": 9.0}) == (90.0, "10 x the recent steps' p99 of 9.00 s")
    # a 7B model's checkpoint (about 12 bytes a parameter) gets its bytes at 50 MB/s on top of the save budget
    seconds, why = b.of({"phase": "save", "hint_bytes": 84_000_000_000})
    assert seconds == 600 + 1680 and why == "600 s + 84.00 GB at 50 MB/s"
    assert b.of({"phase": "first_step"})[0] == 900 and b.of({"phase": "eval"})[0] == 900  # nothing timed yet


def test_budgets_come_from_the_work_within_a_floor_a_ceiling_and_the_collective_timeout():
    """Eval batches and waits for a batch are budgeted like steps, from their own p99 (an eval batch not yet timed:
    from the step's); a save from its bytes at the speed this launch's saves wrote, 3 x, at least the floor; with
    several ranks nothing in the training loop outlasts the process group's timeout (300 s, less a margin)."""
    b = Budgets()
    assert b.of({"phase": "eval", "step_p99_s": 0.1}) == (60, "the step floor; 10 x eval batches' p99 0.10 s is less")
    assert b.of({"phase": "eval", "eval_p99_s": 20.0})[0] == 200
    assert b.of({"phase": "eval", "eval_p99_s": 200.0}) == (
        900,
        "the eval ceiling; 10 x eval batches' p99 200.00 s is more",
    )
    assert b.of({"phase": "data", "data_p99_s": 0.01})[0] == 60 and b.of({"phase": "data", "data_p99_s": 12})[0] == 120
    tiny = {"phase": "save", "hint_bytes": 40_000_000}  # the demo's checkpoint: a frozen save is caught in a minute
    assert b.of(tiny)[0] == 60
    assert b.of({"phase": "save", "hint_bytes": 4_000_000_000, "write_bytes_per_s": 400e6})[0] == 60  # 3 x 10 s: floor
    seconds, why = b.of({"phase": "save", "hint_bytes": 40_000_000_000, "write_bytes_per_s": 400e6})
    assert seconds == 300 and why == "3 x 40.00 GB at 400 MB/s measured, at least 60 s"
    seconds, why = b.of({"phase": "save", "hint_bytes": 40_000_000_000})
    assert seconds == 600 + 800 and why == "600 s + 40.00 GB at 50 MB/s"  # unmeasured: 3 x 800 s, over the ceiling
    # two ranks: a rank frozen in an eval batch or a long save is caught before gloo's 300 s turn it into a failure
    cap = collective_budget(300, b.poll_s)
    assert cap == 300 - 15 - 4
    eval_beat = {"phase": "eval", "eval_p99_s": 200.0, "world": 2}
    assert b.of(eval_beat, cap) == (cap, "the eval ceiling; 10 x eval batches' p99 200.00 s is more, cut to the "
                                     "process group's collective timeout less a margin")  # fmt: skip
    assert b.of({**eval_beat, "world": 1}, cap)[0] == 900  # alone, no peer waits: the ceiling
    assert b.of({"phase": "compile", "world": 2}, cap)[0] == 1800  # every rank compiles at once: not capped
    # the recipe's train.watchdog reaches the launcher as JSON with the same fields
    assert Budgets.from_json(json.dumps(WatchdogConfig(step_floor_s=5).model_dump())) == Budgets(step_floor_s=5)
    assert Budgets.from_json(json.dumps(WatchdogConfig(enabled=False).model_dump())) is None
    assert issubclass(Budgets, WatchdogConfig)  # one definition: the launcher reads the recipe's own section


def test_the_stopped_rank_is_blamed_and_a_silent_start_is_seen(tmp_path):
    now = time.time()
    _beat(tmp_path, 0, beat=now - 100, pid=os.getpid())  # waits in a collective for its peer
    _beat(tmp_path, 1, beat=now - 70, pid=None)
    dog = Watchdog(tmp_path, Budgets(), [0, 1], started=now - 200)
    hang = dog.check(now)
    assert (hang.rank, hang.phase, round(hang.silent_s), hang.budget_s) == (0, "step", 100, 60)
    assert [r["rank"] for r in hang.ranks] == [0, 1]
    assert Watchdog(tmp_path, Budgets(step_floor_s=200), [0, 1]).check(now) is None
    # a rank with no heartbeat at all is judged on the startup budget from the launch
    assert Watchdog(tmp_path, Budgets(), [0, 1, 2], started=now - 10).check(now + 1).rank == 0
    late = Watchdog(tmp_path, Budgets(startup_s=5, step_floor_s=500), [2], started=now - 10).check(now)
    assert (late.rank, late.phase, late.why) == (2, "startup", "the startup budget, no heartbeat")
    # pids in rank order even when rank 1's heartbeat was read before rank 0 had written one
    (tmp_path / "rank0.json").unlink()
    dog = Watchdog(tmp_path, Budgets(), [0, 1])
    _beat(tmp_path, 1, beat=now, pid=1111)
    assert dog.pids() == [1111]
    _beat(tmp_path, 0, beat=now, pid=2222)
    assert dog.pids() == [2222, 1111]


def test_a_stopped_rank_is_blamed_as_soon_as_its_waiting_peer_passes_the_budget(tmp_path):
    """The peer waiting for the frozen rank in a collective beat a moment before the freeze, so it crosses the budget
    first: the stopped rank is blamed then (its peers only wait for it), its own silence a hair under the budget."""
    import signal
    import subprocess

    frozen = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(frozen.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        now = time.time()
        _beat(tmp_path, 0, beat=now - 15.002, pid=os.getpid())
        _beat(tmp_path, 1, beat=now - 14.999, pid=frozen.pid)
        hang = Watchdog(tmp_path, Budgets(step_floor_s=15), [0, 1]).check(now)
        assert (hang.rank, hang.stopped, hang.budget_s) == (1, True, 15) and 14.99 < hang.silent_s < 15, hang
        assert max(r["silent_s"] for r in hang.ranks) >= 15  # the peer is past the budget: that is what triggered
        assert Watchdog(tmp_path, Budgets(step_floor_s=15), [0, 1]).check(now - 0.01) is None  # no rank over yet
    finally:
        frozen.kill()
        frozen.wait()


_RANK = """
import os, signal, sys, time
from pathlib import Path
from trainers.heartbeat import Beat

folder, rank = Path(sys.argv[1]), int(sys.argv[2])
Beat(folder, rank)
def moved_on():
    while True:
        time.sleep(0.001)
def frozen_here():  # rank 1: stops itself; woken, it lets rank 0 go on at once
    os.kill(os.getpid(), signal.SIGSTOP)
    os.close(os.open(folder / "go", os.O_CREAT | os.O_WRONLY))
def waiting_for_peer():  # rank 0: a collective's wait, for rank 1
    (folder / "waiting").touch()
    while not (folder / "go").exists():
        time.sleep(0.0005)
frozen_here() if rank else waiting_for_peer()
moved_on()
"""


def test_the_stacks_show_where_the_ranks_hung_not_where_waking_the_stopped_one_lets_them_go(tmp_path, monkeypatch):
    """Rank 1 is stopped and rank 0 waits for it; the moment rank 1 runs again both move on. The local backend's
    kill of a hung group must ask for the stacks before it wakes the stopped rank, or they show moved_on (CI at
    dc718cc: rank 0's stack was past the collective it had hung in), and must leave no process of the group."""
    import shlex
    import signal
    import subprocess
    import sys

    from infra import watchdog
    from infra.local import LocalJob

    monkeypatch.setattr(watchdog.shutil, "which", lambda name: None)  # the faulthandler path, py-spy or not
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rank = shlex.join([sys.executable, "-c", _RANK, str(tmp_path)])
    # A launcher in its own session with the two ranks under it, as Composer's launcher is in a local job.
    launcher = subprocess.Popen(["sh", "-c", f"{rank} 0 & {rank} 1 & wait"], env=env, start_new_session=True)
    try:
        dog = Watchdog(tmp_path, Budgets(), [0, 1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            (tmp_path / "waiting").exists() and len(dog.pids()) == 2 and process_state(dog.pids()[1]) == "T"
        ):
            time.sleep(0.01)
        pids = dog.pids()
        assert len(pids) == 2 and process_state(pids[1]) == "T" and (tmp_path / "waiting").exists()
        hang = dog.check(time.time() + 3600)
        assert hang is not None and hang.rank == 1 and hang.stopped
        sent: list[tuple[str, int]] = []  # the signals in the order sent: a real woken rank may outrun this test
        kill, killpg = os.kill, os.killpg
        monkeypatch.setattr(os, "kill", lambda pid, sig: (sent.append(("rank", sig)), kill(pid, sig))[1])
        monkeypatch.setattr(os, "killpg", lambda pid, sig: (sent.append(("group", sig)), killpg(pid, sig))[1])
        job = LocalJob(process=launcher, log_path=tmp_path / "rank0.log")
        job._kill_hung(dog, hang)
        monkeypatch.undo()
        woken = sent.index(next(s for s in sent if s[1] == signal.SIGCONT))
        assert sent[:woken] == [("rank", signal.SIGUSR1)] * 2 and sent[-1] == ("group", signal.SIGKILL), sent
        text = job.log_path.read_text()
        zero, one = text.split("--- rank 1: Python stacks (faulthandler)")
        assert "--- rank 0: Python stacks (faulthandler)" in zero
        assert "in waiting_for_peer" in zero and "in moved_on" not in zero, zero
        assert "in frozen_here" in one and "in moved_on" not in one, one
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10  # SIGKILL is delivered at once, the exit is the kernel's to finish
        while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid in pids):
            time.sleep(0.05)
        # the stopped rank too, woken then killed (a zombie is dead, awaiting this container's reaper)
        assert [process_state(pid) in (None, "Z") for pid in pids] == [True, True]
    finally:
        watchdog.signal_group(launcher.pid, signal.SIGCONT)
        watchdog.signal_group(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_heartbeat_is_one_fixed_size_file_rewritten_in_place(tmp_path, monkeypatch):
    from trainers import heartbeat

    monkeypatch.setenv("TESSERA_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setattr(heartbeat, "_BEAT", [])
    beat = heartbeat.start()
    heartbeat.phase("save", hint_bytes=123)
    for k in range(300):
        beat.progress(k, k * STEP, compute_s=0.01 * (k % 100))
    text = (tmp_path / "rank0.json").read_bytes()
    record = json.loads(text.decode().strip())
    assert len(text) == 2048 and record["phase"] == "save" and record["step"] == 299
    assert record["step_p99_s"] == 0.99 and record["pid"] == os.getpid() and record["hint_bytes"] == 123


# ------------------------------------------------------------------ real ranks


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from tests.support.training import write_mds

    return str(write_mds(tmp_path_factory.mktemp("data") / "a", 600, SEQ, 512, seed=1))


def _job(root: Path, source: str, steps: int = 48, **watchdog):
    from tests.support.training import tiny_job, write_job

    job = tiny_job(
        root,
        {"a": source},
        [StageConfig(name="s", tokens=steps * STEP, mixture={"a": 1.0})],
        seq_len=SEQ,
        global_batch_size=BATCH,
        checkpoint_every_tokens=16 * STEP,
        watchdog=WatchdogConfig(poll_s=1, **watchdog),
    )
    return job, write_job(job, root / "job.json")


def _run_stage(job_path: Path, ranks: int = 2, restarts_in_place: int = 0):
    """The stage task in a flow, as the pipeline runs it; returns (its result or exception, the flow run's logs).
    No restarts in place unless asked: these tests are about what the flow does once a launch has ended."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.context import get_run_context

    from infra.config import ComputeConfig
    from tasks.training.train import stage_task

    ids = []

    @flow(name="one-stage")
    def one_stage():
        ids.append(get_run_context().flow_run.id)
        compute = ComputeConfig(procs_per_node=ranks, restarts_in_place=restarts_in_place)
        return stage_task(compute)(str(job_path), 0, "s", compute, str(job_path.parent / "logs"))

    try:
        outcome = one_stage()
    except Exception as exc:  # noqa: BLE001 - the test looks at what it was
        outcome = exc
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), limit=200)
    return outcome, [entry.message for entry in logs]


def _heartbeat(job_path: Path, rank: int) -> dict | None:
    try:
        return json.loads((job_path.parent / "logs" / "s" / "heartbeats" / f"rank{rank}.json").read_bytes().strip())
    except (OSError, ValueError):
        return None


def _model(job) -> dict:
    from tests.support.training import model_tensors
    from trainers.format.checkpoints import list_complete

    return model_tensors(list_complete(job.save_folder)[-1].path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source):
    """The job trained by two ranks, uninterrupted."""
    from tests.support.training import run_stage

    job, job_path = _job(tmp_path_factory.mktemp("ref"), source)
    proc = run_stage(job_path, 0, procs=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _model(job)


def _ledger(job_path: Path) -> list[dict]:
    from tasks.training import launch_records

    return launch_records.read(job_path.parent)


def _same_weights(job, reference) -> bool:
    import torch

    mine = _model(job)
    return all(torch.equal(mine[k], v) for k, v in reference.items())


@pytest.mark.slow
def test_the_whole_trainer_frozen_is_killed_within_two_minutes_on_the_default_budgets(
    prefect_harness, reference, tmp_path, source, monkeypatch
):
    """SIGSTOP the trainer's whole process group (its launcher too) mid-stage, default budgets: the watchdog sees
    no progress past the 60 s step floor, wakes and kills the group within two minutes; the stage task relaunches
    it as a preemption, and the run ends with the uninterrupted run's weights."""
    job, job_path = _job(tmp_path, source)
    # Rank 0 stops its whole process group right after step 20 (a fault hook: exactly there, however loaded the
    # machine; a watching thread could stop it late, after the stage's last step)
    monkeypatch.setenv("TESSERA_FREEZE", f"group:{20 * STEP}")
    monkeypatch.setenv("TESSERA_FREEZE_ONCE", str(tmp_path / "frozen.json"))
    outcome, logs = _run_stage(job_path)
    assert outcome == 0, outcome
    frozen = json.loads((tmp_path / "frozen.json").read_text())
    stopped_at = frozen["at"]
    first, second = _ledger(job_path)
    hung = first["hung"]
    assert first["kind"] == "preempted" and first["code"] == -9 and second["kind"] == "ok"
    assert hung["phase"] == "step" and hung["stopped"] and hung["budget_s"] == 60, hung
    # The whole group is stopped, so rank 0 (the first stopped) is blamed the moment any rank passes the budget;
    # rank 1 may have beaten a moment before rank 0's last beat and crossed first (CI: rank 0 at 59.87 s of 60).
    assert 60 <= max(r["silent_s"] for r in hung["ranks"]) <= 65 and 59 <= hung["silent_s"] <= 65, hung
    assert first["ended"] - stopped_at < 120  # detected and killed within two minutes
    assert sum("the watchdog found rank" in m and "(preemption 1 of" in m for m in logs) == 1
    with pytest.raises(ProcessLookupError):  # no process of the stopped group left behind
        os.killpg(frozen["pgid"], 0)
    assert _same_weights(job, reference)


@pytest.mark.slow
def test_a_kill_and_a_frozen_rank_are_relaunched_and_the_goodput_ledger_adds_up(
    prefect_harness, reference, tmp_path, source, monkeypatch
):
    """Rank 0 is SIGKILLed after step 20 (the checkpoint is at 16); in the relaunch, rank 1 is SIGSTOPped after step
    40 (checkpoint 32) and the watchdog (an 8 s step floor) kills the group after writing every rank's stacks to
    the stage log. The run ends with the uninterrupted run's weights; its goodput ledger adds up to the wall time,
    counts the killed launch's steps after its last checkpoint as lost and the frozen one's silence as hung."""
    from tasks.training.goodput import BUCKETS, compute

    monkeypatch.setenv("TESSERA_FAULT", f"step:{20 * STEP}")
    # Rank 0, so that Composer's launcher, which looks at the ranks in order, reports its SIGKILL before the
    # survivor's 75 (a lost peer) even when both have ended by its next look: a killed rank 1 raced rank 0's 75.
    monkeypatch.setenv("TESSERA_FAULT_RANK", "0")
    monkeypatch.setenv("TESSERA_FAULT_ONCE", str(tmp_path / "killed-once"))
    monkeypatch.setenv("TESSERA_FREEZE", f"rank:{40 * STEP}")  # rank 1 stops itself right after step 40
    monkeypatch.setenv("TESSERA_FREEZE_RANK", "1")
    monkeypatch.setenv("TESSERA_FREEZE_ONCE", str(tmp_path / "frozen.json"))
    job, job_path = _job(tmp_path, source, step_floor_s=8.0)
    outcome, logs = _run_stage(job_path)
    assert outcome == 0, outcome
    killed, hung_launch, done = _ledger(job_path)
    assert [killed["kind"], hung_launch["kind"], done["kind"]] == ["preempted", "preempted", "ok"]
    assert killed["hung"] is None and (killed["tokens_before"], killed["tokens_after"]) == (0, 16 * STEP)
    hung = hung_launch["hung"]
    assert hung["rank"] == 1 and hung["phase"] == "step" and hung["stopped"]
    # The 8 s floor, unless this machine's steps were slow enough that 10 x their p99 is more (a suite at load:
    # p99 0.97 s gave 9.7 s once): either way the budget the watchdog reckoned from the work, and said so.
    learned = re.fullmatch(r"10 x the recent steps' p99 of ([\d.]+) s", hung["why"])
    if learned is None:
        assert hung["budget_s"] == 8 and hung["why"].startswith("the step floor"), hung
    else:
        assert hung["budget_s"] > 8 and hung["budget_s"] == pytest.approx(10 * float(learned[1]), abs=0.05), hung
    said = [m for m in logs if "the watchdog found" in m]
    assert len(said) == 1 and said[0].startswith("stage s: the watchdog found rank 1 (")
    assert (
        f"hung in phase step for {hung['silent_s']:.0f} s, over its {hung['budget_s']:.0f} s budget ({hung['why']}"
        in said[0]
    )
    assert "its process stopped (SIGSTOP)" in said[0] and "(preemption 2 of compute.max_preemptions=" in said[0]
    log = (tmp_path / "logs" / "s" / "rank0.log").read_text()
    assert "--- rank 0: Python stacks (faulthandler)" in log and "--- rank 1: Python stacks (faulthandler)" in log
    # where rank 0 was: in the training loop, waiting for rank 1 in a collective
    rank0 = log[log.index("--- rank 0: Python stacks") : log.index("--- rank 1: Python stacks")]
    assert "in _train_loop" in rank0 and "in all_reduce" in rank0, rank0
    assert process_state(json.loads((tmp_path / "frozen.json").read_text())["pid"]) is None  # the stopped rank: gone
    assert _same_weights(job, reference)

    goodput = compute(tmp_path, job.save_folder, job.run_name)
    assert goodput.launches == 3 and goodput.tokens == 48 * STEP
    assert set(goodput.buckets) == set(BUCKETS)
    assert abs(sum(goodput.buckets.values()) - goodput.wall_s) <= 0.01 * goodput.wall_s
    assert goodput.wall_s == pytest.approx(done["ended"] - killed["started"])
    assert 8 <= goodput.buckets["hung"] <= 13
    assert goodput.buckets["lost"] > 0  # steps 17-20 of the first launch, 33-40 of the second, trained again
    assert goodput.buckets["productive"] > 0 and goodput.buckets["startup"] > 0 and goodput.buckets["save"] > 0
    assert 0 < goodput.ratio < 1


@pytest.mark.slow
def test_a_kill_and_a_frozen_rank_restart_in_place_in_one_launch_and_the_goodput_ledger_adds_up(
    prefect_harness, reference, tmp_path, source, monkeypatch
):
    """As above, with the launcher's restarts in place (compute.restarts_in_place=3): rank 1 is SIGKILLed after step
    20, then SIGSTOPped after step 40; the launcher restarts the ranks from the checkpoint at 16, then (after the
    watchdog's stacks and kill) from the one at 32, in the same launcher process. One launch, two restarts with their
    causes, each charged as a preemption; the weights are the uninterrupted run's, bitwise; the ledger's restart
    bucket holds the time from each kill to the restarted ranks' start."""
    from tasks.training.goodput import compute

    monkeypatch.setenv("TESSERA_FAULT", f"step:{20 * STEP}")
    monkeypatch.setenv("TESSERA_FAULT_RANK", "1")
    monkeypatch.setenv("TESSERA_FAULT_ONCE", str(tmp_path / "killed-once"))
    monkeypatch.setenv("TESSERA_FREEZE", f"rank:{40 * STEP}")
    monkeypatch.setenv("TESSERA_FREEZE_RANK", "1")
    monkeypatch.setenv("TESSERA_FREEZE_ONCE", str(tmp_path / "frozen.json"))
    job, job_path = _job(tmp_path, source, step_floor_s=8.0)
    outcome, logs = _run_stage(job_path, restarts_in_place=3)
    assert outcome == 0, outcome
    (launch,) = _ledger(job_path)  # one launcher from start to end
    assert (launch["kind"], launch["code"], launch["tokens_after"]) == ("ok", 0, 48 * STEP)
    killed, hung = launch["restarts"]
    assert (killed["cause"], killed["rank"], killed["code"]) == ("crashed", 1, -9), killed
    assert (hung["cause"], hung["rank"], hung["hung"]["phase"], hung["hung"]["stopped"]) == ("hung", 1, "step", True)
    assert launch["started"] < killed["at"] < hung["at"] < launch["ended"]
    log = (tmp_path / "logs" / "s" / "rank0.log").read_text()
    assert log.count("tessera.launcher: ranks forked from a warm process") == 3  # the start and both restarts
    assert "tessera.launcher: restart 1 in place: rank 1 exited with code -9" in log
    assert "tessera.launcher: restart 2 in place: the watchdog found rank 1 (" in log
    assert "--- rank 1: Python stacks (faulthandler)" in log
    said = [m for m in logs if "in place:" in m]
    assert len(said) == 2 and said[0].startswith("stage s: restart 1 in place: rank 1 exited with code -9"), said
    assert process_state(json.loads((tmp_path / "frozen.json").read_text())["pid"]) is None
    assert _same_weights(job, reference)

    goodput = compute(tmp_path, job.save_folder, job.run_name)
    assert goodput.launches == 1 and goodput.tokens == 48 * STEP
    assert abs(sum(goodput.buckets.values()) - goodput.wall_s) <= 0.01 * goodput.wall_s
    assert goodput.buckets["restart"] > 0 and goodput.buckets["lost"] > 0 and 8 <= goodput.buckets["hung"] <= 13
    assert goodput.buckets["idle"] < 5  # no relaunch delay: nothing waited between launches


@pytest.mark.slow
def test_a_hang_in_a_save_is_judged_on_the_save_budget_and_launches_without_progress_stop_the_stage(
    prefect_harness, tmp_path, source, monkeypatch
):
    """Every launch hangs in its first checkpoint save (a fault hook): the watchdog names phase save on the save
    budget, not the step's 60 s; two launches in a row without a new checkpoint stop the stage as fatal."""
    from tasks.training.stage_ends import NoProgress

    monkeypatch.setenv("TESSERA_FAULT", "stall-save:600")
    job, job_path = _job(tmp_path, source, save_s=6, bytes_per_s=1e12, no_progress_launches=2)
    outcome, logs = _run_stage(job_path)
    assert isinstance(outcome, NoProgress), outcome
    assert str(outcome).startswith(
        "stage s: 2 launches in a row ended without a new checkpoint (the newest is at 0 tokens; "
        "train.watchdog.no_progress_launches=2); stopping instead of relaunching again."
    )
    launches = _ledger(job_path)
    assert [r["kind"] for r in launches] == ["preempted", "preempted"]
    for record in launches:
        assert record["hung"]["phase"] == "save" and 6 <= record["hung"]["budget_s"] < 7
        # caught on the save budget, not the step's 60 s: the slack covers a loaded machine's late watchdog round
        assert record["hung"]["silent_s"] < 40
    assert sum("hung in phase save" in m for m in logs) == 1  # the second hang ended the stage instead


@pytest.mark.slow
def test_a_slowed_rank_is_reported_with_its_rank(prefect_harness, tmp_path, source, monkeypatch, mlflow_uri):
    """Rank 1 computes three times as long as it would (a fault hook, by ratio: a loaded machine slows both ranks
    alike, where an absolute 0.15 s drowned in its noise): rank 0 compares the ranks' timings every 8 steps through
    the store; the flow says once which rank is slow; MLflow gets ranks/slowest_over_median and a tag. The launch's
    preflight saw it first: rank 1's matmul probe, slowed alike, is named far below its peer's. (Every rank slow
    alike is no straggler: the comparison is to the median, so none is named, and the slowness shows only in the
    group's tokens/s; docs/operations.md says so.)"""
    from mlflow.tracking import MlflowClient

    from tests.support.training import write_job
    from trainers.config import MlflowTarget
    from trainers.progress import parse_ranks

    monkeypatch.setenv("TESSERA_FAULT", "slow:x3")
    monkeypatch.setenv("TESSERA_FAULT_RANK", "1")
    client = MlflowClient(mlflow_uri)
    run_id = client.create_run(client.create_experiment("slow")).info.run_id
    job, _ = _job(tmp_path, source, steps=32, slow_rank_every_steps=8)
    job = job.model_copy(update={"mlflow": MlflowTarget(tracking_uri=mlflow_uri, run_id=run_id)})
    job_path = write_job(job, tmp_path / "job.json")
    outcome, logs = _run_stage(job_path)
    assert outcome == 0, outcome
    checked = [m for m in logs if "preflight passed on 2 rank(s)" in m]
    assert len(checked) == 1 and "; all-reduce " in checked[0], logs
    assert "; far below its peers (the median over train.watchdog.slow_rank_factor 1.5): rank 1 (" in checked[0]
    said = [m for m in logs if " is slow: " in m]
    assert len(said) == 1 and said[0].startswith("stage s: rank 1 (") and "the other ranks wait" in said[0], said
    reports = [r for r in map(parse_ranks, (tmp_path / "logs" / "s" / "rank0.log").read_text().splitlines()) if r]
    assert [r["step"] for r in reports] == [8, 16, 24, 32]
    for report in reports[1:]:  # the first window holds the first step's warm-up
        assert report["slowest"]["rank"] == 1 and report["slow"], report
        fast, slow = sorted(report["ranks"], key=lambda r: r["rank"])
        assert slow["compute_s"] > 2 * fast["compute_s"] and fast["collective_s"] > slow["collective_s"]
    history = client.get_metric_history(run_id, "ranks/slowest_over_median")
    assert sorted(m.step for m in history) == [8 * STEP, 16 * STEP, 24 * STEP, 32 * STEP]
    assert all(m.value > 1.5 for m in history if m.step > 8 * STEP)
    assert client.get_run(run_id).data.tags["tessera.slow_rank"].startswith("rank 1 (")
    probes = {k: client.get_metric_history(run_id, f"preflight/{k}") for k in ("matmul_gflops_min", "slow_ranks")}
    assert [(m.step, m.value) for m in probes["slow_ranks"]] == [(0, 1.0)]
    assert probes["matmul_gflops_min"][0].step == 0 and probes["matmul_gflops_min"][0].value > 0
    assert [m.step for m in client.get_metric_history(run_id, "preflight/allreduce_gb_per_s")] == [0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharding, rank, phase, floor",
    [
        ("NO_SHARD", 1, "eval", 60.0),  # the case, at the default budgets: gloo's 300 s used to fire first
        ("FULL_SHARD", 0, "save", 15.0),
        ("NO_SHARD", 0, "data", 15.0),
        ("FULL_SHARD", 1, "step", 15.0),
    ],
)
def test_a_rank_frozen_in_any_phase_is_caught_as_a_hang_before_the_collective_timeout(
    prefect_harness, tmp_path, source, monkeypatch, sharding, rank, phase, floor
):
    """One rank of two SIGSTOPped in a step, a held-out eval batch, a checkpoint save or a wait for a batch (DDP and
    FSDP2): the watchdog names that rank and phase within the phase's learned budget (the floor, `floor` s: the
    tiny model's work is far under it), well before the process group's 300 s would have failed the launch as a
    lost peer; the launch is recorded as a preemption with the frozen rank, and the relaunch finishes the stage."""
    from tests.support.training import tiny_job, write_job, write_mds

    val = write_mds(tmp_path / "val", 24, SEQ, 512, seed=9)
    job = tiny_job(
        tmp_path,
        {"a": source},
        [StageConfig(name="s", tokens=32 * STEP, mixture={"a": 1.0})],
        seq_len=SEQ,
        global_batch_size=BATCH,
        checkpoint_every_tokens=16 * STEP,
        val_streams={"a": str(val)},
        val_batches=3,
        parallelism={"sharding": sharding},
        watchdog=WatchdogConfig(poll_s=1, step_floor_s=floor),
    )
    job_path = write_job(job, tmp_path / "job.json")
    at = 16 * STEP if phase in ("eval", "save") else 20 * STEP  # the first checkpoint's eval and save; a mid-run step
    monkeypatch.setenv("TESSERA_FREEZE", f"rank:{at}:{phase}")
    monkeypatch.setenv("TESSERA_FREEZE_RANK", str(rank))
    monkeypatch.setenv("TESSERA_FREEZE_ONCE", str(tmp_path / "frozen.json"))
    outcome, logs = _run_stage(job_path)
    assert outcome == 0, outcome
    frozen = json.loads((tmp_path / "frozen.json").read_text())
    first, second = _ledger(job_path)
    hung = first["hung"]
    assert first["kind"] == "preempted" and second["kind"] == "ok", first
    assert (hung["rank"], hung["phase"], hung["stopped"]) == (rank, phase, True), hung
    # The stopped rank is blamed the moment any rank passes its budget (the unit test above): its peer, waiting for it
    # in the collective, may have beaten a moment before the freeze and crossed first (CI once: 14.9992 s of 15).
    assert hung["budget_s"] == floor and floor <= max(r["silent_s"] for r in hung["ranks"]) <= floor + 10, hung
    assert floor - 1 <= hung["silent_s"] <= floor + 10, hung
    detected = first["ended"] - frozen["at"]
    assert detected < floor + 30 < 300 - 15, detected  # caught, stacks written and killed long before gloo's 300 s
    said = [m for m in logs if "the watchdog found" in m]
    assert len(said) == 1 and f"found rank {rank} (" in said[0] and f"hung in phase {phase}" in said[0]
    print(f"frozen rank {rank} in {phase} ({sharding}): killed {detected:.1f} s after the freeze; {os.getloadavg()}")


@pytest.mark.slow
def test_a_slow_save_that_keeps_writing_is_never_killed(prefect_harness, tmp_path, source, monkeypatch):
    """A throttled writer (a fault hook: rank 0's save writes 1 KB every half second for 30 s before the checkpoint)
    under an 8 s save budget: the save's growth keeps the heartbeat beating, so the watchdog never calls it hung,
    and the one launch ends well. A frozen save, which writes nothing, is caught (the test above)."""
    monkeypatch.setenv("TESSERA_FAULT", "slow-save:30")
    job, job_path = _job(tmp_path, source, steps=16, step_floor_s=8.0, save_s=8, bytes_per_s=1e12)
    started = time.time()
    outcome, logs = _run_stage(job_path, ranks=1)
    assert outcome == 0, outcome
    assert [r["kind"] for r in _ledger(job_path)] == ["ok"]
    assert time.time() - started > 30 and not [m for m in logs if "the watchdog found" in m]


def test_a_hung_group_is_killed_even_when_its_log_cannot_be_written(tmp_path, monkeypatch):
    """The hang report goes to a log on a full disk (/dev/full: every write is ENOSPC). The kill must still
    come: before, the write's error ended the watchdog before its kill and the stopped group ran on for good."""
    import shlex
    import signal
    import subprocess
    import sys

    from infra import watchdog
    from infra.local import LocalJob

    monkeypatch.setattr(watchdog.shutil, "which", lambda name: None)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rank = shlex.join([sys.executable, "-c", _RANK, str(tmp_path)])
    launcher = subprocess.Popen(["sh", "-c", f"{rank} 0 & {rank} 1 & wait"], env=env, start_new_session=True)
    try:
        dog = Watchdog(tmp_path, Budgets(), [0, 1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (len(dog.pids()) == 2 and process_state(dog.pids()[1]) == "T"):
            time.sleep(0.01)
        pids = dog.pids()
        hang = dog.check(time.time() + 3600)
        assert hang is not None and hang.rank == 1 and hang.stopped
        LocalJob(process=launcher, log_path=Path("/dev/full"))._kill_hung(dog, hang)  # no OSError escapes
        assert launcher.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid in pids):
            time.sleep(0.05)
        assert [process_state(pid) in (None, "Z") for pid in pids] == [True, True]
    finally:
        watchdog.signal_group(launcher.pid, signal.SIGCONT)
        watchdog.signal_group(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_the_launchers_watchdog_kills_a_frozen_rank_after_its_log_has_gone(tmp_path, monkeypatch):
    """torch's agent with the watchdog in its monitor loop (infra/launcher.py): rank 1 stops itself, and the
    reader of the launcher's output has gone, so the hang report fails (EPIPE). Both ranks are killed within the
    startup budget plus the stacks' wait all the same, and nothing of the launch is left."""
    import signal
    import subprocess
    import sys

    from infra import watchdog
    from tests.support.training import live_group_members

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    beats = tmp_path / "beats"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # 20 s: the reader must be gone before the watchdog reports, so this test sees the frozen rank and closes
        # the pipe first; with 8 s a loaded machine (-n 2 beside the live stack) let the kill come before it looked
        "TESSERA_WATCHDOG": json.dumps({"startup_s": 20, "step_floor_s": 8}),
        "TESSERA_HEARTBEAT_DIR": str(beats),
    }
    argv = [sys.executable, "-m", "infra.launcher", "--nproc-per-node", "2", "--log-dir", str(tmp_path)]
    # Warm, as every launch of a stage is: the ranks fork once the heartbeat module is in, so the startup budget
    # times the ranks' own start. Fresh interpreters import torch first, and on a loaded machine (CI at 2d8ddb8)
    # spent the budget before either wrote its heartbeat: the launch was killed for that, not for the frozen rank.
    warm = ["--warm", "trainers.heartbeat"]
    launcher = subprocess.Popen(
        [*argv, *warm, "-m", "tests.launch_probe", "freeze", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # rank 0 runs: from here on, nobody reads the launcher's output
            if line.startswith(b"rank=0"):
                break
        dog = Watchdog(beats, Budgets(), [0, 1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (len(dog.pids()) == 2 and process_state(dog.pids()[1]) == "T"):
            time.sleep(0.05)
        pids = dog.pids()
        assert len(pids) == 2 and process_state(pids[1]) == "T"
        launcher.stdout.close()
        stopped_at = time.monotonic()
        while time.monotonic() - stopped_at < 60 and any(process_state(pid) not in (None, "Z") for pid in pids):
            time.sleep(0.1)
        assert [process_state(pid) in (None, "Z") for pid in pids] == [True, True]
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 10
        while live_group_members(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_group_members(launcher.pid) == []
    finally:
        watchdog.signal_group(launcher.pid, signal.SIGCONT)
        watchdog.signal_group(launcher.pid, signal.SIGKILL)
        launcher.wait()
