"""Compressed-domain consumers for codecs whose codes index a table per group of coordinates
(vector and product codebooks): a building block for a plug-in codec's ``_scores`` and
``_context`` (docs/plugins.md).

Each row holds one code of ``bits`` bits (1..8) per group, packed least significant bit first
(element i at bits [i*bits, (i+1)*bits), as ``kvquant.reference.pack_bits`` writes them). Scores
read a per-query table of <query part, centroid> dot products; the context sums each row's
weight into its centroid's cell per group, so the caller multiplies by the codebook once. No row
is decoded. Results do not depend on the thread count.
"""
import numpy as np

from kvquant._kernels import tablelookup
from kvquant._threads import resolve_n_threads


def _check_bits(bits):
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8 (one code per group), got {bits!r}")


def _check_codes(codes, n_groups, bits):
    _check_bits(bits)
    codes = np.asarray(codes)
    row_bytes = (n_groups * int(bits) + 7) // 8
    if codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] != row_bytes:
        raise ValueError(f"codes must be uint8 of shape (n_rows, {row_bytes}) for {n_groups} "
                         f"groups of {bits} bits, got {codes.dtype} {codes.shape}")
    return np.ascontiguousarray(codes)


def table_scores(codes, bits, table, row_scale, n_threads=None):
    """Scores of packed rows against per-query lookup tables.

    Parameters
    ----------
    codes : ndarray of shape (n_rows, ceil(n_groups * bits / 8)), dtype uint8
    bits : int, 1..8
    table : ndarray of shape (n_queries, n_groups, 2**bits)
        ``table[i, g, k]``: query i's dot product with centroid k of group g.
    row_scale : ndarray of shape (n_rows,)
        Each row's factor (its scale or radius).
    n_threads : int or None

    Returns
    -------
    scores : ndarray of shape (n_queries, n_rows), dtype float32
        ``row_scale[t] * sum_g table[i, g, code(t, g)]``.
    """
    _check_bits(bits)
    table = np.ascontiguousarray(table, dtype=np.float32)
    if table.ndim != 3 or table.shape[2] != 2 ** int(bits):
        raise ValueError(f"table must have shape (n_queries, n_groups, {2 ** int(bits)}) for "
                         f"{bits}-bit codes, got {table.shape}")
    codes = _check_codes(codes, table.shape[1], bits)
    row_scale = np.ascontiguousarray(row_scale, dtype=np.float32)
    if row_scale.shape != (codes.shape[0],):
        raise ValueError(f"row_scale must have shape ({codes.shape[0]},), got {row_scale.shape}")
    out = np.empty((table.shape[0], codes.shape[0]), np.float32)
    work = codes.shape[0] * table.shape[0] * table.shape[1]
    tablelookup.table_scores(codes, int(bits), table, row_scale, out,
                             resolve_n_threads(n_threads, work))
    return out


def table_weights(codes, bits, weights, n_groups, n_threads=None):
    """Each centroid's total weight per group: the context before the codebook.

    Parameters
    ----------
    codes : ndarray of shape (n_rows, ceil(n_groups * bits / 8)), dtype uint8
    bits : int, 1..8
    weights : ndarray of shape (n_queries, n_rows)
        Row weights (attention weights times each row's scale).
    n_groups : int
    n_threads : int or None

    Returns
    -------
    cells : ndarray of shape (n_queries, n_groups, 2**bits), dtype float64
        ``cells[i, g, k]`` = the sum of ``weights[i, t]`` over rows t whose code of group g is k;
        ``cells @ centroids`` (centroids of shape (2**bits, group width)) is the context.
    """
    codes = _check_codes(codes, int(n_groups), bits)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if weights.ndim != 2 or weights.shape[1] != codes.shape[0]:
        raise ValueError(f"weights must have shape (n_queries, {codes.shape[0]}), "
                         f"got {weights.shape}")
    cells = np.zeros((weights.shape[0], int(n_groups), 2 ** int(bits)))
    work = codes.shape[0] * weights.shape[0] * int(n_groups)
    tablelookup.table_weights(codes, int(bits), weights, cells, resolve_n_threads(n_threads, work))
    return cells
