"""``side_dtype=f16`` on the rotated codecs: the side value rounded to fp16 and stored in 2 bytes.

The reference is the f32 codec itself: same codes, side value rounded by numpy (nearest even), and
the f32 codec's decoder and consumers fed that side value must give the same bits.
"""
import json

import numpy as np
import pytest

from kvquant import budget, get_codec, reference
from kvquant.cache import RowStream
from kvquant.codecs import EncodedRows
from kvquant.codecs.polar import engine_row_bytes

from conftest import gaussian_rows

# (f32 spec, its f16 twin)
PAIRS = [("tq1", "tq1:side_dtype=f16"), ("tq4", "tq4:side_dtype=f16"),
         ("tq8", "tq8:side_dtype=f16"),
         ("tq3:side=unbiased", "tq3:side=unbiased,side_dtype=f16"),
         ("tq2:codebook=gaussian,seed=0x7", "tq2:codebook=gaussian,side_dtype=f16,seed=0x7"),
         ("polar2", "polar2:side_dtype=f16"), ("polar4", "polar4:side_dtype=f16"),
         ("polar5:alloc=level", "polar5:alloc=level,side_dtype=f16")]


def _fp16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _rows_of_many_scales(rng, n, d):
    """Rows whose norms spread over 1e-3..1e4, so rounding to fp16 moves most side values."""
    X = gaussian_rows(rng, n, d)
    return (X * np.float32(10.0) ** rng.uniform(-4, 3, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("spec32, spec16", PAIRS)
def test_f16_is_the_f32_codec_with_its_side_rounded(rng, spec32, spec16):
    d = 64
    c32, c16 = get_codec(spec32, d), get_codec(spec16, d)
    X = _rows_of_many_scales(rng, 400, d)
    e32, e16 = c32.encode(X), c16.encode(X)
    assert np.array_equal(e16.codes, e32.codes)
    assert e16.side.dtype == np.float32
    assert np.array_equal(e16.side, _fp16(e32.side))
    # the rounding really happened (else this test could not tell f16 from f32)
    assert (e16.side != e32.side).mean() > 0.9
    assert np.max(np.abs(e16.side / e32.side - 1)) <= 2.0**-11

    rounded = EncodedRows(e32.codes, _fp16(e32.side), c32.spec, d)
    assert np.array_equal(c16.decode(e16), c32.decode(rounded))
    Q = gaussian_rows(rng, 3, d)
    W = rng.random((3, len(X))).astype(np.float32)
    assert np.array_equal(c16.scores(e16, Q), c32.scores(rounded, Q))
    assert np.array_equal(c16.context(e16, W), c32.context(rounded, W))


def test_tq_f16_decode_matches_numpy_reference(rng):
    d, bits = 128, 4
    codec = get_codec("tq4:side_dtype=f16", d)
    X = _rows_of_many_scales(rng, 200, d)
    enc = codec.encode(X)
    _, ref_side = reference.tq_encode_rows(X, codec.levels64, bits)
    assert np.allclose(enc.side[:, 0], _fp16(ref_side), rtol=2e-3)
    ref = reference.tq_decode_rows(enc.codes, enc.side[:, 0], codec.levels64, bits, d)
    scale = np.abs(X).max(axis=1, keepdims=True)
    assert np.all(np.abs(codec.decode(enc) - ref) <= 1e-5 * scale)


@pytest.mark.parametrize("d", [64, 128, 512])
def test_bytes_per_row(rng, d):
    for bits in range(1, 9):
        c16, c32 = get_codec(f"tq{bits}:side_dtype=f16", d), get_codec(f"tq{bits}", d)
        assert c16.bytes_per_row == (d * bits + 7) // 8 + 2 == c32.bytes_per_row - 2
        assert c16.bits_per_value == 8.0 * c16.bytes_per_row / d
    for bits in range(2, 7):
        for spec in (f"polar{bits}:side_dtype=f16", f"polar{bits}:alloc=level,side_dtype=f16"):
            assert get_codec(spec, d).bytes_per_row == engine_row_bytes(d, bits) + 2
    # the motivating case: 4-bit codes at head_dim 64, side 0.5 -> 0.25 bit per value
    assert get_codec("tq4", 64).bits_per_value == 4.5
    assert get_codec("tq4:side_dtype=f16", 64).bits_per_value == 4.25


def test_nbytes_counts_stored_bytes(rng):
    X = gaussian_rows(rng, 10, 64)
    for spec in ("tq4", "tq4:side_dtype=f16", "polar3:side_dtype=f16", "kv8-g16"):
        codec = get_codec(spec, 64)
        enc = codec.encode(X)
        assert enc.nbytes == 10 * codec.bytes_per_row
        assert enc[2:5].nbytes == 3 * codec.bytes_per_row and enc[-1].nbytes == codec.bytes_per_row
        assert enc.side_dtype == codec.side_dtype
        stream = RowStream(codec)
        stream.append(X)
        assert stream.nbytes == enc.nbytes


@pytest.mark.parametrize("spec", ["tq4:side_dtype=f16", "tq3:side=unbiased,side_dtype=f16",
                                  "polar4:side_dtype=f16", "polar5:alloc=level,side_dtype=f16",
                                  "tq4:codebook=gaussian,side_dtype=f16,seed=0x2a"])
def test_spec_round_trip(spec):
    codec = get_codec(spec, 128)
    assert codec.spec == spec and codec.side_dtype == "f16"
    again = get_codec(codec.spec, 128)
    assert again.spec == spec and again.bytes_per_row == codec.bytes_per_row


def test_f32_is_the_default_and_never_spelled():
    assert get_codec("tq4:side_dtype=f32", 64).spec == "tq4"
    assert get_codec("polar4", 64, side_dtype="f32").spec == "polar4"
    assert get_codec("tq4", 64, side_dtype="f16").spec == "tq4:side_dtype=f16"
    assert get_codec("tq4", 64).side_dtype == "f32" == get_codec("kv8", 64).side_dtype
    with pytest.raises(ValueError, match="side_dtype"):
        get_codec("tq4:side_dtype=f32", 64, side_dtype="f16")


@pytest.mark.parametrize("spec", ["tq4:side_dtype=f64", "polar4:side_dtype=bf16",
                                  "tq4:side_dtype=F16"])
def test_unknown_side_dtype(spec):
    with pytest.raises(ValueError, match="side_dtype"):
        get_codec(spec, 64)


@pytest.mark.parametrize("spec", ["tq4:compat=colibri,side_dtype=f16",
                                  "polar4:compat=colibri,side_dtype=f16",
                                  "polar2:side_dtype=f16,compat=colibri"])
def test_compat_refuses_f16(spec):
    with pytest.raises(ValueError, match="compat='colibri'.*f32 side values"):
        get_codec(spec, 64)


def test_option_not_offered_where_codes_depend_on_the_side():
    # kv8's codes are scaled by its scale: rounding the scale after encoding would be wrong
    for spec in ("kv8:side_dtype=f16", "q8_0:side_dtype=f16", "f32:side_dtype=f16"):
        with pytest.raises(ValueError):
            get_codec(spec, 64)


def _overflow_rows(rng, d):
    X = gaussian_rows(rng, 6, d)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    X[1] *= 50000.0    # fits fp16 (max 65504), also as an unbiased 2-bit scale (~1.13 |x|)
    X[3] *= 66000.0    # rounds to inf in fp16
    X[4] *= 1e30       # inf in fp16, finite in f32
    return X


@pytest.mark.parametrize("spec", ["tq4:side_dtype=f16", "tq2:side=unbiased,side_dtype=f16",
                                  "polar4:side_dtype=f16"])
def test_side_overflow_raises_naming_rows(rng, spec):
    X = _overflow_rows(rng, 64)
    with pytest.raises(ValueError, match=r"2 row\(s\).*float16 maximum 65504.*rows 3, 4.*"
                                         r"side_dtype=f32") as exc:
        get_codec(spec, 64).encode(X)
    assert "nonfinite='inert'" in str(exc.value)
    get_codec(spec.replace("side_dtype=f16", "side_dtype=f32"), 64).encode(X)  # f32 takes them
    X[5, 0] = np.nan
    with pytest.raises(ValueError, match=r"NaN or inf or have a side value.*rows 3, 4, 5"):
        get_codec(spec, 64).encode(X)


@pytest.mark.parametrize("spec", ["tq4:side_dtype=f16", "polar4:side_dtype=f16"])
def test_side_overflow_inert(rng, spec):
    X = _overflow_rows(rng, 64)
    codec = get_codec(spec, 64, nonfinite="inert")
    enc = codec.encode(X)
    assert np.all(enc.codes[[3, 4]] == 0) and np.all(enc.side[[3, 4]] == 0)
    assert np.all(codec.decode(enc)[[3, 4]] == 0)
    # the other rows are what the raising codec stores
    ok = [0, 1, 2, 5]
    clean = get_codec(spec, 64).encode(X[ok])
    assert np.array_equal(enc.codes[ok], clean.codes) and np.array_equal(enc.side[ok], clean.side)
    assert enc.side[1, 0] > 49000


def test_tiny_side_values_become_subnormal_or_zero(rng):
    codec = get_codec("tq4:side_dtype=f16", 64)
    c32 = get_codec("tq4", 64)
    X = gaussian_rows(rng, 3, 64)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    X *= np.array([[1e-2], [1e-6], [1e-9]], np.float32)
    enc = codec.encode(X)
    assert np.array_equal(enc.side, _fp16(c32.encode(X).side))
    assert enc.side[0, 0] > 6.1e-5                       # normal
    assert 0 < enc.side[1, 0] < 6.1e-5                   # subnormal: ~3% off
    assert abs(enc.side[1, 0] / 1e-6 - 1) < 0.05
    assert enc.side[2, 0] == 0                           # below fp16's range: a zero row
    assert np.all(codec.decode(enc)[2] == 0)


def test_decode_refuses_side_values_that_are_not_fp16(rng):
    X = _rows_of_many_scales(rng, 20, 64)
    c16 = get_codec("tq4:side_dtype=f16", 64)
    e32 = get_codec("tq4", 64).encode(X)
    forged = c16.encoded_rows(e32.codes, e32.side.copy())
    with pytest.raises(ValueError, match="float16 cannot represent"):
        c16.decode(forged)
    with pytest.raises(ValueError, match="float16 cannot represent"):
        c16.scores(forged, X[0])
    forged.side[:] = _fp16(forged.side)
    forged.side[7, 0] = np.nextafter(forged.side[7, 0], np.float32(np.inf))
    with pytest.raises(ValueError, match=r"1 row\(s\).*rows 7\)"):
        c16.decode(forged)
    forged.side[7, 0] = _fp16(forged.side[7, 0])
    c16.decode(forged)


def test_budget_uses_the_stored_side_bytes():
    assert budget.row_bytes("tq4:side_dtype=f16", 64) == 34
    assert budget.row_bytes("polar4:side_dtype=f16", 512) == engine_row_bytes(512, 4) + 2 == 226
    shape = budget.load_shape(json.dumps({
        "name": "m", "n_layers": 4,
        "streams": [{"name": "k", "dim": 64, "count": 2}, {"name": "v", "dim": 64, "count": 2}]}))
    assert budget.token_bytes(shape, "tq4") == 4 * 4 * 36
    assert budget.token_bytes(shape, "tq4:side_dtype=f16") == 4 * 4 * 34
    assert budget.layer_row_bytes("glm-5.2", "tq4:side_dtype=f16") == 296 - 4
