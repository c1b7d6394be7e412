"""Compressed-domain consumers: scores and contexts read from the codes (docs/reference.md §1.5).

Every codec is held to the engine's identity checks against decode-then-dot, to the plain-numpy
reference of kvquant.reference, to bit-identical results for 1 and 2 threads, and to bit-identical
results on the portable and the AVX-512 paths.
"""
import importlib
import inspect
import sys

import numpy as np
import pytest

from kvquant import get_codec, reference
from kvquant.codecs import _FAMILIES, Codec
from kvquant._kernels import consumers

from conftest import gaussian_rows
from _simd import PATHS, as_bits as _bits, benchmark_shape_paths_agree, reads_on_every_path
from _simd import simd_path  # noqa: F401 (fixture)

CORE_SPECS = (["f32", "kv8", "kv8-g4", "kv8-g8", "kv8-g16", "kv8-g32"]
              + [f"tq{b}" for b in range(1, 9)]
              + ["tq4:compat=colibri", "tq3:side=unbiased", "tq2:codebook=gaussian",
                 "tq4:side_dtype=f16"])
# Families with kernels of their own (a family that fails to build fails these tests).
LATER_SPECS = (["polar2", "polar3", "polar4", "polar5", "polar6", "polar4:compat=colibri",
                "polar4:side_dtype=f16"]
               + ["q8_0", "q4_0", "q8_0+rot", "q4_0+rot"])


ALL_SPECS = CORE_SPECS + LATER_SPECS
HAS_AVX512 = consumers.cpu_simd() in ("avx512", "avx512vbmi")


def _encoded(spec, dim, T, rng):
    codec = get_codec(spec, dim)
    return codec, codec.encode(gaussian_rows(rng, T, dim))


# -- the engine's identity checks ----------------------------------------------------------------

@pytest.mark.parametrize("dim", [64, 512])
@pytest.mark.parametrize("T", [17, 23])
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_identity_against_decode_then_dot(spec, T, dim, rng):
    codec, enc = _encoded(spec, dim, T, rng)
    X_hat = codec.decode(enc).astype(np.float64)
    Q = gaussian_rows(rng, 3, dim)
    W = rng.random((3, T)).astype(np.float32)
    W /= W.sum(axis=1, keepdims=True)

    s = codec.scores(enc, Q)
    expected = Q.astype(np.float64) @ X_hat.T
    bound = np.linalg.norm(Q, axis=1)[:, None] * np.linalg.norm(X_hat, axis=1)[None, :] + 1e-6
    assert s.dtype == np.float32 and s.shape == (3, T)
    assert np.max(np.abs(s - expected) / bound) < 1e-5

    ctx = codec.context(enc, W)
    expected = W.astype(np.float64) @ X_hat
    assert ctx.dtype == np.float32 and ctx.shape == (3, dim)
    err = np.linalg.norm(ctx - expected, axis=1) / (np.linalg.norm(expected, axis=1) + 1.0)
    assert np.max(err) < 1e-4

    # one query / one weight vector gives the same bits as the same row of a batch
    assert np.array_equal(_bits(codec.scores(enc, Q[1])), _bits(s[1]))
    assert np.array_equal(_bits(codec.context(enc, W[2])), _bits(ctx[2]))


@pytest.mark.parametrize("spec", ["kv8", "kv8-g8", "kv8-g32", "tq1", "tq3", "tq4",
                                  "tq4:compat=colibri", "tq8", "tq2:side=unbiased",
                                  "tq4:side_dtype=f16"])
def test_against_numpy_reference(spec, rng):
    dim, T = 128, 40
    codec, enc = _encoded(spec, dim, T, rng)
    Q = gaussian_rows(rng, 2, dim)
    W = rng.standard_normal((2, T)).astype(np.float32)
    if spec.startswith("kv8"):
        group = None if spec == "kv8" else codec.group
        ref_s = reference.kv8_scores(enc.codes, enc.side, Q, group)
        ref_c = reference.kv8_context(enc.codes, enc.side, W, group)
    else:
        ref_s = reference.tq_scores(enc.codes, enc.side, codec.levels64, codec.bits, Q)
        ref_c = reference.tq_context(enc.codes, enc.side, codec.levels64, codec.bits, W, dim)
    scale_s = np.abs(ref_s).max()
    assert np.max(np.abs(codec.scores(enc, Q) - ref_s)) < 1e-5 * scale_s
    assert np.max(np.abs(codec.context(enc, W) - ref_c)) < 1e-5 * (np.abs(ref_c).max() + 1)


@pytest.mark.parametrize("spec", ["q8_0", "q4_0", "q8_0+rot", "q4_0+rot"])
def test_ggml_against_numpy_reference(spec, rng):
    dim, T = 128, 40
    codec, enc = _encoded(spec, dim, T, rng)
    Q = gaussian_rows(rng, 2, dim)
    W = rng.standard_normal((2, T)).astype(np.float32)
    bits, rotated = (8 if spec.startswith("q8") else 4), spec.endswith("+rot")
    ref_s = reference.ggml_scores(enc.codes, Q, bits, rotated)
    ref_c = reference.ggml_context(enc.codes, W, dim, bits, rotated)
    assert np.max(np.abs(codec.scores(enc, Q) - ref_s)) < 1e-5 * np.abs(ref_s).max()
    assert np.max(np.abs(codec.context(enc, W) - ref_c)) < 1e-5 * (np.abs(ref_c).max() + 1)


def test_f32_against_numpy_reference(rng):
    codec, enc = _encoded("f32", 100, 37, rng)
    X = codec.decode(enc)
    Q = gaussian_rows(rng, 2, 100)
    W = rng.standard_normal((2, 37)).astype(np.float32)
    assert np.allclose(codec.scores(enc, Q), reference.f32_scores(X, Q), rtol=1e-5, atol=1e-4)
    assert np.allclose(codec.context(enc, W), reference.f32_context(X, W), rtol=1e-5, atol=1e-4)


# -- determinism -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS)
def test_same_bits_for_one_and_two_threads(spec, rng):
    # 3000 rows: three context chunks, and enough work that two threads really run
    codec, enc = _encoded(spec, 64, 3000, rng)
    Q = gaussian_rows(rng, 2, 64)
    W = rng.random((2, 3000)).astype(np.float32)
    s1 = codec.scores(enc, Q, n_threads=1)
    c1 = codec.context(enc, W, n_threads=1)
    for n_threads in (2, 3):
        assert np.array_equal(_bits(s1), _bits(codec.scores(enc, Q, n_threads=n_threads)))
        assert np.array_equal(_bits(c1), _bits(codec.context(enc, W, n_threads=n_threads)))


def _awkward_cases(rng):
    """Widths with tails, every group layout, special fp8 codes, inert rows."""
    cases = []
    for spec, dim in [("f32", 24), ("f32", 100), ("kv8", 24), ("kv8", 100), ("kv8-g3", 24),
                      ("kv8-g12", 48), ("kv8-g2", 32), ("kv8-g4", 64), ("kv8-g16", 64),
                      ("kv8-g48", 96), ("tq4", 2), ("tq3", 8), ("tq5", 16), ("tq1", 512),
                      ("tq2", 64), ("tq6", 128), ("tq7", 64), ("tq8", 32), ("tq7", 128),
                      ("tq8", 128)]:
        codec = get_codec(spec, dim, nonfinite="inert")
        X = gaussian_rows(rng, 203, dim)
        X[5] = 0.0                                   # inert row
        X[9, : dim // 2] *= 1e-6                    # subnormal fp8 codes, zeros
        X[11, 0] = np.nan                            # inert (tq) / NaN element -> 0 (kv8)
        enc = codec.encode(X)
        if spec.startswith("kv8"):
            enc.codes[17, :3] = [0x7F, 0xFF, 0x80]   # NaN codes decode to 0; -0
        cases.append((spec, dim, codec, enc))
    for spec in LATER_SPECS:
        codec = get_codec(spec, 64)
        cases.append((spec, 64, codec, codec.encode(gaussian_rows(rng, 203, 64))))
    return cases


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: only the portable path")
def test_portable_and_avx512_paths_give_the_same_bits(rng, simd_path):
    for spec, dim, codec, enc in _awkward_cases(rng):
        Q = gaussian_rows(rng, 3, dim)
        W = rng.standard_normal((3, enc.n_rows)).astype(np.float32)
        out = reads_on_every_path(simd_path, codec, enc, Q, W)
        # and both agree with decode-then-dot
        X_hat = codec.decode(enc).astype(np.float64)
        # (f32 keeps a NaN row as it is: NaN scores on both sides)
        assert np.allclose(out["avx512"][0], Q @ X_hat.T, rtol=1e-5, atol=1e-4, equal_nan=True), spec
        assert np.allclose(out["avx512"][1], W @ X_hat, rtol=1e-4, atol=1e-4, equal_nan=True), spec


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: only the portable path")
@pytest.mark.parametrize("spec", ["kv8", "kv8-g32", "kv8-g4"])
@pytest.mark.parametrize("magnitude", [1e-3, 1e3])
def test_kv8_paths_agree_for_large_and_small_factors(spec, magnitude, rng, simd_path):
    """Queries and weights beyond 2^7 (the raw-decode folding does not apply), and tiny ones."""
    codec, enc = _encoded(spec, 128, 300, rng)
    enc = codec.encode(codec.decode(enc) * np.float32(magnitude * 100))
    Q = gaussian_rows(rng, 2, 128) * np.float32(magnitude)
    W = rng.random((2, 300)).astype(np.float32) * np.float32(magnitude)
    out = reads_on_every_path(simd_path, codec, enc, Q, W)
    X_hat = codec.decode(enc).astype(np.float64)
    assert np.allclose(out[PATHS[-1]][0], Q @ X_hat.T, rtol=1e-5, atol=1e-5 * magnitude ** 2 * 1e3)


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: only the portable path")
@pytest.mark.parametrize("spec", ["f32", "kv8", "kv8-g32", "kv8-g8", "tq2", "tq4", "tq6", "tq7",
                                  "tq8", "q8_0", "q4_0+rot"])
def test_paths_agree_on_the_benchmark_shapes(spec, rng, simd_path):
    codec, enc = _encoded(spec, 512, 2100, rng)
    benchmark_shape_paths_agree(simd_path, codec, enc, gaussian_rows(rng, 1, 512)[0],
                                rng.random(2100).astype(np.float32))


def test_simd_switch(simd_path):
    assert consumers.get_simd() == consumers.cpu_simd()
    previous = consumers.set_simd("portable")
    assert previous == consumers.cpu_simd() and consumers.get_simd() == "portable"
    with pytest.raises(ValueError, match="simd mode"):
        consumers.set_simd("sse9")
    if "avx512vbmi" not in PATHS:
        with pytest.raises(ValueError, match="cannot run"):
            consumers.set_simd("avx512vbmi")


def test_kv8_decode_values_match_the_decoder():
    from kvquant._kernels import fp8
    assert np.array_equal(_bits(np.array(consumers.e4m3_values(), np.float32)),
                          _bits(np.array(fp8.e4m3_table(), np.float32)))


# -- the consumer hooks of every registered codec -------------------------------------------------

def _registered_codec_classes():
    classes = []
    for parse in _FAMILIES:
        module = sys.modules[parse.__module__]
        classes += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                    if issubclass(cls, Codec) and cls is not Codec
                    and cls.__module__ == module.__name__]
    return classes


def test_every_registered_codec_has_compressed_domain_consumers():
    classes = _registered_codec_classes()
    assert {c.__name__ for c in classes} >= {"F32Codec", "FP8Codec", "LloydCodec"}
    for cls in classes:
        assert cls._scores is not Codec._scores, f"{cls.__name__} has no scores consumer"
        assert cls._context is not Codec._context, f"{cls.__name__} has no context consumer"


def test_generic_fallback_is_decode_then_dot(rng):
    """The base hooks (for prototypes) agree with the real consumers."""
    codec, enc = _encoded("tq3", 64, 50, rng)
    Q = gaussian_rows(rng, 2, 64)
    W = rng.random((2, 50)).astype(np.float32)
    codes, side = codec.check_encoded(enc)
    s = np.empty((2, 50), np.float32)
    c = np.empty((2, 64), np.float32)
    Codec._scores(codec, codes, side, Q, s, 1)
    Codec._context(codec, codes, side, W, c, 1)
    assert np.allclose(s, codec.scores(enc, Q), rtol=1e-5, atol=1e-5)
    assert np.allclose(c, codec.context(enc, W), rtol=1e-5, atol=1e-5)


# -- input handling ----------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors(rng):
    codec, enc = _encoded("kv8", 64, 10, rng)
    with pytest.raises(ValueError, match=r"shape \(64,\) or \(m, 64\)"):
        codec.scores(enc, np.zeros(63))
    with pytest.raises(ValueError, match="number of rows 10"):
        codec.context(enc, np.zeros(11))
    with pytest.raises(TypeError, match="floating point"):
        codec.scores(enc, np.zeros(64, dtype=np.int32))
    with pytest.raises(ValueError, match="encoded by 'kv8'"):
        get_codec("tq4", 64).scores(enc, np.zeros(64))
    with pytest.raises(ValueError):
        codec.scores(enc, np.zeros((2, 2, 64)))


@pytest.mark.parametrize("spec", ["f32", "kv8", "tq4"])
def test_empty_cache_and_strided_float64_inputs(spec, rng):
    codec = get_codec(spec, 64)
    empty = codec.encode(np.zeros((0, 64), np.float32))
    assert codec.scores(empty, np.ones(64)).shape == (0,)
    assert np.array_equal(codec.context(empty, np.zeros((2, 0))), np.zeros((2, 64), np.float32))
    codec, enc = _encoded(spec, 64, 30, rng)
    Q = rng.standard_normal((64, 6))          # float64, transposed view: any strides
    W = rng.standard_normal((30, 4))
    assert np.array_equal(codec.scores(enc, Q.T), codec.scores(enc, np.ascontiguousarray(Q.T, np.float32)))
    assert np.array_equal(codec.context(enc, W.T), codec.context(enc, np.ascontiguousarray(W.T, np.float32)))


def test_bench_command_writes_its_table(tmp_path, capsys):
    from kvquant.cli import main
    assert main(["bench", "--dims", "64", "--contexts", "300", "--codecs", "f32,kv8,tq4",
                 "--threads", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 64 | 300 | kv8 |" in out and "BLAS:" in out
    stems = {p.suffix for p in tmp_path.iterdir()}
    assert stems == {".md", ".csv", ".json"}
