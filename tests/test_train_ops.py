"""Operating the trainer from outside: exit codes for stops, no orphans, one trainer per run, MLflow outages, progress.

The slow tests launch real trainers (through Composer's launcher via infra.local, as the flow
does) on the 2-layer d_model 64 model over 32-token samples, and a real `mlflow server`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.mlflow_store import sqlite_store
from trainers.config import MlflowTarget, StageConfig
from trainers.contract import WARM_MODULES
from trainers.exit_codes import FATAL, INTERRUPTED, RETRYABLE, ExitCode

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 8
STEP = SEQ * BATCH  # 256 tokens per optimizer step


def test_exit_codes_tell_interrupted_from_failed():
    assert ExitCode.INTERRUPTED == 76 and 76 in INTERRUPTED
    assert not (INTERRUPTED & RETRYABLE) and not (INTERRUPTED & FATAL) and 0 not in INTERRUPTED


# ---------------------------------------------------------------- MLflow outbox, in process


def _state(tokens: int, loss: float = 2.0):
    return SimpleNamespace(
        timestamp=SimpleNamespace(token=tokens, batch=tokens // STEP), total_loss_dict={"loss/train/total": loss}
    )


def _metrics(target: MlflowTarget, folder: Path):
    from trainers.callbacks import MlflowMetrics

    return MlflowMetrics(
        target,
        SimpleNamespace(lr=1e-3),
        1,
        "warm",
        0,
        4 * STEP,
        STEP,
        flush_every_s=0,
        state_folder=folder,
        run_name="tiny",
    )


def test_a_dead_tracking_server_never_reaches_a_step_and_the_next_launch_delivers(tmp_path, monkeypatch, caplog):
    """Nothing listens at the first launch's address: no hook raises or waits, every row is journaled
    by the end; the next launch (server reachable) delivers them once each, with their original times."""
    from mlflow.tracking import MlflowClient

    from trainers.metrics_journal import journal_path, marker_path

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    store = sqlite_store(tmp_path / "mlflow.db")
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    folder = tmp_path / "ckpt"
    folder.mkdir()

    caplog.set_level(logging.INFO, logger="tessera.train")
    monkeypatch.setenv("TESSERA_METRICS_CLOSE_WAIT_S", "0")
    dead = _metrics(MlflowTarget(tracking_uri="http://127.0.0.1:9", run_id=run_id), folder)
    hook_s = []

    def timed(hook, *args):
        t0 = time.perf_counter()
        hook(*args, None)
        hook_s.append(time.perf_counter() - t0)

    timed(dead.fit_start, _state(0))
    for k in range(1, 11):
        timed(dead.batch_start, _state((k - 1) * STEP))
        timed(dead.batch_end, _state(k * STEP, loss=2.0 + k / 100))
        time.sleep(0.05)  # let the shipper fail a few times meanwhile
    timed(dead.fit_end, _state(10 * STEP))
    timed(dead.close, _state(10 * STEP))
    recorded_by = time.time() * 1000
    assert max(hook_s) < 0.05, hook_s  # fsync at checkpoint steps included
    failing = [r.getMessage() for r in caplog.records if "not accepting metrics" in r.getMessage()]
    assert len(failing) == 1 and "127.0.0.1:9" in failing[0]
    assert any("not delivered to MLflow" in r.getMessage() for r in caplog.records)
    assert json.loads(marker_path(folder, "tiny").read_text()) == {"mlflow_run_id": run_id, "tokens": 10 * STEP}
    assert client.get_metric_history(run_id, "train/loss") == []

    monkeypatch.setenv("TESSERA_METRICS_CLOSE_WAIT_S", "60")
    relaunch = _metrics(MlflowTarget(tracking_uri=store, run_id=run_id), folder)
    assert relaunch.logged_until == 10 * STEP  # the re-trained steps are not recorded again
    relaunch.fit_start(_state(10 * STEP), None)
    relaunch.fit_end(_state(10 * STEP), None)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [k * STEP for k in range(1, 11)]
    assert {m.step: m.value for m in history} == {k * STEP: 2.0 + k / 100 for k in range(1, 11)}
    assert all(m.timestamp <= recorded_by for m in history)  # stamped when trained, not when delivered
    tags = client.get_run(run_id).data.tags
    assert tags["stage/warm/start_tokens"] == "0" and tags["stage/warm/end_tokens"] == str(10 * STEP)
    assert not journal_path(folder, "tiny").exists()  # all delivered: nothing left to replay


def test_progress_lines_parse_and_ignore_everything_else():
    from trainers.progress import format_progress, parse_progress

    record = {
        "stage": "warm",
        "stage_index": 0,
        "step": 3,
        "tokens": 768,
        "stage_start": 0,
        "stage_end": 2560,
        "loss": float("nan"),
        "tokens_per_sec": 1234.5,
        "elapsed_s": 1.5,
    }
    assert parse_progress("  " + format_progress(record) + "\n") == {**record, "loss": None}
    assert parse_progress("2026-01-01 tessera.train: stage warm (0): fresh at 0 tokens") is None
    assert parse_progress("tessera.progress {not json") is None
    assert parse_progress('tessera.progress {"stage": "warm"}') is None  # not a whole record


# ---------------------------------------------------------------- real trainers

LEASE_STEPS, LEASE_EVERY = 400, 40  # long enough to still be training when a second trainer gives up
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    from tests.support.training import write_mds

    return str(write_mds(tmp_path_factory.mktemp("data") / "a", 16_000, SEQ, 512, seed=1))


def _job(root: Path, source: str, steps: int, every_steps: int, **kw):
    from tests.support.training import tiny_job, write_job

    stages = [StageConfig(name="ops", tokens=steps * STEP, mixture={"a": 1.0})]
    job = tiny_job(
        root,
        {"a": source},
        stages,
        seq_len=SEQ,
        global_batch_size=BATCH,
        checkpoint_every_tokens=every_steps * STEP,
        **kw,
    )
    return job, write_job(job, root / "job.json")


def _final_model(job) -> dict:
    import torch

    from trainers.format.checkpoints import list_complete

    return torch.load(list_complete(job.save_folder)[-1].path, map_location="cpu", weights_only=False)["state"]["model"]


def _wait_for(condition, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source):
    """The lease test's job trained by one uninterrupted trainer; its stdout carries progress lines every 0.5 s."""
    from tests.support.training import run_stage

    root = tmp_path_factory.mktemp("ref")
    job, job_path = _job(root, source, LEASE_STEPS, LEASE_EVERY)
    proc = run_stage(job_path, 0, env={"TESSERA_PROGRESS_S": "0.5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return job, proc


@pytest.mark.slow
def test_progress_lines_follow_the_stage_to_its_end(reference):
    from trainers.progress import parse_progress

    job, proc = reference
    lines = [r for r in map(parse_progress, proc.stdout.splitlines()) if r is not None]
    end = LEASE_STEPS * STEP
    assert lines[0]["tokens"] == STEP and lines[0]["step"] == 1  # right after the first step
    assert lines[-1]["tokens"] == end and lines[-1]["step"] == LEASE_STEPS  # and at the stage's end
    assert len(lines) >= 3, proc.stdout[-2000:]
    assert all(a["tokens"] < b["tokens"] and a["elapsed_s"] < b["elapsed_s"] for a, b in zip(lines, lines[1:]))
    # Rate-limited: between the first and the last line, at least TESSERA_PROGRESS_S apart. elapsed_s is rounded to
    # the millisecond, so two lines 0.5 s apart can read 0.499 apart (the check at 0.5 failed once, at -n 2).
    gaps = [round(b["elapsed_s"] - a["elapsed_s"], 3) for a, b in zip(lines[:-2], lines[1:-1])]
    assert all(gap >= 0.5 - 0.001 for gap in gaps), gaps
    for r in lines:
        assert (r["stage"], r["stage_index"], r["stage_start"], r["stage_end"]) == ("ops", 0, 0, end)
        assert r["step"] * STEP == r["tokens"] and r["tokens_per_sec"] > 0 and 0 < r["loss"] < 10


@pytest.mark.slow
def test_sigterm_and_sigint_exit_interrupted(tmp_path, source):
    """A stop from outside is neither the trainer's failure (75) nor Composer's 128+N: it is 76, both for
    SIGINT and for SIGTERM (which Composer's import would otherwise take over), and the relaunch resumes."""
    from tests.support.training import start_stage
    from trainers.format.checkpoints import list_complete

    job, job_path = _job(tmp_path, source, 300, 50)
    for sig in (signal.SIGINT, signal.SIGTERM):
        before = len(list_complete(job.save_folder))
        proc = start_stage(job_path, 0, stdout=None, stderr=tmp_path / f"{sig.name}.err")
        _wait_for(lambda n=before: len(list_complete(job.save_folder)) > n, 180, "a new checkpoint", every=0.05)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == ExitCode.INTERRUPTED, (tmp_path / f"{sig.name}.err").read_text()[-3000:]
    assert "stage ops (0): resume at" in (tmp_path / "SIGTERM.err").read_text()
    assert list_complete(job.save_folder)[-1].tokens < 300 * STEP  # stopped mid-stage, not after it


@pytest.mark.slow
def test_one_trainer_per_run_name(reference, tmp_path, source):
    """Two trainers of one run started at once: one trains, the other waits TESSERA_LEASE_WAIT_S and leaves
    FATAL naming the first. After the first is SIGKILLed, a new trainer gets the lease at once and the
    run ends bitwise where an uninterrupted one does."""
    import re
    import socket

    import torch

    from tests.support.training import run_stage, start_stage
    from trainers.format.checkpoints import list_complete

    job, job_path = _job(tmp_path, source, LEASE_STEPS, LEASE_EVERY)
    procs, outs = {}, {}
    for name in ("a", "b"):
        outs[name] = tmp_path / f"{name}.err"
        env = {
            "TESSERA_LEASE_WAIT_S": "2",
            "TESSERA_HOLDER": f"test trainer {name}",
            "TESSERA_SAMPLE_LOG": str(tmp_path / f"{name}.samples"),
        }
        procs[name] = start_stage(job_path, 0, env=env, stdout=None, stderr=outs[name])
    first_out = _wait_for(lambda: [n for n, p in procs.items() if p.poll() is not None], 180, "one trainer to exit")
    out_at = time.time()
    loser = first_out[0]
    winner = "b" if loser == "a" else "a"
    err = outs[loser].read_text()
    assert procs[loser].returncode == ExitCode.FATAL, err[-3000:]
    assert procs[winner].poll() is None, "the trainer holding the lease should still be training"

    fatal = [line for line in err.splitlines() if "fatal" in line]
    pattern = (
        rf"tessera\.train: fatal: run 'tiny' is already being trained by pid {procs[winner].pid} on host "
        rf"{re.escape(socket.gethostname())} \(test trainer {winner}\) since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d; "
        r"a second trainer would corrupt its checkpoints"
    )
    assert len(fatal) == 1 and re.fullmatch(pattern, fatal[0]), err[-3000:]
    # It gave up within its wait bound, and it never planned, repaired or trained anything.
    waited = re.search(r"^(\S+ \S+),(\d+) tessera\.train: run 'tiny' is held by .* waiting up to 2 s", err, re.M)
    started_wait = time.mktime(time.strptime(waited[1], "%Y-%m-%d %H:%M:%S")) + int(waited[2]) / 1000
    assert out_at - started_wait < 2 + 3
    assert "stage ops (0)" not in err and not (tmp_path / f"{loser}.samples").exists()

    _wait_for(lambda: list_complete(job.save_folder), 120, "the winner's first checkpoint")
    procs[winner].send_signal(signal.SIGKILL)
    assert procs[winner].wait() == -signal.SIGKILL
    last = list_complete(job.save_folder)[-1].tokens
    assert last < LEASE_STEPS * STEP

    relaunch = run_stage(job_path, 0, env={"TESSERA_LEASE_WAIT_S": "0"})  # no waiting: the kernel dropped the lock
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    # The kill can land between a checkpoint's last byte and its manifest (seen in CI once training got faster):
    # the relaunch then re-derives that manifest and resumes from the next checkpoint, one save interval later.
    rederived = re.search(r"checkpoint \S+-tok(\d+)-rank0\.pt had no manifest but verifies", relaunch.stderr)
    resumed_at = last if rederived is None else int(rederived[1])
    assert resumed_at in (last, last + LEASE_EVERY * STEP), relaunch.stderr[-3000:]
    assert f"stage ops (0): resume at {resumed_at} tokens" in relaunch.stderr, relaunch.stderr[-3000:]
    assert "waiting up to" not in relaunch.stderr

    ref_job, _ = reference
    mine, ref = _final_model(job), _final_model(ref_job)
    assert list_complete(job.save_folder)[-1].tokens == LEASE_STEPS * STEP
    assert all(torch.equal(mine[name], tensor) for name, tensor in ref.items())


@pytest.mark.slow
def test_a_refused_lease_stops_every_rank(tmp_path, source):
    """Another process holds the run: both ranks of a 2-rank job leave FATAL with the one-line reason,
    none left waiting in a collective, and the save folder is not touched."""
    import re

    from infra.config import ComputeConfig
    from infra.local import LocalBackend

    job, job_path = _job(tmp_path, source, 10, 4)
    hold = (
        "import sys, time; from trainers.folder_lock import acquire; acquire(sys.argv[1], 'tiny', 0); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, job.save_folder],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TESSERA_HOLDER": "flow run 'tiny' 1234"},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        logs = tmp_path / "logs"
        launched = LocalBackend(ComputeConfig(procs_per_node=2)).launch(
            "trainers.train",
            ["--job", str(job_path), "--stage", "0"],
            log_dir=logs,
            env={**ENV, "TESSERA_LEASE_WAIT_S": "1"},
            warm=WARM_MODULES,  # as the flow launches trainers (tasks/training/train.py)
        )
        assert launched.wait(timeout=180) == ExitCode.FATAL, launched.tail(40)
        assert launched.process.returncode == ExitCode.FATAL  # rank 0's own code too, not a SIGTERM answer
        line = (
            rf"tessera\.train: fatal: run 'tiny' is already being trained by pid {holder.pid} on host \S+ "
            r"\(flow run 'tiny' 1234\) since [-0-9: ]+; a second trainer would corrupt its checkpoints"
        )
        assert re.search(line, launched.log_path.read_text()), launched.tail(40)
        rank1 = (logs / "rank1.stderr.log").read_text()
        assert (
            [x for x in rank1.splitlines() if "fatal" in x and re.fullmatch(line, x)]
            == [x for x in rank1.splitlines() if "fatal" in x or "Traceback" in x]
            != []
        )
        assert sorted(p.name for p in Path(job.save_folder).iterdir()) == ["tiny.lock"]  # no ledger, no repair
    finally:
        holder.kill()
        holder.wait()


# Rank 0 of a two-rank launch reads a setup failure and, as the store's host, waits for rank 1 to
# read it too; rank 1 has, and has left, so the launcher SIGTERMs rank 0 while it waits.
_SIGTERM_AFTER_A_POSTED_FAILURE = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
from trainers.rendezvous import post as _post, read as _read
from trainers.exit_codes import FatalError
from trainers.train import stop_on_signals

stop_on_signals()
store = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
_post(store, "tessera/plan", None, FatalError("run 'tiny' is already being trained"))
print("posted", flush=True)
_read(store, "tessera/plan")
"""


def test_a_rank_stopped_after_reading_a_fatal_setup_failure_still_exits_fatal():
    """The race behind a refused lease exiting 76 on rank 0: the code is decided when the failure is read,
    so the launcher's SIGTERM for the survivors cannot turn FATAL into INTERRUPTED."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_AFTER_A_POSTED_FAILURE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV, "RANK": "0", "WORLD_SIZE": "2"},
    )
    try:
        assert proc.stdout.readline() == "posted\n"
        time.sleep(1)  # inside _read's wait for rank 1, which never reads
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == ExitCode.FATAL
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_dead_supervisor_takes_the_whole_job_down(tmp_path, source):
    """The process that launched a 2-rank job is SIGKILLed mid-training: launcher and ranks are gone within
    15 s (ranks exit INTERRUPTED), and a relaunch resumes from the last complete checkpoint."""
    from infra.config import ComputeConfig
    from infra.launch_outcome import read_records
    from infra.local import LocalBackend
    from tests.support.training import live_group_members
    from trainers.format.checkpoints import list_complete

    job, job_path = _job(tmp_path, source, 300, 50)
    logs = tmp_path / "logs"
    supervisor = (
        "import sys, time; from pathlib import Path; from infra.config import ComputeConfig; "
        "from infra.local import LocalBackend; "
        "job = LocalBackend(ComputeConfig(procs_per_node=2)).launch('trainers.train', "
        "['--job', sys.argv[1], '--stage', '0'], "
        f"log_dir=Path(sys.argv[2]), env={ENV!r}, warm={WARM_MODULES!r}); print(job.process.pid, flush=True); "
        "time.sleep(600)"
    )
    flow = subprocess.Popen(
        [sys.executable, "-c", supervisor, str(job_path), str(logs)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    group = int(flow.stdout.readline())
    assert len(_wait_for(lambda: live_group_members(group), 30, "the job's processes")) >= 1
    # a ceiling on waiting for the event, not a speed bound (a loaded machine took over 180 s)
    _wait_for(lambda: list_complete(job.save_folder), 600, "the first checkpoint", every=0.05)
    assert len(live_group_members(group)) >= 3  # the launcher and two ranks, training

    flow.kill()
    flow.wait()
    killed_at = time.monotonic()
    _wait_for(lambda: not live_group_members(group), 15, "every process of the orphaned job to exit")
    gone_after = time.monotonic() - killed_at
    last = list_complete(job.save_folder)[-1].tokens
    assert last < 300 * STEP, "the job finished before its supervisor died; nothing was tested"
    said = (
        f"tessera.train: supervisor process {flow.pid} is gone; stopping (a relaunch resumes from the last checkpoint)"
    )
    launcher = (logs / "rank0.log").read_text()
    # The rank whose watchdog fires first says so; the launcher then SIGTERMs the other, which may
    # beat that rank's own watchdog. Either way every rank leaves INTERRUPTED, and a 76 is never restarted in place.
    assert said in launcher or said in (logs / "rank1.stderr.log").read_text(), launcher[-3000:]
    restarts, end = read_records(launcher)
    assert restarts == [] and end is not None, launcher[-3000:]
    assert (end["code"], end["codes"]) == (76, {"0": 76, "1": 76}), end

    relaunch = LocalBackend(ComputeConfig(procs_per_node=2)).launch(
        "trainers.train", ["--job", str(job_path), "--stage", "0"], log_dir=logs, env=ENV, warm=WARM_MODULES
    )
    assert relaunch.wait(timeout=300) == 0, relaunch.tail(40)
    with open(relaunch.log_path) as f:
        f.seek(relaunch.log_offset)
        assert f"stage ops (0): resume at {last} tokens" in f.read()
    assert list_complete(job.save_folder)[-1].tokens == 300 * STEP
    print(f"orphaned job gone {gone_after:.1f} s after its supervisor")


OUTAGE_STEPS = 1200


@pytest.mark.slow
@pytest.mark.parametrize("outage_s", [20])
def test_metrics_survive_a_tracking_server_outage(tmp_path, source, outage_s):
    """A real `mlflow server` goes down for `outage_s` while a job trains and comes back on the same port
    and store: the job neither fails nor restarts, and MLflow ends with every step exactly once, stamped
    when it was trained. (Another engineer's end-to-end test runs this with a 60 s outage.)"""
    from mlflow.tracking import MlflowClient

    from infra.config import ComputeConfig
    from infra.local import LocalBackend
    from tests.support.training import MlflowServer
    from trainers.metrics_journal import journal_path
    from trainers.progress import parse_progress

    with MlflowServer(tmp_path / "mlflow") as server:
        client = MlflowClient(server.uri)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        target = MlflowTarget(tracking_uri=server.uri, run_id=run_id)
        job, job_path = _job(tmp_path, source, OUTAGE_STEPS, 200, mlflow=target, keep_checkpoints=2)
        env = {
            **ENV,
            "TESSERA_METRICS_FLUSH_S": "1",
            "TESSERA_PROGRESS_S": "1",
            # what the flow sets for the trainer: few, short HTTP retries inside MLflow itself
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        }
        launched = LocalBackend(ComputeConfig()).launch(
            "trainers.train",
            ["--job", str(job_path), "--stage", "0"],
            log_dir=tmp_path / "logs",
            env=env,
            warm=WARM_MODULES,
        )
        _wait_for(lambda: client.get_metric_history(run_id, "train/loss"), 180, "the first steps in MLflow", every=0.5)
        server.stop()
        down_at = time.time()
        time.sleep(outage_s)
        up_at = time.time()
        server.start()
        assert launched.wait(timeout=400) == 0, launched.tail(40)

        log = launched.log_path.read_text()
        assert log.count("stage ops (0):") == 1  # one launch: no restart
        assert log.count("is not accepting metrics") == 1 and log.count("accepts metrics again") == 1, log[-3000:]
        history = client.get_metric_history(run_id, "train/loss")
        assert sorted(m.step for m in history) == [k * STEP for k in range(1, OUTAGE_STEPS + 1)]
        by_step = sorted(history, key=lambda m: m.step)
        assert all(a.timestamp <= b.timestamp for a, b in zip(by_step, by_step[1:]))  # original times, in order
        during = [m.step for m in history if down_at * 1000 < m.timestamp < up_at * 1000]
        progress = [r["tokens"] for r in map(parse_progress, log.splitlines()) if r]
        assert len(during) > 10, (down_at, up_at, progress)  # trained while the server was down, delivered later
        assert client.get_run(run_id).data.tags["stage/ops/end_tokens"] == str(OUTAGE_STEPS * STEP)
        assert not journal_path(job.save_folder, "tiny").exists()
