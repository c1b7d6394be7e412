"""llama.cpp's attention as it runs (kvquant.ggml_attention) against references written here.

The references follow the description of ggml's CPU flash attention (one query at a time, online
softmax in float32, the query rounded to the K type's dot type, an f16 running sum for f16
values) as plain loops; the block formats come from the ``gguf`` package's quantizers and
``scipy.linalg.hadamard``; nothing is copied from the code under test.
"""
import os

import numpy as np
import pytest
import scipy.linalg

gguf = pytest.importorskip("gguf", reason="the model extra (gguf) is not installed")

from kvquant.ggml_attention import (  # noqa: E402
    GGMLAttentionCache, GGMLPair, attend_rows, hadamard_matrix, parse_ggml_pair,
    quantize_q8_0_x86, rotate_blocks, round_query, stored_values)

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
F32, F16 = np.float32, np.float16


# -- references -----------------------------------------------------------------------------------
def q8_0_x86_reference(x):
    """One row through the x86 q8_0 quantizer, element by element: d = f16(amax / 127),
    q = round-half-even(x * (127 / amax)) in float32. Returns the dequantized row."""
    out = np.empty(x.size, F32)
    for b in range(0, x.size, 32):
        block = x[b:b + 32].astype(F32)
        amax = F32(max(abs(float(v)) for v in block))
        d = F16(F32(amax / F32(127)))
        inv = F32(F32(127) / amax) if amax != 0 else F32(0)
        for j, v in enumerate(block):
            out[b + j] = F32(round(float(F32(v * inv)))) * F32(d)   # Python's round: half even
    return out


def stored_reference(X, kind):
    """What llama.cpp's cache holds: f16 nearest, x86 q8_0, or gguf's (reference) q4_0."""
    if kind == "f16":
        return X.astype(F16).astype(F32)
    if kind == "q8_0":
        return np.stack([q8_0_x86_reference(r) for r in X])
    return gguf.quants.dequantize(gguf.quants.quantize(X, Q4_0), Q4_0).astype(F32)


def query_reference(q, k_type):
    return q.astype(F16).astype(F32) if k_type == "f16" else q8_0_x86_reference(q)


def one_query_reference(q, K, V, scale, k_type, v_type, visible):
    """ggml's one-query path for one query: rows in order, online softmax with a running max M
    and sum S, the value sum in f16 when V is f16 (rounded after every update)."""
    qr = query_reference(q, k_type)
    acc = np.zeros(V.shape[1], F16 if v_type == "f16" else F32)
    M, S = F32(-np.inf), F32(0)
    for t in range(K.shape[0]):
        if not visible[t]:
            continue
        s = F32(F32(np.dot(qr.astype(np.float64), K[t].astype(np.float64))) * scale)
        ms, vs = F32(1), F32(1)
        if s > M:
            ms = F32(np.exp(F32(M - s)))
            M = s
            acc = (acc.astype(F32) * ms).astype(acc.dtype)
        else:
            vs = F32(np.exp(F32(s - M)))
        acc = (acc.astype(F32) + V[t] * vs).astype(acc.dtype)
        S = F32(S * ms + vs)
    return acc.astype(F32) * (F32(1) / S)


def exact_reference(q, K, V, scale, visible):
    """Float64 softmax attention of an unrounded query over the stored rows (the tiled path's
    arithmetic without its float32 roundings)."""
    s = (K.astype(np.float64) @ q.astype(np.float64)) * float(scale)
    s[~visible] = -np.inf
    w = np.exp(s - s.max())
    return (w / w.sum()) @ V.astype(np.float64)


# -- the block formats ----------------------------------------------------------------------------
def test_q8_0_query_rounding_is_the_x86_quantizer_and_reads_as_gguf_decodes_it(rng):
    X = (rng.standard_normal((64, 128)) * rng.uniform(0.01, 30, (64, 1))).astype(F32)
    d, q = quantize_q8_0_x86(X)
    ref = np.stack([q8_0_x86_reference(r) for r in X])
    np.testing.assert_array_equal(round_query(X, "q8_0"), ref)
    # the same bytes, read by gguf's q8_0 decoder (fp16 scale then 32 int8 per block)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    decoded = gguf.quants.dequantize(raw.reshape(64, -1), Q8_0)
    np.testing.assert_array_equal(decoded, ref)
    # against gguf's reference quantizer (x * (1/d), round half away): the same scales, quants
    # that differ by at most one step, and only at near-ties
    theirs = gguf.quants.dequantize(gguf.quants.quantize(X, Q8_0), Q8_0)
    step = np.repeat(d.astype(F32), 32, axis=-1)
    diff = np.abs(theirs - ref)
    assert np.all(diff <= step * 1.0001)
    assert np.count_nonzero(diff) <= 0.001 * X.size


def test_stored_values_follow_each_cache_type(rng):
    X = (rng.standard_normal((16, 64)) * 3).astype(F32)
    for kind in ("f16", "q8_0", "q4_0"):
        np.testing.assert_array_equal(stored_values(X, kind), stored_reference(X, kind))


def test_round_query_f16_is_nearest_even():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 1e-8], F32)
    np.testing.assert_array_equal(round_query(x, "f16"),
                                  np.array([1.0, 1 + 2**-9, 65504.0, 0.0], F32))


def test_hadamard_matrix_is_sylvesters_over_sqrt_n():
    for n in (64, 128, 256):
        H = hadamard_matrix(n)
        np.testing.assert_allclose(H, scipy.linalg.hadamard(n) / np.sqrt(n), rtol=1e-7)
        np.testing.assert_allclose(H @ H, np.eye(n), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(96)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_rows_are_refused(value):
    X = np.ones((3, 64), F32)
    X[1, 5] = value
    for kind in ("f16", "q8_0", "q4_0"):
        with pytest.raises(ValueError, match="NaN or inf"):
            stored_values(X, kind, "K rows")


def test_values_beyond_the_cache_type_are_refused():
    with pytest.raises(ValueError, match="float16's range"):
        stored_values(np.full((1, 64), 70000.0, F32), "f16")
    with pytest.raises(ValueError, match="block scale beyond float16"):
        stored_values(np.full((1, 64), 1e7, F32), "q8_0")


# -- specs ----------------------------------------------------------------------------------------
def test_pair_specs():
    assert parse_ggml_pair("ggml:q8_0/q4_0") == GGMLPair("q8_0", "q4_0", True)
    assert parse_ggml_pair("ggml:f16") == GGMLPair("f16", "f16", True)
    assert parse_ggml_pair("ggml-norot:q4_0/q4_0") == GGMLPair("q4_0", "q4_0", False)
    assert str(parse_ggml_pair("ggml-norot:q4_0")) == "ggml-norot:q4_0/q4_0"
    from kvquant.specs import PairSpec, parse_cache_spec
    assert parse_cache_spec("ggml:q8_0") == GGMLPair("q8_0", "q8_0", True)
    assert isinstance(parse_cache_spec("q8_0+rot"), PairSpec)
    assert isinstance(parse_cache_spec("tq4:seed=3"), PairSpec)
    for bad, match in (("ggml:q5_1/q8_0", "not a llama.cpp cache type"),
                       ("ggml:q8_0+rot", "not a llama.cpp cache type"),
                       ("ggml:q8_0/q8_0/f16", "expected ggml:<K type>/<V type>"),
                       ("ggml:", "expected ggml:")):
        with pytest.raises(ValueError, match=match):
            parse_ggml_pair(bad)
    with pytest.raises(ValueError, match="multiple of 32"):
        GGMLAttentionCache(1, 1, 48, "ggml:q8_0/q8_0")


def test_bits_and_rotation_widths():
    assert GGMLPair("q8_0", "q8_0").bits_per_value(64) == 8.5
    assert GGMLPair("q4_0", "q8_0").bits_per_value(64) == 6.5
    assert GGMLPair("f16", "f16").bits_per_value(64) == 16.0
    # K: the largest power of two >= 64 dividing head_dim; V: 64; only for quantized types
    assert GGMLPair("q8_0", "q4_0").rotation_widths(64) == (64, 64)
    assert GGMLPair("q8_0", "q4_0").rotation_widths(256) == (256, 64)
    assert GGMLPair("q8_0", "q4_0").rotation_widths(192) == (64, 64)
    assert GGMLPair("q8_0", "q4_0").rotation_widths(96) == (None, None)
    assert GGMLPair("f16", "q4_0").rotation_widths(128) == (None, 64)
    assert GGMLPair("q4_0", "f16").rotation_widths(128) == (128, None)
    assert GGMLPair("q8_0", "q8_0", rotation=False).rotation_widths(64) == (None, None)
    cache = GGMLAttentionCache(3, 2, 64, "ggml:q8_0/q4_0")
    assert cache.bytes_per_token == 3 * 2 * (68 + 36)


# -- the arithmetic -------------------------------------------------------------------------------
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q8_0"), ("f16", "f16")]


@pytest.mark.parametrize("k_type,v_type", PAIRS)
def test_one_query_path_matches_the_per_query_loop(rng, k_type, v_type):
    T, g, d = 40, 3, 64
    K = stored_reference((rng.standard_normal((T, d)) * 2).astype(F32), k_type)
    V = stored_reference(rng.standard_normal((T, d)).astype(F32), v_type)
    Q = (rng.standard_normal((5, g, d)) * 2).astype(F32)
    pos = np.arange(T - 5, T)
    hidden = np.arange(T)[None, :] > pos[:, None]
    scale = F32(0.125)
    out = attend_rows(Q, K, V, hidden, scale, k_type, v_type, tiled=False)
    for i in range(Q.shape[0]):
        for h in range(g):
            ref = one_query_reference(Q[i, h], K, V, scale, k_type, v_type, ~hidden[i])
            # f16 sums: the same roundings in the same order; f32 sums: online vs at once, each
            # within T unit roundoffs of sum |w_t v_t| <= max |V| (weights sum to 1)
            f32_atol = 2 * T * 2.0 ** -24 * float(np.abs(V).max())
            tol = (dict(rtol=2e-3, atol=2e-3) if v_type == "f16"
                   else dict(rtol=1e-5, atol=f32_atol))
            np.testing.assert_allclose(out[i, h], ref, **tol)


def test_f16_running_sum_rounds_every_step(rng):
    """The f16 accumulator is measurably coarser than a float32 sum of the same terms."""
    T, d = 600, 64
    K = stored_reference(rng.standard_normal((T, d)).astype(F32) * 0.1, "f16")
    V = stored_reference(rng.standard_normal((T, d)).astype(F32), "f16")
    Q = rng.standard_normal((1, 1, d)).astype(F32)
    hidden = np.zeros((1, T), bool)
    f16_sum = attend_rows(Q, K, V, hidden, F32(1), "f16", "f16", tiled=False)[0, 0]
    ref = one_query_reference(Q[0, 0], K, V, F32(1), "f16", "f16", ~hidden[0])
    np.testing.assert_allclose(f16_sum, ref, rtol=1e-3, atol=1e-4)
    exact = exact_reference(query_reference(Q[0, 0], "f16"), K, V, 1.0, ~hidden[0])
    err = np.abs(f16_sum - exact).max()
    assert 1e-5 < err < 5e-3   # the f16 sum's rounding, not a float32 one


def test_tiled_path_keeps_the_query_and_sum_in_float32(rng):
    T, d = 80, 64
    K = stored_reference(rng.standard_normal((T, d)).astype(F32), "f16")
    V = stored_reference(rng.standard_normal((T, d)).astype(F32), "f16")
    Q = rng.standard_normal((T, 2, d)).astype(F32)
    hidden = np.arange(T)[None, :] > np.arange(T)[:, None]
    out = attend_rows(Q, K, V, hidden, F32(0.125), "f16", "f16", tiled=True)
    for i in (0, 17, T - 1):
        for h in range(2):
            np.testing.assert_allclose(out[i, h], exact_reference(Q[i, h], K, V, 0.125,
                                                                  ~hidden[i]),
                                       rtol=1e-5, atol=1e-6)


# -- the cache ------------------------------------------------------------------------------------
def _rows(rng, T, n_kv, d):
    return ((rng.standard_normal((T, n_kv, d)) * 1.5).astype(F32),
            rng.standard_normal((T, n_kv, d)).astype(F32))


@pytest.mark.parametrize("spec", ["ggml:q8_0/q8_0", "ggml:q4_0/q4_0", "ggml-norot:q4_0/q8_0",
                                  "ggml:f16/q4_0"])
def test_cache_rotates_stores_and_attends_as_llama_cpp(rng, spec):
    """Against a reference cache: rows rotated by scipy's Hadamard matrix (K in blocks of 128
    on a 128-wide head, V in blocks of 64), stored through gguf / the x86 q8_0, one-query loop,
    output rotated back."""
    pair = parse_ggml_pair(spec)
    T, n_kv, n_heads, d = 24, 2, 4, 128
    K, V = _rows(rng, T, n_kv, d)
    Q = rng.standard_normal((T, n_heads, d)).astype(F32)
    cache = GGMLAttentionCache(1, n_kv, d, spec)
    cache.append(0, k=K[:T - 6], v=V[:T - 6])
    cache.append(0, k=K[T - 6:], v=V[T - 6:])
    out = cache.attend_prefill(0, Q[T - 6:], scale=0.09)
    k_rot, v_rot = pair.rotation_widths(d)
    Hk = scipy.linalg.hadamard(128) / np.sqrt(128) if k_rot else np.eye(d)
    Hv = np.kron(np.eye(2), scipy.linalg.hadamard(64) / 8.0) if v_rot else np.eye(d)
    for h in range(n_kv):
        Ks = stored_reference((K[:, h] @ Hk).astype(F32), pair.k_type)
        Vs = stored_reference((V[:, h] @ Hv).astype(F32), pair.v_type)
        for j, p in enumerate(range(T - 6, T)):
            for head in (2 * h, 2 * h + 1):
                ref = one_query_reference((Q[p, head] @ Hk).astype(F32), Ks, Vs, F32(0.09),
                                          pair.k_type, pair.v_type, np.arange(T) <= p) @ Hv
                np.testing.assert_allclose(out[j, head], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["ggml:q8_0/q8_0", "ggml:q4_0/q4_0", "ggml:q8_0/f16"])
def test_prefill_is_the_one_query_path_at_every_position(rng, spec):
    T, d = 70, 64
    K, V = _rows(rng, T, 1, d)
    Q = rng.standard_normal((T, 3, d)).astype(F32)
    prefill = GGMLAttentionCache(1, 1, d, spec)
    prefill.append(0, k=K, v=V)
    at_once = prefill.attend_prefill(0, Q, block=32)
    decode = GGMLAttentionCache(1, 1, d, spec)
    # an f16 running sum may round a last bit (2^-12 near 0.3) differently (BLAS sums scores of 1 and of 32
    # queries in different orders)
    tol = dict(rtol=1e-5, atol=5e-4 if spec.endswith("f16") else 1e-6)
    for p in range(T):
        decode.append(0, k=K[p:p + 1], v=V[p:p + 1])
        np.testing.assert_allclose(decode.attend(0, Q[p]), at_once[p], **tol)


def test_f16_cache_prefill_is_tiled_and_decode_is_not(rng):
    T, d = 70, 64
    K, V = _rows(rng, T, 1, d)
    Q = rng.standard_normal((T, 1, d)).astype(F32)
    cache = GGMLAttentionCache(1, 1, d, "ggml:f16/f16")
    cache.append(0, k=K, v=V)
    Ks, Vs = stored_reference(K[:, 0], "f16"), stored_reference(V[:, 0], "f16")
    tiled = cache.attend_prefill(0, Q)            # 70 >= 64 queries: the tiled path
    one = cache.attend(0, Q[-1, :, :])            # a decode step: f16 query and sum
    np.testing.assert_allclose(tiled[-1, 0], exact_reference(Q[-1, 0], Ks, Vs, 0.125,
                                                            np.ones(T, bool)), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(one[0], one_query_reference(Q[-1, 0], Ks, Vs, F32(0.125), "f16",
                                                           "f16", np.ones(T, bool)),
                               rtol=2e-3, atol=2e-3)
    short = cache.attend_prefill(0, Q[-5:])       # under 64 queries: the one-query path
    np.testing.assert_allclose(short[-1], one, rtol=1e-6, atol=1e-7)


def test_sliding_window_and_prescaled_queries(rng):
    T, d = 30, 64
    K, V = _rows(rng, T, 1, d)
    Q = rng.standard_normal((4, 2, d)).astype(F32)
    cache = GGMLAttentionCache(1, 1, d, "ggml:q8_0/q8_0")
    cache.append(0, k=K, v=V)
    out = cache.attend_prefill(0, Q, scale=0.2, sliding_window=8)
    H = scipy.linalg.hadamard(64) / 8.0
    Ks = stored_reference((K[:, 0] @ H).astype(F32), "q8_0")
    Vs = stored_reference((V[:, 0] @ H).astype(F32), "q8_0")
    for j, p in enumerate(range(T - 4, T)):
        visible = (np.arange(T) <= p) & (np.arange(T) > p - 8)
        ref = one_query_reference((Q[j, 1] @ H).astype(F32), Ks, Vs, F32(0.2), "q8_0", "q8_0",
                                  visible) @ H
        np.testing.assert_allclose(out[j, 1], ref, rtol=1e-4, atol=1e-5)
    # Gemma 3's graph: the query is scaled first, and rounded after
    pre = GGMLAttentionCache(1, 1, d, "ggml:q8_0/q8_0", prescale_query=True)
    pre.append(0, k=K, v=V)
    got = pre.attend(0, Q[-1], scale=0.2)
    ref = one_query_reference((Q[-1, 0] * F32(0.2) @ H).astype(F32), Ks, Vs, F32(1), "q8_0",
                              "q8_0", np.ones(T, bool)) @ H
    np.testing.assert_allclose(got[0], ref, rtol=1e-4, atol=1e-5)


def test_cache_errors_and_bookkeeping(rng):
    cache = GGMLAttentionCache(2, 2, 64, "ggml:q8_0/q8_0")
    K, V = _rows(rng, 5, 2, 64)
    with pytest.raises(ValueError, match=r"shape \(n_new, 2, 64\)"):
        cache.append(0, k=K[:, 0], v=V)
    with pytest.raises(ValueError, match="same number of new rows"):
        cache.append(0, k=K, v=V[:3])
    bad = K.copy()
    bad[2, 1, 7] = np.nan
    with pytest.raises(ValueError, match="K rows of layer 0: NaN or inf"):
        cache.append(0, k=bad, v=V)
    assert cache.length(0) == 0
    cache.append(0, k=K, v=V)
    cache.append(1, k=K, v=V)
    assert len(cache) == 5 and cache.nbytes == 2 * 5 * 2 * (68 + 68)
    with pytest.raises(ValueError, match="6 queries but only 5 rows"):
        cache.attend_prefill(0, rng.standard_normal((6, 4, 64)))
    with pytest.raises(ValueError, match="cannot share"):
        cache.attend(0, rng.standard_normal((3, 64)))
    cache.truncate(2)
    assert cache.length(0) == cache.length(1) == 2
    assert cache.stream(0, "k").spec == "q8_0 (llama.cpp attention)"


# -- through a GGUF model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("tokenizers")
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_llama_gguf import write_tiny_llama
    from kvquant.models.gguf_decoder import GGUFDecoder
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-hd64.gguf"
    write_tiny_llama(path, dim=128, n_heads=2, n_kv=1)     # head_dim 64: llama.cpp rotates
    return GGUFDecoder(str(path))


@pytest.mark.parametrize("spec", ["ggml:q8_0/q8_0", "ggml:q4_0/q8_0"])
def test_gguf_model_prefill_equals_decoding_token_by_token(tiny_model, spec, rng):
    tokens = rng.integers(0, tiny_model.vocab_size, 20)
    cache = tiny_model.new_cache(spec)
    assert isinstance(cache, GGMLAttentionCache) and cache.spec == spec
    at_once = tiny_model.forward(tokens, cache)
    steps = tiny_model.new_cache(spec)
    one_by_one = np.concatenate([tiny_model.forward(tokens[i:i + 1], steps)
                                 for i in range(tokens.size)])
    # a prefill's projections (row blocks through BLAS) round unlike one row's, and a q4_0 or
    # q8_0 code may then round the other way: 2e-4 on logits of size 40 with OpenBLAS's Haswell
    # kernel, where quantizing the rows moves them by 4-40
    np.testing.assert_allclose(at_once, one_by_one, rtol=1e-4,
                               atol=2e-5 * np.abs(one_by_one).max())
    exact = tiny_model.forward(tokens, tiny_model.new_cache("f32"))
    assert np.abs(at_once - exact).max() > 1e-1   # the rows were quantized


def test_gguf_model_ggml_f16_is_close_to_f32_and_q4_0_is_not(tiny_model, rng):
    tokens = rng.integers(0, tiny_model.vocab_size, 80)
    exact = tiny_model.forward(tokens, tiny_model.new_cache("f32"))
    f16 = tiny_model.forward(tokens, tiny_model.new_cache("ggml:f16/f16"))
    q4 = tiny_model.forward(tokens, tiny_model.new_cache("ggml:q4_0/q4_0"))
    e16, e4 = np.abs(f16 - exact).max(), np.abs(q4 - exact).max()
    assert e16 < 0.1 * e4


def test_rotation_is_the_butterfly_of_each_row_alone(rng):
    X = rng.standard_normal((7, 256)).astype(F32)
    for n in (64, 256):
        Y = rotate_blocks(X, n)
        H = scipy.linalg.hadamard(n) / np.sqrt(n)
        np.testing.assert_allclose(Y, (X.reshape(-1, n) @ H).reshape(X.shape), rtol=1e-5,
                                   atol=1e-6)
        # bit-identical row by row: a row's rotation does not depend on the rows beside it
        np.testing.assert_array_equal(np.stack([rotate_blocks(r, n) for r in X]), Y)


def test_a_ggml_spec_is_refused_where_it_cannot_run():
    from kvquant.models import load_model
    with pytest.raises(ValueError, match="MLA model.s cache takes a pair spec.*not a ggml spec"):
        load_model("tiny-mla").new_cache("ggml:q8_0/q8_0")
