"""QuantizedKVCache: quantize on write, attention through the consumers, prefill, sizes."""
import numpy as np
import pytest

from kvquant import get_codec
from kvquant.cache import QuantizedKVCache, RowStream, softmax

from conftest import gaussian_rows


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
    """REFERENCE.md §1.6: one layer of L (512) and R (64) rows."""
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
    buffer = reserved._codes
    for i in range(1000):
        reserved.append(X[i:i + 1])
    assert reserved._codes is buffer


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
