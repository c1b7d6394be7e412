"""The polar consumers (kvquant/_kernels/consumers_polar.h): scores and contexts from rows rebuilt
in the rotated basis, held to decode-then-dot in numpy, to the independent numpy decoders of
kvquant.reference, to identical bits on every SIMD path and thread count, and to inert rows that
contribute nothing."""
import numpy as np
import pytest

from kvquant import get_codec, reference

from conftest import gaussian_rows
from _simd import PATHS, as_bits as _bits, benchmark_shape_paths_agree, reads_on_every_path
from _simd import simd_path  # noqa: F401 (fixture)

VARIANTS = ("compat=colibri", "alloc=level", "alloc=radius")
BITS = (2, 3, 4, 5, 6)
DIMS = (2, 4, 8, 16, 64, 128, 512, 1024)


def _rows(rng, T, d):
    """Gaussian rows of mixed scales, one zero row (inert)."""
    X = gaussian_rows(rng, T, d) * rng.uniform(0.01, 100, (T, 1)).astype(np.float32)
    X[min(3, T - 1)] = 0
    return X


def _check_against(X_hat, Q, W, s, ctx):
    """The engine's identity checks (docs/reference.md §1.5) against float64 numpy."""
    X_hat = np.asarray(X_hat, np.float64)
    expected = Q.astype(np.float64) @ X_hat.T
    bound = np.linalg.norm(Q, axis=1)[:, None] * np.linalg.norm(X_hat, axis=1)[None, :] + 1e-6
    assert np.max(np.abs(s - expected) / bound) < 1e-5
    expected = W.astype(np.float64) @ X_hat
    err = np.linalg.norm(ctx - expected, axis=1) / (np.linalg.norm(expected, axis=1) + 1.0)
    assert np.max(err) < 1e-4


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_consumers_match_decode_then_dot(variant, bits, d, rng):
    codec = get_codec(f"polar{bits}:{variant}", d)
    T = 23
    enc = codec.encode(_rows(rng, T, d))
    Q = gaussian_rows(rng, 3, d)
    W = rng.standard_normal((3, T)).astype(np.float32)
    s, ctx = codec.scores(enc, Q), codec.context(enc, W)
    assert s.dtype == np.float32 and s.shape == (3, T) and ctx.shape == (3, d)
    _check_against(codec.decode(enc), Q, W, s, ctx)
    assert not s[:, 3].any()
    # one query / one weight vector: the same bits as that row of the batch
    assert np.array_equal(_bits(codec.scores(enc, Q[2])), _bits(s[2]))
    assert np.array_equal(_bits(codec.context(enc, W[1])), _bits(ctx[1]))


def _reference_decode(codec, enc, d):
    """Rows decoded by kvquant.reference (numpy, written apart from the kernels)."""
    if codec.compat:
        return reference.polar_engine_decode_rows(enc.codes, enc.side[:, 0], codec.bits, d)
    cb = codec.codebooks
    centroids = np.zeros(cb.centroids.shape)
    for level in range(1, cb.n_levels + 1):
        for b, c in enumerate(cb.centroids64[level]):
            centroids[level, b, :c.size] = c
    return reference.polar_lloyd_decode_rows(enc.codes, enc.side[:, 0], centroids, cb.log2_cos2,
                                             cb.log2_sin2, cb.gains, codec.level_total_bits,
                                             codec.alloc, d)


@pytest.mark.parametrize("d", [16, 64, 512])
@pytest.mark.parametrize("bits", [2, 4, 6])
@pytest.mark.parametrize("variant", VARIANTS)
def test_consumers_match_the_numpy_reference_decoder(variant, bits, d, rng):
    """The decoder and the consumers share their rebuild (polarops.h): check both against a
    decoder that does not."""
    codec = get_codec(f"polar{bits}:{variant}", d)
    T = 40
    enc = codec.encode(_rows(rng, T, d))
    Q = gaussian_rows(rng, 2, d)
    W = rng.standard_normal((2, T)).astype(np.float32)
    _check_against(_reference_decode(codec, enc, d), Q, W, codec.scores(enc, Q),
                   codec.context(enc, W))


@pytest.mark.skipif(len(PATHS) == 1, reason="this CPU has no AVX-512: only the portable path")
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_simd_path_gives_the_same_bits(variant, d, rng, simd_path):
    for bits in BITS:
        codec = get_codec(f"polar{bits}:{variant}", d, nonfinite="inert")
        X = _rows(rng, 45, d)
        X[7, 0] = np.nan                                  # inert
        enc = codec.encode(X)
        Q = gaussian_rows(rng, 2, d)
        W = rng.standard_normal((2, 45)).astype(np.float32)
        reads_on_every_path(simd_path, codec, enc, Q, W)


@pytest.mark.skipif(len(PATHS) == 1, reason="this CPU has no AVX-512: only the portable path")
@pytest.mark.parametrize("spec", ["polar4:compat=colibri", "polar3:alloc=level", "polar2",
                                  "polar6:alloc=level"])
def test_paths_agree_on_the_benchmark_shape(spec, rng, simd_path):
    codec = get_codec(spec, 512)
    enc = codec.encode(gaussian_rows(rng, 2100, 512))
    benchmark_shape_paths_agree(simd_path, codec, enc, gaussian_rows(rng, 1, 512)[0],
                                rng.random(2100).astype(np.float32))


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("variant", VARIANTS)
def test_same_bits_for_one_and_two_threads(variant, d, rng):
    # 3000 rows: three context chunks, and enough work that two threads really run
    codec = get_codec(f"polar4:{variant}", d)
    enc = codec.encode(gaussian_rows(rng, 3000, d))
    Q = gaussian_rows(rng, 2, d)
    W = rng.random((2, 3000)).astype(np.float32)
    s1, c1 = codec.scores(enc, Q, n_threads=1), codec.context(enc, W, n_threads=1)
    for n_threads in (2, 3):
        assert np.array_equal(_bits(s1), _bits(codec.scores(enc, Q, n_threads=n_threads)))
        assert np.array_equal(_bits(c1), _bits(codec.context(enc, W, n_threads=n_threads)))


@pytest.mark.parametrize("d", [8, 64, 512])
@pytest.mark.parametrize("variant", VARIANTS)
def test_inert_rows_contribute_nothing(variant, d, rng, simd_path):
    codec = get_codec(f"polar3:{variant}", d, nonfinite="inert")
    T = 37
    X = _rows(rng, T, d)
    X[5, 1] = np.inf                                      # inert: radius 0
    enc = codec.encode(X)
    # damaged radii are inert too (the decoder's rule): codes of live rows behind them
    for r, bad in ((10, np.nan), (11, -1.0), (12, np.inf)):
        enc.side[r, 0] = bad
    inert = [3, 5, 10, 11, 12]
    live = np.setdiff1d(np.arange(T), inert)
    Q = gaussian_rows(rng, 2, d)
    W = rng.random((2, T)).astype(np.float32)
    W_zero = W.copy()
    W_zero[:, inert] = 0
    W_huge = W_zero.copy()
    W_huge[:, inert] = 1e30
    for mode in PATHS:
        simd_path(mode)
        s = codec.scores(enc, Q)
        assert np.array_equal(_bits(s[:, inert]), np.zeros((2, len(inert)), np.uint32))
        assert np.isfinite(s).all()
        ctx = codec.context(enc, W_zero)
        # any weight on an inert row: the same bits as no weight at all
        assert np.array_equal(_bits(codec.context(enc, W_huge)), _bits(ctx))
        X_hat = codec.decode(enc)
        assert not X_hat[inert].any()
        _check_against(X_hat[live], Q, W_zero[:, live], s[:, live], ctx)


@pytest.mark.parametrize("spec", ["polar3:compat=colibri", "polar5:compat=colibri"])
def test_rows_wider_than_the_stack_buffer(spec, rng, simd_path):
    """Beyond width 8192 the vector path takes its buffer from the heap (compat only: the Lloyd
    codebooks stop at 4096)."""
    d, T = 16384, 9
    codec = get_codec(spec, d)
    enc = codec.encode(_rows(rng, T, d))
    Q = gaussian_rows(rng, 2, d)
    W = rng.standard_normal((2, T)).astype(np.float32)
    out = reads_on_every_path(simd_path, codec, enc, Q, W)
    _check_against(codec.decode(enc), Q, W, *out[PATHS[-1]])
