"""A numpy forward for GGUF decoders (``llama``, ``qwen2``, ``qwen3``, ``gemma3``) whose KV cache
goes through codecs.

One forward serves the four architectures; what differs between them is a field of
:class:`~kvquant.models.gguf_config.DecoderConfig`: RoPE pairing (adjacent pairs on ``llama``
files, whose Q/K weights the converter permuted; the two halves of a head elsewhere; Llama 3.1's RoPE
scaling when the file carries its ``rope_freqs`` divisors), Q/K/V
biases (qwen2), RMSNorm of each query and key head before RoPE (qwen3, gemma3), norms after the
attention and the MLP and scaled embeddings (gemma3), SwiGLU or GeGLU (tanh GELU), the score
scale, and layers that attend to the last ``sliding_window`` positions only (gemma3's local
layers, each kind with its own RoPE base).

Per layer and KV head the cache (:class:`~kvquant.cache.QuantizedKVCache`, streams ``k`` and
``v``) keeps rows of width head_dim: keys after RoPE (and after the key norm) and values. Rows are
encoded as they are appended, before attention reads them (prefill included). A decode step
reads them through the codecs' consumers (``cache.attend``); a prefill, by default, through the
cache's decoded-block ``attend_prefill`` (BLAS; it agrees with the consumers to rounding), and
``prefill="consumer"`` scores and sums every query on the codes instead. Keys and values may use
different codecs (``"kv8/tq4"``: K kv8, V tq4). A local layer's cache keeps all its rows; its
queries read only the window (the cache's ``sliding_window`` argument).

Weights stay in their GGUF types, memory-mapped, and are dequantized as the forward needs them
(:class:`~kvquant.models.gguf_weights.GGUFWeights` states the memory policy and its budget).
"""
import os
from dataclasses import asdict

import numpy as np

from kvquant._kernels import matvec as _matvec
from kvquant._kernels._build_info import openmp_enabled
from kvquant._threads import blas_threads, resolve_n_threads
from kvquant.ggml_attention import GGMLAttentionCache
from kvquant.models import masked_softmax, rms_norm, silu
from kvquant.specs import KVLayout, parse_cache_spec
from kvquant.models.gguf_config import config_from_gguf, gguf_field, layer_tensor_names
from kvquant.models.gguf_file import GGUFFile
from kvquant.models.gguf_weights import DEFAULT_BUDGET_BYTES, GGUFWeights

__all__ = ["GGUFDecoder", "PREFILL_MODES", "gelu_tanh", "new_kv_cache", "rope_adjacent",
           "rope_halves"]

PREFILL_MODES = ("block", "consumer")
# Threads for the cache's kernels when a forward appends rows and when it prefills.
CACHE_THREADS = 1
# Threads of a decode step (one new token a sequence). A step alternates attention (kvquant's
# OpenMP threads) with products of one row by the weights; when those products go through numpy,
# OpenBLAS's workers and libgomp's busy-wait after each call on the core the other pool needs
# (README, "Inside a forward"). DECODE_PROJECTIONS = "pool" runs the step's products and its
# logits on kvquant's own OpenMP threads (kvquant/_kernels/matvec.h): one pool, nothing spinning
# against it, so attention and projections both take the threads OpenMP allows ("auto";
# OMP_NUM_THREADS caps them). "auto" (the default) takes the pool where OpenMP allows exactly 2
# threads, where it was measured, and "blas" elsewhere (without OpenMP the pool would be one
# thread; on more cores it was not measured). On 2 cores
# (kvquant_experiments.bench.decode_threads, settings alternating in one process;
# data/results/decode-threads-*-pool.txt) the pool gave the shortest steps of a
# SmolLM2-shaped decoder at 8192, 16384 and 32768 cached tokens and of SmolLM2 at 4096 (0.68-0.96
# of one attention thread's a round), and about the same for Gemma 3 270M at 8000 (50.0 against
# 47.0-49.3 ms: its 671 MB output matrix is most of a step either way). The products' bits
# differ from BLAS's in rounding only (tests/test_decode_threads.py).
# DECODE_PROJECTIONS = "blas" keeps numpy's products and picks between two ways of dodging the
# spinning: attention on 1 thread with BLAS left as it is, or attention on 2 threads with BLAS
# held to 1 for the whole step, the second once the cached K/V elements the step reads reach
# LONG_CONTEXT_RATIO times the weight elements it multiplies (measured with the SmolLM2-shaped
# decoder, float32 weights, kv8/tq4/q4_0+rot caches: the first setting shorter at ratios 0.70
# and 1.40, even at 2.10, the second shorter at 2.81; data/results/forward-attention-T*-crossover.*
# and decode-threads-smollm2-shape-T16384-24576-32768-crossover.txt); only where OpenMP allows
# exactly 2 threads (more cores were not measured: "auto" then keeps the first setting).
# A number instead of "auto" fixes the attention threads (and, with "blas", DECODE_BLAS_THREADS
# the BLAS threads; None: BLAS left as it is). Batches of several sequences (decode_step) and
# prefills keep CACHE_THREADS and numpy's products: those are matrix products, BLAS's strength.
DECODE_ATTENTION_THREADS = "auto"
DECODE_BLAS_THREADS = None
LONG_CONTEXT_RATIO = 2.0
DECODE_PROJECTIONS = "auto"
# Hidden rows per block in logits(): bounds the float32 (rows, vocab) block held at once.
LOGIT_ROW_BLOCK = 512


def _angles(positions, d, base, factors=None):
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:   # Llama 3.1's RoPE scaling: frequency i divided by factors[i]
        inv = inv / np.asarray(factors, dtype=np.float64)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]


def rope_adjacent(X, positions, base, factors=None):
    """RoPE on adjacent pairs: (x[2i], x[2i+1]) rotate by pos * base^(-2i/d) / factors[i].

    X : (n, heads, d) float32, positions : (n,) int, factors : (d/2,) or None (all 1).
    Returns float32, same layout.
    """
    cos, sin = _angles(positions, X.shape[-1], base, factors)
    a, b = X[..., 0::2], X[..., 1::2]
    out = np.empty_like(X)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def rope_halves(X, positions, base, factors=None):
    """RoPE on the two halves of a head: (x[i], x[i + d/2]) rotate by
    pos * base^(-2i/d) / factors[i].

    X : (n, heads, d) float32, positions : (n,) int, factors : (d/2,) or None (all 1).
    Returns float32, same layout.
    """
    d = X.shape[-1]
    cos, sin = _angles(positions, d, base, factors)
    a, b = X[..., :d // 2], X[..., d // 2:]
    out = np.empty_like(X)
    out[..., :d // 2] = a * cos - b * sin
    out[..., d // 2:] = b * cos + a * sin
    return out


def gelu_tanh(X):
    """GELU with the tanh approximation (float32)."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * X * (np.float32(1.0) + np.tanh(c * (X + np.float32(0.044715) * X**3)))


def _blas_linear(h, W):
    """h @ W.T (numpy's product, BLAS's threads)."""
    return h @ W.T


def _pool_linear(n_threads):
    """h @ W.T for one row h, on kvquant's OpenMP threads (matvec.h)."""
    n_threads = resolve_n_threads(n_threads)

    def linear(h, W):
        if h.shape[0] != 1:
            raise ValueError(f"the pool's products take one row, got {h.shape[0]}")
        W = np.ascontiguousarray(W, dtype=np.float32)
        y = np.empty((1, W.shape[0]), np.float32)
        _matvec.matvec(W, np.ascontiguousarray(h[0], dtype=np.float32), y[0], n_threads)
        return y
    return linear


def _window(window):
    """The cache's sliding_window keyword, given only on a windowed layer (so that caches of
    one's own that know no window still serve the models without one)."""
    return {} if window is None else {"sliding_window": window}


def _append(cache, layer, k, v, pre_rope, rows=None):
    """Store rows in a cache. A cache with ``keys_before_rope`` set also gets the keys before
    RoPE and the rotation ``rope_keys(X, positions)`` (to quantize them unrotated and rotate on
    read, as KVQuant does); ``rows`` (a slice) picks a sequence's rows of a batch."""
    if getattr(cache, "keys_before_rope", False):
        raw, rope_keys = pre_rope
        cache.append(layer, n_threads=CACHE_THREADS, k=k, v=v, rope_keys=rope_keys,
                     k_before_rope=raw if rows is None else raw[rows])
    else:
        cache.append(layer, n_threads=CACHE_THREADS, k=k, v=v)


def new_kv_cache(cfg, spec="f32"):
    """The cache that the cache spec ``spec`` (:mod:`kvquant.specs`: a string or a CacheSpec)
    builds for a model of config ``cfg`` (``n_layers``, ``n_kv_heads``, ``head_dim``,
    ``architecture``): a :class:`~kvquant.cache.QuantizedKVCache` with streams ``k`` and ``v``
    per KV head for ``"tq4"``, ``"kv8/tq4"`` or a per-layer plan; a
    :class:`~kvquant.ggml_attention.GGMLAttentionCache` for ``"ggml:q8_0/q8_0"`` (llama.cpp's
    cache types and its attention arithmetic); a plug-in kind's own cache.
    """
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                      getattr(cfg, "architecture", ""), capacity=256)
    return parse_cache_spec(spec).new_kv_cache(layout)


class GGUFDecoder:
    """A decoder read from a GGUF file of architecture llama, qwen2, qwen3 or gemma3.

    Parameters
    ----------
    path : str
    name : str, optional
        Model name used in results (default: the file name).
    prefill : {"block", "consumer"}
        How several tokens at once attend (see :meth:`forward_hidden`); decode always uses the
        consumers.
    budget_bytes : int
        Bytes of dequantized float32 weights to keep between forwards
        (:class:`~kvquant.models.gguf_weights.GGUFWeights`).

    Attributes
    ----------
    name, vocab_size, context_length, n_layers, n_kv_heads, head_dim : as the file says
    bos_token_id : int or None
        The id :meth:`encode` puts first (the file's ``tokenizer.ggml.add_bos_token``), else None.
    """

    def __init__(self, path, name=None, prefill="block", budget_bytes=DEFAULT_BUDGET_BYTES):
        try:
            import gguf  # noqa: F401  (its quantizers dequantize the tensors)
        except ImportError:
            raise ImportError(
                "reading GGUF files needs the 'gguf' package: pip install -e '.[models]' in the "
                "kvquant source tree"
            ) from None
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r} is not one of {PREFILL_MODES}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no GGUF file at {path}")
        self.prefill = prefill
        self.path = path
        self.name = name or os.path.splitext(os.path.basename(path))[0]
        self._reader = reader = GGUFFile(path)
        try:
            self.config = cfg = config_from_gguf(reader)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        self.weights = w = GGUFWeights(reader, path, budget_bytes)
        self._check_tensors()
        self.vocab_size = cfg.vocab_size
        self.context_length = cfg.context_length
        self.n_layers = cfg.n_layers
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        # Tied embeddings: no output.weight in the file means the output matrix is token_embd.
        self._output_name = "output.weight" if "output.weight" in w else "token_embd.weight"
        self.output_norm = w.get("output_norm.weight")
        # Llama 3.1/3.2 files carry their RoPE scaling as per-frequency divisors (llama.cpp's
        # rope_freqs, which its converter computes from the model's rope_scaling)
        self.rope_factors = w.get("rope_freqs.weight") if "rope_freqs.weight" in w else None
        self._norms = [{n: w.get(f"blk.{i}.{n}") for n in self._layer_names
                        if n.endswith("norm.weight") or n.endswith(".bias")}
                       for i in range(cfg.n_layers)]
        w.keep(self._output_name)
        for i in range(cfg.n_layers):
            for n in self._matrix_names:
                w.keep(f"blk.{i}.{n}")
        self._step_weight_elements = sum(
            int(np.prod(w.shape(name))) for name in
            [self._output_name] + [f"blk.{i}.{n}" for i in range(cfg.n_layers)
                                   for n in self._matrix_names])
        self._tokenizer = None
        add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token", False, required=False)
        bos = self._token_id("tokenizer.ggml.bos_token_id")
        self.bos_token_id = bos if add_bos else None
        self.eos_token_id = self._token_id("tokenizer.ggml.eos_token_id")

    def _token_id(self, key):
        """A token id the file names (BOS, EOS), or None: an integer inside the vocabulary, so
        that a damaged one is refused at load, not met as an index error in the first forward."""
        value = gguf_field(self._reader, key, None, required=False)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < self.vocab_size):
            raise ValueError(f"{self.path}: {key} is {value!r}; the vocabulary's ids are "
                             f"0..{self.vocab_size - 1}")
        return value

    _matrix_names = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                     "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

    @property
    def _layer_names(self):
        return layer_tensor_names(self.config)

    def _check_tensors(self):
        """Every tensor expected, of its shape, and no other (an unknown tensor is a feature of
        the architecture this forward would leave out)."""
        cfg, w = self.config, self.weights
        D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
        shapes = {"attn_norm.weight": (D,), "attn_q.weight": (q, D), "attn_k.weight": (kv, D),
                  "attn_v.weight": (kv, D), "attn_output.weight": (D, q), "ffn_norm.weight": (D,),
                  "ffn_gate.weight": (F, D), "ffn_up.weight": (F, D), "ffn_down.weight": (D, F),
                  "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                  "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                  "post_attention_norm.weight": (D,), "post_ffw_norm.weight": (D,)}
        expected = {"token_embd.weight": (cfg.vocab_size, D), "output_norm.weight": (D,)}
        if "output.weight" in w:
            expected["output.weight"] = (cfg.vocab_size, D)
        if "rope_freqs.weight" in w and cfg.architecture == "llama":
            expected["rope_freqs.weight"] = (hd // 2,)
        for i in range(cfg.n_layers):
            for n in self._layer_names:
                expected[f"blk.{i}.{n}"] = shapes[n]
        unknown = sorted(set(w.tensors) - set(expected))
        if unknown:
            raise ValueError(
                f"{self.path}: tensor(s) {', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''}"
                f" are not part of the {cfg.architecture} forward implemented here (refused "
                "rather than run without them)")
        for name, shape in expected.items():
            w.check_shape(name, shape)

    # -- model contract ------------------------------------------------------------------------
    @property
    def attention(self):
        """How attention reads the cache, for results."""
        if self.prefill == "block":
            return "decode: codec consumers; prefill: decoded block + BLAS (attend_prefill)"
        return "codec consumers (decode and prefill)"

    def describe(self):
        cfg = asdict(self.config)
        cfg["sliding_layers"] = [i for i, s in enumerate(self.config.sliding_layers) if s]
        cfg["rope_bases"] = sorted(set(self.config.rope_bases))
        return {"model": self.name, "file": os.path.basename(self.path), **cfg,
                "attention": self.attention, "bos_token_id": self.bos_token_id}

    @property
    def tokenizer(self):
        """The file's tokenizer (built on first use; refuses kinds not implemented)."""
        if self._tokenizer is None:
            from kvquant.models.tokenizer import tokenizer_from_gguf
            try:
                self._tokenizer = tokenizer_from_gguf(self._reader)
            except ValueError as exc:   # the fields are the file's: the message names it
                raise ValueError(f"{self.path}: {exc}") from None
        return self._tokenizer

    def encode(self, text):
        """Text -> token ids (int64 array), with the BOS id first when the file asks for it."""
        ids = self.tokenizer.encode(text).ids
        if self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return np.array(ids, dtype=np.int64)

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def new_cache(self, pair_spec="f32"):
        return new_kv_cache(self.config, pair_spec)

    def forward(self, tokens, cache, last_only=False):
        """Run tokens after those already in ``cache``: :meth:`logits` of :meth:`forward_hidden`.

        Returns
        -------
        logits : ndarray of shape (n_tokens, vocab_size), or (1, vocab_size) with last_only, float32
        """
        tokens = self._check_tokens(tokens)
        attention, blas, linear = self._step_threads(tokens.size, len(cache))
        with blas_threads(blas):
            hidden = self._hidden(tokens, cache, attention, linear)
            return self._logits(hidden[-1:] if last_only else hidden, linear)

    def forward_hidden(self, tokens, cache):
        """Run tokens after those already in ``cache`` (appending their K/V rows to it).

        One token (decode) attends through the consumers (``cache.attend``). Several tokens
        (prefill) attend as ``self.prefill`` says: ``"block"`` (default) is the cache's
        ``attend_prefill``, which decodes each KV head's rows once and multiplies with BLAS;
        ``"consumer"`` scores and sums every query on the codes (slower, same result to rounding).

        Returns
        -------
        hidden : ndarray of shape (n_tokens, hidden_size), float32
            The final hidden states, after the output norm.
        """
        tokens = self._check_tokens(tokens)
        attention, blas, linear = self._step_threads(tokens.size, len(cache))
        with blas_threads(blas):
            return self._hidden(tokens, cache, attention, linear)

    def decode_threads(self, cached_tokens):
        """The threads of a decode step after ``cached_tokens`` tokens: (attention threads,
        BLAS threads or None for BLAS left as it is), as DECODE_ATTENTION_THREADS and
        DECODE_PROJECTIONS say (with "pool", the projections run on the attention's threads)."""
        return self._decode_setting(cached_tokens, self._pool_projections())

    def _decode_setting(self, cached_tokens, pool):
        """decode_threads, with ``pool`` (the step's products on the OpenMP threads) decided."""
        if DECODE_ATTENTION_THREADS != "auto":
            if isinstance(DECODE_ATTENTION_THREADS, str):
                raise ValueError(f"DECODE_ATTENTION_THREADS is {DECODE_ATTENTION_THREADS!r}: "
                                 "use \"auto\" or a thread count")
            return DECODE_ATTENTION_THREADS, None if pool else DECODE_BLAS_THREADS
        if pool:
            return resolve_n_threads(None), None
        if (resolve_n_threads(None) == 2
                and self.long_context_ratio(cached_tokens) >= LONG_CONTEXT_RATIO):
            return 2, 1
        return 1, None

    def long_context_ratio(self, cached_tokens):
        """Cached K/V elements a decode step after ``cached_tokens`` tokens reads (the new
        token's rows included, each windowed layer its window only) over the weight elements it
        multiplies (the layers' matrices and the output matrix)."""
        cfg, rows = self.config, cached_tokens + 1
        windows = (cfg.layer_window(i) for i in range(cfg.n_layers))
        read = sum(rows if w is None else min(rows, w) for w in windows)
        return read * cfg.n_kv_heads * 2 * cfg.head_dim / self._step_weight_elements

    @staticmethod
    def _pool_projections():
        """Whether a decode step's products run on kvquant's OpenMP threads
        (DECODE_PROJECTIONS)."""
        if DECODE_PROJECTIONS not in ("auto", "blas", "pool"):
            raise ValueError(f"DECODE_PROJECTIONS is {DECODE_PROJECTIONS!r}: use \"auto\", "
                             "\"blas\" or \"pool\"")
        if DECODE_PROJECTIONS == "auto":
            return bool(openmp_enabled()) and resolve_n_threads(None) == 2
        return DECODE_PROJECTIONS == "pool"

    def _step_threads(self, n_tokens, cached_tokens):
        """(attention threads, BLAS threads, linear) of a forward: a decode step's (one token),
        or for several tokens (a prefill, or a batch of sequences) the cache's CACHE_THREADS
        with BLAS left as it is; ``linear(h, W)`` computes the step's products h @ W.T."""
        pool = self._pool_projections()      # checked on every forward, prefills too
        if n_tokens != 1:
            return CACHE_THREADS, None, _blas_linear
        attention, blas = self._decode_setting(cached_tokens, pool)
        return attention, blas, _pool_linear(attention) if pool else _blas_linear

    def _hidden(self, tokens, cache, attention_threads, linear=_blas_linear):
        """forward_hidden of checked tokens, the decode attention on ``attention_threads``, the
        products through ``linear``, BLAS's threads left to the caller."""
        start = len(cache)
        if start + tokens.size > self.context_length:
            raise ValueError(
                f"{start} cached + {tokens.size} new tokens exceed the model's trained context of "
                f"{self.context_length} tokens; use shorter chunks")
        pos = start + np.arange(tokens.size)

        def attend(li, q, k, v, pre_rope):
            return self._attend_sequence(cache, li, q, k, v, pre_rope, pos, attention_threads)

        return self._final_norm(self._layers(tokens, pos, attend, linear))

    def _attend_sequence(self, cache, li, q, k, v, pre_rope, pos, attention_threads, rows=None):
        """Store one sequence's new rows in its cache, then attend: one token through the
        consumers (``cache.attend``), several as ``self.prefill`` says."""
        window = self.config.layer_window(li)
        _append(cache, li, k, v, pre_rope, rows)
        if q.shape[0] == 1:
            return cache.attend(li, q[0], scale=self.config.attn_scale,
                                n_threads=attention_threads, **_window(window))[None]
        # a llama.cpp attention cache computes a batch its own way, whatever self.prefill
        if self.prefill == "block" or isinstance(cache, GGMLAttentionCache):
            return cache.attend_prefill(li, q, scale=self.config.attn_scale,
                                        n_threads=CACHE_THREADS, **_window(window))
        return self._consumer_prefill(cache, li, q, pos, window)

    def forward_sequences(self, sequences):
        """Run several sequences at once, each its own tokens after its own cache: the weights
        are read once for all their rows, and each sequence's rows are stored and attended to
        in its cache exactly as :meth:`forward_hidden` of that sequence alone would (the
        products differ from separate forwards by float rounding only).

        Parameters
        ----------
        sequences : list of (cache, tokens)
            Distinct caches; each tokens array non-empty.

        Returns
        -------
        hidden : ndarray of shape (total tokens, hidden_size), float32
            The final hidden states, the sequences' rows one after another (:meth:`logits`
            turns any block of them into logits).
        """
        if not sequences:
            raise ValueError("forward_sequences needs at least one sequence")
        caches = [c for c, _ in sequences]
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each sequence needs its own cache")
        ids = [self._check_tokens(t) for _, t in sequences]
        starts = [len(c) for c in caches]
        for start, t in zip(starts, ids):
            if start + t.size > self.context_length:
                raise ValueError(f"{start} cached + {t.size} new tokens exceed the model's "
                                 f"trained context of {self.context_length} tokens")
        bounds = np.cumsum([0] + [t.size for t in ids])
        pos = np.concatenate([s + np.arange(t.size) for s, t in zip(starts, ids)])
        tokens = np.concatenate(ids)

        def attend(li, q, k, v, pre_rope):
            out = np.empty_like(q)
            for cache, a, b in zip(caches, bounds[:-1], bounds[1:]):
                rows = slice(int(a), int(b))
                out[rows] = self._attend_sequence(cache, li, q[rows], k[rows], v[rows],
                                                  pre_rope, pos[rows], CACHE_THREADS, rows)
            return out

        return self._final_norm(self._layers(tokens, pos, attend))

    def _logits(self, X, linear):
        """:meth:`logits`, one row of a kept output matrix through ``linear``."""
        if linear is not _blas_linear and X.shape[0] == 1 and self.weights.is_kept(
                self._output_name):
            return linear(np.ascontiguousarray(X, dtype=np.float32),
                          self.weights.get(self._output_name))
        return self.logits(X)

    def logits(self, hidden_rows):
        """Logits of final hidden states (rows of :meth:`forward_hidden`).

        Parameters
        ----------
        hidden_rows : ndarray of shape (m, hidden_size)

        Returns
        -------
        ndarray of shape (m, vocab_size), float32
        """
        X = np.ascontiguousarray(hidden_rows, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden rows must have shape (m, {self.config.hidden_size}), got "
                             f"{X.shape}")
        if self.weights.is_kept(self._output_name):
            return self.weights.matmul_t(X, self._output_name)
        out = np.empty((X.shape[0], self.vocab_size), np.float32)
        for r0 in range(0, X.shape[0], LOGIT_ROW_BLOCK):
            out[r0:r0 + LOGIT_ROW_BLOCK] = self.weights.matmul_t(X[r0:r0 + LOGIT_ROW_BLOCK],
                                                                 self._output_name)
        return out

    def decode_step(self, tokens, caches):
        """One new token for each of several sequences, each with its own cache (a batch).

        The weights are read once for the whole batch; each sequence attends to its own cache
        through the consumers. Returns logits of shape (n_sequences, vocab_size).
        """
        tokens = self._check_tokens(tokens)
        if len(caches) != tokens.size:
            raise ValueError(f"{tokens.size} tokens for {len(caches)} caches")
        pos = np.array([len(c) for c in caches])
        if pos.max() + 1 > self.context_length:
            raise ValueError(f"a cache already holds {pos.max()} tokens: the next one exceeds "
                             f"the model's trained context of {self.context_length}")

        # one sequence is a decode step; a batch's projections are products with several rows,
        # which keep BLAS's threads (and the cache then its CACHE_THREADS)
        threads, blas, linear = self._step_threads(tokens.size, int(pos[0]))

        def attend(li, q, k, v, pre_rope):
            window = self.config.layer_window(li)
            out = np.empty_like(q)
            for b, cache in enumerate(caches):
                _append(cache, li, k[b:b + 1], v[b:b + 1], pre_rope, slice(b, b + 1))
                out[b] = cache.attend(li, q[b], scale=self.config.attn_scale,
                                      n_threads=threads, **_window(window))
            return out

        with blas_threads(blas):
            return self._logits(self._final_norm(self._layers(tokens, pos, attend, linear)),
                                linear)

    # -- pieces ----------------------------------------------------------------------------------
    def _check_tokens(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        return tokens

    def _final_norm(self, x):
        return rms_norm(x, self.output_norm, self.config.rms_norm_eps)

    def _layers(self, tokens, pos, attend, linear=_blas_linear):
        """The decoder blocks on rows of tokens at positions ``pos``; ``attend(layer, q, k, v,
        pre_rope)`` stores k, v (n, n_kv_heads, hd) in the cache and returns the attention output
        (n, n_heads, hd) of the queries q (n, n_heads, hd); ``pre_rope`` is (the keys before
        RoPE, ``rope_keys(X, positions)``), for caches that ask for them; ``linear(h, W)`` is
        h @ W.T."""
        cfg, w = self.config, self.weights
        n, hd, eps = tokens.size, cfg.head_dim, cfg.rms_norm_eps
        x = w.rows("token_embd.weight", tokens)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        act = silu if cfg.activation == "silu" else gelu_tanh
        rope = rope_adjacent if cfg.rope_pairs == "adjacent" else rope_halves
        for li in range(cfg.n_layers):
            p, norms = f"blk.{li}.", self._norms[li]
            h = rms_norm(x, norms["attn_norm.weight"], eps)
            q = linear(h, w.get(p + "attn_q.weight"))
            k = linear(h, w.get(p + "attn_k.weight"))
            v = linear(h, w.get(p + "attn_v.weight"))
            if cfg.qkv_bias:
                q += norms["attn_q.bias"]
                k += norms["attn_k.bias"]
                v += norms["attn_v.bias"]
            q = q.reshape(n, cfg.n_heads, hd)
            k = k.reshape(n, cfg.n_kv_heads, hd)
            v = v.reshape(n, cfg.n_kv_heads, hd)
            if cfg.qk_norm:
                q = rms_norm(q.reshape(-1, hd), norms["attn_q_norm.weight"], eps).reshape(q.shape)
                k = rms_norm(k.reshape(-1, hd), norms["attn_k_norm.weight"], eps).reshape(k.shape)
            base = cfg.rope_bases[li]
            pre_rope = (k, lambda X, at, base=base: rope(X, at, base, self.rope_factors))
            q, k = rope(q, pos, base, self.rope_factors), rope(k, pos, base, self.rope_factors)
            # The rows enter the cache (quantized) before anything reads them.
            out = linear(attend(li, q, k, v, pre_rope).reshape(n, -1),
                         w.get(p + "attn_output.weight"))
            if cfg.post_norms:
                out = rms_norm(out, norms["post_attention_norm.weight"], eps)
            x = x + out
            h = rms_norm(x, norms["ffn_norm.weight"], eps)
            with np.errstate(over="ignore"):
                gate = act(linear(h, w.get(p + "ffn_gate.weight")))
            out = linear(gate * linear(h, w.get(p + "ffn_up.weight")),
                         w.get(p + "ffn_down.weight"))
            if cfg.post_norms:
                out = rms_norm(out, norms["post_ffw_norm.weight"], eps)
            x = x + out
        return x

    def _consumer_prefill(self, cache, layer, q, pos, window):
        """Causal (and, on a local layer, windowed) attention of many queries through
        ``codec.scores`` / ``codec.context``."""
        cfg = self.config
        S, hd = q.shape[0], cfg.head_dim
        group = cfg.n_heads // cfg.n_kv_heads
        if S > 1 and cache.recent:
            raise ValueError(
                f"a stream of this cache reads its last {cache.recent} rows from float32 copies "
                "(recent=W), each query its own: prefill='consumer' reads all the queries of a "
                "prefill in one call; use prefill='block'")
        # Query rows of one KV group are (position, head in group).
        qpos = np.repeat(pos, group)
        n_rows = len(cache.stream(layer, "k"))
        hidden = np.arange(n_rows)[None, :] > qpos[:, None]
        if window is not None:
            hidden |= np.arange(n_rows)[None, :] <= qpos[:, None] - window
        out = np.empty((S, cfg.n_heads, hd), np.float32)
        for g in range(cfg.n_kv_heads):
            Q = q[:, g * group:(g + 1) * group].reshape(S * group, hd)
            scores = cache.scores(layer, "k", Q, head=g, n_threads=CACHE_THREADS)
            scores *= np.float32(cfg.attn_scale)
            weights = masked_softmax(scores, hidden)
            out[:, g * group:(g + 1) * group] = cache.context(
                layer, "v", weights, head=g, n_threads=CACHE_THREADS).reshape(S, group, hd)
        return out
