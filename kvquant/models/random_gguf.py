"""Small random-weight GGUF files of each architecture the GGUF decoder reads, rebuilt from a seed.

``write_random_gguf(path, arch, seed)`` writes the same file for the same arguments (numpy's PCG64
normals and the ``gguf`` package's quantizers are deterministic); ``weights_sha256`` fingerprints
the dequantized weights, so a test can check it runs the model that tools/make_gguf_fixtures.py
gave transformers. The matrices use several GGUF types (F32, F16, Q8_0, Q4_0, Q5_0) so the
dequantization paths are exercised too. For the tests and tools/make_gguf_fixtures.py (both import
it from here); writing needs the ``gguf`` package (the test extra).
"""
import hashlib

import numpy as np

# arch -> shape. Gemma 3 and Qwen 3 keep their transformers defaults for what a GGUF file does
# not say (head_dim 256 = query_pre_attn_scalar for Gemma 3; head_dim 128 for Qwen 3), and Gemma 3
# has six layers so that layer 5 attends globally and layers 0-4 to a window of 8.
SHAPES = {
    "llama": dict(n_layers=2, hidden=64, ffn=96, n_heads=4, n_kv=2, head_dim=16, rope_base=10000.0),
    # a llama file with Llama 3.1's RoPE scaling (rope_freqs.weight), its original context short
    # enough that the scaled frequencies turn within the fixture's positions
    "llama3.1": dict(n_layers=2, hidden=64, ffn=96, n_heads=4, n_kv=2, head_dim=16,
                     rope_base=10000.0, arch="llama",
                     llama3_rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=256)),
    "qwen2": dict(n_layers=2, hidden=64, ffn=96, n_heads=4, n_kv=2, head_dim=16, rope_base=1e6),
    "qwen3": dict(n_layers=2, hidden=64, ffn=96, n_heads=2, n_kv=1, head_dim=128, rope_base=1e6),
    "gemma3": dict(n_layers=6, hidden=32, ffn=64, n_heads=2, n_kv=1, head_dim=256, rope_base=1e6,
                   sliding_window=8),
}
CONTEXT = 64
EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "gemma3": 1e-6}


def architecture(name):
    """The GGUF architecture of an entry of :data:`SHAPES`."""
    return SHAPES[name].get("arch", name)


def llama3_rope_factors(head_dim, base, factor, low_freq_factor, high_freq_factor,
                        original_max_position_embeddings):
    """Llama 3.1's per-frequency RoPE divisors, as llama.cpp's converter writes them to
    rope_freqs.weight: 1 for wavelengths below original / high_freq_factor, ``factor`` above
    original / low_freq_factor, and a smooth blend between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * base ** (i / head_dim)
        if wavelen < original_max_position_embeddings / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_max_position_embeddings / low_freq_factor:
            out.append(factor)
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)
# matrix -> GGUF type name (rows are multiples of 32, as the block types need)
MATRIX_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "F16",
                "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "12 3"]
# each architecture's usual llama.cpp pre-tokenizer
BPE_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
# A SentencePiece-style vocabulary as Gemma's GGUF lays it out: control pieces, user-defined
# pieces (newlines, runs of spaces spelled with real spaces), 256 byte pieces, then the normal
# pieces by falling score.
SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER = ["\n", "\n\n", "  ", "   "]
SPM_NORMAL = ["▁t", "he", "▁the", "in", "▁a", "▁c", "at", "▁cat", "er", "▁w", "or", "▁wor",
              "ld", "▁world", "▁", "e", "t", "a", "h", "c", "w", "o", "r", "l", "d", "n", "i", "s",
              "▁is", "."]


def spm_vocab():
    """(pieces, scores, types) of the SentencePiece-style vocabulary."""
    pieces = SPM_CONTROL + SPM_USER + [f"<0x{b:02X}>" for b in range(256)] + SPM_NORMAL
    types = [3] * len(SPM_CONTROL) + [4] * len(SPM_USER) + [6] * 256 + [1] * len(SPM_NORMAL)
    scores = [-1000.0] * (len(SPM_CONTROL) + len(SPM_USER)) + [0.0] * 256 + \
        [-float(i) for i in range(len(SPM_NORMAL))]
    return pieces, scores, types


def _add_tokenizer(w, arch):
    if arch == "gemma3":
        pieces, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(pieces)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        return len(pieces)
    tokens = BPE_SPECIALS + list(bytes_to_unicode().values()) + \
        [m.replace(" ", "") for m in BPE_MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(BPE_PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types([3] * len(BPE_SPECIALS) + [1] * (len(tokens) - len(BPE_SPECIALS)))
    w.add_token_merges(BPE_MERGES)
    w.add_eos_token_id(0)
    return len(tokens)


def write_random_gguf(path, entry, seed=0, metadata=None, extra_tensors=None, file_arch=None):
    """Write a random-weight GGUF file of the entry ``entry`` of :data:`SHAPES` to ``path``.

    For tests of refusals: ``metadata`` (key -> value) and ``extra_tensors`` (name -> float32
    array) are written as they are, and ``file_arch`` replaces ``general.architecture``.
    Returns the number of tokens in its vocabulary.
    """
    import gguf

    s, arch = SHAPES[entry], architecture(entry)
    rng = np.random.default_rng(seed)
    D, F, H, G, hd = s["hidden"], s["ffn"], s["n_heads"], s["n_kv"], s["head_dim"]
    w = gguf.GGUFWriter(str(path), file_arch or arch)
    w.add_name(f"random {arch}")
    w.add_block_count(s["n_layers"])
    w.add_context_length(CONTEXT)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(EPS[arch])
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(s["sliding_window"])
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    V = _add_tokenizer(w, arch)
    w.add_vocab_size(V)

    def add(name, shape, scale, qtype="F32", offset=0.0):
        arr = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)

    add("token_embd.weight", (V, D), 1.0 if arch != "gemma3" else 0.3, "Q8_0")
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (D,), 0.1, offset=1.0)
        for name, shape in [("attn_q", (H * hd, D)), ("attn_k", (G * hd, D)),
                            ("attn_v", (G * hd, D)), ("attn_output", (D, H * hd)),
                            ("ffn_gate", (F, D)), ("ffn_up", (F, D)), ("ffn_down", (D, F))]:
            scale = (0.15 if name in ("attn_q", "attn_k") else 0.25) / np.sqrt(shape[1] / 64)
            add(p + name + ".weight", shape, scale, MATRIX_TYPES[name])
        if arch == "qwen2":
            add(p + "attn_q.bias", (H * hd,), 0.3)
            add(p + "attn_k.bias", (G * hd,), 0.3)
            add(p + "attn_v.bias", (G * hd,), 0.3)
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", (hd,), 0.2, offset=1.0)
            add(p + "attn_k_norm.weight", (hd,), 0.2, offset=1.0)
        add(p + "ffn_norm.weight", (D,), 0.1, offset=1.0)
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", (D,), 0.1, offset=1.0)
            add(p + "post_ffw_norm.weight", (D,), 0.1, offset=1.0)
    add("output_norm.weight", (D,), 0.1, offset=1.0)
    if arch == "qwen2":   # one file with an untied output matrix
        add("output.weight", (V, D), 0.5, "Q8_0")
    if "llama3_rope" in s:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, s["rope_base"],
                                                               **s["llama3_rope"]))
    for tensor, arr in (extra_tensors or {}).items():
        w.add_tensor(tensor, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return V


def weights_sha256(path):
    """sha256 of a GGUF file's tensors dequantized to float32, in name order."""
    import gguf
    from gguf.quants import dequantize

    h = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.name):
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(dequantize(t.data, t.tensor_type), np.float32).tobytes())
    return h.hexdigest()
