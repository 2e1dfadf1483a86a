"""The goodput ledger's arithmetic on a run's own files, and `tessera status RUN`, which prints it.

The ledger of real launches (a kill and a hang, buckets adding up to the wall time) is proven by
tests/test_watchdog.py::test_a_kill_and_a_frozen_rank_are_relaunched_and_the_goodput_ledger_adds_up; here the two
files are written by hand with round numbers, so every bucket has one right value.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, tiny_recipe
from trainers.config import StageConfig

T0 = 1_700_000_000.0


def _run(tmp_path):
    """A run `r` of the tiny recipe with two launches: one killed 40 s after its last checkpoint, one that ended."""
    import yaml

    from tasks.training import launch_records
    from tests.support.training import tiny_job, write_job

    recipe = tiny_recipe(tmp_path)
    run_dir = tmp_path / "work" / "runs" / "r"
    run_dir.mkdir(parents=True)
    job = tiny_job(run_dir, {"a": "unused"}, [StageConfig(name="s", tokens=4096, mixture={"a": 1.0})], run_name="r")
    write_job(job, run_dir / "job.json")
    launch_records.append(
        run_dir,
        {"stage": "s", "started": T0, "ended": T0 + 100, "code": -9, "kind": "preempted", "hung": None,
         "tokens_before": 0, "tokens_after": 2048, "stopped": False, "pending_s": 0.0, "flow_run": "f1"},
    )  # fmt: skip
    launch_records.append(
        run_dir,
        {"stage": "s", "started": T0 + 105, "ended": T0 + 200, "code": 0, "kind": "ok", "hung": None,
         "tokens_before": 2048, "tokens_after": 4096, "stopped": False, "pending_s": 0.0, "flow_run": "f1"},
    )  # fmt: skip
    phases = dict.fromkeys(("startup", "plan", "download", "load", "first_step", "data", "step", "eval"), 0.0)
    first = phases | {"startup": 3, "first_step": 5, "step": 45, "data": 5}  # 58 s, to the checkpoint at T0 + 60
    # the second compiled its blocks for 3 s of its first step (train.compile): neither startup nor productive
    second = phases | {"startup": 3, "load": 4, "first_step": 2, "compile": 3, "step": 70, "data": 5, "save": 3}
    second["close"] = 1  # 91 s
    records = [
        {"pid": 1, "process_start": T0 + 2, "at": T0 + 60, "stage": "s", "tokens": 2048, "final": False,
         "phases": first},
        {"pid": 2, "process_start": T0 + 108, "at": T0 + 199, "stage": "s", "tokens": 4096, "final": True,
         "phases": second},
    ]  # fmt: skip
    (run_dir / "ckpt").mkdir()
    (run_dir / "ckpt" / "r-time.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut sh')
    assert yaml.safe_load(recipe.read_text())["work_dir"] == str(tmp_path / "work")
    return recipe, run_dir, job


def test_the_buckets_add_up_to_the_wall_time_and_the_killed_launchs_tail_is_lost(tmp_path):
    from tasks.training.goodput import compute

    _, run_dir, job = _run(tmp_path)
    goodput = compute(run_dir, job.save_folder, "r")
    assert (goodput.launches, goodput.tokens, goodput.wall_s) == (2, 4096, 200.0)
    assert goodput.buckets == {
        "productive": 50 + 75,  # data + step of both launches
        "startup": (2 + 3 + 5) + (3 + 3 + 2),  # process start after the launch, its startup, the first step
        "compile": 3,
        "load": 4,
        "save": 3,
        "eval": 0,
        "lost": 40,  # the killed launch's work after its checkpoint at T0 + 60: trained again
        "hung": 0,
        "restart": 0,
        "pending": 0,
        "idle": 5 + 1 + 1,  # the relaunch delay, the second's close and its exit
    }
    assert sum(goodput.buckets.values()) == goodput.wall_s and goodput.ratio == 125 / 200


def test_a_restart_in_place_splits_its_launch_the_crashs_tail_is_lost_and_the_restart_has_its_bucket(tmp_path):
    """The same two processes as one launch whose launcher restarted its ranks in place at T0 + 100 (a rank killed):
    the first attempt's work after its checkpoint is lost, the 8 s from the crash to the new process plus its startup
    phases are the restart's, and nothing is charged as a relaunch's idle gap."""
    from tasks.training import launch_records
    from tasks.training.goodput import compute

    _, run_dir, job = _run(tmp_path)
    launch_records.path(run_dir).unlink()
    restart = {"attempt": 1, "cause": "crashed", "rank": 1, "code": -9, "at": T0 + 100, "hung": None}
    launch_records.append(
        run_dir,
        {"stage": "s", "started": T0, "ended": T0 + 200, "code": 0, "kind": "ok", "hung": None, "tokens_before": 0,
         "tokens_after": 4096, "stopped": False, "pending_s": 0.0, "flow_run": "f1", "restarts": [restart]},
    )  # fmt: skip
    goodput = compute(run_dir, job.save_folder, "r")
    assert (goodput.launches, goodput.wall_s) == (1, 200.0)
    assert goodput.buckets == {
        "productive": 50 + 75,
        "startup": 2 + 3 + 5,  # the launch's own start only
        "restart": (108 - 100) + 3 + 2,  # crash to the new process, then its startup and first step
        "compile": 3,
        "load": 4,
        "save": 3,
        "eval": 0,
        "lost": 40,  # the first attempt's work after its checkpoint at T0 + 60
        "hung": 0,
        "pending": 0,
        "idle": 1 + 1,  # the close and the exit
    }
    assert sum(goodput.buckets.values()) == goodput.wall_s


def test_goodput_measures_the_run_not_the_calendar(tmp_path):
    """A rerun a day later (another flow run) that resumes, then a rerun with nothing to do: the day between them
    and the no-op launch are left out, and said; the figure is the one of the same launches back to back."""
    from tasks.training import launch_records
    from tasks.training.goodput import compute

    _, run_dir, job = _run(tmp_path)
    before = compute(run_dir, job.save_folder, "r")
    day = 86_400.0
    launch_records.append(
        run_dir,
        {"stage": "s", "started": T0 + 200 + day, "ended": T0 + 230 + day, "code": 0, "kind": "ok", "hung": None,
         "tokens_before": 4096, "tokens_after": 4096, "stopped": False, "pending_s": 0.0, "flow_run": "f2"},
    )  # fmt: skip
    after = compute(run_dir, job.save_folder, "r")
    assert (after.ratio, after.wall_s, after.buckets) == (before.ratio, before.wall_s, before.buckets)
    assert after.left_out == {"between_flow_runs": 0.0, "no_op_launches": 30.0}
    assert "Left out of the wall: launches that found their stage already complete: 30.0 s." in after.markdown("r")

    # the second launch of the run, had it been started by a person a day later, in its own flow run
    records = launch_records.read(run_dir)[:2]
    records[1] |= {"flow_run": "f3", "started": records[1]["started"] + day, "ended": records[1]["ended"] + day}
    launch_records.path(run_dir).unlink()
    for record in records:
        launch_records.append(run_dir, record)
    (run_dir / "ckpt" / "r-time.jsonl").write_text(
        "".join(
            json.dumps(r | ({"process_start": r["process_start"] + day, "at": r["at"] + day} if r["pid"] == 2 else {}))
            + "\n"
            for r in map(json.loads, (run_dir / "ckpt" / "r-time.jsonl").read_text().splitlines()[:2])
        )
    )
    later = compute(run_dir, job.save_folder, "r")
    assert later.left_out["between_flow_runs"] == day + 5  # the gap between the two flow runs, not charged
    assert later.wall_s == before.wall_s - 5 and later.buckets["idle"] == before.buckets["idle"] - 5
    assert later.stage_ratio("s") == (later.ratio, later.wall_s)  # one stage: its own figure is the run's


def test_tessera_status_prints_the_ledger_and_names_an_unknown_run_in_one_line(tmp_path):
    recipe, _, _ = _run(tmp_path)
    cli = [sys.executable, "-m", "cli.main", "status"]
    out = subprocess.run([*cli, "r", "--recipe", str(recipe)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "run r: goodput 62.5% over 200 s of wall time, 2 launch(es), 4,096 tokens"
    assert lines[1].split() == ["productive", "training", "(steps", "a", "checkpoint", "kept)", "125.0", "s", "62.5%"]
    assert any(line.split()[:2] == ["lost:", "steps"] and line.split()[-2:] == ["s", "20.0%"] for line in lines)
    assert lines[lines.index("prepared data:") - 1] == "  stage s: 62.5% productive of 200 s"
    # then the recipe's data, from its files: this run's recipe names data never prepared in its data root
    data = lines[lines.index("prepared data:") + 1 :]
    assert [line.split(": not prepared yet: 0 partitions done at ")[0] for line in data] == [
        "  source literary",
        "  source stories",
    ], data
    missing = subprocess.run([*cli, "nope", "--recipe", str(recipe)], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"tessera: error: {tmp_path / 'work' / 'runs' / 'nope' / 'job.json'}: no such run in {tmp_path / 'work'} "
        "(`tessera run` writes it)"
    ]


def test_with_the_ranks_in_pods_the_time_records_come_from_the_s3_save_folder(tmp_path, moto_s3):
    """On Kubernetes the flow never sees the pods' disks: rank 0 pushes its time records beside the checkpoints in
    the s3 save folder, and the flow's ledger reads them there."""
    from tasks.training.goodput import compute, for_job
    from trainers.remote import RemoteFolder

    _, run_dir, job = _run(tmp_path)
    moto_s3.create_bucket(Bucket="ckpts")
    in_pods = job.model_copy(update={"train": job.train.model_copy(update={"save_folder": "s3://ckpts/runs"})})
    in_pods = in_pods.model_copy(update={"save_folder": str(tmp_path / "flow-side-copy")})  # empty on the flow
    RemoteFolder(in_pods.remote_folder).push_file(run_dir / "ckpt" / "r-time.jsonl")
    assert for_job(run_dir, in_pods).buckets == compute(run_dir, job.save_folder, "r").buckets
    assert for_job(run_dir, in_pods).buckets["productive"] == 125


def test_an_unreachable_s3_save_folder_leaves_the_launches_unaccounted_and_says_so(tmp_path, monkeypatch, caplog):
    """Goodput is a report: a mirror that does not answer costs it the trainer's time records (each launch counted
    whole as unaccounted), in one warning line, never the flow or `tessera status`."""
    import logging

    from tasks.training.goodput import compute, for_job

    _, run_dir, job = _run(tmp_path)
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    in_pods = job.model_copy(update={"train": job.train.model_copy(update={"save_folder": "s3://ckpts/runs"})})
    in_pods = in_pods.model_copy(update={"save_folder": str(tmp_path / "flow-side-copy")})
    with caplog.at_level(logging.WARNING, logger="tessera.goodput"):
        goodput = for_job(run_dir, in_pods)
    assert goodput.buckets == compute(run_dir, tmp_path / "flow-side-copy", "r").buckets
    assert goodput.launches == 2 and goodput.buckets["productive"] == 0
    assert "goodput of r: cannot read its time records" in caplog.text
