"""llama.cpp's CPU attention on its cache types, as it runs: a baseline cache.

The storage-only baselines (``q8_0+rot/q8_0+rot``, ...) quantize the rows and then attend in
exact float32 arithmetic. llama.cpp does not: its CPU flash attention (ggml's
``ggml_compute_forward_flash_attn_ext_f16``, ggml/src/ggml-cpu/ops.cpp) rounds the query, and
sometimes its running sums, on the way. :class:`GGMLAttentionCache` reproduces that arithmetic
on the rows a kvquant model appends, so that a table can say plainly "as llama.cpp runs"
(pair specs ``ggml:<K type>/<V type>``) next to "storage only" (``q8_0+rot/q8_0+rot``).

A pair spec ``ggml:<K>/<V>`` (or ``ggml:<T>`` for both) names llama.cpp's cache types
(``--cache-type-k`` / ``--cache-type-v``): ``f16``, ``q8_0``, ``q4_0``.
``ggml-norot:<K>/<V>`` is the same with llama.cpp's cache rotation turned off
(``LLAMA_ATTN_ROT_DISABLE=1``). What is modelled (docs/reference.md, "llama.cpp's attention as
it runs", gives the sources):

* **Rotation** (llama.cpp PR #21038, src/llama-kv-cache.cpp and src/llama-graph.cpp): when the K
  type is quantized and head_dim % 64 == 0, the queries and keys are multiplied by the
  orthonormal Walsh-Hadamard matrix (Sylvester order, no signs) of the largest power of two
  >= 64 that divides head_dim, in blocks of that size; when the V type is quantized and
  head_dim % 64 == 0, the values are rotated in blocks of 64 and the attention output is
  rotated back by the same (symmetric, involutory) matrix.
* **Storage** (``set_rows`` with the CPU type's ``from_float``): f16 rounds to nearest even;
  q8_0 is the x86 SIMD quantizer (``quantize_row_q8_0`` in ggml-cpu/arch/x86/quants.c:
  d = amax / 127 stored as f16, quants ``rint(x * (127 / amax))``, ties to even), q4_0 the
  reference one (``quantize_row_q4_0_ref``, the ``q4_0`` codec of :mod:`kvquant.codecs.ggml`).
* **The query** is converted to the K type's ``vec_dot_type`` before K.Q: q8_0 (the same x86
  quantizer) for q8_0 and q4_0 keys, f16 for f16 keys. Scores are the dot products of the
  stored values (computed in float32), times the scale in float32, plus the mask.
* **Softmax** is in float32 with ``expf``; the output is the value sum times ``1 / S``.
* **Values**: quantized V rows are dequantized to float32 and summed in float32. An f16 V is
  summed in an **f16 accumulator** (``VKQ16``): every step ``acc = f16(acc + v * expf(s - M))``
  and, at a new running maximum, ``acc = f16(acc * expf(M_old - M))``.
* **Which path**: an f16/f16 cache with 64 or more queries at once (a prefill) takes the tiled
  path (``ggml_compute_forward_flash_attn_ext_tiled``): the query stays float32 and the value
  sum is float32. Every other case (any quantized type, a decode step, a short batch) takes
  the one-query path (``..._one_chunk``) described above, prefill included.
* **Gemma 3** scales its queries before attention (``ggml_scale`` of Q, scale 1 in the
  attention): the cache does the same when built with ``prescale_query=True``.

Not modelled: the order of float32 additions inside the dot products and sums (rounding-level
against the roundings above) and the split of a long f16 decode over threads (llama.cpp with n
threads cuts a cache of >= 512 rows into n ranges, each with its own f16 accumulator, merged in
float32; here one range: as with one thread).
"""
import re
from dataclasses import dataclass

import numpy as np

from kvquant.specs import CacheSpec, SpecKind, register_builtin_kind

__all__ = ["CACHE_TYPES", "GGML_FAMILY", "GGMLAttentionCache", "GGMLPair", "hadamard_matrix",
           "parse_ggml_pair", "quantize_q8_0_x86", "rotate_blocks", "round_query",
           "stored_values"]

QK = 32                       # values per q8_0 / q4_0 block
TILE_Q = 64                   # ggml's GGML_FA_TILE_Q: queries at once that take the tiled path
ROT_MIN = 64                  # llama.cpp rotates only head widths that 64 divides
CACHE_TYPES = {"f16": None, "q8_0": 34, "q4_0": 18}   # type -> bytes per block of 32 (f16: 2/value)
PREFIXES = {"ggml": True, "ggml-norot": False}        # prefix -> llama.cpp's cache rotation on
GGML_FAMILY = "llama.cpp as run"
F16_MAX = 65504.0


def _type_bytes(cache_type, dim):
    block = CACHE_TYPES[cache_type]
    return 2 * dim if block is None else (dim // QK) * block


@dataclass(frozen=True)
class GGMLPair(CacheSpec):
    """A parsed ``ggml:<K>/<V>`` pair spec: llama.cpp's cache types and its rotation switch (the
    ``ggml`` kind of :class:`~kvquant.specs.CacheSpec`)."""

    k_type: str
    v_type: str
    rotation: bool = True
    kind = "ggml"

    @property
    def text(self):
        prefix = "ggml" if self.rotation else "ggml-norot"
        return f"{prefix}:{self.k_type}/{self.v_type}"

    spec = text

    @property
    def family(self):
        return GGML_FAMILY

    def describe(self, streams=("K", "V")):
        return (f"llama.cpp as run{'' if self.rotation else ' (no rotation)'}: "
                f"{streams[0]} {self.k_type} / {streams[1]} {self.v_type}")

    def new_kv_cache(self, layout):
        # llama.cpp's Gemma 3 graph scales the queries before attention
        return GGMLAttentionCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, self,
                                  prescale_query=layout.architecture == "gemma3",
                                  capacity=layout.capacity)

    def rotation_widths(self, head_dim):
        """(K rotation width or None, V rotation width or None), as llama.cpp picks them."""
        if not self.rotation or head_dim % ROT_MIN:
            return None, None
        k_rot = None
        if self.k_type != "f16":
            k_rot = ROT_MIN
            while head_dim % (2 * k_rot) == 0:
                k_rot *= 2
        return k_rot, (ROT_MIN if self.v_type != "f16" else None)

    def bytes_per_row(self, stream, head_dim):
        return _type_bytes(self.k_type if stream == "k" else self.v_type, head_dim)

    def bits_per_value(self, head_dim, tokens=None):
        """(K + V bytes per row) * 8 / (2 * head_dim); no fixed costs, whatever ``tokens``."""
        return 8.0 * (self.bytes_per_row("k", head_dim) + self.bytes_per_row("v", head_dim)) \
            / (2 * head_dim)

    def check(self, head_dim):
        if self.k_type != "f16" or self.v_type != "f16":
            if head_dim % QK:
                raise ValueError(f"{self.spec}: q8_0 and q4_0 store blocks of {QK} values; "
                                 f"head_dim {head_dim} is not a multiple of {QK}")
        return self


def _claims(text):
    return text.split(":", 1)[0] in PREFIXES


def parse_ggml_pair(pair_spec):
    """``"ggml:q8_0/q4_0"`` -> ``GGMLPair("q8_0", "q4_0", rotation=True)``; ``"ggml:f16"`` is
    ``ggml:f16/f16``; ``ggml-norot:`` turns the rotation off. ValueError naming what is wrong."""
    if isinstance(pair_spec, GGMLPair):
        return pair_spec
    if not isinstance(pair_spec, str) or not _claims(pair_spec.strip()):
        raise ValueError(f"{pair_spec!r} is not a llama.cpp attention spec (ggml:<K>/<V>)")
    prefix, _, types = pair_spec.strip().partition(":")
    parts = [p.strip().lower() for p in types.split("/")]
    if len(parts) == 1:
        parts = parts * 2
    known = ", ".join(CACHE_TYPES)
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{pair_spec!r}: expected {prefix}:<K type>/<V type> with types among "
                         f"{known}, e.g. '{prefix}:q8_0/q8_0'")
    for p in parts:
        if not re.fullmatch(r"[a-z0-9_]+", p) or p not in CACHE_TYPES:
            raise ValueError(f"{pair_spec!r}: {p!r} is not a llama.cpp cache type modelled here "
                             f"(known: {known}); for kvquant's own codecs drop '{prefix}:'")
    return GGMLPair(parts[0], parts[1], PREFIXES[prefix])


register_builtin_kind(SpecKind("ggml", _claims, parse_ggml_pair))


# --------------------------------------------------------------------------------------------
# Rows as llama.cpp stores them
# --------------------------------------------------------------------------------------------
def hadamard_matrix(n):
    """llama.cpp's rotation: the Sylvester Walsh-Hadamard matrix over sqrt(n), float32 (n, n).
    Symmetric and its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.float32(np.sqrt(n))).astype(np.float32)


def rotate_blocks(X, n):
    """Each consecutive block of n values of the last axis times llama.cpp's rotation, computed
    as ggml's CPU ``fwht`` does (``ggml_compute_forward_fwht``: x / sqrt(n) in float32, then
    the butterflies (u + v, u - v) at strides 1, 2, 4, ...): every row gets the same bits
    whatever the rows beside it. Equal to ``X @ hadamard_matrix(n)`` up to float32 rounding.

    X : ndarray of shape (..., d), d a multiple of n -> float32, same shape.
    """
    shape = X.shape
    Y = np.asarray(X, dtype=np.float32).reshape(-1, n) * (np.float32(1) / np.sqrt(np.float32(n)))
    step = 1
    while step < n:
        Y = Y.reshape(-1, n // (2 * step), 2, step)
        u, v = Y[:, :, 0, :], Y[:, :, 1, :]
        Y = np.stack([u + v, u - v], axis=2)
        step *= 2
    return Y.reshape(shape)


def _f16_values(X, what):
    with np.errstate(over="ignore"):
        Y = X.astype(np.float16)
    if not np.isfinite(Y).all():
        raise ValueError(f"{what}: values beyond float16's range (|x| > {F16_MAX:g}) would be "
                         "stored as inf by llama.cpp's f16 cache; nothing was stored")
    return Y.astype(np.float32)


def quantize_q8_0_x86(X):
    """llama.cpp's q8_0 quantizer on x86 (AVX/AVX2 build), as its CPU backend runs it.

    Parameters
    ----------
    X : ndarray of shape (..., d), float32, d a multiple of 32

    Returns
    -------
    d : ndarray of shape (..., d / 32), float16 (the block scales, amax / 127)
    q : ndarray of shape (..., d / 32, 32), int8 (``rint(x * 127 / amax)``, ties to even)
    """
    X = np.asarray(X, dtype=np.float32)
    B = X.reshape(*X.shape[:-1], X.shape[-1] // QK, QK)
    amax = np.abs(B).max(axis=-1)
    with np.errstate(over="ignore", divide="ignore"):
        d = (amax / np.float32(127.0)).astype(np.float16)
        inv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1),
                       np.float32(0)).astype(np.float32)
    q = np.rint(B * inv[..., None]).astype(np.int8)
    return d, q


def _q8_0_values(X, what):
    d, q = quantize_q8_0_x86(X)
    if not np.isfinite(d).all():
        raise ValueError(f"{what}: a q8_0 block scale beyond float16 (|x| >= 8.3e6): "
                         "llama.cpp would store an infinite scale; nothing was stored")
    return (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(X.shape)


def _q4_0_values(X, what):
    from kvquant.codecs import get_codec
    codec = get_codec("q4_0", X.shape[-1])
    rows = X.reshape(-1, X.shape[-1])
    try:
        return codec.decode(codec.encode(rows)).reshape(X.shape)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def stored_values(X, cache_type, what="rows"):
    """The values llama.cpp's cache of ``cache_type`` holds for rows X, widened to float32.

    Parameters
    ----------
    X : ndarray of shape (..., d), float32 (already rotated when llama.cpp rotates)
    cache_type : {"f16", "q8_0", "q4_0"}

    Returns
    -------
    ndarray of the same shape, float32 (exact: f16 values, or block scale times quant)
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not np.isfinite(X).all():
        raise ValueError(f"{what}: NaN or inf values; nothing was stored")
    if cache_type == "f16":
        return _f16_values(X, what)
    if cache_type == "q8_0":
        return _q8_0_values(X, what)
    return _q4_0_values(X, what)


def round_query(Q, k_type):
    """The query as K.Q reads it on the one-query path: converted to the K type's vec_dot_type
    (f16 for f16 keys, q8_0 by the x86 quantizer for q8_0 and q4_0 keys), widened to float32.

    Q : ndarray of shape (..., d), float32 -> same shape, float32.
    """
    Q = np.asarray(Q, dtype=np.float32)
    if k_type == "f16":
        with np.errstate(over="ignore"):
            return Q.astype(np.float16).astype(np.float32)
    d, q = quantize_q8_0_x86(Q)
    return (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(Q.shape)


# --------------------------------------------------------------------------------------------
# The attention arithmetic
# --------------------------------------------------------------------------------------------
def _softmax_parts(S, hidden):
    """exp(s - max) over the visible scores (0 where hidden) and their sum, float32.

    S : (n_q, g, T) float32 scaled scores; hidden : (n_q, T) bool."""
    S = np.where(hidden[:, None, :], np.float32(-np.inf), S)
    M = S.max(axis=-1, keepdims=True)
    P = np.exp(S - M, dtype=np.float32)
    return P, P.sum(axis=-1, dtype=np.float32)


def _f16_accumulated(S, hidden, V):
    """The one-query path's f16 value sum: online softmax over the rows in order, the running
    sum ``acc`` rounded to f16 at every step (ggml_vec_mad_f16 / ggml_vec_scale_f16).

    S : (n_q, g, T) float32 scaled scores; hidden : (n_q, T) bool, each column's visible queries
    one contiguous range (causal, optionally windowed, queries by position); V : (T, dv) float32
    holding f16 values. Returns (acc as float32 (n_q, g, dv), S_sum float32 (n_q, g)).
    """
    n_q, g, T = S.shape
    acc = np.zeros((n_q, g, V.shape[1]), np.float32)   # holds f16 values throughout
    M = np.full((n_q, g), -np.inf, np.float32)
    total = np.zeros((n_q, g), np.float32)
    visible = ~hidden
    any_visible = visible.any(axis=0)
    first = visible.argmax(axis=0)
    last = n_q - visible[::-1].argmax(axis=0)
    if np.any(visible.sum(axis=0) != np.where(any_visible, last - first, 0)):
        raise ValueError("the f16 value sum needs each row's visible queries in one range "
                         "(causal or windowed masks over queries in position order)")
    with np.errstate(invalid="ignore", over="ignore"):
        for t in np.flatnonzero(any_visible):
            a, b = first[t], last[t]
            s, m = S[a:b, :, t], M[a:b]
            new_max = s > m
            vs = np.exp(s - m, dtype=np.float32)
            if new_max.any():
                # a new running maximum: the sum so far scaled by expf(M_old - M), in f16
                ms = np.exp(m[new_max] - s[new_max], dtype=np.float32)
                block = acc[a:b]
                block[new_max] = (block[new_max] * ms[:, None]).astype(np.float16)
                total[a:b][new_max] *= ms
                m[new_max] = s[new_max]
                vs[new_max] = 1.0
            acc[a:b] = (acc[a:b] + V[t] * vs[..., None]).astype(np.float16)
            total[a:b] += vs
    return acc, total


def attend_rows(Q, K, V, hidden, scale, k_type, v_type, tiled):
    """llama.cpp's flash attention of queries of one KV head over stored rows.

    Parameters
    ----------
    Q : ndarray of shape (n_q, g, d), float32 (rotated as the keys are)
    K, V : ndarray of shape (T, d), float32 (:func:`stored_values`)
    hidden : ndarray of shape (n_q, T), bool (masked rows: future, or outside a window)
    scale : float32
    k_type, v_type : cache types
    tiled : bool
        The tiled path (f16/f16, 64 or more queries): float32 query and value sum.

    Returns
    -------
    ndarray of shape (n_q, g, dv), float32 (still in the rotated V basis)
    """
    n_q, g, d = Q.shape
    Qr = Q if tiled else round_query(Q, k_type)
    S = np.matmul(Qr.reshape(n_q * g, d), K.T).reshape(n_q, g, K.shape[0])
    S *= scale
    if v_type == "f16" and not tiled:
        acc, total = _f16_accumulated(S, hidden, V)
    else:
        P, total = _softmax_parts(S, hidden)
        acc = np.matmul(P.reshape(n_q * g, -1), V).reshape(n_q, g, V.shape[1])
    with np.errstate(divide="ignore"):
        inv = np.where(total == 0, np.float32(0), np.float32(1) / total).astype(np.float32)
    return acc * inv[..., None]


class _StreamView:
    """What result tables read of a stream: its spec."""

    def __init__(self, spec):
        self.spec = spec


class GGMLAttentionCache:
    """A KV cache that stores rows as llama.cpp's cache types and attends as its CPU flash
    attention computes (see the module docstring for what is modelled).

    It serves the GGUF decoders as :class:`~kvquant.cache.QuantizedKVCache` does (``append``,
    ``attend``, ``attend_prefill``, lengths and sizes); streams ``k`` and ``v``.

    Parameters
    ----------
    n_layers, n_kv_heads, head_dim : int
    pair : str or GGMLPair
        ``ggml:<K>/<V>`` or ``ggml-norot:<K>/<V>``.
    prescale_query : bool
        Multiply the queries by the score scale before rounding them and attend with scale 1
        (llama.cpp's Gemma 3 graph), instead of scaling the scores.
    capacity : int
        Rows to reserve per layer.
    """

    stream_names = ("k", "v")
    recent = 0
    fixed_bytes = 0

    def __init__(self, n_layers, n_kv_heads, head_dim, pair, prescale_query=False, capacity=0):
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.pair = parse_ggml_pair(pair).check(int(head_dim))
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), \
            int(head_dim)
        self.dims = {"k": self.head_dim, "v": self.head_dim}
        self.prescale_query = bool(prescale_query)
        k_rot, v_rot = self.pair.rotation_widths(self.head_dim)
        self._k_rot, self._v_rot = k_rot, v_rot   # rotation widths, or None
        self._lengths = [0] * self.n_layers
        self._k = [np.empty((0, self.n_kv_heads, self.head_dim), np.float32)
                   for _ in range(self.n_layers)]
        self._v = [a.copy() for a in self._k]
        self.reserve(capacity)

    @property
    def spec(self):
        return self.pair.spec

    def __repr__(self):
        return (f"<GGMLAttentionCache {self.spec} layers={self.n_layers} "
                f"kv_heads={self.n_kv_heads} d={self.head_dim} tokens={self._lengths}>")

    # -- sizes and access --------------------------------------------------------------------
    def _check_layer(self, layer):
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.n_layers - 1}")

    def length(self, layer):
        self._check_layer(layer)
        return self._lengths[layer]

    def __len__(self):
        return self._lengths[-1]

    def stream(self, layer, name, head=0):
        """The stream's description for result tables (``.spec``: llama.cpp's type and
        arithmetic)."""
        self._check_layer(layer)
        if name not in self.dims:
            raise KeyError(f"no stream {name!r}; this cache has {list(self.stream_names)}")
        kind = self.pair.k_type if name == "k" else self.pair.v_type
        return _StreamView(f"{kind} (llama.cpp attention"
                           f"{'' if self.pair.rotation else ', rotation off'})")

    @property
    def bytes_per_token(self):
        """Bytes one token adds in llama.cpp's cache (all layers, streams and KV heads)."""
        row = self.pair.bytes_per_row("k", self.head_dim) + \
            self.pair.bytes_per_row("v", self.head_dim)
        return self.n_layers * self.n_kv_heads * row

    @property
    def nbytes(self):
        return sum(self._lengths) * self.n_kv_heads * (
            self.pair.bytes_per_row("k", self.head_dim) +
            self.pair.bytes_per_row("v", self.head_dim))

    # -- writing -----------------------------------------------------------------------------
    def reserve(self, capacity):
        for li in range(self.n_layers):
            if capacity > self._k[li].shape[0]:
                for store in (self._k, self._v):
                    grown = np.empty((capacity, self.n_kv_heads, self.head_dim), np.float32)
                    grown[:self._lengths[li]] = store[li][:self._lengths[li]]
                    store[li] = grown

    def truncate(self, length):
        self._lengths = [min(int(length), n) for n in self._lengths]

    def append(self, layer, n_threads=None, k=None, v=None):
        """Store new tokens' rows in one layer as llama.cpp's cache does (rotated when it
        rotates, then rounded to the cache type).

        k, v : array-like of shape (n_new, n_kv_heads, head_dim)
        """
        self._check_layer(layer)
        shape = (self.n_kv_heads, self.head_dim)
        rows = {}
        for name, X in (("k", k), ("v", v)):
            if X is None:
                raise ValueError("append needs rows for both streams k and v")
            X = np.asarray(X, dtype=np.float32)
            if X.ndim == 2 and self.n_kv_heads == 1:
                X = X[:, None, :]
            if X.ndim != 3 or X.shape[1:] != shape:
                raise ValueError(f"rows for stream {name!r} must have shape (n_new, "
                                 f"{self.n_kv_heads}, {self.head_dim}), got {X.shape}")
            rows[name] = X
        if rows["k"].shape[0] != rows["v"].shape[0]:
            raise ValueError(f"k and v need the same number of new rows, got "
                             f"{rows['k'].shape[0]} and {rows['v'].shape[0]}")
        n_new = rows["k"].shape[0]
        K, V = rows["k"], rows["v"]
        if self._k_rot is not None:
            K = rotate_blocks(K, self._k_rot)
        if self._v_rot is not None:
            V = rotate_blocks(V, self._v_rot)
        K = stored_values(K, self.pair.k_type, f"K rows of layer {layer}")
        V = stored_values(V, self.pair.v_type, f"V rows of layer {layer}")
        n = self._lengths[layer]
        if n + n_new > self._k[layer].shape[0]:
            self.reserve(max(2 * self._k[layer].shape[0], n + n_new))
        self._k[layer][n:n + n_new] = K
        self._v[layer][n:n + n_new] = V
        self._lengths[layer] = n + n_new

    # -- attention ---------------------------------------------------------------------------
    def _queries(self, Q, scale):
        """Rotated (and, with prescale_query, scaled) queries and the score scale."""
        scale = np.float32(1.0 / np.sqrt(self.head_dim) if scale is None else scale)
        if self.prescale_query:
            Q = Q * scale
            scale = np.float32(1.0)
        if self._k_rot is not None:
            Q = rotate_blocks(Q, self._k_rot)
        return np.ascontiguousarray(Q, dtype=np.float32), scale

    def attend(self, layer, q, scale=None, n_threads=None, length=None, sliding_window=None):
        """One query per head over the layer's rows (a decode step: the one-query path).

        q : array-like of shape (n_heads, head_dim) -> ndarray (n_heads, head_dim), float32.
        """
        q = np.asarray(q, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.head_dim:
            raise ValueError(f"q must have shape (n_heads, {self.head_dim}), got {q.shape}")
        T = self.length(layer) if length is None else int(length)
        pos = np.array([T - 1])
        return self._attend(layer, q[None], pos, T, scale, sliding_window)[0]

    def attend_prefill(self, layer, Q, scale=None, n_threads=None, block=256,
                       sliding_window=None):
        """Causal attention of the last n_q stored tokens' queries, as llama.cpp computes a
        batch of n_q tokens (the tiled path for f16/f16 with n_q >= 64, else the one-query
        path for every query).

        Q : array-like of shape (n_q, n_heads, head_dim) -> ndarray of the same shape, float32.
        """
        Q = np.asarray(Q, dtype=np.float32)
        if Q.ndim != 3 or Q.shape[2] != self.head_dim:
            raise ValueError(f"Q must have shape (n_q, n_heads, {self.head_dim}), got "
                             f"{Q.shape}")
        T = self.length(layer)
        if Q.shape[0] > T:
            raise ValueError(f"{Q.shape[0]} queries but only {T} rows stored: append the rows "
                             "first")
        pos = T - Q.shape[0] + np.arange(Q.shape[0])
        out = np.empty_like(Q)
        tiled = self.pair.k_type == self.pair.v_type == "f16" and Q.shape[0] >= TILE_Q
        for b0 in range(0, Q.shape[0], block):
            b1 = min(b0 + block, Q.shape[0])
            out[b0:b1] = self._attend(layer, Q[b0:b1], pos[b0:b1], int(pos[b1 - 1]) + 1,
                                      scale, sliding_window, tiled=tiled)
        return out

    def _attend(self, layer, Q, pos, visible, scale, sliding_window, tiled=False):
        n_q, n_heads, d = Q.shape
        if n_heads % self.n_kv_heads:
            raise ValueError(f"{n_heads} query heads cannot share {self.n_kv_heads} KV heads "
                             "evenly")
        g = n_heads // self.n_kv_heads
        Q, scale = self._queries(Q, scale)
        rows = np.arange(visible)[None, :]
        hidden = rows > pos[:, None]
        if sliding_window is not None:
            hidden |= rows <= pos[:, None] - int(sliding_window)
        out = np.empty((n_q, n_heads, d), np.float32)
        K, V = self._k[layer][:visible], self._v[layer][:visible]
        for h in range(self.n_kv_heads):
            heads = slice(h * g, (h + 1) * g)
            out[:, heads] = attend_rows(Q[:, heads], np.ascontiguousarray(K[:, h]),
                                        np.ascontiguousarray(V[:, h]), hidden, scale,
                                        self.pair.k_type, self.pair.v_type, tiled)
        if self._v_rot is not None:
            out = rotate_blocks(out, self._v_rot)
        return out
