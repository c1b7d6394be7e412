"""``KVQuantCache``: a transformers ``Cache`` whose layers keep K and V as kvquant codes.

Each layer holds a :class:`kvquant.cache.QuantizedKVCache` of one layer with the streams ``k``
and ``v`` (one :class:`~kvquant.streams.StreamStore` each, the KV heads as its slots): rows are
encoded when the model appends them, before anything reads them, and only what the stream spec
keeps is held (codes and side values; float32 sinks, offsets, scales and window copies where the
spec asks for them). Nothing decoded is handed back to the model: ``update`` returns the new
rows, tagged with their layer, and the ``"kvquant"`` attention (:mod:`kvquant.hf.attention`)
reads the layer's codes. Any other attention would see only the new rows, so the cache refuses
to run under one.

Sliding-window layers (Gemma 3's local layers, Mistral) keep every row; the attention reads
only the window.
"""
import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from kvquant.cache import QuantizedKVCache
from kvquant.specs import PairSpec, parse_cache_spec

ATTN_IMPLEMENTATION = "kvquant"
_TAG = "_kvquant_layer"     # attribute of the tensors update() returns: their KVQuantLayer
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_of(rows):
    """The :class:`KVQuantLayer` that returned ``rows`` from its ``update``, or None."""
    return getattr(rows, _TAG, None)


class KVQuantLayer(CacheLayerMixin):
    """One decoder layer's K and V rows in kvquant stream stores.

    Parameters
    ----------
    k_spec, v_spec : StreamSpec
        Checked stream specs of the K and V rows (:meth:`kvquant.specs.PairSpec.checked`).
    n_kv_heads, head_dim : int
    sliding_window : int or None
        The layer's attention window (None: full attention). Every row is kept either way.
    key_order : ndarray of shape (head_dim,), int, or None
        The order in which the codec sees a key's channels (and the queries', so that scores
        are unchanged); None: as the model computes them.
    n_threads : int or None, default 1
        Threads of the codec kernels (encode, consumers); see :class:`KVQuantCache`.
    **codec_options
        Passed to :func:`kvquant.get_codec` (e.g. ``seed=...``).

    Attributes
    ----------
    kv : QuantizedKVCache
        One layer, streams ``k`` and ``v`` of width ``head_dim``, ``n_kv_heads`` slots.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, k_spec, v_spec, n_kv_heads, head_dim, sliding_window=None,
                 key_order=None, n_threads=1, **codec_options):
        super().__init__()
        self.key_order = key_order
        self.n_threads = n_threads
        self.kv = QuantizedKVCache(1, {"k": (k_spec, head_dim), "v": (v_spec, head_dim)},
                                   n_kv_heads=n_kv_heads, **codec_options)
        self.n_kv_heads, self.head_dim = int(n_kv_heads), int(head_dim)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.is_sliding = self.sliding_window is not None
        # a truncation drops the float32 copies of a recent window: not an exact rollback
        self.is_croppable = self.kv.recent == 0

    def __repr__(self):
        window = f", window={self.sliding_window}" if self.is_sliding else ""
        return (f"KVQuantLayer(k={self.kv.stream(0, 'k').spec!r}, "
                f"v={self.kv.stream(0, 'v').spec!r}, tokens={len(self.kv)}{window})")

    # -- the cache-layer API -------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Encode and keep the new rows; returns them (not the cache) tagged with this layer.

        Parameters
        ----------
        key_states, value_states : Tensor of shape (1, n_kv_heads, n_new, head_dim)

        Returns
        -------
        (Tensor, Tensor)
            ``key_states`` and ``value_states`` as given (detached views), which only the
            ``"kvquant"`` attention knows how to read with the cache behind them.
        """
        for name, x in (("key", key_states), ("value", value_states)):
            if x.device.type != "cpu":
                raise ValueError(f"KVQuantCache runs on CPU; the {name} states are on "
                                 f"{x.device}. Load the model on CPU (device_map='cpu')")
            if x.ndim != 4 or x.shape[0] != 1:
                raise ValueError(f"KVQuantCache holds one sequence (batch size 1); got {name} "
                                 f"states of shape {tuple(x.shape)}. Run sequences one at a time")
            if x.shape[1] != self.n_kv_heads or x.shape[3] != self.head_dim:
                raise ValueError(f"{name} states of shape {tuple(x.shape)} do not fit this cache "
                                 f"({self.n_kv_heads} KV heads of width {self.head_dim}): was it "
                                 "built from this model's config?")
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError(f"{key_states.shape[2]} key rows but {value_states.shape[2]} value "
                             "rows")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = _rows(key_states)
        if self.key_order is not None:
            keys = np.ascontiguousarray(keys[..., self.key_order])
        self.kv.append(0, n_threads=self.n_threads, k=keys, v=_rows(value_states))
        keys, values = key_states.detach(), value_states.detach()
        setattr(keys, _TAG, self)
        setattr(values, _TAG, self)
        return keys, values

    def get_mask_sizes(self, query_length):
        """(kv_length, kv_offset): every row is kept, so the mask spans all of them."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self):
        return len(self.kv)

    def get_max_length(self):
        return -1

    def offload(self):
        """Nothing to move: the rows live in numpy arrays on the CPU."""

    def prefetch(self):
        """Nothing to move (see :meth:`offload`)."""

    def reset(self):
        self.kv.truncate(0)
        self.is_initialized = False

    def crop(self, tokens_to_remove):
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got "
                             f"{tokens_to_remove}")
        if tokens_to_remove:
            self.kv.truncate(max(len(self.kv) + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx):
        if self.get_seq_length() and not torch.equal(beam_idx.cpu(), torch.zeros_like(beam_idx)):
            raise ValueError("KVQuantCache holds one sequence: beam search is not supported "
                             "(num_beams=1)")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1:
            raise ValueError("KVQuantCache holds one sequence (batch size 1): cannot repeat it "
                             f"{repeats} times (num_beams=1, num_return_sequences=1)")

    def batch_select_indices(self, indices):
        if self.get_seq_length() and not torch.equal(torch.as_tensor(indices).cpu().flatten(),
                                                     torch.zeros(1, dtype=torch.long)):
            raise ValueError("KVQuantCache holds one sequence (batch size 1)")

    # -- sizes -----------------------------------------------------------------------------------
    def bytes_for(self, n_tokens):
        """Bytes this layer holds once it has ``n_tokens`` tokens (K and V, every KV head;
        :meth:`kvquant.streams.StreamStore.bytes_for`)."""
        return sum(self.kv.stream(0, name).store.bytes_for(n_tokens) for name in ("k", "v"))


def _rows(states):
    """(1, n_kv_heads, n, head_dim) tensor -> (n, n_kv_heads, head_dim) float32 ndarray."""
    x = states.detach()[0].transpose(0, 1)
    return np.ascontiguousarray(x.to(torch.float32).numpy())


def _key_order(key_channels, head_dim):
    """The channel order of :class:`KVQuantCache`'s ``key_channels`` (None: the model's)."""
    if key_channels == "model":
        return None
    if key_channels != "interleaved":
        raise ValueError(f"key_channels must be 'model' or 'interleaved', got {key_channels!r}")
    if head_dim % 2:
        raise ValueError(f"key_channels='interleaved' pairs channels: head_dim {head_dim} is odd")
    half = head_dim // 2
    # interleaved channel 2i is the model's i, 2i+1 its i + head_dim/2 (its RoPE partner)
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


def _per_layer_specs(spec, n_layers):
    """One :class:`~kvquant.specs.PairSpec` per layer from a cache spec (a pair for every layer,
    or a per-layer plan with one spec per stream) or a list of one pair spec per layer."""
    from kvquant.models.plan import CachePlan
    if isinstance(spec, (list, tuple)):
        if len(spec) != n_layers:
            raise ValueError(f"{len(spec)} specs for a model of {n_layers} layers: give one spec "
                             "for all layers (e.g. 'tq4' or 'kv8/tq4') or one per layer")
        pairs = [parse_cache_spec(s) for s in spec]
    else:
        parsed = parse_cache_spec(spec)
        if isinstance(parsed, CachePlan):
            if parsed.n_layers != n_layers:
                raise ValueError(f"{parsed.text}: a plan of {parsed.n_layers} layers for a model "
                                 f"of {n_layers}")
            if parsed.calibration is not None or any(isinstance(s, tuple)
                                                     for pair in parsed.layers for s in pair):
                raise ValueError(f"{parsed.text}: KVQuantCache takes plans of one spec per "
                                 "layer and stream, without calibrated statistics")
            pairs = [PairSpec.parse("/".join(pair)) for pair in parsed.layers]
        else:
            pairs = [parsed] * n_layers
    for p in pairs:
        if not isinstance(p, PairSpec):
            raise ValueError(f"{p.text!r}: KVQuantCache takes pair specs ('tq4', "
                             f"'polar5/polar4@center') and per-layer plans, not {p.kind} specs")
    return pairs


class KVQuantCache(Cache):
    """A transformers cache whose layers keep K and V through kvquant stream specs.

    Parameters
    ----------
    config : PretrainedConfig
        The model's config (``model.config``); its decoder config gives the layers, their types
        (full or sliding-window attention), the KV heads and the head width. The model must
        run the ``"kvquant"`` attention (``attn_implementation="kvquant"``).
    spec : str, CacheSpec or list, default "f32"
        A stream spec for K and V (``"tq4"``), a K/V pair (``"kv8/tq4"``,
        ``"polar5/polar4@center"``), a per-layer plan (one spec per layer and stream), or a
        list of one pair spec per layer (strings or :class:`~kvquant.specs.PairSpec`). Stream options:
        ``center``, ``normalize``, ``sinks=N``, ``recent=W``
        (:func:`kvquant.streams.options.parse_stream_spec`).
    key_channels : {"model", "interleaved"}, default "model"
        The order in which the codec sees the channels of a key: as the model computes them
        (transformers' rotary layout: channel i and i + head_dim/2 form a RoPE pair), or
        ``"interleaved"``, each RoPE pair adjacent (2i, 2i+1), as GGUF files and llama.cpp lay
        keys out (transformers permutes the q/k weights of a GGUF Llama back to its own
        layout). Attention is the same either way (queries are permuted alike); a codec working
        on blocks or a rotation of channels stores different errors, so compare with llama.cpp
        or kvquant's GGUF models under ``"interleaved"``.
    n_threads : int or None, default 1
        Threads of the codec kernels (kvquant's thread policy: None is the OpenMP default).
        One by default: torch already runs its matrix products on the cores, and one decode
        step makes a few small kernel calls per layer, which more threads would slow down.
    **codec_options
        Passed to :func:`kvquant.get_codec` (e.g. ``seed=...``).

    Notes
    -----
    One sequence at a time (batch size 1), on CPU. Sizes are reported as by
    :class:`kvquant.cache.QuantizedKVCache`: :attr:`nbytes`, :attr:`bytes_per_token`,
    :attr:`fixed_bytes`, :meth:`bytes_for`.

    Examples
    --------
    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvquant")
    >>> cache = KVQuantCache(model.config, "polar5/polar4@center")
    >>> out = model.generate(ids, max_new_tokens=20, cache=cache)
    >>> # (past_key_values=cache on a transformers 5.x from before the rename to cache)
    >>> cache.nbytes, cache.bytes_per_token
    """

    def __init__(self, config, spec="f32", key_channels="model", n_threads=1,
                 **codec_options):
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        other = sorted(set(layer_types) - set(LAYER_TYPES))
        if other:
            raise ValueError(f"KVQuantCache supports full and sliding-window attention layers; "
                             f"this model has {other} layers")
        n_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        key_order = _key_order(key_channels, head_dim)
        layers = []
        for pair, kwargs in zip(_per_layer_specs(spec, len(layer_types)), layer_kwargs):
            # StreamSpec.check builds each codec once per width, however many layers share it
            layers.append(KVQuantLayer(*pair.checked((head_dim, head_dim), ("K", "V")),
                                       n_kv_heads, head_dim,
                                       kwargs.get("sliding_window"), key_order,
                                       n_threads, **codec_options))
        super().__init__(layers=layers)
        self.config = text

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        implementation = getattr(self.config, "_attn_implementation", None)
        if implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"KVQuantCache is read by the 'kvquant' attention only, and this cache's config "
                f"says attn_implementation={implementation!r}: load the model with "
                "attn_implementation='kvquant' (import kvquant.hf first) or call "
                "model.set_attn_implementation('kvquant'), and build the cache from that "
                "model's config (KVQuantCache(model.config, spec))")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"the model asks for layer {layer_idx}, but this KVQuantCache was built for "
                f"{len(self.layers)} layers: build it from the model's own config "
                "(KVQuantCache(model.config, spec))")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    # -- what it holds ---------------------------------------------------------------------------
    stream_names = ("k", "v")

    def stream(self, layer, name, head=0):
        """The stream ``name`` ("k" or "v") of one layer and KV head, as
        :meth:`kvquant.cache.QuantizedKVCache.stream` gives it."""
        return self.layers[layer].kv.stream(0, name, head)

    @property
    def specs(self):
        """(K spec, V spec) of every layer."""
        return [(layer.kv.stream(0, "k").spec, layer.kv.stream(0, "v").spec)
                for layer in self.layers]

    @property
    def nbytes(self):
        """Bytes of the stored rows, every layer (codes and side values; float32 sinks,
        window copies, offsets and scales)."""
        return sum(layer.kv.nbytes for layer in self.layers)

    @property
    def capacity_bytes(self):
        """Bytes allocated."""
        return sum(layer.kv.capacity_bytes for layer in self.layers)

    @property
    def bytes_per_token(self):
        """Bytes one token adds (K and V of every layer and KV head); the stream options'
        float32 rows and vectors are :attr:`fixed_bytes` on top."""
        return sum(layer.kv.bytes_per_token for layer in self.layers)

    @property
    def fixed_bytes(self):
        """What the stream options add once their sinks and windows are full: a cache of
        T >= sinks + recent tokens holds ``T * bytes_per_token + fixed_bytes``."""
        return sum(layer.kv.fixed_bytes for layer in self.layers)

    def bytes_for(self, n_tokens):
        """Bytes the cache holds once it has ``n_tokens`` tokens in every layer."""
        return sum(layer.bytes_for(n_tokens) for layer in self.layers)
