"""A work dir whose disk fills mid-run: one line naming the folder and its free space, no retry, nothing
half-written, and a rerun after freeing space resumes from the last complete checkpoint.

The work dir is a small tmpfs in a private mount namespace (`unshare -m`, root or CAP_SYS_ADMIN): at the launch
it has room for two checkpoints, as the preflight asks (trainers/preflight.py), and the third does not fit.
The trainer's own log is on that disk too.
"""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, tiny_recipe
from tests.support.training import can_unshare_mounts


def test_a_full_disk_is_found_anywhere_in_the_chain_and_is_fatal():
    """torch raises a RuntimeError from its zip writer while handling the ENOSPC of the write that failed."""
    from trainers.disk import no_space
    from trainers.exit_codes import ExitCode, classify

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . unexpected pos 9555904 vs 9555792"
            ) from None
    except RuntimeError as wrapped:
        assert wrapped.__cause__ is None and wrapped.__context__ is full
        assert no_space(wrapped) is full and classify(wrapped) == ExitCode.FATAL
    sqlite = Exception("(sqlite3.OperationalError) database or disk is full")
    assert no_space(sqlite) is sqlite
    assert no_space(RuntimeError("unexpected pos")) is None
    assert classify(RuntimeError("unexpected pos")) == ExitCode.RETRYABLE


def test_a_name_the_file_system_refuses_stops_the_trainer_in_one_fatal_line(tmp_path):
    """A run name too long for the disk (as a job written by hand could have): the first state file fails with
    ENAMETOOLONG, which no relaunch gets past, so the trainer exits fatal in one line naming it, not retryable."""
    from tests.support.training import run_stage, tiny_job, write_job, write_mds
    from trainers.config import StageConfig
    from trainers.disk import permanent_fault
    from trainers.exit_codes import ExitCode, classify

    assert classify(RuntimeError("wrapped")) == ExitCode.RETRYABLE
    for code in (errno.ENAMETOOLONG, errno.EROFS, errno.EACCES):
        fault = OSError(code, os.strerror(code), "/data/x")
        try:
            try:
                raise fault
            except OSError:
                raise RuntimeError("wrapped") from None
        except RuntimeError as wrapped:
            assert permanent_fault(wrapped) is fault and classify(wrapped) == ExitCode.FATAL

    src = write_mds(tmp_path / "src", 16, 32, 512, seed=0)
    job = tiny_job(tmp_path, {"src": str(src)}, [StageConfig(name="s", tokens=4 * 256, mixture={"src": 1.0})])
    job = job.model_copy(update={"run_name": "r" * 236})
    proc = run_stage(write_job(job, tmp_path / "job.json"), 0)
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "File name too long" in x]
    assert len(lines) == 1 and "no relaunch gets past" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare_mounts(), reason="needs `unshare -m` to give the work dir a small disk of its own")
def test_a_disk_that_fills_mid_run_is_one_line_and_a_rerun_after_freeing_space_resumes(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from tests.support.gauntlet import cut_demo_tasks

    # MLflow's store beside the work dir, so only the work dir fills; the work dir a small disk of its own, empty
    recipe = tiny_recipe(tmp_path, prefect_db=False)
    raw = yaml.safe_load(recipe.read_text())
    raw["train"]["stages"] = [{"name": "literary", "tokens": 6144, "mixture": {"literary": 1.0}}]
    raw["eval"] |= {
        "every": 2048,
        "data_root": str(cut_demo_tasks(ROOT / "data/gauntlet/eval/local_data", tmp_path / "g")),
    }
    recipe.write_text(yaml.safe_dump(raw))
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    tessera = shlex.join([sys.executable, "-m", "cli.main", "run", str(recipe)])
    checkpoints = work / "runs" / "tiny" / "checkpoints"
    # Prepared data (~2 MB with the tests' tokenizer), two checkpoints (~4.4 MB each) and the logs fit in 12 MiB;
    # three do not.
    script = f"""
        mount -t tmpfs -o size=12m tmpfs {work}
        {tessera} > {out}/run1.out 2> {out}/run1.err; echo $? > {out}/run1.rc
        ls {checkpoints} > {out}/after1.ls; ls {checkpoints}/manifests > {out}/manifests1.ls
        mount -o remount,size=300m tmpfs {work}
        {tessera} > {out}/run2.out 2> {out}/run2.err; echo $? > {out}/run2.rc
        ls {checkpoints}/manifests > {out}/manifests2.ls; du -sk {work}/data {checkpoints} > {out}/du.txt
        cat {work}/runs/tiny/logs/literary/rank0.log > {out}/rank0.log
    """
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=ROOT, env=env, check=True, timeout=900
    )
    first = (out / "run1.err").read_text()
    said = [line for line in first.splitlines() if line.startswith("tessera: error: ")]
    assert (out / "run1.rc").read_text().strip() == "2", first[-3000:]
    assert "Traceback" not in first
    assert said == [
        f"tessera: error: stage literary: no space for a checkpoint: the disk holding {checkpoints} has "
        + said[0].split(" has ", 1)[1]
    ]
    assert said[0].endswith(
        "free of 12.6 MB, and one checkpoint of this model takes about 4.4 MB; free some space (or give "
        "train.save_folder a larger disk), then rerun: it resumes from the checkpoint at 4,096 tokens"
    )
    assert "Retry" not in first and first.count("launched 1 rank(s)") == 1  # fatal at once: no retry filled it again
    # the cut-short save is unpublished
    assert (out / "manifests1.ls").read_text().split() == ["tok-000000002048.json", "tok-000000004096.json"]
    # and the cut-short file itself is gone: the trainer removed it, which gave its log on that disk room for the
    # fatal line (before, the line was lost whenever the save had taken the last free page)
    assert "tiny-s0-tok6144-rank0.pt" not in (out / "after1.ls").read_text().split()
    assert "tiny-s0-tok4096-rank0.pt" in (out / "after1.ls").read_text().split()
    log = (out / "rank0.log").read_text()
    assert f"tessera.train: fatal: no space left on the disk holding {checkpoints} (" in log

    second = (out / "run2.err").read_text()
    assert (out / "run2.rc").read_text().strip() == "0", second[-3000:]
    assert "stage literary: resuming run tiny from the checkpoint at 4,096 tokens (step 4)" in second
    assert (out / "manifests2.ls").read_text().split() == [f"tok-00000000{t}.json" for t in (2048, 4096, 6144)]
