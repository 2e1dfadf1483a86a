"""The preflight of each launch: room and write access for checkpoints, fatal in one line before any compute; the
probes' figures relayed, and a rank far below its peers named. The 2-rank case (figures in the flow's log and
MLflow, a slowed rank named) is in tests/test_watchdog.py's slowed-rank test."""

from __future__ import annotations

import time

import pytest

from trainers.config import ModelConfig, StageConfig


def _job(tmp_path, **update):
    from tests.support.training import tiny_job, write_mds

    source = write_mds(tmp_path / "a", 64, 32, 512, seed=0)
    job = tiny_job(tmp_path, {"a": str(source)}, [StageConfig(name="s", tokens=8 * 256, mixture={"a": 1.0})])
    return job.model_copy(update=update)


def test_a_save_folder_without_room_for_two_checkpoints_stops_the_launch_before_it_builds_the_model(tmp_path):
    """A model whose two checkpoints (12 bytes a parameter each) outgrow any disk here: the real trainer exits fatal
    (78) with one line naming the folder, its free space and the need, before it allocates the model."""
    from tests.support.training import run_stage, write_job
    from trainers.exit_codes import ExitCode

    huge = ModelConfig(n_layers=64, d_model=16384, n_heads=128)  # ~206B parameters: about 4.9 TB for two
    job = _job(tmp_path, model=huge)
    proc = run_stage(write_job(job, tmp_path / "job.json"), 0)
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("tessera.train: fatal: ")]
    assert len(said) == 1 and "Traceback" not in proc.stderr
    assert said[0].startswith(
        f"tessera.train: fatal: preflight: no room for checkpoints: the disk holding {job.save_folder} has "
    )
    assert " TB; free some space (or give train.save_folder a larger disk), then rerun" in said[0]
    assert "and 2 checkpoints of this model take about 4.9 TB; " in said[0]


def test_a_save_folder_that_cannot_take_a_file_is_one_fatal_line(tmp_path):
    from trainers.exit_codes import ExitCode, FatalError, classify
    from trainers.preflight import check_save_folder

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    job = _job(tmp_path, save_folder=str(blocker / "ckpt"))
    with pytest.raises(FatalError) as raised:
        check_save_folder(job)
    assert str(raised.value) == (
        f"preflight: train.save_folder {blocker / 'ckpt'} cannot take a file: [Errno 20] Not a directory: "
        f"'{blocker / 'ckpt'}'"
    )
    assert classify(raised.value) == ExitCode.FATAL
    room = check_save_folder(job.model_copy(update={"save_folder": str(tmp_path / "ckpt")}))
    assert room["free_bytes"] >= room["need_bytes"] > 0
    assert not list((tmp_path / "ckpt").iterdir())  # the probe file is gone again


def test_an_s3_save_folder_whose_bucket_is_missing_is_fatal_and_a_writable_one_passes(tmp_path, moto_s3):
    from trainers.exit_codes import FatalError
    from trainers.preflight import check_save_folder

    job = _job(tmp_path)
    missing = job.model_copy(update={"train": job.train.model_copy(update={"save_folder": "s3://no-such-bucket/x"})})
    with pytest.raises(FatalError) as raised:
        check_save_folder(missing)
    assert str(raised.value).startswith(
        "preflight: train.save_folder s3://no-such-bucket/x/tiny does not take a file ("
    )
    moto_s3.create_bucket(Bucket="ckpts")
    ok = job.model_copy(update={"train": job.train.model_copy(update={"save_folder": "s3://ckpts/runs"})})
    check_save_folder(ok)
    assert "Contents" not in moto_s3.list_objects_v2(Bucket="ckpts")  # the probe object was deleted


def test_a_failed_probe_is_an_infrastructure_retry_and_a_slow_rank_is_named():
    import torch

    from tasks.training.train_progress import describe_preflight
    from trainers.exit_codes import ExitCode, InfrastructureError, classify
    from trainers.preflight import matmul_gflops, summarize
    from trainers.progress import format_preflight, parse_preflight

    assert classify(InfrastructureError("preflight: a probe failed")) == ExitCode.INTERRUPTED
    assert matmul_gflops(torch.device("cpu")) > 0.1
    ranks = [
        {"rank": r, "host": f"node-{r // 2}", "node": f"node-{r // 2}", "matmul_gflops": g, "allreduce_gb_per_s": 1.5}
        for r, g in enumerate([40.0, 41.0, 39.0, 12.0])
    ]
    summary = parse_preflight(format_preflight(summarize(ranks, 1.5)))
    assert summary["slow"] == [{"rank": 3, "host": "node-1", "node": "node-1", "matmul_gflops": 12.0}]
    line, warn = describe_preflight("s", summary)
    assert warn and line == (
        "stage s: preflight passed on 4 rank(s): matmul 39.5 GFLOP/s median, 12.0 the slowest; all-reduce 1.50 GB/s; "
        "far below its peers (the median over train.watchdog.slow_rank_factor 1.5): rank 3 (node-1, 12.0 GFLOP/s)"
    )
    even = summarize(ranks[:3], 1.5)
    assert even["slow"] == [] and not describe_preflight("s", even)[1]


def test_the_matmul_probe_is_the_best_window_and_a_straggler_hook_slows_it_by_its_factor(monkeypatch):
    """The probe's figure is the rate of its best short window, so a rank probing while other processes hold the
    cores still reports its own rate; the fault hook's x3 rank reports a third of it (the watchdog test's slow rank
    is named by this figure; a mean over the whole probe named the wrong rank at load)."""
    import time

    import torch

    from trainers.preflight import MATMUL_S, matmul_gflops

    monkeypatch.setenv("RANK", "1")
    clean = max(matmul_gflops(torch.device("cpu")) for _ in range(2))
    monkeypatch.setenv("TESSERA_FAULT", "slow:x3")
    monkeypatch.setenv("TESSERA_FAULT_RANK", "1")
    start = time.perf_counter()
    slowed = matmul_gflops(torch.device("cpu"))
    assert time.perf_counter() - start >= 3 * MATMUL_S  # the hook takes the time, as a slow node would
    assert clean / 4.5 < slowed < clean / 2


def test_a_cpu_probe_whose_core_is_shared_with_three_busy_processes_reports_the_cores_rate():
    """On a CPU the probe's windows are timed by the CPU the rank spent, so a rank whose core three other processes
    share for the whole probe (wall clock: about a quarter of the rate in every window) reports the core's rate,
    within the noise of a machine that runs other tests: CI once named the wrong rank slow at 2x."""
    import os
    import subprocess
    import sys

    import torch

    from trainers.preflight import matmul_gflops

    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    core = min(affinity)
    torch.set_num_threads(1)  # the matmul on this thread, which the affinity below pins
    os.sched_setaffinity(0, {core})
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    spinners = []
    try:
        clean = max(matmul_gflops(torch.device("cpu")) for _ in range(2))
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
        time.sleep(1.0)  # each spinner running on the core
        shared = max(matmul_gflops(torch.device("cpu")) for _ in range(2))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    assert shared > clean / 2, (shared, clean)


def test_composers_environment_probe_starts_no_second_python(monkeypatch):
    """Every Trainer logs Composer's environment, and its CPU name came from py-cpuinfo, which runs a second
    Python interpreter (a second of CPU per rank per launch); the build reads the name without one."""
    import subprocess

    from composer.utils import collect_env

    from trainers.build import _cpu_model_without_a_child_python

    monkeypatch.setattr(collect_env, "get_cpu_model", collect_env.get_cpu_model)  # undone after the test
    _cpu_model_without_a_child_python()

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    env = collect_env.get_composer_env_dict()
    name = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1].strip()
    assert env["cpu_model"] == name and env["composer_version"]
