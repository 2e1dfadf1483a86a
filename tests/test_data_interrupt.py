"""Ctrl-C and SIGTERM stop a real `tessera prepare` within 5 s, publish nothing partial, keep what finished: the
sources and the partitions done."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.test_data_helpers import ROOT, SHAKESPEARE, write_recipe

STORIES = ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt"


def _corpus(tmp_path):
    text = SHAKESPEARE.read_text() + "\n\n" + STORIES.read_text()
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for _ in range(22):  # ~41 MB: tens of seconds of tokenizing on two cores
            f.write(text + "\n\n")
    early = tmp_path / "early.txt"
    early.write_text(text[:200_000])
    return early, big


def _start(recipe):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    # Its own process group, as a shell gives a foreground job: a terminal's Ctrl-C goes to the group.
    return subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "tessera"), "prepare", str(recipe)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(cond, proc, timeout_s=240):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _interrupt(proc, root, sig: int, group: bool) -> tuple[str, float]:
    """Once `big` is being written past a partition (and `early` is done), send `sig`; return stderr and seconds to
    be gone."""
    _wait_for(lambda: glob.glob(os.path.join(root, "early-*", "_DONE")), proc)
    done_before = len(_big_partitions(root))
    _wait_for(lambda: len(_big_partitions(root)) > done_before, proc)
    _wait_for(lambda: glob.glob(os.path.join(root, "big-*", ".tmp-*", "train")), proc)
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # tessera, Prefect's temporary server, the tokenizer pool
    t0 = time.monotonic()
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    try:
        _, stderr = proc.communicate(timeout=30)
        gone, alive = psutil.wait_procs(family, timeout=max(0.0, 5 - (time.monotonic() - t0)))
    finally:  # a hung run must not outlive the test
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
    elapsed = time.monotonic() - t0
    assert not alive, [p.pid for p in alive]
    print(f"{signal.Signals(sig).name}: exit code {proc.returncode}, all processes gone in {elapsed:.2f} s")
    return stderr, elapsed


def _big_partitions(root) -> dict[str, int]:
    """big's finished partitions: the inode of each one's train folder (a partition written again gets a new one)."""
    return {
        os.path.basename(os.path.dirname(m)): os.stat(m.replace("/parts/", "/train/").removesuffix("/_DONE")).st_ino
        for m in glob.glob(os.path.join(root, "big-*", "parts", "*", "_DONE"))
    }


def _state(root):
    (early,) = glob.glob(os.path.join(root, "early-*"))
    with open(os.path.join(early, "provenance.json")) as f:
        return early, f.read(), os.stat(os.path.join(early, "_DONE")).st_mtime_ns


@pytest.mark.slow  # three real `tessera prepare` runs over ~41 MB
def test_ctrl_c_and_sigterm_stop_prepare_and_a_rerun_finishes(tmp_path):
    early, big = _corpus(tmp_path)
    root = tmp_path / "data"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        [
            {"name": "early", "paths": [str(early)], "separator": "\n\n"},
            {"name": "big", "paths": [str(big)], "separator": "\n\n"},
        ],
        root,
        tmp_path / "wd",
        workers=2,
        partition_bytes=4 << 20,  # big: 11 partitions
    )
    kept: dict[str, int] = {}

    for sig, group, code in ((signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)):
        proc = _start(recipe)
        stderr, elapsed = _interrupt(proc, str(root), sig, group)
        assert proc.returncode == code, stderr[-3000:]
        assert elapsed < 5, (sig.name, elapsed, stderr[-3000:])
        said = [line for line in stderr.splitlines() if line.startswith("tessera: interrupted")]
        assert said == [
            f"tessera: interrupted by {sig.name}: nothing partial was published; finished sources "
            "and partitions are kept and a rerun reuses them"
        ], stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        # Nothing partial of the interrupted source: no done-marker, no staging, no lease; its finished partitions
        # (this run's and the last one's, untouched) and the finished source intact.
        assert glob.glob(os.path.join(root, "big-*", "_DONE")) == glob.glob(os.path.join(root, ".big-*")) == []
        assert glob.glob(os.path.join(root, "big-*", ".tmp-*")) == []
        now = _big_partitions(root)
        assert len(now) > len(kept) and {k: now[k] for k in kept} == kept
        kept = now
        if sig == signal.SIGINT:
            finished = _state(root)
        assert _state(root) == finished

    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "tessera"), "prepare", str(recipe)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith(("early ", "big "))}
    assert rows["early"][5] == "cached" and rows["big"][5] == "written", done.stdout
    assert _state(root) == finished  # reused, not rewritten
    assert f"source big: {len(kept)} of 11 partitions already prepared" in done.stderr, done.stderr[-3000:]
    assert {k: v for k, v in _big_partitions(root).items() if k in kept} == kept
    docs = [d for d in big.read_text().split("\n\n") if d.strip()]
    assert int(rows["big"][1].replace(",", "")) == len(docs)
    assert glob.glob(os.path.join(root, "big-*", "_DONE")) and glob.glob(os.path.join(root, ".*")) == []
