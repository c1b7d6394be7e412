"""llama.cpp's q4_1, q5_0, q5_1 and iq4_nl (+rot): byte identity with the gguf package, iq4_nl's
encoder held to its definition, layout, consumers, the cache and the file, bad input."""
import platform

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kvquant import EncodedRows, get_codec, reference
from kvquant._kernels import consumers
from kvquant._kernels import ggml as ggml_kernels
from kvquant.cache import RowStream
from kvquant.codecs import ggml as ggml_codecs
from kvquant.kvfile import CacheFile, Stream
from kvquant.metrics import relative_l2
from kvquant.rotation import HadamardRotation

from conftest import gaussian_rows
from _simd import PATHS, as_bits, benchmark_shape_paths_agree, reads_on_every_path
from _simd import simd_path  # noqa: F401 (fixture)
from test_ggml import adversarial_rows

KINDS = ("q4_1", "q5_0", "q5_1", "iq4_nl")
WITH_QUANTIZER = ("q4_1", "q5_0", "q5_1")     # gguf has no IQ4_NL quantizer
OFFSET = ("q4_1", "q5_1")
GGML_TYPE = {k: getattr(GGMLQuantizationType, k.upper()) for k in KINDS}
BLOCK_BYTES = {"q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
BITS = {"q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}
ALL_SPECS = [k + r for k in KINDS for r in ("", "+rot")]


def gguf_quantize(X, kind):
    with np.errstate(all="ignore"):
        return quants.quantize(np.asarray(X, np.float32), GGML_TYPE[kind])


def gguf_dequantize(codes, kind):
    with np.errstate(all="ignore"):
        return quants.dequantize(np.asarray(codes, np.uint8), GGML_TYPE[kind])


def fp16_fields(codes, kind):
    """The fp16 scale and (offset kinds) minimum of every block, as float32 (T, n_blocks, k)."""
    B = codes.reshape(codes.shape[0], -1, BLOCK_BYTES[kind])
    n = 2 if kind in OFFSET else 1
    return B[:, :, :2 * n].copy().view("<f2").astype(np.float32)


# -- identity with gguf --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", WITH_QUANTIZER)
@pytest.mark.parametrize("d", [32, 128, 2048])
def test_random_rows_are_byte_identical_to_gguf(rng, kind, d):
    n = 64 if d == 2048 else 300
    X = gaussian_rows(rng, n, d) * (10.0 ** rng.uniform(-6, 3, (n, 1))).astype(np.float32)
    X += rng.normal(0, 2, (n, 1)).astype(np.float32) * np.abs(X).max(axis=1, keepdims=True)
    codec = get_codec(kind, d)
    enc = codec.encode(X)
    expected = gguf_quantize(X, kind)
    assert enc.codes.shape == expected.shape == (n, codec.bytes_per_row)
    assert np.array_equal(enc.codes, expected)
    assert np.array_equal(codec.decode(enc), gguf_dequantize(expected, kind))
    assert np.array_equal(enc.codes, getattr(reference, f"{kind}_encode_rows")(X))


@pytest.mark.parametrize("kind", WITH_QUANTIZER)
def test_adversarial_rows_are_byte_identical_to_gguf(rng, kind):
    X = adversarial_rows(rng)
    expected = gguf_quantize(X, kind)
    # rows where gguf writes an infinite fp16 scale or minimum are the rows the codec refuses
    refused = ~np.isfinite(fp16_fields(expected, kind)).all(axis=(1, 2))
    assert refused.any() and not refused.all()
    with pytest.raises(ValueError, match="float16"):
        get_codec(kind, X.shape[1]).encode(X[refused])
    keep = ~refused
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # a float32-subnormal scale makes 1/d infinite: numpy's inf->int cast is platform-defined
        block_max = np.abs(X).reshape(X.shape[0], -1, 32).max(axis=2)
        keep &= ~((block_max > 0) & (block_max < 4e-35)).any(axis=1)
    X, expected = X[keep], expected[keep]
    enc = get_codec(kind, X.shape[1]).encode(X)
    got = enc.codes.copy()
    if kind in OFFSET:
        # a minimum of zeros of both signs: ggml keeps the first, numpy's min either; same value
        ours, theirs = (fp16_fields(c, kind)[:, :, 1] for c in (got, expected))
        zero = (ours == 0) & (theirs == 0)
        B = got.reshape(got.shape[0], -1, BLOCK_BYTES[kind])
        B[:, :, 2:4][zero] = expected.reshape(B.shape)[:, :, 2:4][zero]
    bad = np.flatnonzero((got != expected).any(axis=1))
    assert bad.size == 0, (bad, got[bad[:1]], expected[bad[:1]])
    assert np.array_equal(get_codec(kind, X.shape[1]).decode(enc), gguf_dequantize(expected, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_arbitrary_bytes_matches_gguf(rng, kind):
    """Any row of these formats decodes as gguf decodes it, infinite and NaN fields included."""
    d = 256
    codec = get_codec(kind, d)
    codes = rng.integers(0, 256, (200, codec.code_bytes), dtype=np.uint8)
    ours = codec.decode(EncodedRows(codes, np.zeros((200, 0), np.float32), codec.spec, d))
    assert np.array_equal(ours, gguf_dequantize(codes, kind), equal_nan=True)
    ref = reference.ggml_more_decode_rows(codes, d, kind)
    with np.errstate(invalid="ignore"):
        assert np.array_equal(ours, ref.astype(np.float32), equal_nan=True)


# -- iq4_nl: the encoder against its definition ---------------------------------------------------

def test_iq4_nl_codes_are_the_nearest_levels_and_the_scale_is_least_squares(rng):
    d = 256
    X = gaussian_rows(rng, 400, d) * (10.0 ** rng.uniform(-4, 3, (400, 1))).astype(np.float32)
    X[::7, 3] *= 40                                              # outliers set the peak
    enc = get_codec("iq4_nl", d).encode(X)
    assert np.array_equal(enc.codes, reference.iq4_nl_encode_rows(X))
    B = enc.codes.reshape(400, d // 32, 18)
    code = np.concatenate([B[:, :, 2:] & 0x0F, B[:, :, 2:] >> 4], axis=2)
    Xb = X.reshape(400, d // 32, 32)
    K = np.array(quants.IQ4_NL.kvalues, np.float32)
    # each code: the level nearest x / d0 (d0 = the first peak / -127), ties to the upper level
    peak = np.take_along_axis(Xb, np.abs(Xb).argmax(axis=2)[..., None], axis=2)
    a = (np.float32(1) / (peak / np.float32(-127))) * Xb
    dist = np.abs(a[..., None] - K)                              # float32, as ggml compares
    nearest = 15 - np.argmin(dist[..., ::-1], axis=-1)           # the last of equal distances
    assert np.array_equal(code, nearest)
    # the scale: the x^2-weighted least-squares fit of those levels, rounded to fp16
    k = K[code].astype(np.float64)
    w = Xb.astype(np.float64) ** 2
    ls = (w * k * Xb).sum(axis=2) / (w * k * k).sum(axis=2)
    stored = B[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float64)
    # within half an fp16 step of it (float32 sums: a hair more), subnormal steps included
    half_step = np.maximum(np.abs(ls) * 2.0 ** -11, 2.0 ** -25)
    assert np.all(np.abs(stored - ls) <= half_step * (1 + 1e-3))
    assert np.mean(stored == ls.astype(np.float16)) > 0.99


def test_iq4_nl_zero_blocks_and_its_error_against_q4_0(rng):
    X = gaussian_rows(rng, 2000, 64)
    X[0, :32] = 0.0
    X[1, 32:] = 1e-16                                            # under ggml's GROUP_MAX_EPS
    enc = get_codec("iq4_nl", 64).encode(X)
    assert not enc.codes[0, :18].any() and not enc.codes[1, 18:].any()
    assert not get_codec("iq4_nl", 64).decode(enc)[[0, 1]][[0, 1], [0, 40]].any()
    # the non-uniform levels fit Gaussian rows better than q4_0's uniform ones, at 4.5 bits too
    err = {s: relative_l2(X[2:], get_codec(s, 64).roundtrip(X[2:])).mean()
           for s in ("iq4_nl", "q4_0")}
    assert err["iq4_nl"] < 0.95 * err["q4_0"]              # measured: 0.078 against 0.085


# -- layout --------------------------------------------------------------------------------------

def test_q4_1_and_q5_1_byte_layout():
    q = (np.arange(32) * 7) % 32
    q[0], q[1] = 0, 31                                 # min 1.0 and max 32.0 set d = 1
    x = (q + 1).astype(np.float32)[None, :]
    c51 = get_codec("q5_1", 32).encode(x).codes[0]
    assert c51[:4].tolist() == [0x00, 0x3C, 0x00, 0x3C]      # d = 31 / 31 = 1, m = 1
    assert int.from_bytes(c51[4:8].tobytes(), "little") == sum(((q >> 4) & 1) << np.arange(32))
    assert all(c51[8 + j] == (q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16))
    c41 = get_codec("q4_1", 32).encode(np.minimum(x, 16)).codes[0]
    assert c41[:4].tolist() == [0x00, 0x3C, 0x00, 0x3C]      # d = 15 / 15 = 1, m = 1
    q4 = np.minimum(q, 15)
    assert all(c41[4 + j] == q4[j] | (q4[j + 16] << 4) for j in range(16))


def test_q5_0_byte_layout():
    q = (np.arange(32) * 11) % 32
    q[0] = 0                                           # element 0 is -16: the peak, d = 1
    x = (q - 16).astype(np.float32)[None, :]
    c = get_codec("q5_0", 32).encode(x).codes[0]
    assert c[:2].tolist() == [0x00, 0x3C]
    assert int.from_bytes(c[2:6].tobytes(), "little") == sum(((q >> 4) & 1) << np.arange(32))
    assert all(c[6 + j] == (q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [32, 96, 512])
def test_bytes_per_row(rng, kind, d):
    codec = get_codec(kind, d)
    assert codec.bytes_per_row == codec.code_bytes == BLOCK_BYTES[kind] * d // 32
    assert codec.n_side == 0 and codec.bits_per_value == BITS[kind]
    enc = codec.encode(gaussian_rows(rng, 3, d))
    assert enc.side.shape == (3, 0) and enc.codes.shape == (3, codec.bytes_per_row)


def test_kernel_kinds_are_the_codec_kinds():
    assert {ggml_codecs.KINDS[k][0]: ggml_codecs.KINDS[k][1] for k in ggml_codecs.KINDS} \
        == ggml_kernels.BLOCK_BYTES
    assert ggml_kernels.IQ4_NL_LEVELS == tuple(quants.IQ4_NL.kvalues)
    assert tuple(reference.IQ4_NL_LEVELS) == tuple(quants.IQ4_NL.kvalues)


# -- rotated variants ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [None, 0x1234])
def test_rotated_is_the_format_after_the_rotation(rng, kind, seed):
    d = 128
    X = gaussian_rows(rng, 200, d)
    spec = f"{kind}+rot" + (f":seed={seed:#x}" if seed else "")
    codec = get_codec(spec, d)
    rot = HadamardRotation(d) if seed is None else HadamardRotation(d, seed)
    enc = codec.encode(X)
    expected = (gguf_quantize(rot.rotate(X), kind) if kind in WITH_QUANTIZER
                else reference.iq4_nl_encode_rows(rot.rotate(X)))
    assert np.array_equal(enc.codes, expected)
    decoded = codec.decode(enc)
    assert np.allclose(decoded, rot.unrotate(gguf_dequantize(expected, kind)), rtol=0, atol=1e-6)
    assert codec.spec == spec and get_codec(codec.spec, d).spec == spec


def test_more_bits_less_error(rng):
    X = gaussian_rows(rng, 500, 128)
    err = {s: relative_l2(X, get_codec(s, 128).roundtrip(X)).mean()
           for s in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")}
    assert err["q8_0"] < err["q5_1"] < err["q4_1"] < err["q4_0"]
    assert err["q5_0"] < err["q4_1"]


# -- consumers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS)
def test_consumers_against_numpy_reference_and_decode_then_dot(spec, rng):
    dim, T = 128, 40
    codec = get_codec(spec, dim)
    X = gaussian_rows(rng, T, dim) + np.float32(0.7)             # a shared offset: m matters
    enc = codec.encode(X)
    Q = gaussian_rows(rng, 2, dim)
    W = rng.standard_normal((2, T)).astype(np.float32)
    kind, rotated = spec.partition("+")[0], spec.endswith("+rot")
    ref_s = reference.ggml_more_scores(enc.codes, Q, kind, rotated)
    ref_c = reference.ggml_more_context(enc.codes, W, dim, kind, rotated)
    s, c = codec.scores(enc, Q), codec.context(enc, W)
    assert s.dtype == c.dtype == np.float32 and s.shape == (2, T) and c.shape == (2, dim)
    assert np.max(np.abs(s - ref_s)) < 1e-5 * np.abs(ref_s).max()
    assert np.max(np.abs(c - ref_c)) < 1e-5 * (np.abs(ref_c).max() + 1)
    X_hat = codec.decode(enc).astype(np.float64)
    assert np.allclose(s, Q @ X_hat.T, rtol=1e-5, atol=1e-4)
    assert np.allclose(c, W @ X_hat, rtol=1e-5, atol=1e-4)
    assert np.array_equal(as_bits(codec.scores(enc, Q[1])), as_bits(s[1]))
    assert np.array_equal(as_bits(codec.context(enc, W[0])), as_bits(c[0]))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_consumers_same_bits_for_any_thread_count_and_path(spec, rng, simd_path):
    codec = get_codec(spec, 64, nonfinite="inert")
    X = gaussian_rows(rng, 3000, 64) - np.float32(0.5)           # three context chunks
    X[5] = 0.0
    X[9, :32] *= 1e-6                                            # fp16-subnormal scales
    X[11, 0] = np.nan                                            # an inert row
    enc = codec.encode(X)
    Q = gaussian_rows(rng, 2, 64)
    W = rng.random((2, 3000)).astype(np.float32)
    s1, c1 = codec.scores(enc, Q, n_threads=1), codec.context(enc, W, n_threads=1)
    for n_threads in (2, 3):
        assert np.array_equal(as_bits(s1), as_bits(codec.scores(enc, Q, n_threads=n_threads)))
        assert np.array_equal(as_bits(c1), as_bits(codec.context(enc, W, n_threads=n_threads)))
    out = reads_on_every_path(simd_path, codec, enc, Q, W)
    assert np.array_equal(as_bits(out["portable"][0]), as_bits(s1))


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU has no AVX-512: only the portable path")
@pytest.mark.parametrize("spec", ["q4_1", "q5_0+rot", "q5_1", "iq4_nl+rot"])
def test_paths_agree_on_the_benchmark_shapes(spec, rng, simd_path):
    codec = get_codec(spec, 512)
    enc = codec.encode(gaussian_rows(rng, 2100, 512))
    benchmark_shape_paths_agree(simd_path, codec, enc, gaussian_rows(rng, 1, 512)[0],
                                rng.random(2100).astype(np.float32))


def test_the_consumers_read_the_compiled_module():
    assert callable(consumers.scores_ggml_more) and callable(consumers.context_ggml_more)


# -- the cache's streams and the cache file --------------------------------------------------------

@pytest.mark.parametrize("spec", ["q4_1@center", "q5_0+rot@sinks=2", "iq4_nl", "q5_1+rot"])
def test_a_stream_holds_the_codec_rows(rng, spec):
    from kvquant.streams.options import split_stream_spec
    codec_spec, opts = split_stream_spec(spec)
    X = gaussian_rows(rng, 50, 64) + np.float32(2.0)
    stream = RowStream(get_codec(codec_spec, 64), **opts.as_dict())
    stream.append(X[:20])
    stream.append(X[20:])
    codec = get_codec(codec_spec, 64)
    offset = X[:20].astype(np.float64).mean(axis=0).astype(np.float32) if opts.center else 0
    expected = codec.decode(codec.encode(X - offset)) + offset
    expected[:opts.sinks] = X[:opts.sinks]
    np.testing.assert_array_equal(stream.decode(), expected)


@pytest.mark.parametrize("spec", ["q4_1", "q5_0+rot", "q5_1@center", "iq4_nl+rot"])
def test_the_cache_file_holds_them(tmp_path, rng, spec):
    X = gaussian_rows(rng, 12 * 3, 64).reshape(12, 3, 64)
    path = tmp_path / "c.kvq"
    cf = CacheFile.open(path, streams=[Stream("K", 64, 3, spec)])
    cf.append(np.arange(0, 5), streams={"K": X[:5]})
    cf.append(np.arange(5, 12), streams={"K": X[5:]})
    back = CacheFile.open(path, streams=[Stream("K", 64, 3, spec)])
    assert back.tier == "kvq" and back.report.loaded == 12
    np.testing.assert_array_equal(back.records.decode("K"), cf.records.decode("K"))
    if "@" not in spec:
        codec = get_codec(spec, 64)
        for j in range(3):
            np.testing.assert_array_equal(back.records.decode("K")[:, j],
                                          codec.decode(codec.encode(X[:, j])))
    with pytest.raises(Exception, match="q4_0|codec|spec"):
        CacheFile.open(path, streams=[Stream("K", 64, 3, "q4_0")])


# -- threads, bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_and_overflowing_rows(rng, kind):
    X = gaussian_rows(rng, 6, 64)
    X[1, 3] = np.nan
    X[2, 40] = -np.inf
    X[4, 10] = 1e7                                  # the block scale overflows fp16
    with pytest.raises(ValueError, match=r"NaN or inf.*float16.*rows 1, 2, 4"):
        get_codec(kind, 64).encode(X)
    inert = get_codec(kind, 64, nonfinite="inert")
    enc = inert.encode(X)
    for r in (1, 2, 4):
        assert not inert.decode(enc)[r].any()
    assert np.array_equal(enc.codes[[0, 3, 5]], get_codec(kind, 64).encode(X[[0, 3, 5]]).codes)


@pytest.mark.parametrize("kind", OFFSET)
def test_a_minimum_beyond_fp16_is_refused(kind):
    X = np.zeros((2, 32), np.float32)
    X[1] = -70000.0                                 # d = 0 but m = -70000 is -inf in fp16
    assert not np.isfinite(fp16_fields(gguf_quantize(X, kind), kind)[1]).all()
    with pytest.raises(ValueError, match=r"minimum.*rows 1"):
        get_codec(kind, 32).encode(X)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_widths_and_specs(kind):
    with pytest.raises(ValueError, match=r"multiple of 32.*48"):
        get_codec(kind, 48)
    with pytest.raises(ValueError, match=rf"power-of-two.*96.*unrotated {kind}"):
        get_codec(f"{kind}+rot", 96)
    with pytest.raises(ValueError, match=r"seed.*\+rot"):
        get_codec(f"{kind}:seed=3", 64)
    with pytest.raises(ValueError, match=r"unknown codec spec.*iq4_nl"):
        get_codec(kind + "x", 64)
