"""fp8 e4m3fn against docs/reference.md §1.1, ml_dtypes and the numpy reference."""
import ml_dtypes
import numpy as np
import pytest

from kvquant import get_codec, reference
from kvquant._kernels import fp8 as fp8_kernels

from conftest import gaussian_rows


def encode_elements(x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape[0], np.uint8)
    fp8_kernels.float_to_e4m3(x, out)
    return out


@pytest.mark.parametrize("value, expected", [
    (17.0, 16.0), (19.0, 20.0), (17.1, 18.0), (14.5, 14.0), (15.5, 16.0), (15.9, 16.0),
])
def test_rounding_vectors(value, expected):
    table = np.array(fp8_kernels.e4m3_table(), np.float32)
    assert table[encode_elements([value])[0]] == expected


@pytest.mark.parametrize("value, code", [
    (2.0**-10, 0x00), (1.5 * 2.0**-10, 0x01), (1000.0, 0x7E), (-1e30, 0xFE), (np.inf, 0x7E),
    (-np.inf, 0xFE), (-0.0, 0x80), (0.0, 0x00), (np.nan, 0x00), (448.0, 0x7E), (-448.0, 0xFE),
])
def test_special_vectors(value, code):
    assert encode_elements([value])[0] == code


def test_every_code_round_trips_except_nan():
    table = np.array(fp8_kernels.e4m3_table(), np.float32)
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)])
    assert np.array_equal(encode_elements(table[codes]), codes)
    assert table[0x7F] == 0 and table[0xFF] == 0
    # the decode table is the format's definition
    ref = reference.e4m3_values()
    assert np.array_equal(table[codes], ref[codes].astype(np.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_encoder_never_emits_nan_codes(rng):
    x = np.concatenate([rng.standard_normal(100000) * 10.0**rng.uniform(-12, 40, 100000),
                        [np.nan, np.inf, -np.inf, 464, 480, -479.9]]).astype(np.float32)
    codes = encode_elements(x)
    assert not np.isin(codes, [0x7F, 0xFF]).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_exhaustive_float16_against_ml_dtypes():
    x = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    ours = encode_elements(x)
    theirs = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    # Deliberate differences: ml_dtypes maps NaN, +-inf and |x| >= 464 to the NaN code; the engine
    # maps NaN to 0x00 and saturates everything beyond 448 to +-448.
    same_rules = np.isfinite(x) & (np.abs(x) < 464)
    assert same_rules.sum() > 48000   # all float16 values below 464 in magnitude
    assert np.array_equal(ours[same_rules], theirs[same_rules])
    big = np.isfinite(x) & (np.abs(x) >= 464)
    assert np.all(ours[big] == np.where(np.signbit(x[big]), 0xFE, 0x7E))
    assert np.all(ours[np.isnan(x)] == 0)


def test_random_float32_against_ml_dtypes_and_reference(rng):
    x = (rng.standard_normal(200000) * 2.0 ** rng.integers(-14, 10, 200000)).astype(np.float32)
    x = x[np.abs(x) < 464]
    ours = encode_elements(x)
    assert np.array_equal(ours, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    sub = x[:5000]
    assert np.array_equal(encode_elements(sub), reference.e4m3_encode(sub))


@pytest.mark.parametrize("spec, group", [("kv8", None), ("kv8-g32", 32), ("kv8-g8", 8)])
def test_rows_match_reference(rng, spec, group):
    X = gaussian_rows(rng, 300, 128) * rng.uniform(0.01, 100, (300, 1)).astype(np.float32)
    X[5] = 0.0
    X[6, :64] = 0.0
    codec = get_codec(spec, 128)
    enc = codec.encode(X)
    ref_codes, ref_scales = reference.fp8_encode_rows(X, group)
    assert np.array_equal(enc.codes, ref_codes)
    assert np.array_equal(enc.side, ref_scales)
    assert np.array_equal(codec.decode(enc), reference.fp8_decode_rows(ref_codes, ref_scales, group))


def test_row_scale_rule_and_error_bound(rng):
    X = gaussian_rows(rng, 1000, 64) * 7.0
    codec = get_codec("kv8", 64)
    enc = codec.encode(X)
    amax = np.abs(X).max(axis=1)
    assert np.array_equal(enc.side[:, 0], (amax / np.float32(448)).astype(np.float32))
    Xh = codec.decode(enc)
    # the max element maps exactly to +-448 and comes back exactly
    idx = np.abs(X).argmax(axis=1)
    assert np.all(np.abs(enc.codes[np.arange(1000), idx]) & 0x7F == 0x7E)
    bound = np.abs(X) / 16 + enc.side * 2.0**-10
    assert np.all(np.abs(Xh - X) <= bound * (1 + 1e-6))
    rel_mse = ((Xh - X) ** 2).sum() / (X**2).sum()
    assert 4e-4 < rel_mse < 9e-4   # docs/reference.md §2: ~6.6e-4 on Gaussian rows


def test_inert_rows():
    X = np.zeros((3, 16), np.float32)
    X[1] = 1e-36
    X[2, 3] = np.nan
    codec = get_codec("kv8", 16, nonfinite="inert")
    enc = codec.encode(X)
    assert np.all(enc.codes == 0) and np.all(enc.side == 1.0)
    assert np.all(codec.decode(enc) == 0)


def test_engine_rule_for_nan_and_inf_elements(rng):
    """As the engine: a NaN element encodes to 0 in an otherwise normal group; an inf makes its
    group inert."""
    X = gaussian_rows(rng, 4, 32)
    X[1, 5] = np.nan
    X[2, 20] = np.inf
    X[3, :] = np.nan
    codec = get_codec("kv8-g16", 32, nonfinite="inert")
    enc = codec.encode(X)
    ref_codes, ref_scales = reference.fp8_encode_rows(X, 16)
    assert np.array_equal(enc.codes, ref_codes) and np.array_equal(enc.side, ref_scales)
    assert enc.codes[1, 5] == 0 and enc.side[1, 0] == np.abs(np.delete(X[1, :16], 5)).max() / 448
    assert np.all(enc.codes[2, 16:] == 0) and enc.side[2, 1] == 1.0 and enc.side[2, 0] != 1.0
    assert np.all(enc.codes[3] == 0) and np.all(enc.side[3] == 1.0)


def test_nonfinite_rows_raise_by_default():
    X = np.ones((4, 16), np.float32)
    X[2, 0] = np.inf
    with pytest.raises(ValueError, match=r"rows 2\b"):
        get_codec("kv8", 16).encode(X)


