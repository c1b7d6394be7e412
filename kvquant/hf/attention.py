"""The ``"kvquant"`` attention of transformers: attention read from a KVQuantCache's codes.

Two functions are registered under the name ``"kvquant"`` (:func:`register`):

* :func:`kvquant_mask`, with transformers' ``AttentionMaskInterface``: the model's mask (causal,
  sliding window, padding, anything a mask function says) summarized row by row as
  :class:`CausalBands`: the first and last row each query sees and how many;
* :func:`kvquant_attention_forward`, with ``AttentionInterface``: the layer's queries attend to
  the rows of the layer's :class:`~kvquant.hf.cache.KVQuantLayer` through
  :meth:`kvquant.cache.QuantizedKVCache.attend` (one query: the codecs' consumers, on the codes)
  and :meth:`~kvquant.cache.QuantizedKVCache.attend_prefill` (many queries: each KV head's rows
  decoded once, in numpy, and BLAS), or, under a sliding window or softcapping, through the
  stores' ``scores`` / ``context`` consumers with the band of each query masked. Nothing is
  decoded into torch.

What it does not implement it refuses, naming the problem: another device than the CPU, a cache
that is not a KVQuantCache, a mask whose rows are not the layer's causal band (padding, a custom
or 4D mask, bidirectional attention), dropout, gradients, ``output_attentions``, position biases
or attention sinks.
"""
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvquant.cache import softmax
from kvquant.hf.cache import ATTN_IMPLEMENTATION, layer_of

MASK_BLOCK = 512      # query rows of a mask evaluated at once (a block is MASK_BLOCK x kv bools)
PREFILL_BLOCK = 64    # queries per consumer call in a banded prefill
# the keyword transformers 5.x renamed past_key_values to (5.25 and later warn on the old one;
# releases from before the rename take only past_key_values)
_USE = ("pass cache=KVQuantCache(model.config, spec) to generate() or the model's forward (with "
        "use_cache=True; past_key_values= on transformers releases whose models take no cache "
        "keyword)")


@dataclass(frozen=True, eq=False)
class CausalBands:
    """A mask row by row: the rows each query sees.

    Attributes
    ----------
    q_offset : int
        Position of the first query.
    first, last : ndarray of shape (q_length,), int64
        First and last row (absolute index) each query sees; -1 where it sees none.
    count : ndarray of shape (q_length,), int64
        How many rows it sees (``last - first + 1`` when they are one band).
    """

    q_offset: int
    first: np.ndarray
    last: np.ndarray
    count: np.ndarray

    @property
    def q_length(self):
        return int(self.first.size)

    def band_starts(self, positions, window):
        """The first row of each query's band, checked against what the mask says.

        A query at position p reads rows ``max(0, p - window + 1) .. p`` (``0 .. p`` without a
        window). Raises ValueError when a row of the mask is anything else (padding, a custom
        mask, a window other than the layer's).
        """
        positions = np.asarray(positions, np.int64)
        lo = np.zeros_like(positions) if window is None else np.maximum(positions - window + 1, 0)
        ok = (self.last == positions) & (self.first == lo) & (self.count == positions - lo + 1)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            sees = ("no row" if self.count[i] == 0 else
                    f"{self.count[i]} row(s) in {self.first[i]}..{self.last[i]}")
            band = "causal" if window is None else f"sliding-window (window {window})"
            raise ValueError(
                f"the 'kvquant' attention implements the {band} mask only: the query at position "
                f"{positions[i]} should see rows {lo[i]}..{positions[i]}, the model's mask lets "
                f"it see {sees}. Padding (left-padded batches), custom or bidirectional masks are "
                "not supported: run one unpadded sequence")
        return lo


def kvquant_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, use_vmap=False, device="cpu", **kwargs):
    """The mask interface of ``"kvquant"``: the mask transformers would build, as
    :class:`CausalBands` (evaluated in blocks of :data:`MASK_BLOCK` query rows).

    Takes the arguments transformers gives a mask interface (``sdpa_mask``'s)."""
    if batch_size != 1:
        raise ValueError(f"the 'kvquant' attention runs one sequence at a time (batch size 1), "
                         f"got a batch of {batch_size}")
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    kwargs = {} if mask_function is None else {"mask_function": mask_function}
    first, last, count = [], [], []
    for b0 in range(0, q_length, MASK_BLOCK):
        rows = min(MASK_BLOCK, q_length - b0)
        m = sdpa_mask(batch_size=1, q_length=rows, kv_length=kv_length, q_offset=q_offset + b0,
                      kv_offset=kv_offset, attention_mask=attention_mask,
                      allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                      use_vmap=use_vmap, device=device, **kwargs)[0, 0].cpu()
        n = m.sum(-1)
        f = m.to(torch.int8).argmax(-1)
        l_ = kv_length - 1 - m.flip(-1).to(torch.int8).argmax(-1)
        seen = n > 0
        first.append(torch.where(seen, f + kv_offset, -1).numpy())
        last.append(torch.where(seen, l_ + kv_offset, -1).numpy())
        count.append(n.numpy())
    cat = (lambda parts: np.concatenate(parts).astype(np.int64) if parts
           else np.zeros(0, np.int64))
    return CausalBands(q_offset, cat(first), cat(last), cat(count))


def _refuse_unsupported(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
    """The layer of the cache behind ``key``, after every check (ValueError naming the
    problem)."""
    if query.device.type != "cpu":
        raise ValueError(f"the 'kvquant' attention runs on CPU (its consumers are numpy/Cython "
                         f"kernels); the queries are on {query.device}")
    layer = layer_of(key)
    if layer is None or layer_of(value) is not layer:
        raise ValueError(f"the 'kvquant' attention reads K and V from a KVQuantCache, and these "
                         f"keys come from none: {_USE}")
    if dropout:
        raise ValueError(f"the 'kvquant' attention has no dropout (got dropout={dropout}): "
                         "call model.eval()")
    if torch.is_grad_enabled() and query.requires_grad:
        raise ValueError("the 'kvquant' attention has no gradient (it reads numpy codes): run "
                         "under torch.no_grad() or torch.inference_mode()")
    if kwargs.get("output_attentions",
                  getattr(getattr(module, "config", None), "output_attentions", False)):
        raise ValueError("the 'kvquant' attention does not return attention weights "
                         "(output_attentions=True): use attn_implementation='eager'")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise ValueError("the 'kvquant' attention is causal only; this layer is bidirectional")
    for name in ("position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the 'kvquant' attention does not implement {name!r}")
    if not isinstance(attention_mask, CausalBands):
        got = "no mask" if attention_mask is None else f"a {type(attention_mask).__name__}"
        raise ValueError(f"the 'kvquant' attention takes the mask built by its own mask function "
                         f"(from a 2D attention_mask or none); got {got} (a custom or 4D mask?)")
    return layer


def kvquant_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                              scaling=None, is_causal=None, softcap=None, **kwargs):
    """Attention of ``query`` over the KVQuantCache layer behind ``key`` (transformers'
    attention-interface signature).

    Parameters
    ----------
    module : the model's attention module
    query : Tensor of shape (1, n_heads, n_q, head_dim)
        The queries of the rows the layer's cache appended last (n_q of them).
    key, value : Tensor
        What :meth:`KVQuantLayer.update` returned (only their layer is read).
    attention_mask : CausalBands
        From :func:`kvquant_mask`; each query must see exactly its causal band (its window's
        on a sliding-window layer).
    scaling : float or None
        Score multiplier (None: 1/sqrt(head_dim)).
    softcap : float or None
        Scores become ``softcap * tanh(scores / softcap)`` before the softmax.

    Returns
    -------
    (Tensor of shape (1, n_q, n_heads, head_dim), None)
    """
    layer = _refuse_unsupported(module, query, key, value, attention_mask, dropout, is_causal,
                                kwargs)
    window = layer.sliding_window
    if kwargs.get("sliding_window", window) != window:
        raise ValueError(f"the model asks for a sliding window of {kwargs['sliding_window']} on "
                         f"a cache layer built with {window}: build the cache from this model's "
                         "config")
    if query.shape[0] != 1:
        raise ValueError(f"the 'kvquant' attention runs one sequence (batch size 1), got queries "
                         f"of shape {tuple(query.shape)}")
    Q = query.detach()[0].transpose(0, 1).to(torch.float32).numpy()
    Q = np.ascontiguousarray(Q if layer.key_order is None else Q[..., layer.key_order])
    n_q, n_rows = Q.shape[0], len(layer.kv)
    if attention_mask.q_length != n_q or attention_mask.q_offset != n_rows - n_q:
        raise ValueError(f"the mask is for {attention_mask.q_length} queries from position "
                         f"{attention_mask.q_offset}, but the cache layer holds {n_rows} rows "
                         f"and {n_q} queries arrived: was the cache changed between the mask "
                         "and the attention?")
    positions = np.arange(n_rows - n_q, n_rows)
    lo = attention_mask.band_starts(positions, window)
    scale = 1.0 / np.sqrt(Q.shape[-1]) if scaling is None else float(scaling)
    out = attend(layer.kv, Q, positions, lo, scale, softcap, layer.n_threads)
    return torch.from_numpy(out).unsqueeze(0).to(query.dtype), None


def attend(kv, Q, positions, lo, scale, softcap=None, n_threads=None):
    """Queries ``Q`` (n_q, n_heads, d) at ``positions`` over rows ``lo .. position`` of layer 0
    of ``kv`` (a :class:`~kvquant.cache.QuantizedKVCache`); (n_q, n_heads, d) float32.

    Full causal bands without softcapping go through the cache's own ``attend`` (one query)
    and ``attend_prefill`` (many); anything else through :func:`attend_banded`."""
    if softcap is None and not lo.any():
        if Q.shape[0] == 1:
            return kv.attend(0, Q[0], scale=scale, length=int(positions[0]) + 1,
                             n_threads=n_threads)[None]
        return kv.attend_prefill(0, Q, scale=scale, n_threads=n_threads)
    return attend_banded(kv, Q, positions, lo, scale, softcap, n_threads)


def attend_banded(kv, Q, positions, lo, scale, softcap=None, n_threads=None):
    """Attention of each query over its band of rows, through the stores' ``scores`` and
    ``context`` consumers: scores of rows ``0 .. p``, scaled, softcapped, the rows before ``lo``
    masked out, softmax, context (rows outside the band get weight 0).

    Queries go in blocks of :data:`PREFILL_BLOCK` (one consumer call per block and KV head);
    one at a time when a stream reads a recent window from float32 copies (each query reads
    its own window, which a read of a block's rows would not). One query over streams that
    only encode their rows reads the codes of its band only (:func:`_attend_band_codes`)."""
    n_q, n_heads, d = Q.shape
    group = n_heads // kv.n_kv_heads
    if n_heads % kv.n_kv_heads:
        raise ValueError(f"{n_heads} query heads cannot share {kv.n_kv_heads} KV heads evenly")
    if n_q == 1 and all(kv.stream(0, name).store.plain for name in ("k", "v")):
        return _attend_band_codes(kv, Q, int(lo[0]), int(positions[0]) + 1, scale, softcap,
                                  n_threads)
    block = 1 if kv.recent else PREFILL_BLOCK
    out = np.empty((n_q, n_heads, kv.dims["v"]), np.float32)
    scale, cap = np.float32(scale), None if softcap is None else np.float32(softcap)
    for b0 in range(0, n_q, block):
        b1 = min(b0 + block, n_q)
        pos = positions[b0:b1]
        visible = int(pos[-1]) + 1
        cols = np.arange(visible)[None, :]
        hidden = np.repeat((cols < lo[b0:b1, None]) | (cols > pos[:, None]), group, axis=0)
        for h in range(kv.n_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            S = kv.scores(0, "k", Q[b0:b1, heads].reshape(-1, d), head=h, n_threads=n_threads,
                          length=visible)
            S *= scale
            if cap is not None:
                S = np.tanh(S / cap) * cap
            S[hidden] = -np.inf
            ctx = kv.context(0, "v", softmax(S), head=h, n_threads=n_threads)
            out[b0:b1, heads] = ctx.reshape(b1 - b0, group, -1)
    return out


def _attend_band_codes(kv, Q, lo, stop, scale, softcap, n_threads=None):
    """One query per head (Q of shape (1, n_heads, d)) over rows lo .. stop-1 of plain streams
    (every row coded): the consumers read the codes of those rows only, so that a sliding
    window costs its width, not the context's."""
    n_heads = Q.shape[1]
    group = n_heads // kv.n_kv_heads
    out = np.empty((1, n_heads, kv.dims["v"]), np.float32)
    for h in range(kv.n_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        keys, values = kv.stream(0, "k", h), kv.stream(0, "v", h)
        k, v = keys.encoded(stop), values.encoded(stop)
        S = keys.codec.scores_checked(k.codes[lo:], k.side[lo:], Q[0, heads], n_threads)
        S *= np.float32(scale)
        if softcap is not None:
            S = np.tanh(S / np.float32(softcap)) * np.float32(softcap)
        out[0, heads] = values.codec.context_checked(v.codes[lo:], v.side[lo:], softmax(S),
                                                     n_threads)
    return out


def register():
    """Register ``"kvquant"`` with transformers' attention and mask interfaces (done when
    :mod:`kvquant.hf` is imported)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvquant_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvquant_mask)
