"""What a GGUF file's metadata says about its decoder, per architecture, as one DecoderConfig.

The keys follow llama.cpp's convention (``<arch>.block_count``, ``<arch>.attention.head_count``,
...). The architectures read here are ``llama``, ``qwen2``, ``qwen3`` and ``gemma3``; their
differences are stated as fields of :class:`DecoderConfig` (RoPE pairing, biases, QK-norm, extra
norms, activation, embedding scale, sliding-window layers), so that one forward
(:mod:`kvquant.models.gguf_decoder`) runs them all.

Anything the forward does not implement is refused with a ValueError naming it: another
architecture, a metadata key of the architecture that is not known here (rope scaling of any
kind declared in metadata, logit softcapping, experts, a sliding window on a ``llama`` file,
per-layer head counts, partial RoPE, ...), a tensor name that is not expected (the decoder
checks the tensors; Llama 3.1's RoPE divisors, ``rope_freqs.weight``, it applies). Nothing runs
approximately.

Facts the files do not carry, taken from llama.cpp's loader (``src/llama-model.cpp``) and
transformers' ``Gemma3TextConfig``, which agree on them:

- ``llama`` files have their Q/K weights permuted by the converter for RoPE on adjacent pairs;
  ``qwen2``, ``qwen3`` and ``gemma3`` files are not permuted and rotate the two halves of a head
  (llama.cpp's "NEOX" RoPE, transformers' ``rotate_half``).
- Gemma 3: every sixth layer (5, 11, 17, ...) attends globally, the others to the last
  ``sliding_window`` positions (the query's own included); local layers use RoPE base 10000
  (unless the file gives ``gemma3.rope.freq_base_swa``), global layers ``rope.freq_base``; scores
  are scaled by ``query_pre_attn_scalar ** -0.5`` with ``query_pre_attn_scalar`` = head_dim, except
  for the 62-layer 27B model where it is hidden / n_heads; embeddings are multiplied by
  sqrt(hidden); the MLP is GeGLU with the tanh approximation of GELU; the RMSNorm weights in
  the file already include Gemma's ``1 +`` (the converter adds it).
"""
from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "DecoderConfig", "config_from_gguf", "gguf_field"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# Gemma 3's layer pattern and local RoPE base (llama.cpp: set_swa_pattern(6),
# rope_freq_base_train_swa = 10000; transformers: sliding_window_pattern 6, rope_local_base_freq).
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62

# <arch>.* keys every architecture may carry and this reader understands.
_COMMON_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "vocab_size", "attention.key_length",
    "attention.value_length",
    # rope scaling: understood only as "none" (checked below)
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    # a mixture of experts: understood only as none (checked below)
    "expert_count", "expert_used_count",
}
_ARCH_KEYS = {
    "llama": set(),
    "qwen2": set(),
    "qwen3": set(),
    "gemma3": {"attention.sliding_window", "rope.freq_base_swa", "final_logit_softcapping",
               "attn_logit_softcapping"},
}


def gguf_field(reader, key, default=None, required=True, missing=""):
    """The value of a metadata key of a :class:`~kvquant.models.gguf_file.GGUFFile` (ValueError
    when required and missing; ``missing`` is added to that message, e.g. what the key's absence
    means)."""
    if key not in reader.metadata:
        if required:
            raise ValueError(f"the GGUF file has no {key!r}{missing}")
        return default
    return reader.metadata[key]


@dataclass(frozen=True)
class DecoderConfig:
    """One decoder's shape and its architecture's choices.

    ``sliding_layers`` marks the layers that attend to the last ``sliding_window`` positions
    only; ``rope_bases`` gives each layer's RoPE base.
    """
    architecture: str
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_base: float
    rope_pairs: str             # "adjacent" (x[2i], x[2i+1]) or "halves" (x[i], x[i + d/2])
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool            # a norm after attention and after the MLP (Gemma)
    activation: str             # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float
    attn_scale: float
    sliding_window: int         # 0: none
    sliding_layers: tuple
    rope_bases: tuple

    def layer_window(self, layer):
        """The sliding window of a layer (None: it attends to every earlier position)."""
        return self.sliding_window if self.sliding_layers[layer] else None


def _check_known_keys(reader, arch):
    known = _COMMON_KEYS | _ARCH_KEYS[arch]
    unknown = sorted(k for k in reader.metadata
                     if k.startswith(arch + ".") and k[len(arch) + 1:] not in known)
    if unknown:
        raise ValueError(f"{arch} file: metadata {', '.join(unknown)} not implemented here "
                         "(refused rather than run without it)")


MAX_SIZE = 1 << 31      # no width, count or length of a model here comes near it


def _int(value, key):
    """A size field's value: a positive integer below MAX_SIZE (a damaged file's 0 or 2^40 is
    refused here, before anything is allocated by it)."""
    if isinstance(value, (list, tuple)):
        raise ValueError(f"{key} is a per-layer list {list(value)[:8]}...; only one value for "
                         "all layers is implemented")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_SIZE:
        raise ValueError(f"{key} is {value!r}; it must be a positive integer below {MAX_SIZE} "
                         "(the file is damaged or not a model file)")
    return value


def _check_block_count(reader, n_layers):
    """block_count must name the blocks whose tensors the file holds: 0..n_layers-1."""
    blocks = set()
    for name in reader.tensors:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            blocks.add(int(parts[1]))
    if len(blocks) != n_layers or (blocks and max(blocks) != n_layers - 1):
        have = f"blocks 0..{max(blocks)}" if blocks else "no block tensors"
        raise ValueError(f"block_count is {n_layers} but the file has {have} "
                         f"({len(blocks)} distinct); the file is damaged")


def config_from_gguf(reader):
    """The :class:`DecoderConfig` of a :class:`~kvquant.models.gguf_file.GGUFFile` (ValueError for anything not
    implemented)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture is {arch!r}; implemented: {', '.join(ARCHITECTURES)}")
    _check_known_keys(reader, arch)

    def get(key, default=None, required=True):
        return gguf_field(reader, f"{arch}.{key}", default, required)

    scaling = get("rope.scaling.type", "none", required=False)
    factor = float(get("rope.scaling.factor", 1.0, required=False))
    if scaling != "none" and not (scaling == "linear" and factor == 1.0):
        raise ValueError(f"{arch}.rope.scaling.type is {scaling!r} (factor {factor}): RoPE "
                         "scaling is not implemented")
    if int(get("expert_count", 0, required=False)):
        raise ValueError(f"{arch}.expert_count is {get('expert_count')}: a mixture of experts is "
                         "not implemented")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if float(get(key, 0.0, required=False)):
            raise ValueError(f"{arch}.{key} is {get(key)}: logit softcapping is not implemented")

    n_layers = _int(get("block_count"), "block_count")
    _check_block_count(reader, n_layers)
    hidden = _int(get("embedding_length"), "embedding_length")
    n_heads = _int(get("attention.head_count"), "attention.head_count")
    n_kv_heads = _int(get("attention.head_count_kv", n_heads, required=False),
                      "attention.head_count_kv")
    head_dim = _int(get("attention.key_length", hidden // n_heads, required=False),
                    "attention.key_length")
    value_dim = _int(get("attention.value_length", head_dim, required=False),
                     "attention.value_length")
    if value_dim != head_dim:
        raise ValueError(f"value width {value_dim} != key width {head_dim}: not implemented")
    rope_dims = _int(get("rope.dimension_count", head_dim, required=False),
                     "rope.dimension_count")
    if rope_dims != head_dim:
        raise ValueError(f"rope.dimension_count {rope_dims} != head_dim {head_dim}: RoPE on part "
                         "of a head is not implemented")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv_heads} KV heads evenly")
    rope_base = float(get("rope.freq_base", 10000.0, required=False))
    vocab = get("vocab_size", None, required=False)
    if vocab is None:   # some converters leave it out: the vocabulary's length is the same
        vocab = len(gguf_field(reader, "tokenizer.ggml.tokens"))
    vocab = _int(vocab, "vocab_size")
    gemma = arch == "gemma3"
    window = int(get("attention.sliding_window")) if gemma else 0
    if gemma and window < 1:
        raise ValueError(f"gemma3.attention.sliding_window is {window}: the local layers need a "
                         "window of at least one position")
    sliding = tuple(gemma and (i + 1) % GEMMA3_SWA_PATTERN != 0 for i in range(n_layers))
    local_base = float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE, required=False))
    if gemma:
        scalar = hidden // n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim
    else:
        scalar = head_dim
    return DecoderConfig(
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=_int(get("feed_forward_length"), "feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=_int(get("context_length"), "context_length"),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=rope_base,
        rope_pairs="adjacent" if arch == "llama" else "halves",
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        post_norms=gemma,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
        attn_scale=float(scalar) ** -0.5,
        sliding_window=window,
        sliding_layers=sliding,
        rope_bases=tuple(local_base if s else rope_base for s in sliding),
    )


def layer_tensor_names(cfg):
    """``{short name: required}`` of the tensors of one block (``blk.<i>.<name>.weight``/``.bias``)."""
    names = {"attn_norm.weight": True, "attn_q.weight": True, "attn_k.weight": True,
             "attn_v.weight": True, "attn_output.weight": True, "ffn_norm.weight": True,
             "ffn_gate.weight": True, "ffn_up.weight": True, "ffn_down.weight": True}
    if cfg.qkv_bias:
        names.update({"attn_q.bias": True, "attn_k.bias": True, "attn_v.bias": True})
    if cfg.qk_norm:
        names.update({"attn_q_norm.weight": True, "attn_k_norm.weight": True})
    if cfg.post_norms:
        names.update({"post_attention_norm.weight": True, "post_ffw_norm.weight": True})
    return names
