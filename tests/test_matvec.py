"""The decode projections' matrix-vector kernel (kvquant/_kernels/matvec.h) against its numpy
reference bit for bit, for any thread count, and against float64; and the GGUF decoder's
"pool" setting, which sends a decode step's products through it."""
import numpy as np
import pytest

from kvquant._kernels import matvec as kernel
from kvquant.reference import matvec_lanes

SHAPES = [(1, 1), (7, 33), (65, 16), (130, 576), (1536, 576), (576, 1536), (300, 17)]


@pytest.mark.parametrize("m, n", SHAPES)
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_matvec_is_the_reference_bit_for_bit(rng, m, n, n_threads):
    W = rng.standard_normal((m, n), dtype=np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    y = np.empty(m, np.float32)
    kernel.matvec(W, x, y, n_threads)
    np.testing.assert_array_equal(y, matvec_lanes(W, x))
    exact = W.astype(np.float64) @ x.astype(np.float64)
    bound = 1e-6 * n * (np.abs(W).astype(np.float64) @ np.abs(x).astype(np.float64))
    assert np.all(np.abs(y - exact) <= bound + 1e-30)


def test_bad_arguments_are_named(rng):
    W = rng.standard_normal((5, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="x needs 8 entries and y 5"):
        kernel.matvec(W, np.zeros(7, np.float32), np.zeros(5, np.float32), 1)
    with pytest.raises(ValueError, match="x needs 8 entries and y 5"):
        kernel.matvec(W, np.zeros(8, np.float32), np.zeros(4, np.float32), 1)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="n_threads must be at least 1"):
            kernel.matvec(W, np.zeros(8, np.float32), np.zeros(5, np.float32), bad)


def test_empty_and_special_inputs(rng):
    y = np.full(3, 7.0, np.float32)
    kernel.matvec(np.zeros((3, 0), np.float32), np.zeros(0, np.float32), y, 2)
    assert np.array_equal(y, np.zeros(3, np.float32))
    kernel.matvec(np.zeros((0, 5), np.float32), np.zeros(5, np.float32),
                  np.zeros(0, np.float32), 2)
    W = rng.standard_normal((4, 40), dtype=np.float32)
    x = rng.standard_normal(40, dtype=np.float32)
    x[3] = np.inf
    y = np.empty(4, np.float32)
    kernel.matvec(W, x, y, 1)
    np.testing.assert_array_equal(y, matvec_lanes(W, x))   # inf and NaN as the reference's
