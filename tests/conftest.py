import os

import numpy as np
import pytest

# Plots never need a display; the thread budget matches the 2-core CI machine.
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def rng():
    """A fresh seeded generator per test: reproducible, independent of test order."""
    return np.random.default_rng(20261130)


def gaussian_rows(rng, n, d, dtype=np.float32):
    return rng.standard_normal((n, d)).astype(dtype)
