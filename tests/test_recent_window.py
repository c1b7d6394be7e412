"""The recent window (stream option ``recent=W``): a query at position p reads rows p-W+1 .. p
from float32 copies and older rows through the codec; checked against a numpy statement of that
rule, per query, in the one-query consumers, the prefill and a real forward pass."""
import numpy as np
import pytest

from kvquant import get_codec
from kvquant.cache import QuantizedKVCache, RowStream
from kvquant.specs import split_spec_text
from kvquant.streams.options import MAX_RECENT, parse_stream_spec

D = 32


def rows(rng, n, d=D):
    X = rng.standard_normal((n, d)).astype(np.float32)
    X += np.linspace(-2, 2, d, dtype=np.float32)     # a shared offset, as keys have
    return X


def coded_rows(codec_spec, X, first, center=False, sinks=0):
    """The rows as the codec gives them back (numpy statement of centering and sinks; the
    offset is the mean of the first append's ``first`` rows): what a row outside every window
    reads as."""
    codec = get_codec(codec_spec, X.shape[1])
    offset = X[:first].astype(np.float64).mean(axis=0).astype(np.float32) if center else 0
    out = X.copy()
    out[sinks:] = codec.decode(codec.encode(X[sinks:] - offset)) + offset
    return out


def seen_by(X, Xq, length, W, sinks=0, held_from=0):
    """Rows 0..length-1 as a query at position length-1 reads them: float32 within its window
    (and the sinks), the codec's rows elsewhere."""
    out = Xq[:length].copy()
    start = max(length - W, held_from, sinks)
    out[start:length] = X[start:length]
    out[:sinks] = X[:sinks]
    return out


@pytest.mark.parametrize("spec, center, sinks", [("tq4", False, 0), ("polar4", True, 2),
                                                 ("q4_0+rot", True, 0), ("kv8", False, 1)])
@pytest.mark.parametrize("W", [1, 5, 64])
def test_reads_take_the_window_from_float32(rng, spec, center, sinks, W):
    X = rows(rng, 40)
    opts = {"center": center, "sinks": sinks}
    stream = RowStream(get_codec(spec, D), recent=W, **opts)
    for a, b in ((0, 12), (12, 13), (13, 40)):
        stream.append(X[a:b])
    Xq = coded_rows(spec, X, first=12, center=center, sinks=sinks)
    q = rng.standard_normal((3, D)).astype(np.float32)
    # every length from the last append's first row on: the copies of that append are held
    for length in range(14, 41):
        want = seen_by(X, Xq, length, W, sinks, held_from=min(13 - W, 12) if W < 13 else 0)
        np.testing.assert_allclose(stream.scores(q, length=length), q @ want.T,
                                   rtol=1e-5, atol=1e-4)
        w = rng.random((2, length)).astype(np.float32)
        np.testing.assert_allclose(stream.context(w), w @ want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(stream.decode(), seen_by(X, Xq, 40, W, sinks), atol=1e-5)
    np.testing.assert_allclose(stream.decode(window=False), Xq, atol=1e-5)


def test_a_row_that_left_the_window_reads_from_its_codes(rng):
    X = rows(rng, 30)
    stream = RowStream(get_codec("tq3", D), recent=4)
    stream.append(X[:20])
    for t in range(20, 30):     # decode steps: one row each
        stream.append(X[t:t + 1])
    Xq = coded_rows("tq3", X, first=20)
    assert stream.window_start() == 26
    np.testing.assert_allclose(stream.decode(), seen_by(X, Xq, 30, 4), atol=1e-5)
    with pytest.raises(ValueError, match="not all held in float32"):
        stream.recent_rows(20, 30)     # rows 20..25 left the window: only their codes remain
    stream.truncate(28)
    # the window of length 28 is rows 24..27; the stream held copies from row 25 on (the last
    # window and the last append), so 25..27 read exact, 24 from its codes
    assert stream.window_start() == 25
    np.testing.assert_allclose(stream.decode(), seen_by(X, Xq, 28, 4, held_from=25), atol=1e-5)
    with pytest.raises(ValueError, match="read at least 28 rows"):
        stream.scores(np.ones(D, np.float32), length=20)   # its window's copies are gone
    stream.append(X[28:30])
    np.testing.assert_allclose(stream.decode(), seen_by(X, Xq, 30, 4), atol=1e-5)


def test_bytes_count_the_window_copies():
    codec = get_codec("tq4", 64)
    stream = RowStream(codec, recent=16, sinks=1, center=True)
    for n in (0, 1, 5, 17, 100):
        exact = min(n, 1)
        window = min(n - exact, 16)
        vectors = 1 if n else 0
        assert stream.bytes_for(n) == (n - exact) * codec.bytes_per_row + 256 * (
            exact + window + vectors)
    assert stream.fixed_bytes == stream.bytes_for(17) - 17 * codec.bytes_per_row


def test_nonfinite_rows_under_inert_read_as_zero_in_the_window(rng):
    X = rows(rng, 6)
    X[4, 3] = np.nan
    stream = RowStream(get_codec("tq4", D, nonfinite="inert"), recent=3)
    stream.append(X)
    assert (stream.decode()[4] == 0).all() and np.isfinite(stream.decode()).all()
    with pytest.raises(ValueError, match="NaN"):
        RowStream(get_codec("tq4", D), recent=3).append(X)


def reference_attention(Q, K, Kq, V, Vq, first, Wk, Wv, scale):
    """Float64 causal attention of queries at positions first.. with per-query windows."""
    n_q, n_heads, _ = Q.shape
    out = np.empty((n_q, n_heads, V.shape[1]))
    for j in range(n_q):
        p = first + j
        Ks, Vs = Kq[:p + 1].astype(np.float64), Vq[:p + 1].astype(np.float64)
        Ks[max(0, p + 1 - Wk):] = K[max(0, p + 1 - Wk):p + 1]
        Vs[max(0, p + 1 - Wv):] = V[max(0, p + 1 - Wv):p + 1]
        s = Q[j].astype(np.float64) @ Ks.T * scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[j] = (w / w.sum(axis=1, keepdims=True)) @ Vs
    return out


@pytest.mark.parametrize("block", [256, 7])
def test_prefill_gives_each_query_its_own_window(rng, block):
    K, V = rows(rng, 50), rows(rng, 50)
    cache = QuantizedKVCache(1, {"k": ("tq4@recent=8", D), "v": ("tq3@recent=3", D)})
    cache.append(0, k=K[:20, None], v=V[:20, None])
    cache.append(0, k=K[20:, None], v=V[20:, None])
    Q = rng.standard_normal((30, 2, D)).astype(np.float32)
    got = cache.attend_prefill(0, Q, block=block)
    Kq = coded_rows("tq4", K, first=20)
    Vq = coded_rows("tq3", V, first=20)
    want = reference_attention(Q, K, Kq, V, Vq, 20, 8, 3, 1 / np.sqrt(D))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    one = np.stack([cache.attend(0, Q[j], length=21 + j) for j in range(30)])
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-5 * np.abs(one).max())
    # the window changes the answer: without it every row is read from its codes
    plain = QuantizedKVCache(1, {"k": ("tq4", D), "v": ("tq3", D)})
    plain.append(0, k=K[:20, None], v=V[:20, None])
    plain.append(0, k=K[20:, None], v=V[20:, None])
    assert np.abs(plain.attend_prefill(0, Q) - got).max() > 1e-3


def test_prefill_with_sinks_inside_the_first_windows(rng):
    """Queries at positions within the sinks read no window copies (their rows are exact)."""
    K, V = rows(rng, 9), rows(rng, 9)
    cache = QuantizedKVCache(1, {"k": ("tq3@center,normalize,sinks=2,recent=3", D),
                                 "v": ("tq3@sinks=2,recent=3", D)})
    cache.append(0, k=K[:, None], v=V[:, None])
    Q = rng.standard_normal((9, 1, D)).astype(np.float32)
    got = cache.attend_prefill(0, Q, block=4)
    one = np.stack([cache.attend(0, Q[j], length=j + 1) for j in range(9)])
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-5 * np.abs(one).max())


def test_a_window_in_any_layer_counts():
    cache = QuantizedKVCache(2, {"k": (["tq4", "tq4@recent=4"], D), "v": ("tq4", D)})
    assert cache.recent == 4


def test_spec_language_and_where_a_window_cannot_go():
    assert parse_stream_spec("tq4@center,recent=16") == ("tq4", {"center": True, "recent": 16})
    assert split_spec_text("tq4@recent=16,kv8") == ["tq4@recent=16", "kv8"]
    with pytest.raises(ValueError, match=f"0 <= N <= {MAX_RECENT}"):
        parse_stream_spec(f"tq4@recent={MAX_RECENT + 1}")
    assert RowStream(get_codec("tq4", D), recent=16, sinks=1).spec == "tq4@sinks=1,recent=16"
    with pytest.raises(ValueError, match="recent_rows must be given exactly"):
        from kvquant.streams.options import StreamOptions
        RowStream.from_state(get_codec("tq4", D), StreamOptions(recent=4),
                             np.zeros((0, 16), np.uint8), np.zeros((0, 1), np.float32))
