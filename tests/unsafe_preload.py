"""A module that breaks a warm process's rules when imported (infra/warm.py), for tests/test_warm.py.

TESSERA_TEST_UNSAFE=openmp  raises torch's threads and runs a computation on them (starts an OpenMP pool)
TESSERA_TEST_UNSAFE=cuda    initialises CUDA (on a machine without a GPU the attempt fails, and is still caught)
"""

import os

import torch

what = os.environ.get("TESSERA_TEST_UNSAFE", "")
if what == "openmp":
    torch.set_num_threads(2)
    torch.ones(1 << 20).sum()
elif what == "cuda":
    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError):  # no driver, no GPU: the attempt is what counts
        pass
