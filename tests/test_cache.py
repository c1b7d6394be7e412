"""QuantizedKVCache: quantize on write, attention through the consumers, prefill, sizes."""
import numpy as np
import pytest

from kvquant import get_codec
from kvquant.cache import QuantizedKVCache, RowStream, softmax

from conftest import gaussian_rows



def assert_reads(stream, expected, q, w):
    """Scores and contexts of ``stream`` against float64 products with the rows it should hold
    (the engine's identity-check tolerances, docs/reference.md §1.5)."""
    ref_s = q.astype(np.float64) @ expected.T.astype(np.float64)
    assert np.abs(stream.scores(q) - ref_s).max() <= 1e-5 * np.abs(ref_s).max()
    ref_c = w.astype(np.float64) @ expected.astype(np.float64)
    assert np.abs(stream.context(w) - ref_c).max() <= 1e-4 * (np.abs(ref_c).max() + 1)

def _reference_attention(q, K, V, scale):
    """float64 softmax(q K^T * scale) V for one head."""
    s = (q.astype(np.float64) @ K.astype(np.float64).T) * scale
    w = np.exp(s - s.max())
    return (w / w.sum()) @ V.astype(np.float64)


def _gqa_cache(rng, T=50, n_layers=2, keys="tq4", values="kv8", heads=3, dim=64):
    cache = QuantizedKVCache(n_layers, {"k": (keys, dim), "v": (values, dim)}, n_kv_heads=heads)
    K = rng.standard_normal((n_layers, T, heads, dim)).astype(np.float32)
    V = rng.standard_normal((n_layers, T, heads, dim)).astype(np.float32)
    for layer in range(n_layers):
        t = 0
        for step in (1, 7, 1, 20, T):          # uneven appends, growth on the way
            n = min(step, T - t)
            if n:
                cache.append(layer, k=K[layer, t:t + n], v=V[layer, t:t + n])
                t += n
    return cache, K, V


def test_attend_matches_decode_then_attention(rng):
    cache, K, V = _gqa_cache(rng)
    q = gaussian_rows(rng, 9, 64)                          # 9 query heads over 3 KV heads
    for layer in range(2):
        out = cache.attend(layer, q, scale=0.125)
        assert out.shape == (9, 64) and out.dtype == np.float32
        for i in range(9):
            h = i // 3
            K_hat = cache.stream(layer, "k", h).decode()
            V_hat = cache.stream(layer, "v", h).decode()
            ref = _reference_attention(q[i], K_hat, V_hat, 0.125)
            assert np.linalg.norm(out[i] - ref) < 1e-4 * (np.linalg.norm(ref) + 1)


def test_quantized_on_write_and_stored_bit_for_bit(rng):
    cache, K, V = _gqa_cache(rng, T=37)
    codec = get_codec("tq4", 64)
    enc = codec.encode(K[1, :, 2])
    stored = cache.stream(1, "k", 2).encoded()
    assert np.array_equal(stored.codes, enc.codes) and np.array_equal(stored.side, enc.side)


def test_prefill_agrees_with_the_one_query_path(rng):
    cache, K, V = _gqa_cache(rng, T=45, n_layers=1, keys="kv8", values="tq3")
    n_q = 30
    Q = rng.standard_normal((n_q, 9, 64)).astype(np.float32)
    pre = cache.attend_prefill(0, Q, scale=0.125, block=8)
    assert pre.shape == (n_q, 9, 64)
    first = 45 - n_q
    for j in range(n_q):
        one = cache.attend(0, Q[j], scale=0.125, length=first + j + 1)
        assert np.allclose(pre[j], one, rtol=1e-4, atol=2e-5), j


def test_attend_is_the_same_for_one_and_two_threads(rng):
    cache, K, V = _gqa_cache(rng, T=3000, n_layers=1)
    q = gaussian_rows(rng, 9, 64)
    a = cache.attend(0, q, n_threads=1)
    b = cache.attend(0, q, n_threads=2)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_mla_building_blocks(rng):
    """Scores over two streams of different widths and codecs, context over one."""
    cache = QuantizedKVCache(3, {"L": ("kv8-g32", 512), "R": ("tq4", 64)})
    T = 23
    L = gaussian_rows(rng, T, 512)
    R = gaussian_rows(rng, T, 64)
    cache.append(2, L=L, R=R)
    qL, qR = gaussian_rows(rng, 4, 512), gaussian_rows(rng, 4, 64)
    s = cache.scores(2, "L", qL) + cache.scores(2, "R", qR)
    w = softmax(s * np.float32(0.05))
    ctx = cache.context(2, "L", w)
    L_hat = cache.stream(2, "L").decode().astype(np.float64)
    R_hat = cache.stream(2, "R").decode().astype(np.float64)
    s_ref = qL @ L_hat.T + qR @ R_hat.T
    assert np.allclose(s, s_ref, rtol=1e-5, atol=1e-3)
    w_ref = np.exp(0.05 * (s_ref - s_ref.max(axis=1, keepdims=True)))
    w_ref /= w_ref.sum(axis=1, keepdims=True)
    assert np.allclose(ctx, w_ref @ L_hat, rtol=1e-4, atol=1e-4)
    assert cache.length(2) == T and cache.length(0) == 0


@pytest.mark.parametrize("specs, per_token", [
    (("f32", "f32"), 2304), (("kv8", "kv8"), 584), (("tq4", "tq4"), 296),
])
def test_bytes_per_token_reproduce_the_engine_rows(specs, per_token, rng):
    """docs/reference.md §1.6: one layer of L (512) and R (64) rows."""
    cache = QuantizedKVCache(1, {"L": (specs[0], 512), "R": (specs[1], 64)})
    assert cache.bytes_per_token == per_token
    cache.append(0, L=gaussian_rows(rng, 10, 512), R=gaussian_rows(rng, 10, 64))
    assert cache.nbytes == 10 * per_token
    assert cache.capacity_bytes >= cache.nbytes


def test_growth_is_geometric_and_reserve_avoids_copies(rng):
    stream = RowStream(get_codec("kv8", 16))
    X = gaussian_rows(rng, 1000, 16)
    capacities = set()
    for i in range(1000):
        stream.append(X[i:i + 1])
        capacities.add(stream.capacity)
    assert len(capacities) <= 8                     # 16, 32, ..., 1024: O(log T) reallocations
    assert stream.capacity < 2 * 1000 + 16
    enc = get_codec("kv8", 16).encode(X)
    assert np.array_equal(stream.encoded().codes, enc.codes)
    reserved = RowStream(get_codec("kv8", 16), capacity=1000)
    buffer = reserved.store._codes
    for i in range(1000):
        reserved.append(X[i:i + 1])
    assert reserved.store._codes is buffer


def test_per_layer_codecs_and_truncate(rng):
    cache = QuantizedKVCache(2, {"k": (["tq2", "tq8"], 32), "v": ("kv8", 32)})
    assert cache.codec(0, "k").spec == "tq2" and cache.codec(1, "k").spec == "tq8"
    for layer in range(2):
        cache.append(layer, k=gaussian_rows(rng, 12, 32), v=gaussian_rows(rng, 12, 32))
    assert len(cache) == 12
    cache.truncate(5)
    assert cache.length(0) == cache.length(1) == 5
    assert cache.attend(1, gaussian_rows(rng, 2, 32)).shape == (2, 32)


def test_bad_rows_leave_the_cache_untouched(rng):
    cache = QuantizedKVCache(1, {"k": ("tq4", 64), "v": ("kv8", 64)}, n_kv_heads=2)
    K = rng.standard_normal((3, 2, 64)).astype(np.float32)
    V = K.copy()
    V[1, 1, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cache.append(0, k=K, v=V)
    assert cache.length(0) == 0 and cache.stream(0, "k", 0).n_rows == 0


def test_errors_name_the_problem(rng):
    cache = QuantizedKVCache(2, {"k": ("tq4", 64), "v": ("kv8", 64)}, n_kv_heads=2)
    with pytest.raises(ValueError, match="every stream"):
        cache.append(0, k=np.zeros((1, 2, 64)))
    with pytest.raises(ValueError, match=r"\(n_new, 2, 64\)"):
        cache.append(0, k=np.zeros((1, 64)), v=np.zeros((1, 64)))
    with pytest.raises(ValueError, match="same number"):
        cache.append(0, k=np.ones((1, 2, 64)), v=np.ones((2, 2, 64)))
    with pytest.raises(ValueError, match="evenly"):
        cache.attend(0, np.zeros((3, 64)))
    with pytest.raises(IndexError):
        cache.attend(2, np.zeros((2, 64)))
    with pytest.raises(KeyError):
        cache.stream(0, "L")
    with pytest.raises(ValueError, match="append the rows first"):
        cache.attend_prefill(0, np.zeros((1, 2, 64)))
    with pytest.raises(ValueError, match="dim"):
        QuantizedKVCache(1, {"k": ("kv8", 0), "v": ("kv8", 8)})


# -- stream options: center, sinks ----------------------------------------------------------------
def _offset_rows(rng, n, dim=64, shift=4.0):
    """Rows sharing a large per-channel mean, as keys of real models do."""
    mean = shift * rng.standard_normal(dim)
    return (rng.standard_normal((n, dim)) + mean).astype(np.float32)


@pytest.mark.parametrize("codec_spec", ["tq4", "polar4", "q4_0+rot", "kv8"])
def test_centered_stream_is_the_codec_on_the_rows_minus_the_first_append_mean(rng, codec_spec):
    X = _offset_rows(rng, 60)
    stream = RowStream(get_codec(codec_spec, 64), center=True)
    stream.append(X[:25])
    stream.append(X[25:])                      # the offset is the first append's mean, kept
    mu = X[:25].astype(np.float64).mean(axis=0).astype(np.float32)
    codec = get_codec(codec_spec, 64)
    expected = codec.decode(codec.encode(X - mu)) + mu
    assert np.array_equal(stream.offset, mu)
    assert np.array_equal(stream.decode(), expected)
    assert np.array_equal(stream.decode(10, 40), expected[10:40])
    q = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.random((3, 60)).astype(np.float32)
    assert_reads(stream, expected, q, w)


def test_centering_lowers_the_error_of_offset_rows(rng):
    X = _offset_rows(rng, 400)
    plain, centered = RowStream(get_codec("tq4", 64)), RowStream(get_codec("tq4", 64), center=True)
    plain.append(X)
    centered.append(X)
    err = [np.linalg.norm(s.decode() - X) for s in (plain, centered)]
    # the codec's relative error applies to the rows minus the mean: ~4x smaller here
    assert err[1] < 0.4 * err[0]


@pytest.mark.parametrize("steps", [(5,), (1, 1, 1, 2), (2, 3), (4, 1)])
def test_sinks_are_exact_and_the_rest_is_the_codec(rng, steps):
    X = rng.standard_normal((sum(steps), 64)).astype(np.float32)
    stream = RowStream(get_codec("tq3", 64), sinks=3)
    t = 0
    for n in steps:
        stream.append(X[t:t + n])
        t += n
    codec = get_codec("tq3", 64)
    D = stream.decode()
    assert np.array_equal(D[:3], X[:3])
    assert np.array_equal(D[3:], codec.decode(codec.encode(X[3:])))
    assert stream.nbytes == 3 * 64 * 4 + (len(X) - 3) * codec.bytes_per_row
    q = rng.standard_normal(64).astype(np.float32)
    for length in range(len(X) + 1):
        s = stream.scores(q, length=length)
        assert s.shape == (length,)
        assert np.allclose(s, D[:length] @ q, rtol=1e-5, atol=1e-5)
        w = rng.random(length).astype(np.float32)
        assert np.allclose(stream.context(w), w @ D[:length], rtol=1e-5, atol=1e-5)


def test_cache_with_stream_options_attends_like_its_decoded_rows(rng):
    cache, K, V = _gqa_cache(rng, keys="polar5@center,sinks=1", values="polar4@sinks=1")
    assert cache.stream(0, "k").spec == "polar5@center,sinks=1"
    q = gaussian_rows(rng, 9, 64)
    out = cache.attend(1, q, scale=0.125)
    for i in range(9):
        h = i // 3
        K_hat, V_hat = cache.stream(1, "k", h).decode(), cache.stream(1, "v", h).decode()
        assert np.array_equal(K_hat[0], K[1, 0, h]) and np.array_equal(V_hat[0], V[1, 0, h])
        ref = _reference_attention(q[i], K_hat, V_hat, 0.125)
        assert np.linalg.norm(out[i] - ref) < 1e-4 * (np.linalg.norm(ref) + 1)
    Q = rng.standard_normal((20, 9, 64)).astype(np.float32)
    pre = cache.attend_prefill(1, Q, scale=0.125, block=8)
    for j in (0, 19):
        one = cache.attend(1, Q[j], scale=0.125, length=50 - 20 + j + 1)
        assert np.allclose(pre[j], one, rtol=1e-4, atol=1e-5)


def test_stream_options_bad_rows_truncate_and_errors(rng):
    stream = RowStream(get_codec("tq4", 64), center=True, sinks=2)
    X = rng.standard_normal((6, 64)).astype(np.float32)
    bad = X.copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="sink row"):
        stream.append(bad)
    assert len(stream) == 0 and stream.offset is None
    stream.append(X)
    with pytest.raises(ValueError, match="no offset"):
        stream.append_encoded(get_codec("tq4", 64).encode(X))
    stream.truncate(1)
    assert np.array_equal(stream.decode(), X[:1])
    stream.truncate(0)
    assert stream.offset is None
    for spec, match in [("tq4@", "nothing after"), ("tq4@centre", "unknown stream option"),
                        ("tq4@sinks=-1", "sinks"), ("tq4@sinks", "sinks"),
                        ("tq4@center=1", "no value"), ("tq4@center,center", "twice")]:
        with pytest.raises(ValueError, match=match):
            QuantizedKVCache(1, {"k": (spec, 64)})
    with pytest.raises(ValueError, match="stream options"):
        get_codec("tq4@center", 64)


def test_normalized_stream_scales_channels_by_the_root_of_their_spread(rng):
    X = _offset_rows(rng, 80) * np.geomspace(0.1, 10.0, 64).astype(np.float32)
    stream = RowStream(get_codec("polar5", 64), center=True, normalize=True)
    stream.append(X[:50])
    stream.append(X[50:])
    mu = X[:50].astype(np.float64).mean(axis=0)
    sigma = np.sqrt(((X[:50] - mu) ** 2).mean(axis=0))
    scale = np.sqrt(sigma / np.sqrt((sigma ** 2).mean())).astype(np.float32)
    assert np.allclose(stream.channel_scale, scale, rtol=1e-6)
    codec = get_codec("polar5", 64)
    mu32, s32 = stream.offset, stream.channel_scale
    expected = codec.decode(codec.encode((X - mu32) / s32)) * s32 + mu32
    assert np.array_equal(stream.decode(), expected)
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w = rng.random((2, 80)).astype(np.float32)
    assert_reads(stream, expected, q, w)
    assert stream.nbytes == 80 * codec.bytes_per_row + 2 * 64 * 4
    # rows with channels of very different spread: the error falls
    plain = RowStream(get_codec("polar5", 64), center=True)
    plain.append(X)
    assert np.linalg.norm(stream.decode() - X) < np.linalg.norm(plain.decode() - X)


def test_normalize_with_one_first_row_keeps_unit_scales(rng):
    stream = RowStream(get_codec("tq4", 64), normalize=True)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    stream.append(X[:1])
    stream.append(X[1:])
    assert np.array_equal(stream.channel_scale, np.ones(64, np.float32))
    assert stream.spec == "tq4@normalize"
    with pytest.raises(ValueError, match="no value"):
        QuantizedKVCache(1, {"k": ("tq4@normalize=1", 64)})


# -- stream factories: streams of one's own --------------------------------------------------------
def test_stream_factory_gives_each_layer_and_head_its_own_stream(rng):
    calls = []

    def make_stream(capacity):
        calls.append(capacity)
        return RowStream(get_codec("tq4", 64), capacity, center=True, sinks=1)

    own = QuantizedKVCache(2, {"k": (make_stream, 64), "v": ("kv8", 64)}, n_kv_heads=3,
                           capacity=40)
    assert calls == [40] * 6
    streams = {id(own.stream(layer, "k", h)) for layer in range(2) for h in range(3)}
    assert len(streams) == 6
    # the same rows as the spec that names those options
    named = QuantizedKVCache(2, {"k": ("tq4@center,sinks=1", 64), "v": ("kv8", 64)},
                             n_kv_heads=3)
    K = rng.standard_normal((2, 30, 3, 64)).astype(np.float32)
    V = rng.standard_normal((2, 30, 3, 64)).astype(np.float32)
    for cache in (own, named):
        for layer in range(2):
            cache.append(layer, k=K[layer, :12], v=V[layer, :12])
            cache.append(layer, k=K[layer, 12:], v=V[layer, 12:])
    Q = rng.standard_normal((30, 9, 64)).astype(np.float32)
    for layer in range(2):
        assert np.array_equal(own.attend_prefill(layer, Q), named.attend_prefill(layer, Q))
    assert own.bytes_per_token == named.bytes_per_token
    assert own.stream(0, "k", 2).spec == "tq4@center,sinks=1"


def test_stream_factory_errors():
    with pytest.raises(TypeError, match="RowStream"):
        QuantizedKVCache(1, {"k": (lambda cap: get_codec("tq4", 64), 64)})
    with pytest.raises(ValueError, match="width 32"):
        QuantizedKVCache(1, {"k": (lambda cap: RowStream(get_codec("tq4", 32)), 64)})
    shared = RowStream(get_codec("tq4", 64))
    with pytest.raises(ValueError, match="same RowStream twice"):
        QuantizedKVCache(1, {"k": (lambda cap: shared, 64)}, n_kv_heads=2)
    full = RowStream(get_codec("tq4", 64))
    full.append(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="holding 2 rows"):
        QuantizedKVCache(1, {"k": (lambda cap: full, 64)})
