"""No silent wrong answer at any magnitude (the magnitude contract of README.md, "Codecs").

Every registered spec x widths x row shapes x magnitudes from the smallest subnormal to FLT_MAX:
a row either raises the named ValueError (and is inert under ``nonfinite="inert"``) or encodes
to codes that decode, score and give context finite and right:

* decoded rows scale with the input: decoding the row scaled by 2^e gives 2^e times the decoded
  unit-scale row (tq, polar, kv8, f32; power-of-two scaling is exact in float32), so a huge row is
  as good as an ordinary one; zero and tiny rows (norm <= 1e-35) decode to 0;
* the unit-scale rows meet an independent bound (kv8: docs/reference.md §1.1's per-element bound;
  q8_0/q4_0: gguf's own quantizer; rotated codecs: the relative error of a float64 reference);
* scores and contexts equal decode-then-dot in float64 to rounding (docs/reference.md §1.5);
* a refused row lies beyond the norm the codec promises to take (``Codec.safe_norm``).
"""
import math

import numpy as np
import pytest

from kvquant import get_codec
from kvquant.codecs.base import ROW_LIMIT

from _simd import simd_path  # noqa: F401 (fixture)

F32 = np.float32
FLT_MAX = float(np.finfo(F32).max)
LIMIT = ROW_LIMIT                                       # 3.4e38f = 3.39999995e38
TINY_NORM = 1e-35                                       # the engine's inert floor

SPECS = (["f32", "kv8", "kv8-g4", "kv8-g32"]
         + [f"tq{b}" for b in range(1, 9)]
         + ["tq4:compat=colibri", "tq3:side=unbiased", "tq2:codebook=gaussian",
            "tq4:side_dtype=f16"]
         + [f"polar{b}" for b in range(2, 7)]
         + ["polar4:compat=colibri", "polar2:compat=colibri", "polar4:alloc=level",
            "polar4:side_dtype=f16"]
         + ["q8_0", "q4_0", "q8_0+rot", "q4_0+rot"]
         + ["q4_1", "q5_0", "q5_1", "iq4_nl", "q5_1+rot", "iq4_nl+rot"])
WIDTHS = (2, 64, 512, 4096)
MAGNITUDES = (2.0**-149, 1e-38, float(np.finfo(F32).tiny), 1e-35, 1e-30, 1e-10, 1.0, 1e10,
              1e30, 1e36, FLT_MAX / 64, 1e37, 5e37, 1e38, 2e38, LIMIT, FLT_MAX)
SHAPES = ("one", "one_in_noise", "all_same", "all_random")


def _codec(spec, dim, **kw):
    try:
        return get_codec(spec, dim, **kw)
    except ValueError as exc:
        if "width" in str(exc) or "divisor" in str(exc):
            return None   # this width is not one the codec takes (tested in its own module)
        raise


def _row(shape, m, n, rng):
    """One float32 row of the given shape whose largest magnitude is m (as float32)."""
    k = int(rng.integers(n))
    sign = rng.choice([-1.0, 1.0])
    if shape == "one":
        x = np.zeros(n)
        x[k] = sign * m
    elif shape == "one_in_noise":
        x = rng.standard_normal(n) * min(m, 1.0) * 0.5
        x[k] = sign * m
    elif shape == "all_same":
        x = np.full(n, m)
    else:
        g = rng.standard_normal(n)
        x = g / np.abs(g).max() * m
    return x.astype(F32)


def _pow2_exponent(x):
    """e with max|x| / 2^e in [1, 2), or None for a zero row."""
    top = float(np.abs(x).max())
    return None if top == 0 else math.frexp(top)[1] - 1


def _unit_error_bound(spec, codec, x1, d1):
    """An independent bound on decoding the unit-scale row x1 (float32 in, float32 out)."""
    x64, err = x1.astype(np.float64), d1.astype(np.float64) - x1.astype(np.float64)
    if spec == "f32":
        assert np.array_equal(d1, x1)
    elif codec.family == "kv8":
        # docs/reference.md §1.1: |err| <= |x|/16 + scale 2^-10 (+ float32 rounding of the product)
        g = codec.group
        amax = np.abs(x64).reshape(-1, g).max(axis=1)
        scale = np.repeat(amax / 448.0, g)
        bound = np.abs(x64) / 16 + scale * 2**-10 + 1e-6 * np.abs(x64)
        bound = np.where(np.repeat(amax, g) > TINY_NORM, bound, np.abs(x64))  # inert groups: 0
        assert np.all(np.abs(err) <= bound)
    elif codec.family == "ggml" and not codec.rotate:
        import gguf
        from kvquant import reference
        kind = getattr(gguf.GGMLQuantizationType, codec.kind.upper())
        with np.errstate(all="ignore"):
            codes = (reference.iq4_nl_encode_rows(x1[None]) if codec.kind == "iq4_nl"
                     else gguf.quants.quantize(x1[None], kind))   # gguf has no IQ4_NL quantizer
            ref = gguf.quants.dequantize(codes, kind)[0]
        assert np.array_equal(d1, ref)
    else:
        # rotated codecs: never worse than storing zero (the decoded row keeps the input's
        # direction: <x, x^> > 0) and the norm kept within the largest level
        assert np.linalg.norm(err) < np.linalg.norm(x64) * 1.0001
        assert float(x64 @ d1.astype(np.float64)) > 0


def _check_reads(codec, enc, D):
    """scores and context against decode-then-dot in float64; everything finite."""
    rng = np.random.default_rng(1)
    n, T = codec.dim, D.shape[0]
    q = rng.standard_normal((2, n))
    q /= np.abs(q).sum(axis=1, keepdims=True)      # |q|_1 = 1: every exact score is finite
    w = rng.random((2, T))
    w /= w.sum(axis=1, keepdims=True)              # convex weights: every exact context is finite
    D64 = D.astype(np.float64)
    s = codec.scores(enc, q)
    c = codec.context(enc, w)
    assert np.all(np.isfinite(s)) and np.all(np.isfinite(c))
    row_norms = np.linalg.norm(D64, axis=1)
    s_tol = 2e-5 * np.linalg.norm(q, axis=1)[:, None] * row_norms[None, :] + 1e-40
    assert np.all(np.abs(s - q @ D64.T) <= s_tol)
    c_tol = 2e-5 * (w @ row_norms)[:, None] + 1e-40
    assert np.all(np.abs(c - w @ D64) <= c_tol)


@pytest.mark.parametrize("spec", SPECS)
def test_every_magnitude_is_refused_or_right(spec):
    rng = np.random.default_rng(0)
    for n in WIDTHS:
        codec = _codec(spec, n)
        if codec is None:
            continue
        inert = get_codec(spec, n, nonfinite="inert")
        ordinary = rng.standard_normal((2, n)).astype(F32)
        for shape in SHAPES:
            for m in MAGNITUDES:
                x = _row(shape, m, n, rng)
                where = f"{spec} n={n} {shape} m={m:.3g}"
                X = np.stack([ordinary[0], x, ordinary[1]])
                try:
                    enc = codec.encode(X)
                except ValueError as exc:
                    # the named error: the row, and only it, is refused
                    assert "rows 1)" in str(exc), where
                    norm = float(np.linalg.norm(x.astype(np.float64)))
                    if codec.family == "kv8":
                        assert float(np.abs(x).max()) > LIMIT, where
                    elif codec.safe_norm is not None:
                        assert norm > codec.safe_norm, (where, str(exc))
                    D = inert.decode(inert.encode(X))
                    assert np.all(np.isfinite(D)), where
                    if codec.family == "kv8":
                        # the engine's rule: groups above the limit are zeros, the others live
                        over = np.abs(x).reshape(-1, codec.group).max(axis=1) > LIMIT
                        assert np.all(D[1].reshape(-1, codec.group)[over] == 0), where
                    else:
                        assert np.all(D[1] == 0), where
                    assert np.array_equal(D[[0, 2]], codec.decode(codec.encode(X[[0, 2]]))), where
                    continue
                D = codec.decode(enc)
                assert np.all(np.isfinite(D)), where
                _check_reads(codec, enc, D)
                e = _pow2_exponent(x)
                if e is None:
                    assert np.all(D[1] == 0), where
                    continue
                x1 = (x.astype(np.float64) * 2.0**-e).astype(F32)
                d1 = codec.decode(codec.encode(x1[None]))[0]
                _unit_error_bound(spec, codec, x1, d1)
                if codec.family == "ggml":
                    continue   # fp16 block scales: not scale-free (checked against gguf above)
                expect = d1.astype(np.float64) * 2.0**e
                norm = float(np.linalg.norm(x.astype(np.float64)))
                # zero and tiny rows (kv8: groups with amax <= 1e-35) are stored as zeros
                tol = 1e-5 * norm + 4 * TINY_NORM * math.sqrt(n)
                if codec.side_dtype == "f16":
                    # the side value is rounded to fp16 at one scale only (relative 2^-11; an
                    # absolute 2^-25 in fp16's subnormal range, where tiny rows become 0)
                    tol += 2**-10 * norm + 8 * 2**-25
                assert np.linalg.norm(D[1].astype(np.float64) - expect) <= tol, where


@pytest.mark.parametrize("spec", ["tq4:compat=colibri", "polar4:compat=colibri",
                                  "polar3:compat=colibri", "kv8", "kv8-g16"])
def test_compat_threshold_is_the_engines_float_literal(spec):
    """The engine makes a row inert when its norm (kv8: amax) is above the float literal 3.4e38f;
    rows at it are stored live exactly as the engine stores them, rows one ulp above are refused
    (or inert, as the engine, under nonfinite='inert')."""
    from kvquant import reference as ref
    n = 64
    at = np.float32(3.4e38)
    assert float(at) == 3.3999999521443642e38 and float(at) < FLT_MAX
    above = np.nextafter(at, np.float32(np.inf))
    codec = get_codec(spec, n)
    inert = get_codec(spec, n, nonfinite="inert")
    X = np.zeros((2, n), F32)
    X[0, 5] = at
    X[1, 5] = -above
    enc = codec.encode(X[:1])
    if spec.startswith("tq4"):
        levels = np.array([-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
                           0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733], F32)
        codes, side = ref.engine_tq4_encode_rows(X[:1], levels)
    elif spec.startswith("polar"):
        codes, side = ref.polar_engine_encode_rows(X[:1], codec.bits)
    else:
        codes, side = ref.fp8_encode_rows(X[:1], codec.group if codec.group != n else None)
    assert np.array_equal(enc.codes, codes) and np.array_equal(enc.side, side.reshape(enc.side.shape))
    assert np.all(np.isfinite(codec.decode(enc)))
    with pytest.raises(ValueError, match=r"above 3\.4e38.*\(rows 0\)"):
        codec.encode(X[1:])
    enc = inert.encode(X)
    assert np.all(enc.codes[1] == 0)
    # the engine's inert row: radius 0 (rotated codecs), scale 1 (kv8)
    assert np.all(enc.side[1] == (1.0 if codec.family == "kv8" else 0.0))
    assert np.all(inert.decode(enc)[1] == 0)


@pytest.mark.parametrize("spec", ["tq4", "tq8", "tq4:side=unbiased", "polar4", "polar4:alloc=level"])
def test_rows_that_overflow_the_butterflies_encode_to_the_exact_codes(spec):
    """x0 = x1 = 2e38 overflows the float32 rotation's partial sums: the Lloyd codecs rotate a
    copy scaled by 2^-64, so the codes are those of the same row at an ordinary scale (the scale
    is a power of two: exact), and the decode is 2^64 times that row's decode."""
    n = 64
    small = np.zeros((1, n), F32)
    small[0, :2] = 2e38 * 2.0**-64
    big = (small.astype(np.float64) * 2.0**64).astype(F32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(big[0, 0]) + np.float32(big[0, 1]))
    codec = get_codec(spec, n)
    e_big, e_small = codec.encode(big), codec.encode(small)
    assert np.array_equal(e_big.codes, e_small.codes)
    assert np.array_equal(e_big.side, e_small.side * np.float32(2.0**64))
    assert np.array_equal(codec.decode(e_big), codec.decode(e_small) * np.float32(2.0**64))


@pytest.mark.parametrize("spec", ["tq4:compat=colibri", "polar4:compat=colibri"])
def test_compat_refuses_rows_whose_engine_rotation_overflows(spec):
    """The engine stores x0 = x1 = 2e38 live with garbage codes (its butterflies overflow):
    compat refuses the row by name, and makes it inert under nonfinite='inert'."""
    n = 64
    X = np.zeros((1, n), F32)
    X[0, :2] = 2e38
    with pytest.raises(ValueError, match=r"rotation overflows.*\(rows 0\)"):
        get_codec(spec, n).encode(X)
    inert = get_codec(spec, n, nonfinite="inert")
    assert np.all(inert.decode(inert.encode(X)) == 0)


def test_unchanged_bits_for_ordinary_rows():
    """The overflow guards touch only rows that need them: ordinary rows still match the float64
    reference encoder and the engine's float32 restatement bit for bit."""
    from kvquant import reference as ref
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((64, 128)) * 10.0 ** rng.uniform(-20, 30, (64, 1))).astype(F32)
    codec = get_codec("tq4:compat=colibri", 128)
    codes, side = ref.engine_tq4_encode_rows(X, codec.levels)
    enc = codec.encode(X)
    assert np.array_equal(enc.codes, codes) and np.array_equal(enc.side[:, 0], side)
    pc = get_codec("polar4:compat=colibri", 128)
    codes, side = ref.polar_engine_encode_rows(X, 4)
    enc = pc.encode(X)
    assert np.array_equal(enc.codes, codes) and np.array_equal(enc.side[:, 0], side)
    D, D_ref = pc.decode(enc), ref.polar_engine_decode_rows(codes, side, 4, 128)
    # numpy's cos/sin may differ from libm's in the last place
    norms = np.linalg.norm(X.astype(np.float64), axis=1, keepdims=True)
    assert np.all(np.abs(D - D_ref) <= 1e-5 * norms)


@pytest.mark.parametrize("spec", ["tq4", "tq8", "tq4:compat=colibri", "tq3:side=unbiased",
                                  "polar4", "polar4:alloc=level", "polar4:compat=colibri",
                                  "kv8-g32", "q4_0+rot"])
def test_huge_rows_give_the_same_bits_for_any_threads_and_simd_path(spec, simd_path):
    """The overflow guards (scaled copies at encode, decode and the context's unrotation) keep
    results independent of the thread count and of the consumers' instruction set."""
    from _simd import as_bits, reads_on_every_path
    rng = np.random.default_rng(7)
    n, T = 512, 256                           # enough work for two threads
    codec = get_codec(spec, n, nonfinite="inert")
    X = rng.standard_normal((T, n))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    X *= 10.0 ** rng.uniform(-30, math.log10(LIMIT), (T, 1))   # norms from 1e-30 to the limit
    X[::7] = 0
    X[::7, 3] = LIMIT                         # one-hot rows at the limit: decode needs the guard
    X = X.astype(F32)
    enc1, enc2 = codec.encode(X, n_threads=1), codec.encode(X, n_threads=2)
    assert np.array_equal(enc1.codes, enc2.codes) and np.array_equal(as_bits(enc1.side),
                                                                      as_bits(enc2.side))
    D = codec.decode(enc1, n_threads=1)
    assert np.array_equal(as_bits(D), as_bits(codec.decode(enc1, n_threads=2)))
    assert np.all(np.isfinite(D))
    Q = rng.standard_normal((3, n))
    Q /= np.abs(Q).sum(axis=1, keepdims=True)
    W = rng.random((3, T))
    W /= W.sum(axis=1, keepdims=True)
    reads = reads_on_every_path(simd_path, codec, enc1, Q, W)
    s, c = reads["portable"]
    assert np.all(np.isfinite(s)) and np.all(np.isfinite(c))
    simd_path("auto")
    assert np.array_equal(as_bits(codec.context(enc1, W, n_threads=1)),
                          as_bits(codec.context(enc1, W, n_threads=2)))


@pytest.mark.parametrize("spec", ["tq1:side=unbiased", "tq3:side=unbiased", "tq4", "tq8",
                                  "tq4:compat=colibri", "polar3", "polar4:compat=colibri"])
def test_norms_up_to_the_limit(spec):
    """Norms on a fine grid up to the limit: each row is refused or decodes to its own scale
    (an unbiased side value can exceed the norm: it must never pass the limit and decode as an
    inert row)."""
    rng = np.random.default_rng(11)
    n = 64
    codec = get_codec(spec, n)
    G = rng.standard_normal((200, n))
    G /= np.linalg.norm(G, axis=1, keepdims=True)
    norms = np.linspace(0.9, 1.0, 200) * LIMIT
    X = (G * norms[:, None]).astype(F32)
    for i in range(X.shape[0]):
        try:
            enc = codec.encode(X[i:i + 1])
        except ValueError:
            assert codec.safe_norm is None or norms[i] > codec.safe_norm
            continue
        d = codec.decode(enc)[0].astype(np.float64)
        x1 = (X[i].astype(np.float64) * 2.0**-127).astype(F32)
        expect = codec.decode(codec.encode(x1[None]))[0].astype(np.float64) * 2.0**127
        assert np.all(np.isfinite(d)) and np.linalg.norm(d - expect) <= 1e-5 * norms[i], i
