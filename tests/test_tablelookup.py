"""Table lookups over grouped codes (kvquant._kernels.tablelookup), against the numpy gathers of
kvquant.reference, for every code width a row can hold and with codes that straddle bytes."""
import numpy as np
import pytest

from kvquant import reference
from kvquant._kernels import tablelookup


def _rows(rng, n_rows, n_groups, bits):
    codes = rng.integers(0, 2 ** bits, size=(n_rows, n_groups)).astype(np.uint8)
    return codes, reference.pack_bits(codes, bits)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n_groups", [1, 5, 32])
def test_scores_match_the_gather(bits, n_groups):
    rng = np.random.default_rng(bits * 100 + n_groups)
    _, packed = _rows(rng, 37, n_groups, bits)
    table = rng.standard_normal((3, n_groups, 2 ** bits)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 37).astype(np.float32)
    out = np.empty((3, 37), np.float32)
    tablelookup.table_scores(packed, bits, table, scale, out, 2)
    want = reference.table_scores(packed, bits, table, scale)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("bits", [1, 3, 4, 5, 6, 8])
def test_weights_land_in_their_cells(bits):
    rng = np.random.default_rng(bits)
    n_groups = 9
    codes, packed = _rows(rng, 53, n_groups, bits)
    weights = rng.standard_normal((2, 53))
    cells = np.zeros((2, n_groups, 2 ** bits))
    tablelookup.table_weights(packed, bits, weights, cells, 2)
    want = reference.table_weights(packed, bits, weights, n_groups, 2 ** bits)
    np.testing.assert_allclose(cells, want, rtol=1e-12, atol=1e-12)
    # every row's weight is counted once per group
    np.testing.assert_allclose(cells.sum(axis=2), np.repeat(weights.sum(axis=1)[:, None],
                                                            n_groups, axis=1), rtol=1e-12)


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(7)
    _, packed = _rows(rng, 301, 32, 5)
    table = rng.standard_normal((2, 32, 32)).astype(np.float32)
    scale = np.ones(301, np.float32)
    weights = rng.standard_normal((2, 301))
    runs = []
    for threads in (1, 2, 3):
        out = np.empty((2, 301), np.float32)
        cells = np.zeros((2, 32, 32))
        tablelookup.table_scores(packed, 5, table, scale, out, threads)
        tablelookup.table_weights(packed, 5, weights, cells, threads)
        runs.append((out, cells))
    for out, cells in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(cells, runs[0][1])


def test_no_rows_is_a_no_op():
    out = np.empty((1, 0), np.float32)
    tablelookup.table_scores(np.zeros((0, 4), np.uint8), 4, np.zeros((1, 8, 16), np.float32),
                             np.zeros(0, np.float32), out, 1)
    cells = np.zeros((1, 8, 16))
    tablelookup.table_weights(np.zeros((0, 4), np.uint8), 4, np.zeros((1, 0)), cells, 1)
    assert not cells.any()


def test_the_public_wrappers_name_bad_input():
    from kvquant.codecs import tables
    codes = np.zeros((4, 3), np.uint8)                      # 4 groups of 6 bits = 3 bytes
    table = np.zeros((1, 4, 64), np.float32)
    assert tables.table_scores(codes, 6, table, np.ones(4)).shape == (1, 4)
    assert tables.table_weights(codes, 6, np.ones((2, 4)), 4).shape == (2, 4, 64)
    with pytest.raises(ValueError, match="bits must be an integer from 1 to 8"):
        tables.table_scores(codes, 9, table, np.ones(4))
    with pytest.raises(ValueError, match=r"codes must be uint8 of shape \(n_rows, 3\)"):
        tables.table_scores(codes[:, :2], 6, table, np.ones(4))
    with pytest.raises(ValueError, match="table must have shape"):
        tables.table_scores(codes, 6, table[:, :, :32], np.ones(4))
    with pytest.raises(ValueError, match=r"row_scale must have shape \(4,\)"):
        tables.table_scores(codes, 6, table, np.ones(5))
    with pytest.raises(ValueError, match=r"weights must have shape \(n_queries, 4\)"):
        tables.table_weights(codes, 6, np.ones((2, 5)), 4)
