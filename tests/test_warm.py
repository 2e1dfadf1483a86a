"""A launch's warm process (infra/warm.py): it imports the trainer once, never initialises CUDA and starts no
OpenMP pool before it forks; one that breaks a rule makes the ranks start as fresh interpreters, and says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infra import backend_for
from infra.config import ComputeConfig
from tests.conftest import ROOT
from trainers.contract import WARM_MODULES

PRELOAD = """
import os, sys
import infra.warm
for name in sys.argv[1:]:
    __import__(name)
import infra.warm_seal
import torch
threads = len(os.listdir("/proc/self/task"))
print(str(infra.warm._SEALED[0]), torch.cuda.is_initialized(), torch.get_num_threads(),
      os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"], threads)
"""


def _preload(*modules: str, unsafe: str = "") -> list[str]:
    """Import infra.warm then `modules` in a fresh interpreter, in the forkserver's order; what it then says."""
    env = {**os.environ, "TESSERA_TEST_UNSAFE": unsafe, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD, *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_the_trainers_preload_touches_no_cuda_and_starts_no_openmp_pool():
    verdict, cuda, threads, nvml, _ = _preload(*WARM_MODULES)
    assert (verdict, cuda, threads, nvml) == ("None", "False", "1", "1")


@pytest.mark.parametrize(
    ("unsafe", "said"),
    [
        ("openmp", "the warm process raised torch's threads to 2 before forking (OpenMP)"),
        ("cuda", "the warm process initialised CUDA ("),
    ],
)
def test_a_preload_that_breaks_a_rule_is_caught(unsafe, said):
    verdict = " ".join(_preload("tests.unsafe_preload", unsafe=unsafe)[:-4])
    assert verdict.startswith(said), verdict


def test_a_launch_whose_warm_process_broke_a_rule_starts_fresh_interpreters_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TESSERA_TEST_UNSAFE", "openmp")
    backend = backend_for(ComputeConfig(procs_per_node=2))
    job = backend.launch("tests.launch_probe", ["exit", "0"], log_dir=tmp_path, warm=("tests.unsafe_preload",))
    assert job.wait(timeout=120) == 0
    log = job.log_path.read_text()
    assert (
        "tessera.launcher: the warm process raised torch's threads to 2 before forking (OpenMP); ranks start as "
        "fresh interpreters" in log
    ), log
    assert "rank=0 world=2" in log and "ranks forked from a warm process" not in log


def _frozen(line_start: str, text: str) -> tuple[str, int]:
    line = next(x for x in text.splitlines() if x.startswith(line_start))
    enabled, frozen = line.split()[1:]
    return enabled, int(frozen.removeprefix("frozen="))


@pytest.mark.parametrize("warm", [True, False], ids=["forked-warm", "fresh-interpreters"])
def test_every_rank_collects_and_a_warm_ones_inherit_the_servers_imports_frozen(tmp_path, monkeypatch, warm):
    """The warm process imports with the collector off (infra/warm_open.py) and freezes what it imported before it
    forks (infra/warm_seal.py): every rank runs with the collector on, and a rank forked warm holds the server's
    imports (torch's, at least 100,000 objects) frozen, which a fresh interpreter does not."""
    monkeypatch.chdir(ROOT)
    backend = backend_for(ComputeConfig(procs_per_node=2))
    job = backend.launch(
        "tests.launch_probe", ["gc", "0"], log_dir=tmp_path, warm=("tests.launch_probe",) if warm else ()
    )
    assert job.wait(timeout=120) == 0
    said = [
        _frozen("rank=0 gc=", job.log_path.read_text()),
        _frozen("rank=1 gc=", (tmp_path / "rank1.stdout.log").read_text()),
    ]
    assert [enabled for enabled, _ in said] == ["gc=True", "gc=True"]
    if warm:
        assert all(frozen > 100_000 for _, frozen in said), said
    else:
        assert all(frozen == 0 for _, frozen in said), said


def test_a_trainer_in_a_fresh_interpreter_imports_with_the_collector_off_then_collects():
    """trainers/train.py's heavy imports: the collector off while they run (so a collection during them would be
    seen as none), then what they built frozen and the collector on again for training."""
    probe = (
        "import gc, trainers.train as t\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: seen.append(phase))\n"
        "t._import_trainer()\n"
        "print(len(seen), gc.isenabled(), gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    collections, enabled, frozen = out.stdout.split()
    assert (collections, enabled) == ("0", "True") and int(frozen) > 100_000, out.stdout
