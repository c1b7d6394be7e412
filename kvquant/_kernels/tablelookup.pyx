# Consumers of codes that index a table per group of coordinates (vector and product
# codebooks): each row holds one code of `bits` bits per group, packed LSB first as pack_bits
# writes them. Scores add up a per-query table of <query part, centroid> values; the context
# adds each row's weight to its centroid's cell, per group, and leaves the (groups x centroids)
# sums to the caller, which multiplies them by the codebook once. No row is decoded.
#
# Thread invariance: scores are one row per iteration, summed in a fixed lane order; the context
# gives each thread whole groups, each summed in row order. The bits do not depend on the
# thread count.
from cython.parallel cimport parallel, prange
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

import numpy as np


cdef inline void unpack_blocks(const uint8_t* row, Py_ssize_t n_blocks, int bits,
                               uint8_t* codes) noexcept nogil:
    """Eight codes fill exactly `bits` whole bytes: each block read as one word, cut at fixed
    shifts (inlined with a constant `bits` below, so the compiler unrolls both loops)."""
    cdef uint64_t mask = (1u << bits) - 1u
    cdef uint64_t word
    cdef Py_ssize_t block
    cdef int k
    for block in range(n_blocks):
        word = 0
        for k in range(bits):
            word |= (<uint64_t>row[block * bits + k]) << (8 * k)
        for k in range(8):
            codes[block * 8 + k] = <uint8_t>((word >> (k * bits)) & mask)


cdef inline void unpack_codes(const uint8_t* row, Py_ssize_t n_groups, int bits,
                              uint8_t* codes) noexcept nogil:
    """The row's codes (bits <= 8, LSB first as pack_bits writes them)."""
    cdef Py_ssize_t n_blocks = n_groups // 8
    cdef Py_ssize_t g, first
    cdef uint32_t value
    cdef int shift
    if bits == 2:
        unpack_blocks(row, n_blocks, 2, codes)
    elif bits == 3:
        unpack_blocks(row, n_blocks, 3, codes)
    elif bits == 4:
        unpack_blocks(row, n_blocks, 4, codes)
    elif bits == 5:
        unpack_blocks(row, n_blocks, 5, codes)
    elif bits == 6:
        unpack_blocks(row, n_blocks, 6, codes)
    else:
        unpack_blocks(row, n_blocks, bits, codes)
    for g in range(n_blocks * 8, n_groups):
        first = g * bits
        shift = first & 7
        value = row[first >> 3]
        if shift + bits > 8:
            value |= (<uint32_t>row[(first >> 3) + 1]) << 8
        codes[g] = <uint8_t>((value >> shift) & ((1u << bits) - 1u))


cdef inline float table_sum(const float* table, const uint8_t* codes, Py_ssize_t n_groups,
                            Py_ssize_t n_centroids) noexcept nogil:
    """sum_g table[g, codes[g]] in four float lanes (g mod 4), added in a fixed order: the
    lanes break the chain of dependent adds."""
    cdef float lane0 = 0, lane1 = 0, lane2 = 0, lane3 = 0
    cdef Py_ssize_t g = 0
    while g + 4 <= n_groups:
        lane0 += table[g * n_centroids + codes[g]]
        lane1 += table[(g + 1) * n_centroids + codes[g + 1]]
        lane2 += table[(g + 2) * n_centroids + codes[g + 2]]
        lane3 += table[(g + 3) * n_centroids + codes[g + 3]]
        g += 4
    while g < n_groups:
        lane0 += table[g * n_centroids + codes[g]]
        g += 1
    return (lane0 + lane1) + (lane2 + lane3)


def table_scores(const uint8_t[:, ::1] packed,  # IN  (n_rows, ceil(n_groups*bits/8))
                 int bits,
                 const float[:, :, ::1] table,   # IN  (n_queries, n_groups, n_centroids)
                 const float[::1] row_scale,     # IN  (n_rows,) each row's factor
                 float[:, ::1] out,              # OUT (n_queries, n_rows)
                 int n_threads):
    """out[i, t] = row_scale[t] * sum_g table[i, g, code(t, g)]."""
    cdef Py_ssize_t t, i
    cdef Py_ssize_t n_rows = packed.shape[0], n_queries = table.shape[0]
    cdef Py_ssize_t n_groups = table.shape[1], n_centroids = table.shape[2]
    cdef uint8_t* codes
    if n_rows == 0 or n_queries == 0:
        return
    with nogil, parallel(num_threads=n_threads):
        codes = <uint8_t*>malloc(n_groups)      # this thread's unpacked row
        for t in prange(n_rows, schedule="static"):
            unpack_codes(&packed[t, 0], n_groups, bits, codes)
            for i in range(n_queries):
                out[i, t] = table_sum(&table[i, 0, 0], codes, n_groups, n_centroids) * row_scale[t]
        free(codes)


def table_weights(const uint8_t[:, ::1] packed,  # IN  (n_rows, ceil(n_groups*bits/8))
                  int bits,
                  const double[:, ::1] weights,   # IN  (n_queries, n_rows) row weights
                  double[:, :, ::1] cells,        # OUT (n_queries, n_groups, n_centroids), zeroed
                  int n_threads):
    """cells[i, g, k] = sum of weights[i, t] over the rows t whose code of group g is k."""
    cdef Py_ssize_t t, i, g
    cdef Py_ssize_t n_rows = packed.shape[0], n_queries = weights.shape[0]
    cdef Py_ssize_t n_groups = cells.shape[1], n_centroids = cells.shape[2]
    cdef Py_ssize_t query_stride = n_groups * n_centroids
    cdef uint8_t[:, ::1] codes = np.empty((n_rows, n_groups), np.uint8)
    cdef double* cell
    if n_rows == 0 or n_queries == 0:
        return
    for t in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        unpack_codes(&packed[t, 0], n_groups, bits, &codes[t, 0])
    # whole groups per thread, each summed in row order
    for g in prange(n_groups, nogil=True, schedule="static", num_threads=n_threads):
        for t in range(n_rows):
            cell = &cells[0, g, 0] + codes[t, g]
            for i in range(n_queries):
                cell[i * query_stride] += weights[i, t]
