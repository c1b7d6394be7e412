"""Randomized Hadamard rotation (REFERENCE.md §1.2) against the numpy reference."""
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
