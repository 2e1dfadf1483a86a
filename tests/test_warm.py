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
