import os

# Plots never need a display. Threads: the README's command runs the test files on one
# pytest-xdist worker per core, so each worker's OpenMP and BLAS get one thread: two teams of
# two on two cores spin at every barrier for a core the other worker holds (a decode step's
# many small parallel regions then ran 5-10x slower). Workers inherit the controlling
# process's environment, so their count is set, not defaulted; a run without workers takes
# both cores. Tests of threading ask for their thread counts explicitly. Set before numpy or
# the kernels load: both read it once.
os.environ.setdefault("MPLBACKEND", "Agg")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _THREADS = "1"
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = _THREADS
else:
    _THREADS = os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

# a plugin may have loaded numpy (and OpenBLAS read its thread count) before this file ran
threadpool_limits(int(_THREADS), user_api="blas")


@pytest.fixture
def rng():
    """A fresh seeded generator per test: reproducible, independent of test order."""
    return np.random.default_rng(20261130)


def gaussian_rows(rng, n, d, dtype=np.float32):
    return rng.standard_normal((n, d)).astype(dtype)
