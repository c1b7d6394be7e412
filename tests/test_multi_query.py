"""Multi-query reads (GQA): the m query heads sharing a KV head go to one consumer call, which
reads each row once. Each query's scores and context must be the bits of a one-query call, for
every m, thread count and SIMD path (the reduction order of kvquant/_kernels/simd.h), and agree
with kvquant.reference's numpy consumers.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from kvquant import get_codec, reference
from kvquant._kernels import consumers

from conftest import gaussian_rows
from _simd import PATHS, as_bits
from _simd import simd_path  # noqa: F401 (fixture)

# every family with multi-query kernels, the layouts that fall back to one query at a time
# (kv8-g4, a width with a tail), and the bit widths with their own unpacking
SPECS = [("f32", 64), ("f32", 40), ("kv8", 128), ("kv8", 48), ("kv8-g16", 64), ("kv8-g32", 128),
         ("kv8-g4", 64), ("tq1", 64), ("tq2", 128), ("tq3", 64), ("tq4", 128), ("tq4", 64),
         ("tq5", 64), ("tq6", 128), ("tq7", 64), ("tq8", 64), ("tq4:side_dtype=f16", 64),
         ("q8_0", 64), ("q4_0", 128), ("q4_0+rot", 64), ("q8_0+rot", 64)]
M_MAX = 9   # past the 8 queries of one pass


def _encoded(spec, dim, T, rng):
    codec = get_codec(spec, dim, nonfinite="inert")
    X = gaussian_rows(rng, T, dim)
    X[3] = 0.0                        # an inert row
    X[7, : dim // 2] *= 1e-6          # fp8 subnormal codes
    enc = codec.encode(X)
    if spec.startswith("kv8"):
        enc.codes[11, :3] = [0x7F, 0xFF, 0x80]   # NaN codes (read as 0) and -0
    return codec, enc


@pytest.mark.parametrize("spec,dim", SPECS)
def test_each_query_of_a_batch_has_the_bits_of_a_one_query_call(spec, dim, rng, simd_path):
    # 1100 rows: two context chunks, and enough work for two threads
    codec, enc = _encoded(spec, dim, 1100, rng)
    Q = gaussian_rows(rng, M_MAX, dim)
    W = rng.random((M_MAX, enc.n_rows)).astype(np.float32)
    simd_path("portable")
    one_s = [codec.scores(enc, Q[j], n_threads=1) for j in range(M_MAX)]
    one_c = [codec.context(enc, W[j], n_threads=1) for j in range(M_MAX)]
    for path in PATHS:
        simd_path(path)
        for m in (1, 2, 3, 5, 8, 9):
            n_threads = 1 + m % 2
            s = codec.scores(enc, Q[:m], n_threads=n_threads)
            c = codec.context(enc, W[:m], n_threads=3 - n_threads)
            for j in range(m):
                assert np.array_equal(as_bits(s[j]), as_bits(one_s[j])), (path, m, j)
                assert np.array_equal(as_bits(c[j]), as_bits(one_c[j])), (path, m, j)


@pytest.mark.parametrize("spec", ["kv8", "kv8-g32", "tq4", "tq2", "q4_0+rot", "q8_0"])
def test_eight_queries_agree_with_the_numpy_reference(spec, rng, simd_path):
    dim, T, m = 128, 300, 8
    codec, enc = get_codec(spec, dim), None
    enc = codec.encode(gaussian_rows(rng, T, dim))
    Q = gaussian_rows(rng, m, dim)
    W = rng.standard_normal((m, T)).astype(np.float32)
    if spec.startswith("kv8"):
        group = None if spec == "kv8" else codec.group
        ref_s = reference.kv8_scores(enc.codes, enc.side, Q, group)
        ref_c = reference.kv8_context(enc.codes, enc.side, W, group)
    elif spec.startswith("tq"):
        ref_s = reference.tq_scores(enc.codes, enc.side, codec.levels64, codec.bits, Q)
        ref_c = reference.tq_context(enc.codes, enc.side, codec.levels64, codec.bits, W, dim)
    else:
        bits, rotated = (8 if spec.startswith("q8") else 4), spec.endswith("+rot")
        ref_s = reference.ggml_scores(enc.codes, Q, bits, rotated)
        ref_c = reference.ggml_context(enc.codes, W, dim, bits, rotated)
    for path in PATHS:
        simd_path(path)
        s, c = codec.scores(enc, Q), codec.context(enc, W)
        assert np.max(np.abs(s - ref_s)) < 1e-5 * np.abs(ref_s).max(), path
        assert np.max(np.abs(c - ref_c)) < 1e-5 * (np.abs(ref_c).max() + 1), path


# side values a file could hold but encode never writes: each must read as the portable path
# reads it (a tq radius outside (0, 3.4e38] makes the row inert), wherever it sits in a block of
# sixteen rows (the vector kernels scale and weight rows sixteen at a time)
FORGED_SIDES = np.array([np.nan, -1.0, -0.0, np.inf, 3.4e38, 0.0, 1e-40, 7.0], np.float32)
FORGED_SIDES[5] = np.nextafter(FORGED_SIDES[4], np.float32(np.inf))   # just past the limit


@pytest.mark.parametrize("spec", ["tq4", "tq3", "kv8", "q4_0"])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 47, 130])
def test_block_edges_and_forged_sides_give_the_portable_bits(spec, T, rng, simd_path):
    dim = 64
    codec = get_codec(spec, dim)
    enc = codec.encode(gaussian_rows(rng, T, dim))
    if not spec.startswith("q"):
        rows = [t for t in (0, 5, 14, 15, 16, 17, 31, 46, 129) if t < T]
        for k, t in enumerate(rows):
            enc.side[t, 0] = FORGED_SIDES[k % len(FORGED_SIDES)]
    Q = gaussian_rows(rng, 3, dim)
    W = rng.random((3, T)).astype(np.float32)
    simd_path("portable")
    ref = [(codec.scores(enc, Q[:m]), codec.context(enc, W[:m])) for m in (1, 3)]
    if spec.startswith("tq"):   # inert rows read as zeros, live rows as the numpy reference
        want = reference.tq_scores(enc.codes, enc.side, codec.levels64, codec.bits, Q)
        fits = np.abs(want) < 1e30   # a radius near 3.4e38 overflows float32 scores (as it must)
        assert np.allclose(ref[1][0][fits], want[fits], rtol=1e-5, atol=1e-5)
    for path in PATHS[1:]:
        simd_path(path)
        for (s, c), m in zip(ref, (1, 3)):
            assert np.array_equal(as_bits(codec.scores(enc, Q[:m])), as_bits(s)), (path, m)
            assert np.array_equal(as_bits(codec.context(enc, W[:m])), as_bits(c)), (path, m)


@pytest.mark.parametrize("magnitude", [1e-3, 1e3])
def test_kv8_batches_beyond_the_raw_decode_range(magnitude, rng, simd_path):
    """Queries and weights above 2^7 (kv8's raw decode does not apply) and tiny ones."""
    codec, enc = _encoded("kv8-g32", 128, 300, rng)
    enc = codec.encode(codec.decode(enc) * np.float32(magnitude * 100))
    Q = gaussian_rows(rng, 3, 128) * np.float32(magnitude)
    W = rng.random((3, 300)).astype(np.float32) * np.float32(magnitude)
    simd_path("portable")
    ref = codec.scores(enc, Q), codec.context(enc, W)
    for path in PATHS[1:]:
        simd_path(path)
        assert np.array_equal(as_bits(codec.scores(enc, Q)), as_bits(ref[0])), path
        assert np.array_equal(as_bits(codec.context(enc, W)), as_bits(ref[1])), path


def test_cache_attend_gives_each_query_head_the_bits_of_a_one_head_read(rng):
    """KVCache.attend hands the query heads of a KV head to one call (GQA, 3 per KV head)."""
    from kvquant.cache import QuantizedKVCache, softmax
    cache = QuantizedKVCache(1, {"k": ("tq4", 64), "v": ("kv8", 64)}, n_kv_heads=2)
    cache.append(0, k=gaussian_rows(rng, 1000, 128).reshape(1000, 2, 64),
                 v=gaussian_rows(rng, 1000, 128).reshape(1000, 2, 64))
    q = gaussian_rows(rng, 6, 64)
    out = cache.attend(0, q)
    for i in range(6):
        h = i // 3
        s = cache.scores(0, "k", q[i:i + 1], head=h) * np.float32(1 / np.sqrt(64))
        ctx = cache.context(0, "v", softmax(s), head=h)[0]
        assert np.array_equal(as_bits(out[i]), as_bits(ctx)), i


@pytest.mark.skipif("avx2" not in PATHS, reason="this CPU has no AVX2")
def test_the_avx2_path_is_chosen_by_the_environment():
    code = ("import numpy as np; from kvquant import get_codec; "
            "from kvquant._kernels import consumers as c; print(c.get_simd()); "
            "k = get_codec('tq4', 64); e = k.encode(np.ones((40, 64), np.float32)); "
            "print(k.scores(e, np.ones(64)).view(np.uint32)[:3].tolist())")
    outs = {}
    for mode in ("avx2", "portable"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, KVQUANT_SIMD=mode))
        assert res.returncode == 0, res.stderr
        outs[mode] = res.stdout.split("\n")
        assert outs[mode][0] == mode
    assert outs["avx2"][1] == outs["portable"][1]


def test_simd_names_include_avx2():
    assert "avx2" in consumers.SIMD_NAMES.values()
    assert consumers.get_simd() == consumers.cpu_simd()


NARROW = [("kv8", d) for d in (16, 32, 48, 64, 80)] + [
    (spec, d) for spec in ("tq1", "tq2", "tq3", "tq4", "tq5", "tq4:side_dtype=f16")
    for d in (16, 32, 64, 128)]


@pytest.mark.parametrize("spec,dim", NARROW)
def test_narrow_rows_for_one_query_give_the_portable_bits(spec, dim, rng, simd_path):
    """Rows of at most 64 elements take the narrow kernels where the path has them (kv8's one
    query in registers, tq's queries four at a time, whose lane sums begin at their first product,
    as every AVX-512 tq score sum does; tq's context of up to four): every row count around their
    blocks of 16, inert rows, fp8 subnormal and NaN codes, forged radii, factors inside and beyond
    kv8's raw decode, zero queries of either sign (products of -0, whose sums begun at 0 are +0),
    1 to 5 and 8 queries (passes of 4 and 1, 4 and 4), one and two threads; 80 (kv8) and 128 (tq)
    are the first widths past them."""
    for T in (1, 2, 15, 16, 17, 33, 300):
        codec, enc = _encoded(spec, dim, max(T, 12), rng)
        enc = codec.encoded_rows(enc.codes[:T].copy(), enc.side[:T].copy())
        if spec.startswith("tq") and "f16" not in spec:   # (f16 sides refuse forged values)
            for k, t in enumerate(t for t in (0, 5, 14, 15, 16, 17, 31) if t < T):
                enc.side[t, 0] = FORGED_SIDES[k % len(FORGED_SIDES)]
        for magnitude, m in ((1.0, 1), (1e3, 1), (1e-3, 1), (0.0, 1), (-0.0, 1), (1.0, 2),
                             (1.0, 3), (-0.0, 3), (1e3, 4), (1.0, 5), (1.0, 8)):
            q = gaussian_rows(rng, m, dim) * np.float32(magnitude)
            w = rng.random((m, T)).astype(np.float32) * np.float32(magnitude)
            simd_path("portable")
            ref = codec.scores(enc, q), codec.context(enc, w)
            if spec.startswith("tq") and magnitude == 1.0:
                want = reference.tq_scores(enc.codes, enc.side, codec.levels64, codec.bits, q)
                fits = np.abs(want) < 1e30
                assert np.allclose(ref[0][fits], want[fits], rtol=1e-5, atol=1e-5)
            if magnitude == 0.0:
                # every product is a zero: sums begun at +0 are +0, and so are their products
                # with the rows' factors (kv8's scales and tq's steps are never negative here)
                assert not as_bits(ref[0]).any(), T
            for path in PATHS[1:]:
                simd_path(path)
                for nt in (1, 2):
                    got = codec.scores(enc, q, n_threads=nt), codec.context(enc, w, n_threads=nt)
                    for a, b in zip(ref, got):
                        assert np.array_equal(as_bits(a), as_bits(b)), (path, T, magnitude, nt)


@pytest.mark.parametrize("spec,dim", [("kv8", 32), ("kv8", 64), ("kv8", 128), ("tq2", 32),
                                      ("tq4", 64), ("tq4", 128)])
def test_non_finite_queries_and_weights_give_each_path_the_same_values(spec, dim, rng,
                                                                        simd_path):
    """A NaN or infinite query element or weight: every path puts NaN in the same places and the
    same bits everywhere else (a NaN's payload and sign are no path's promise: which operand's
    NaN an add passes on is the compiler's choice)."""
    codec, enc = _encoded(spec, dim, 40, rng)
    q = gaussian_rows(rng, 3, dim)
    q[0, 1], q[1, 2], q[2, 0] = np.nan, np.inf, -np.inf
    w = rng.random((3, enc.n_rows)).astype(np.float32)
    w[0, 5], w[1, 17], w[2, 33] = np.nan, np.inf, -np.inf

    def reads():
        return ([codec.scores(enc, q[j]) for j in range(3)] + [codec.scores(enc, q)]
                + [codec.context(enc, w[j]) for j in range(3)] + [codec.context(enc, w)])

    simd_path("portable")
    ref = reads()
    assert any(np.isnan(a).any() for a in ref)
    if spec == "kv8":   # (tq's rotation turns an infinite query into NaN)
        assert any(np.isinf(a).any() for a in ref)
    for path in PATHS[1:]:
        simd_path(path)
        for k, (a, b) in enumerate(zip(ref, reads())):
            assert np.array_equal(np.isnan(a), np.isnan(b)), (path, k)
            live = ~np.isnan(a)
            assert np.array_equal(as_bits(a[live]), as_bits(b[live])), (path, k)
