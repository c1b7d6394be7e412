"""Randomized Hadamard rotation (docs/reference.md §1.2) against the numpy reference."""
import math

import numpy as np
import pytest

from kvquant import reference
from kvquant._kernels import rotation as rotation_kernels
from kvquant.rotation import ENGINE_SEED, HadamardRotation, sign_vector

from conftest import gaussian_rows


def test_first_sixteen_engine_signs():
    expected = "- + - + + + - + + + - - + - + +".split()
    assert ["-" if s < 0 else "+" for s in sign_vector(16)] == expected


@pytest.mark.parametrize("seed", [ENGINE_SEED, 0, 12345, 2**32 - 1])
def test_signs_match_pure_python_reference(seed):
    assert np.array_equal(sign_vector(4096, seed), reference.sign_vector(4096, seed))


def test_narrow_rows_use_the_first_signs():
    assert np.array_equal(HadamardRotation(64).signs, HadamardRotation(512).signs[:64])


@pytest.mark.parametrize("n", [2**k for k in range(1, 13)])
def test_round_trip_and_reference(rng, n):
    rot = HadamardRotation(n)
    X = gaussian_rows(rng, 7, n)
    Y = rot.rotate(X)
    back = rot.unrotate(Y)
    assert np.linalg.norm(back - X) <= 1e-5 * np.linalg.norm(X)
    if n <= 1024:
        assert np.allclose(Y, reference.rotate(X), rtol=0, atol=1e-5 * np.abs(X).max())
    # orthogonal: norms are kept
    assert np.allclose(np.linalg.norm(Y, axis=1), np.linalg.norm(X, axis=1), rtol=1e-5)


def test_fwht_is_the_sylvester_matrix(rng):
    X = gaussian_rows(rng, 5, 32)
    out = X.copy()
    rotation_kernels.fwht_rows(out, 1)
    assert np.allclose(out, X @ reference.hadamard_matrix(32).T, atol=1e-4)


def fwht_float32_stage_by_stage(X):
    """The butterflies in float32, one stage at a time over the whole array (numpy's float32 adds
    and subtracts are IEEE, so these are the bits of any exact implementation of the order)."""
    Y = X.astype(np.float32).copy()
    n, h = Y.shape[1], 1
    with np.errstate(over="ignore", invalid="ignore"):
        while h < n:
            Z = Y.reshape(Y.shape[0], n // (2 * h), 2, h)
            a, b = Z[:, :, 0, :].copy(), Z[:, :, 1, :].copy()
            Z[:, :, 0, :], Z[:, :, 1, :] = a + b, a - b
            h *= 2
    return Y


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096])
def test_fwht_bits_match_stage_by_stage_float32(rng, n):
    """The kernel groups butterflies (16 lanes in registers, two stages per pass): every element
    must still see the same float operations on the same operands, at every width."""
    rows = 9 if n >= 1024 else 65
    X = gaussian_rows(rng, rows, n) * rng.uniform(1e-30, 1e30, (rows, 1)).astype(np.float32)
    X[0, ::3] = 0
    X[1] = np.float32(3e38)             # overflows to inf, then inf - inf: NaN, as stage by stage
    X[2, 0] = np.nan
    X[3, :] = np.float32(1e-45)         # subnormals
    out = X.copy()
    rotation_kernels.fwht_rows(out, 2)
    expect = fwht_float32_stage_by_stage(X)
    assert np.array_equal(out.view(np.uint32), expect.view(np.uint32))


def test_fwht_many_rows_equal_one_row_at_a_time(rng):
    X = gaussian_rows(rng, 1000, 256)
    batch = X.copy()
    rotation_kernels.fwht_rows(batch, 2)
    for i in (0, 1, 517, 999):
        one = X[i:i + 1].copy()
        rotation_kernels.fwht_rows(one, 1)
        assert np.array_equal(one[0], batch[i])


@pytest.mark.parametrize("bad", [0, 1, 3, 48, 100])
def test_non_power_of_two_width_is_refused(bad):
    with pytest.raises(ValueError, match=rf"{bad}.*kv8"):
        HadamardRotation(bad)


def test_thread_count_invariance(rng):
    rot = HadamardRotation(512)
    X = gaussian_rows(rng, 1001, 512)
    assert np.array_equal(rot.rotate(X, n_threads=1), rot.rotate(X, n_threads=2))
    assert np.array_equal(rot.unrotate(X, n_threads=1), rot.unrotate(X, n_threads=2))


def test_row_norms_in_double(rng):
    X = gaussian_rows(rng, 100, 300) * 1e19   # squares overflow float32 but not double
    out = np.empty(100)
    rotation_kernels.row_norms(X, out, 2)
    assert np.allclose(out, np.linalg.norm(X.astype(np.float64), axis=1), rtol=1e-12)


@pytest.mark.parametrize("n", [2, 64, 4096])
def test_huge_rows_rotate_without_overflow(n):
    """The float32 butterflies of x0 = x1 = 2e38 (or a constant row) overflow; the rotation then
    runs on a copy scaled by 2^-64: exactly 2^64 times the rotation of the scaled row, and the
    matrix reference in float64 to rounding."""
    rng = np.random.default_rng(n)
    rot = HadamardRotation(n)
    X = rng.standard_normal((3, n))
    X[0] = 0
    X[0, :2] = 2e38
    X[1] = 3e38 / math.sqrt(n)
    X[2] *= 1e37 / np.abs(X[2]).max()
    X = X.astype(np.float32)
    small = (X.astype(np.float64) * 2.0**-64).astype(np.float32)
    Y = rot.rotate(X)
    assert np.all(np.isfinite(Y))
    assert np.array_equal(Y, rot.rotate(small) * np.float32(2.0**64))
    assert np.allclose(Y, reference.rotate(X.astype(np.float64)), rtol=0, atol=1e-5 * 3e38)
    back = rot.unrotate(Y)
    assert np.array_equal(back, rot.unrotate(rot.rotate(small)) * np.float32(2.0**64))
    assert np.allclose(back, X, rtol=0, atol=1e-5 * 3e38)
