"""The cache's sliding_window argument (Gemma 3's local layers): a query at position p reads rows
p - W + 1 .. p only, in a decode step (attend) and in a prefill (attend_prefill)."""
import numpy as np
import pytest

from kvquant.cache import QuantizedKVCache


def _cache(spec, K, V):
    cache = QuantizedKVCache(1, {"k": (spec, K.shape[-1]), "v": (spec, V.shape[-1])},
                             n_kv_heads=K.shape[1])
    cache.append(0, k=K, v=V)
    return cache


@pytest.mark.parametrize("spec", ["f32", "kv8", "tq4"])
def test_a_window_reads_the_last_rows_only(spec):
    rng = np.random.default_rng(0)
    T, W, G, d = 20, 6, 2, 32
    K, V = rng.standard_normal((2, T, G, d)).astype(np.float32)
    Q = rng.standard_normal((T, 4, d)).astype(np.float32)
    full = _cache(spec, K, V)
    prefill = full.attend_prefill(0, Q, sliding_window=W)
    for p in range(T):
        lo = max(p + 1 - W, 0)
        # rows are encoded one by one (per-row codecs): the last W rows alone, coded the same
        alone = _cache(spec, K[lo:p + 1], V[lo:p + 1]).attend(0, Q[p])
        step = full.attend(0, Q[p], length=p + 1, sliding_window=W)
        np.testing.assert_allclose(step, alone, rtol=0, atol=1e-5)
        np.testing.assert_allclose(prefill[p], alone, rtol=0, atol=1e-4)
    # a window as long as the sequence is no window
    np.testing.assert_allclose(full.attend_prefill(0, Q, sliding_window=T),
                               full.attend_prefill(0, Q), rtol=0, atol=1e-6)
    assert np.abs(prefill[-1] - full.attend_prefill(0, Q)[-1]).max() > 1e-3


@pytest.mark.parametrize("spec", ["f32", "tq4", "tq4@sinks=1,recent=3", "kv8@center,recent=9"])
@pytest.mark.parametrize("block", [1, 4, 7])
def test_a_blocked_prefill_reads_each_blocks_windows_only(spec, block):
    """Blocks of queries far from the start read only the rows their windows cover (with recent
    float32 copies and sinks too): the same attention as one decode step per position."""
    rng = np.random.default_rng(1)
    T, W, G, d = 41, 6, 2, 32
    K, V = rng.standard_normal((2, T, G, d)).astype(np.float32)
    Q = rng.standard_normal((T, 4, d)).astype(np.float32)
    full = _cache(spec, K, V)
    prefill = full.attend_prefill(0, Q, sliding_window=W, block=block)
    for p in range(T):
        step = full.attend(0, Q[p], length=p + 1, sliding_window=W)
        np.testing.assert_allclose(prefill[p], step, rtol=0, atol=1e-5)
    np.testing.assert_allclose(prefill, full.attend_prefill(0, Q, sliding_window=W, block=T),
                               rtol=0, atol=1e-6)
