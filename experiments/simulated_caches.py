"""SIMULATED caches of the field's other KV schemes: KIVI, transformers' ``QuantizedCache``
default, KVQuant's pre-RoPE keys. Each row is quantized and dequantized in numpy and attention is
exact float32 over the dequantized rows; nothing is stored compressed and no kernel reads codes.
They measure what the schemes' rounding does to a model, not their speed or memory.

A simulation is a pair spec with the prefix ``sim:``, ``"sim:<K side>/<V side>"``, or an alias.
A side is a quantizer and options after ``@``:

``chan<b>-g<G>``
    Per channel (KIVI's keys): each channel of each run of G consecutive tokens gets an
    asymmetric b-bit grid, scale = (max - min) / (2^b - 1) and zero point = min, both stored as
    fp16; x^ = round((x - min) / scale) scale + min, rounding half to even, clipped. Only complete
    runs of G tokens can be quantized: the rows of a partial group are held in float32 (KIVI keeps
    them in its residual).
``tok<b>-g<G>``
    Per token (KIVI's values): the same grid over each run of G channels of a row.
any codec spec of kvquant.get_codec (``q4_0+rot``, ``tq4``, ...)
    Per row, as that codec encodes and decodes it.

Options: ``res=R``: a full-precision residual of R tokens. On ``chan`` sides it is KIVI's key
residual: the newest ``n mod R`` rows of a cache of n tokens stay float32 and every R tokens they
are quantized together (R a multiple of G). On the other sides it is KIVI's value residual: the
newest R rows stay float32 (a sliding window). ``flush=R`` (``tok`` and codec sides): the newest
``n mod R`` rows stay float32, as transformers' cache flushes its residual. With a residual a
token's query reads the cache as it stood before the token plus the token's own rows in float32
(KIVI and transformers attend first, then flush). ``prerope`` (K side only): the keys are
quantized before RoPE and rotated after dequantizing (KVQuant, Hooper et al. 2024, arXiv
2401.18079); the model must give the cache its keys before RoPE (the GGUF decoder does when a
cache sets ``keys_before_rope``).

Aliases:

``kivi<b>[-g<G>][-r<R>]``
    KIVI (Liu et al. 2024, arXiv 2402.02750): keys per channel, values per token, b bits, group
    G (default 32) and residual R (default 128): ``chan<b>-g<G>@res=<R>/tok<b>-g<G>@res=<R>``.
``hf-quanto<b>``
    transformers' ``QuantizedCache`` with its defaults (transformers 5.x ``QuantizedLayer``:
    ``nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128``). optimum-quanto's
    grouping on axis 0 cuts the (batch, heads, tokens, head_dim) tensor into runs of 64 along
    head_dim: per-token groups for keys and values alike (not KIVI's per-channel keys):
    ``tok<b>-g64@flush=128/tok<b>-g64@flush=128``. transformers requantizes its whole cache from
    the dequantized rows at each flush; per-token min/max grids make that idempotent up to
    rounding, so each row is quantized once here, and min/max stay float32 as the model's dtype
    (here counted as fp16 like KIVI's, an under-count of 32 bits per group).

Bits per value at a context of n tokens (:func:`bits_per_value`): quantized rows cost b bits per
value plus 32 bits (fp16 scale + zero point) per group, codec rows their bytes per row; rows held
in float32 (residual, partial groups) cost 32 bits; K and V averaged.
"""
import re
from dataclasses import dataclass

import numpy as np

from kvquant.specs import CacheSpec, SpecKind

__all__ = ["SIM_PREFIX", "SPEC_KIND", "SimulatedCache", "SimulationSpec", "bits_per_value",
           "expand", "fixed_bytes", "parse"]

SIM_PREFIX = "sim:"
F32_BITS = 32.0
SIDE_BITS = 32.0          # an fp16 scale and an fp16 zero point per group


def expand(pair_spec):
    """The ``sim:<K>/<V>`` form of a simulation spec (aliases expanded)."""
    body = pair_spec.strip()[len(SIM_PREFIX):]
    m = re.fullmatch(r"kivi(\d)(?:-g(\d+))?(?:-r(\d+))?", body)
    if m:
        b, g, r = m.group(1), m.group(2) or "32", m.group(3) or "128"
        return f"{SIM_PREFIX}chan{b}-g{g}@res={r}/tok{b}-g{g}@res={r}"
    m = re.fullmatch(r"hf-quanto(\d)", body)
    if m:
        b = m.group(1)
        return f"{SIM_PREFIX}tok{b}-g64@flush=128/tok{b}-g64@flush=128"
    return SIM_PREFIX + body


class Side:
    """One stream of a simulation: how rows are quantized and which stay float32.

    Parameters
    ----------
    text : str
        ``chan<b>-g<G>``, ``tok<b>-g<G>`` or a codec spec, then ``@`` options (module docs).
    dim : int
        Row width (the model's head_dim).
    is_key : bool
    """

    def __init__(self, text, dim, is_key):
        self.text = text
        base, _, opts = text.partition("@")
        self.dim = int(dim)
        self.res = self.flush = 0
        self.prerope = False
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, value = opt.partition("=")
            if opt == "prerope":
                if not is_key:
                    raise ValueError(f"{text!r}: prerope applies to keys only (the K side)")
                self.prerope = True
            elif key in ("res", "flush") and eq and value.isdigit() and int(value) > 0:
                setattr(self, key, int(value))
            else:
                raise ValueError(f"{text!r}: unknown option {opt!r}; options are prerope, "
                                 "res=R and flush=R (R > 0 tokens)")
        m = re.fullmatch(r"(chan|tok)(\d)-g(\d+)", base)
        self.codec = None
        if m:
            self.kind, self.bits, self.group = m.group(1), int(m.group(2)), int(m.group(3))
            if not 1 <= self.bits <= 8 or self.group < 1:
                raise ValueError(f"{text!r}: bits must be 1..8 and the group >= 1")
            if self.kind == "tok" and self.dim % self.group:
                raise ValueError(f"{text!r}: groups of {self.group} channels do not divide "
                                 f"rows of width {self.dim}")
            self.quant_bits = self.bits + SIDE_BITS / self.group
        else:
            from kvquant.codecs import get_codec
            self.kind, self.codec = "codec", get_codec(base, self.dim)
            self.quant_bits = 8.0 * self.codec.bytes_per_row / self.dim
        if self.kind == "chan":
            if self.flush:
                raise ValueError(f"{text!r}: a per-channel side flushes its residual every "
                                 "res=R tokens already; give res=R")
            if self.res % self.group:
                raise ValueError(f"{text!r}: the residual (res={self.res}) must be a multiple "
                                 f"of the group ({self.group}), as in KIVI")
        if self.res and self.flush:
            raise ValueError(f"{text!r}: give res=R or flush=R, not both")

    def read_quantized_rows(self, n):
        """Rows the query of the n-th token reads dequantized (0 .. this - 1; the rest in
        float32). With a residual, that token's query reads the cache as it stood before the
        token came, plus the token's own rows in float32: KIVI's decode step and transformers'
        ``update`` attend before they flush. Without one, rows are quantized before any query
        reads them, as in kvquant's own caches."""
        return self.quantized_rows(n - 1) if (self.res or self.flush) else self.quantized_rows(n)

    def quantized_rows(self, n):
        """Rows 0 .. quantized_rows(n) - 1 of a cache of n tokens are held quantized, the rest
        in float32."""
        if self.kind == "chan":
            step = self.res or self.group
            return step * (n // step)
        if self.flush:
            return self.flush * (n // self.flush)
        return max(0, n - self.res)

    def bits_at(self, n=None):
        """Bits per value at a context of n tokens (None: what each further token adds)."""
        if not n:
            return self.quant_bits
        nq = self.quantized_rows(n)
        return (nq * self.quant_bits + (n - nq) * F32_BITS) / n

    def roundtrip(self, X):
        """Quantize and dequantize X (n, heads, dim), float32 (``chan``: n a multiple of G)."""
        X = np.asarray(X, np.float32)
        if self.kind == "codec":
            flat = X.reshape(-1, self.dim)
            return self.codec.roundtrip(flat).reshape(X.shape)
        n, h, d = X.shape
        if self.kind == "tok":
            G = X.reshape(n, h, d // self.group, self.group)
            return _minmax_roundtrip(G, self.bits, axis=3).reshape(X.shape)
        G = X.reshape(n // self.group, self.group, h, d)
        return _minmax_roundtrip(G, self.bits, axis=1).reshape(X.shape)


def _minmax_roundtrip(G, bits, axis):
    """KIVI's asymmetric grid along ``axis``: fp16 scale and zero point, round half to even."""
    top = np.float32(2 ** bits - 1)
    lo = G.min(axis=axis, keepdims=True)
    hi = G.max(axis=axis, keepdims=True)
    scale = ((hi - lo) / top).astype(np.float16).astype(np.float32)
    zero = lo.astype(np.float16).astype(np.float32)
    if not (np.isfinite(scale).all() and np.isfinite(zero).all()):
        raise ValueError("a group's range is beyond float16: the simulation stores its scale and "
                         "zero point as fp16, as KIVI does")
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint((G - zero) / scale), 0)
    return (np.clip(q, 0, top) * scale + zero).astype(np.float32)


def _sides(pair_spec):
    """The texts of the K side and the V side of a simulation spec."""
    parts = expand(pair_spec)[len(SIM_PREFIX):].split("/")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ValueError(f"{pair_spec!r}: a simulation is sim:<K side>/<V side> or an alias "
                         "(sim:kivi<b>[-g<G>][-r<R>], sim:hf-quanto<b>)")
    return parts[0].strip(), parts[1].strip()


def parse(pair_spec, dim):
    """(K side, V side) of a simulation spec, for rows of width ``dim``."""
    k, v = _sides(pair_spec)
    return Side(k, dim, True), Side(v, dim, False)


def bits_per_value(pair_spec, head_dim, tokens=None):
    """Bits per value of a simulation at a context of ``tokens`` (None: per further token)."""
    k, v = parse(pair_spec, head_dim)
    return (k.bits_at(tokens) + v.bits_at(tokens)) / 2


def fixed_bytes(pair_spec, n_layers, n_kv_heads, head_dim, tokens):
    """Bytes a simulated cache of ``tokens`` tokens holds beyond ``tokens`` x its bytes per
    further token (float32 residual rows and partial groups), all layers and KV heads."""
    k, v = parse(pair_spec, head_dim)
    extra = sum((tokens - s.quantized_rows(tokens)) * (F32_BITS - s.bits_at()) * head_dim / 8
                for s in (k, v))
    return extra * n_layers * n_kv_heads


class _Stream:
    def __init__(self, spec):
        self.spec = spec


class SimulatedCache:
    """A simulated KV cache with the interface the GGUF models use (append, attend,
    attend_prefill, sizes). Each layer keeps its K (after RoPE) and V rows in float32 and their
    dequantized versions; the query at position p reads each row in the version the scheme's
    decode step of that token reads (:meth:`Side.read_quantized_rows`), prefill included (KIVI's
    own prefill attends to the float32 rows: here every position is read as decoding reads it).

    Parameters
    ----------
    pair_spec : str
        A simulation spec (module docs).
    n_layers, n_kv_heads, head_dim : int
    """

    def __init__(self, pair_spec, n_layers, n_kv_heads, head_dim):
        self.spec = expand(pair_spec)
        self.k_side, self.v_side = parse(pair_spec, head_dim)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.keys_before_rope = self.k_side.prerope
        self.stream_names = ("k", "v")
        self.recent = 0
        empty = np.zeros((0, n_kv_heads, head_dim), np.float32)
        # per layer: exact K (after RoPE), V; their dequantized versions; keys kept for chan
        self._k = [empty] * n_layers
        self._v = [empty] * n_layers
        self._kq = [empty] * n_layers
        self._vq = [empty] * n_layers
        self._k_src = [empty] * n_layers   # what the K side quantizes (before RoPE with prerope)

    # -- model interface -------------------------------------------------------------------
    def __len__(self):
        return self._k[0].shape[0]

    def length(self, layer):
        return self._k[layer].shape[0]

    def stream(self, layer, name, head=0):
        side = self.k_side if name == "k" else self.v_side
        return _Stream(f"simulated {side.text}")

    def append(self, layer, n_threads=None, k=None, v=None, k_before_rope=None, rope_keys=None):
        """Store rows k, v (n, n_kv_heads, head_dim); with ``prerope`` also the keys before RoPE
        and ``rope_keys(X, positions)``."""
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        t0 = self._k[layer].shape[0]
        self._k[layer] = np.concatenate([self._k[layer], k])
        self._v[layer] = np.concatenate([self._v[layer], v])
        self._vq[layer] = self._grow(self.v_side, self._vq[layer], self._v[layer], None, t0)
        if self.k_side.prerope:
            if k_before_rope is None or rope_keys is None:
                raise ValueError("a pre-RoPE simulation needs the keys before RoPE: the model "
                                 "must pass k_before_rope and rope_keys")
            src = np.concatenate([self._k_src[layer], np.asarray(k_before_rope, np.float32)])
            self._k_src[layer] = src
        else:
            src, rope_keys = self._k[layer], None
        self._kq[layer] = self._grow(self.k_side, self._kq[layer], src, rope_keys, t0)

    def _grow(self, side, done, src, rope_keys, t0):
        """The dequantized rows extended to the rows the side can quantize now."""
        T = src.shape[0]
        if side.kind == "chan":
            ready = side.group * (T // side.group)     # complete groups only
        else:
            ready = T
        start = done.shape[0]
        if ready <= start:
            return done
        new = side.roundtrip(src[start:ready])
        if rope_keys is not None:
            new = np.asarray(rope_keys(new, np.arange(start, ready)), np.float32)
        return np.concatenate([done, new])

    def attend(self, layer, q, scale=None, n_threads=None, length=None, sliding_window=None):
        """One query per head (n_heads, head_dim) at the newest position."""
        return self.attend_prefill(layer, np.asarray(q)[None], scale,
                                   sliding_window=sliding_window)[0]

    def attend_prefill(self, layer, Q, scale=None, n_threads=None, block=256,
                       sliding_window=None):
        """Causal attention of the queries of the last ``len(Q)`` positions, Q of shape
        (n_q, n_heads, head_dim); each reads the rows in the version its own cache length
        holds."""
        Q = np.asarray(Q, np.float32)
        S, n_heads, d = Q.shape
        T = self._k[layer].shape[0]
        group = n_heads // self.n_kv_heads
        scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
        pos = T - S + np.arange(S)
        rows = np.arange(T)
        exact_k = rows[None, :] >= np.array([self.k_side.read_quantized_rows(p + 1)
                                             for p in pos])[:, None]
        exact_v = rows[None, :] >= np.array([self.v_side.read_quantized_rows(p + 1)
                                             for p in pos])[:, None]
        hidden = rows[None, :] > pos[:, None]
        if sliding_window is not None:
            hidden |= rows[None, :] <= pos[:, None] - sliding_window
        K, V = self._k[layer], self._v[layer]
        Kq, Vq = _padded(self._kq[layer], T), _padded(self._vq[layer], T)
        out = np.empty((S, n_heads, d), np.float32)
        for g in range(self.n_kv_heads):
            q = Q[:, g * group:(g + 1) * group]                     # (S, group, d)
            s = np.where(exact_k[:, None], q @ K[:, g].T, q @ Kq[:, g].T) * scale
            s = np.where(hidden[:, None], -np.inf, s)
            w = np.exp(s - s.max(axis=2, keepdims=True))
            w /= w.sum(axis=2, keepdims=True)
            out[:, g * group:(g + 1) * group] = (np.where(exact_v[:, None], w, 0) @ V[:, g]
                                                 + np.where(exact_v[:, None], 0, w) @ Vq[:, g])
        return out

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def bytes_per_token(self):
        """Bytes each further token adds (quantized rows: codes plus fp16 scales and zeros)."""
        per_row = (self.k_side.bits_at() + self.v_side.bits_at()) * self.head_dim / 8
        return per_row * self.n_layers * self.n_kv_heads

    @property
    def fixed_bytes(self):
        """Bytes the float32 rows (residuals, partial groups) cost beyond their quantized size,
        at the cache's current length."""
        n = len(self)
        extra = sum((n - s.quantized_rows(n)) * (F32_BITS - s.bits_at()) * self.head_dim / 8
                    for s in (self.k_side, self.v_side))
        return extra * self.n_layers * self.n_kv_heads


def _padded(X, T):
    """Rows not yet quantized (a partial group) as zeros: never read (their queries read the
    float32 rows)."""
    if X.shape[0] == T:
        return X
    return np.concatenate([X, np.zeros((T - X.shape[0],) + X.shape[1:], np.float32)])


@dataclass(frozen=True)
class SimulationSpec(CacheSpec):
    """A ``sim:`` spec as written (aliases kept: rows are named by it), checked when parsed:
    the ``sim`` kind of :class:`kvquant.specs.CacheSpec`, installed through the entry-point
    group ``kvquant.cache_specs`` so that every process (workers, Dask) parses it."""

    written: str
    kind = "sim"

    @property
    def text(self):
        return self.written

    @classmethod
    def parse(cls, text):
        text = text.strip()
        _sides(text)   # the form checked here; each side is checked against a width when built
        return cls(text)

    @property
    def family(self):
        return "simulation"

    def describe(self, streams=("K", "V")):
        return "simulated " + expand(self.text)[len(SIM_PREFIX):]

    def bits_per_value(self, head_dim, tokens=None):
        return bits_per_value(self.text, head_dim, tokens)

    def new_kv_cache(self, layout):
        return SimulatedCache(self.text, layout.n_layers, layout.n_kv_heads, layout.head_dim)

    def fixed_bytes(self, n_layers, n_kv_heads, head_dim, tokens):
        """The float32 rows' bytes at a context of ``tokens`` (they depend on the length)."""
        return fixed_bytes(self.text, n_layers, n_kv_heads, head_dim, tokens)


# what kvquant.specs loads from the entry point "sim" (setup.cfg)
SPEC_KIND = SpecKind("sim", lambda text: text.startswith(SIM_PREFIX), SimulationSpec.parse)
