"""The GGUF decoder's decode-step threads: with numpy's products (DECODE_PROJECTIONS = "blas"),
the "auto" setting's ratio counted independently from the file, the setting it picks on each
side of LONG_CONTEXT_RATIO, and a forward that runs with what it picked (the cache's attention
threads, BLAS's threads during the step); with one pool (the default), every product of a decode
step through the compiled matvec on the attention's threads. Nothing here asserts a speed."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the models extra (gguf) is not installed")
threadpoolctl = pytest.importorskip("threadpoolctl")

from kvquant.models.random_gguf import write_random_gguf  # noqa: E402

from kvquant.models import gguf_decoder  # noqa: E402
from kvquant.models.gguf_decoder import GGUFDecoder  # noqa: E402

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("threads")
    paths = {}
    for arch in ("llama", "gemma3"):
        paths[arch] = str(folder / f"{arch}.gguf")
        write_random_gguf(paths[arch], arch, seed=3)
    return paths


def _weight_elements(path):
    """Elements of the matrices a decode step multiplies, from the file's own tensor list."""
    tensors = {t.name: int(t.n_elements) for t in gguf.GGUFReader(path).tensors}
    layers = sum(n for name, n in tensors.items()
                 if name.startswith("blk.") and name.split(".")[2] in MATRICES)
    return layers + tensors.get("output.weight", tensors["token_embd.weight"])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_ratio_counts_cached_elements_over_weight_elements(files, arch):
    model = GGUFDecoder(files[arch])
    cfg = model.config
    per_row = cfg.n_kv_heads * 2 * cfg.head_dim            # K and V of every KV head
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    for cached in (0, 5, 40):
        rows = cached + 1
        read = sum(rows if w is None else min(rows, w) for w in windows) * per_row
        assert model.long_context_ratio(cached) == pytest.approx(
            read / _weight_elements(files[arch]), rel=1e-12)
    if arch == "gemma3":   # five layers of six see their window of 8 only
        assert sum(w is not None for w in windows) == 5 and set(windows) == {None, 8}


def test_auto_picks_two_attention_threads_past_the_ratio(files, monkeypatch):
    model = GGUFDecoder(files["llama"])
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "auto")
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "blas")   # the ratio rule's mode
    monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None: 2)
    r10 = model.long_context_ratio(10)
    monkeypatch.setattr(gguf_decoder, "LONG_CONTEXT_RATIO", r10)
    assert model.decode_threads(10) == (2, 1)
    assert model.decode_threads(9) == (1, None)
    # one thread allowed (OMP_NUM_THREADS=1): never two; more than two (not measured): the
    # first setting, BLAS left with its threads
    for allowed in (1, 4):
        monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None, a=allowed: a)
        assert model.decode_threads(1000) == (1, None)
    # a number fixes both settings, whatever the context
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", 3)
    monkeypatch.setattr(gguf_decoder, "DECODE_BLAS_THREADS", 2)
    assert model.decode_threads(0) == (3, 2)
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "Auto")
    with pytest.raises(ValueError, match="DECODE_ATTENTION_THREADS is 'Auto'"):
        model.decode_threads(0)


class _Spy:
    """A cache that records the attention threads asked and BLAS's threads at each attend."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def attend(self, layer, q, n_threads=None, **kwargs):
        blas = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
                if lib["user_api"] == "blas"]
        self.calls.append((n_threads, min(blas) if blas else None))
        return self.cache.attend(layer, q, n_threads=n_threads, **kwargs)

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def __len__(self):
        return len(self.cache)


def test_a_decode_step_runs_with_the_setting_picked(files, monkeypatch):
    blas = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    if not blas:
        pytest.skip("threadpoolctl sees no BLAS library")
    model = GGUFDecoder(files["llama"])
    ids = np.arange(12) % model.vocab_size
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "auto")
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "blas")   # the ratio rule's mode
    monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None: 2)
    logits = {}
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        for ratio, expected in ((np.inf, (1, 2)), (0.0, (2, 1))):
            monkeypatch.setattr(gguf_decoder, "LONG_CONTEXT_RATIO", ratio)
            cache = _Spy(model.new_cache("tq4"))
            model.forward(ids[:-1], cache)                   # a prefill: not a decode step
            cache.calls.clear()
            logits[ratio] = model.forward(ids[-1:], cache, last_only=True)
            assert cache.calls == [expected] * model.n_layers
        # BLAS is given back after the step
        assert min(lib["num_threads"] for lib in threadpoolctl.threadpool_info()
                   if lib["user_api"] == "blas") == 2
    # the consumers' bits do not depend on their threads; BLAS's products to rounding
    np.testing.assert_allclose(logits[0.0], logits[np.inf], rtol=0, atol=1e-5)


def test_the_other_entry_points_take_the_same_setting(files, monkeypatch):
    """forward_hidden and a decode_step of one sequence are decode steps too; a decode_step of
    two sequences (a batch) keeps CACHE_THREADS with BLAS as it is."""
    model = GGUFDecoder(files["llama"])
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "auto")
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "blas")   # the ratio rule's mode
    monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None: 2)
    monkeypatch.setattr(gguf_decoder, "LONG_CONTEXT_RATIO", 0.0)
    caches = [_Spy(model.new_cache("kv8")) for _ in range(2)]
    for c in caches:
        model.forward(np.arange(5), c)
        c.calls.clear()
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        model.forward_hidden(np.array([7]), caches[0])
        assert caches[0].calls == [(2, 1)] * model.n_layers
        caches[0].calls.clear()
        model.decode_step(np.array([3]), caches[:1])
        assert caches[0].calls == [(2, 1)] * model.n_layers
        caches[0].calls.clear()
        model.decode_step(np.array([3, 4]), caches)
        for c in caches:
            assert c.calls == [(gguf_decoder.CACHE_THREADS, 2)] * model.n_layers


def test_a_gemma3_file_without_a_window_is_refused(tmp_path, monkeypatch):
    import kvquant.models.random_gguf as _gguf_writer
    monkeypatch.setitem(_gguf_writer.SHAPES, "gemma3-no-window",
                        dict(_gguf_writer.SHAPES["gemma3"], sliding_window=0, arch="gemma3"))
    path = tmp_path / "no-window.gguf"
    write_random_gguf(path, "gemma3-no-window")
    with pytest.raises(ValueError, match="sliding_window is 0"):
        GGUFDecoder(str(path))


def test_one_pool_runs_the_projections_on_the_attentions_threads(files, monkeypatch):
    """DECODE_PROJECTIONS = "pool": every product of a decode step (seven a layer and the
    logits) goes through the compiled matvec on the attention's threads, BLAS is left alone, and
    the logits are BLAS's to rounding."""
    from kvquant._kernels import matvec as kernel
    model = GGUFDecoder(files["llama"])
    ids = np.arange(12) % model.vocab_size
    calls = []

    class Counted:
        @staticmethod
        def matvec(W, x, y, n_threads):
            calls.append((W.shape, n_threads))
            kernel.matvec(W, x, y, n_threads)

    monkeypatch.setattr(gguf_decoder, "_matvec", Counted)
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "auto")
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "blas")   # the ratio rule's mode
    monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None: 2)
    logits = {}
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        for mode in ("blas", "pool"):
            monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", mode)
            assert model.decode_threads(0) == ((2, None) if mode == "pool" else (1, None))
            cache = _Spy(model.new_cache("tq4"))
            model.forward(ids[:-1], cache)                   # a prefill: BLAS's products
            assert calls == []
            cache.calls.clear()
            logits[mode] = model.forward(ids[-1:], cache, last_only=True)
            if mode == "pool":
                assert cache.calls == [(2, 2)] * model.n_layers   # BLAS untouched
                assert len(calls) == 7 * model.n_layers + 1
                assert {t for _, t in calls} == {2}
                assert calls[-1][0] == (model.vocab_size, model.config.hidden_size)
    np.testing.assert_allclose(logits["pool"], logits["blas"], rtol=0, atol=1e-5)
    # forward_hidden and a one-sequence decode_step are decode steps; a batch is not
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "pool")
    caches = [model.new_cache("kv8") for _ in range(2)]
    for c in caches:
        model.forward(ids[:4], c)
    calls.clear()
    model.forward_hidden(ids[4:5], caches[0])
    assert len(calls) == 7 * model.n_layers                 # no logits there
    calls.clear()
    model.decode_step(ids[5:6], caches[:1])
    assert len(calls) == 7 * model.n_layers + 1
    calls.clear()
    model.decode_step(ids[6:8], caches)
    assert calls == []
    # a misspelt setting is named, prefills included
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "openmp")
    with pytest.raises(ValueError, match="DECODE_PROJECTIONS is 'openmp'"):
        model.decode_threads(0)
    with pytest.raises(ValueError, match="DECODE_PROJECTIONS is 'openmp'"):
        model.forward(ids[:3], model.new_cache("kv8"))


def test_auto_takes_the_pool_on_two_openmp_threads_only(files, monkeypatch):
    """DECODE_PROJECTIONS = "auto": the pool where OpenMP allows exactly 2 threads (where it was
    measured); numpy's products on one thread, on more, and in a build without OpenMP."""
    model = GGUFDecoder(files["llama"])
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "auto")
    for allowed, openmp, pool in ((2, True, True), (1, True, False), (4, True, False),
                                  (2, False, False)):
        monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None, a=allowed: a)
        monkeypatch.setattr(gguf_decoder, "openmp_enabled", lambda o=openmp: o)
        assert model._pool_projections() is pool
        linear = model._step_threads(1, 0)[2]
        assert (linear is not gguf_decoder._blas_linear) is pool


def test_the_pool_resolves_its_thread_count(files, monkeypatch):
    """A count the cache takes (None: OpenMP's default, -1: every core) is resolved before it
    reaches the kernel, which takes positive counts only."""
    model = GGUFDecoder(files["llama"])
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "pool")
    cache = model.new_cache("kv8")
    model.forward(np.arange(4), cache)
    for fixed in (None, -1):
        monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", fixed)
        assert np.isfinite(model.forward(np.array([5]), cache)).all()


def test_one_pool_takes_the_threads_openmp_allows(files, monkeypatch):
    model = GGUFDecoder(files["llama"])
    monkeypatch.setattr(gguf_decoder, "DECODE_PROJECTIONS", "pool")
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", "auto")
    for allowed in (1, 2, 6):
        monkeypatch.setattr(gguf_decoder, "resolve_n_threads", lambda n=None, a=allowed: a)
        assert model.decode_threads(10) == (allowed, None)
    monkeypatch.setattr(gguf_decoder, "DECODE_ATTENTION_THREADS", 3)
    assert model.decode_threads(10) == (3, None)      # a number: BLAS is not the step's
