"""`tessera prepare` as a user runs it: bad paths give one line and no retry; it prepares what `run` would."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.test_data_helpers import ROOT, SHAKESPEARE, tessera, write_recipe

SOURCE = [{"name": "s", "paths": [str(SHAKESPEARE)], "separator": "\n\n"}]


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    """The CLI's bad-input contract: exit 2, one `tessera: error:` line, no traceback, no retry."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr[-3000:]
    assert "Retry 1/" not in done.stderr and "AwaitingRetry" not in done.stderr, done.stderr[-3000:]  # Prefect's words
    errors = [line for line in done.stderr.splitlines() if line.startswith("tessera: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


def test_work_dir_that_is_a_file(tmp_path):
    (tmp_path / "wd").write_text("not a directory")
    recipe = write_recipe(tmp_path / "r.yaml", SOURCE, tmp_path / "data", tmp_path / "wd")
    done = tessera("prepare", str(recipe))
    line = _one_line_error(done)
    assert line.startswith(
        f"tessera: error: work_dir {tmp_path / 'wd'}: cannot hold Prefect's database in {tmp_path / 'wd' / 'prefect'} ("
    ), line
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # a real `tessera prepare` with Prefect's temporary server
def test_data_root_that_is_a_file(tmp_path):
    (tmp_path / "root").write_text("a file where the data root should be")
    recipe = write_recipe(tmp_path / "r.yaml", SOURCE, tmp_path / "root", tmp_path / "wd")
    for command in ("prepare", "run"):
        t0 = time.monotonic()
        line = _one_line_error(tessera(command, str(recipe)))
        assert line == f"tessera: error: {tmp_path / 'root'}: data.root is a file, not a directory"
        assert time.monotonic() - t0 < 10  # said before Prefect's server started (that alone takes 5 s or more)


def _can_mount_in_namespace() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"], capture_output=True)
    return None if probe.returncode == 0 else f"cannot mount in a private namespace: {probe.stderr.decode()[:200]}"


@pytest.mark.slow
def test_data_root_on_a_read_only_filesystem(tmp_path):
    why = _can_mount_in_namespace()
    if why:
        pytest.skip(why)
    ro = tmp_path / "ro"
    ro.mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", SOURCE, ro / "data", tmp_path / "wd")
    # A read-only tmpfs over `ro`, seen only by this one command (a private mount namespace).
    script = f"mount -t tmpfs -o ro tmpfs {ro} && exec {ROOT / '.venv' / 'bin' / 'tessera'} prepare {recipe}"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    t0 = time.monotonic()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    line = _one_line_error(done)
    assert line == f"tessera: error: {ro / 'data'}: cannot create data.root: Read-only file system", line
    assert time.monotonic() - t0 < 10  # said before Prefect's server started, and so never retried


def test_missing_tokenizer_fails_with_the_recipe_before_prefect_starts(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", SOURCE, tmp_path / "data", tmp_path / "wd", tokenizer="tokenizers/nope/tokenizer.json"
    )
    t0 = time.monotonic()
    line = _one_line_error(tessera("prepare", str(recipe)))
    assert time.monotonic() - t0 < 10
    assert line.startswith(f"tessera: error: {recipe}:")
    assert line.endswith(
        f": data.tokenizer.path: tokenizers/nope/tokenizer.json does not exist (relative paths resolve against {ROOT})"
    ), line
    assert not (tmp_path / "wd" / "prefect").exists()  # Prefect never started


@pytest.mark.slow
def test_prepare_makes_every_stage_length_that_run_trains_on(tmp_path, prefect_harness):
    """A stage with its own seq_len: `tessera prepare` leaves exactly the directories `run` reads."""
    sources = [{"name": "s", "paths": [str(SHAKESPEARE)], "separator": "\n\n"}]
    stages = [
        {"name": "short", "tokens": 8 * 64 * 4, "mixture": {"s": 1.0}},
        {"name": "long", "tokens": 8 * 256 * 2, "mixture": {"s": 1.0}, "seq_len": 256},
    ]
    recipe = write_recipe(tmp_path / "r.yaml", sources, tmp_path / "data", tmp_path / "wd", stages=stages, seq_len=64)
    done = tessera("prepare", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    made = sorted(os.listdir(tmp_path / "data"))
    assert len([d for d in made if d.startswith("s-")]) == 2, made  # one per seq_len: 64 and 256

    # What `tessera run` calls (flows/pipeline.py), in this process: everything is already there.
    from flows.prepare import prepare_recipe_data
    from tasks.recipe import load_recipe

    r = load_recipe(recipe)
    data = prepare_recipe_data(r.data, r.train.stages)
    assert all(s.cached for s in data.prepared.sources.values())
    assert set(data.seq_len_streams) == {256}
    for path in [data.prepared.sources["s"].path, data.seq_len_streams[256]["s"]]:
        assert os.path.isfile(os.path.join(os.path.dirname(path), "_DONE"))
        assert os.path.basename(os.path.dirname(path)) in made
    assert f"at seq_len 256:\n  s: {data.seq_len_streams[256]['s']}" in done.stdout
    assert sorted(os.listdir(tmp_path / "data")) == made  # and nothing new was written
