"""The compiled softmax (kvquant/_kernels/softmax.h, kvquant.cache.softmax) against independent
references: its exp against float64 exp to within 1 ulp, its weights against a float64 softmax,
its sums bit for bit against the order softmax.h defines (computed step by step in numpy float32),
the same bits on every path and thread count, and numpy's softmax's NaN and infinity rules."""
import numpy as np
import pytest

from kvquant import reference
from kvquant._kernels import softmax as kernel
from kvquant.cache import softmax

from _simd import PATHS, as_bits
from _simd import simd_path  # noqa: F401 (fixture)

LENGTHS = [1, 15, 16, 17, 4095, 4096, 4097, 3 * 4096 + 5]


def _exp(x):
    out = np.empty_like(x)
    kernel.exp_nonpositive(x, out)
    return out


def _ulps(got, x):
    """|got - exp(x)| in units of the last place of exp(x) rounded to float32."""
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / ulp


def test_exp_is_within_one_ulp_down_to_the_smallest_subnormal():
    x = -np.linspace(0.0, 104.0, 1_500_001, dtype=np.float32)
    x = np.concatenate([x, -np.float32(2.0) ** -np.arange(1, 60, dtype=np.float32)])
    got = _exp(x)
    err = _ulps(got, x)
    assert err.max() <= 1.0, (err.max(), x[err.argmax()])
    # most results are the correctly rounded ones
    assert np.mean(got == np.exp(x.astype(np.float64)).astype(np.float32)) > 0.85
    assert (got[x < -87.5] < np.finfo(np.float32).tiny).all()     # subnormal results exist
    assert (got[x < -87.5] > 0).any()


def test_exp_special_values():
    x = np.array([0.0, -0.0, -np.inf, np.nan, -104.0, -104.5, -1e30], np.float32)
    got = _exp(x)
    assert got[0] == 1.0 and got[1] == 1.0
    assert got[2] == 0.0 and np.isnan(got[3])
    # e^-104 < 2^-150: rounds to 0, as everything below
    assert np.exp(np.float64(-104.0)) < 2.0**-150
    assert not got[4:].any()


def _softmax64(S, scale=1.0):
    t = (S.astype(np.float32) * np.float32(scale)).astype(np.float64)
    e = np.exp(t - t.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax_in_order(S, scale):
    """softmax.h's definition in numpy float32, step by step: the kernel's own exp (tested above)
    and its order of sums (lanes within chunks of 4096, the tree, chunks in order)."""
    t = S * np.float32(scale)
    e = np.empty_like(t)
    for r in range(len(t)):
        e[r] = _exp(t[r] - t[r].max())
    out = np.empty_like(t)
    n = t.shape[1]
    for r in range(len(t)):
        total = None
        for a in range(0, n, kernel.CHUNK):
            chunk = e[r, a:a + kernel.CHUNK]
            padded = np.zeros(-(-len(chunk) // 16) * 16, np.float32)
            padded[:len(chunk)] = chunk
            lanes = np.zeros(16, np.float32)
            for g in padded.reshape(-1, 16):
                lanes = lanes + g
            s8 = lanes[:8] + lanes[8:]
            s4 = s8[:4] + s8[4:]
            s2 = s4[:2] + s4[2:]
            part = s2[0] + s2[1]
            total = part if total is None else np.float32(total + part)
        out[r] = e[r] / total
    return out


@pytest.mark.parametrize("n", LENGTHS)
def test_weights_follow_the_defined_order_on_every_path_and_thread_count(rng, n, simd_path):
    S = (rng.standard_normal((3, n)) * 6).astype(np.float32)
    want = _softmax_in_order(S, 0.125)
    for path in PATHS:
        simd_path(path)
        for threads in (1, 2, 3):
            got = S.copy()
            kernel.softmax_rows(got, 0.125, threads)
            assert np.array_equal(as_bits(got), as_bits(want)), (path, threads)


@pytest.mark.parametrize("n", [1, 17, 4097, 131072])
def test_weights_match_a_float64_softmax(rng, n):
    S = (rng.standard_normal((2, n)) * 8).astype(np.float32)
    got = softmax(S, scale=0.25)
    assert got.dtype == np.float32 and got.shape == S.shape
    # exp within 1 ulp and the division within half of one; the sum runs 256 terms a lane
    # and 32 chunks in order at n = 131072, whose roundings (2^-24 each, random signs) reach
    # ~1e-6 (1.1e-6 seen here, and by numpy's float32 softmax too)
    np.testing.assert_allclose(got, _softmax64(S, 0.25), rtol=4e-6, atol=1e-30)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=2e-6)


def test_scale_is_the_float32_product(rng):
    S = (rng.standard_normal((4, 999)) * 5).astype(np.float32)
    scale = 1 / np.sqrt(96.0)
    assert np.array_equal(as_bits(softmax(S, scale=scale)),
                          as_bits(softmax(S * np.float32(scale))))


def test_in_place_views_and_dtypes_give_the_same_bits(rng):
    S = (rng.standard_normal((2, 3, 500)) * 8).astype(np.float32)
    S[1, 2, 10:20] = -np.inf                          # masked entries read as weight 0
    want = softmax(S)
    assert want is not S and not want[1, 2, 10:20].any()
    work = S.copy()
    got = softmax(work, out=work)
    assert got is work and np.array_equal(as_bits(got), as_bits(want))
    # a transposed view: the weights of each row do not depend on its layout
    T = np.ascontiguousarray(np.swapaxes(S, 1, 2))
    view = np.swapaxes(T, 1, 2)
    got = softmax(view, out=view)
    assert got is view and np.array_equal(as_bits(got), as_bits(want))
    got64 = softmax(S.astype(np.float64))
    assert got64.dtype == np.float32 and np.array_equal(as_bits(got64), as_bits(want))


def test_nan_and_infinities_follow_numpy():
    rows = np.array([[0.0, 1.0, np.nan, 2.0],           # a NaN: the row is NaN
                     [0.0, np.inf, 1.0, 2.0],           # +inf: NaN (inf - inf)
                     [-np.inf] * 4,                     # nothing visible: NaN (-inf + inf)
                     [0.0, -np.inf, 1.0, -np.inf],      # -inf entries: weight 0
                     [3.0, 3.0, 3.0, 3.0]], np.float32)
    with np.errstate(invalid="ignore"):
        want = reference.softmax(rows.copy())
    got = softmax(rows)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[:3]).all()
    np.testing.assert_allclose(got[3:], want[3:], rtol=1e-6)
    assert got[4].tolist() == [0.25] * 4


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="at least one score"):
        softmax(np.zeros((3, 0), np.float32))
    with pytest.raises(ValueError, match="at least one score"):
        softmax(np.float32(1.0))
