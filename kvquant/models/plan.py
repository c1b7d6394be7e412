"""``CachePlan``: stream specs per layer (and per KV head) of a model's K/V cache, in a file.

A pair spec (``"tq4"``, ``"polar4@center/polar3"``) gives every layer the same codecs. A plan
gives each layer its own pair, and each KV head of a layer its own spec where wanted: what a bit
allocator produces (``python -m kvquant_experiments.allocate``). A plan is a small JSON file::

    {"kind": "kvquant-cache-plan", "version": 1, "n_layers": 30, "n_kv_heads": 3,
     "layers": [{"k": "polar5@center,normalize,sinks=1", "v": "polar3@center,sinks=1"},
                {"k": ["polar4", "polar5", "polar4"], "v": "polar3"}, ...],
     "calibration": "smollm2-calibration.npz"}

``k`` / ``v`` are stream specs (:func:`kvquant.streams.options.parse_stream_spec`), or a list
of one per KV head. ``calibration`` (optional; a path relative to the plan file) names the
calibrated statistics (:mod:`kvquant.streams.calibration`) that streams with
``center=calib`` / ``normalize=calib`` read. Any other key is kept as ``meta`` (an allocator's
budget, its source), never interpreted.

Everywhere a model takes a pair spec it takes the path of a plan file (a string ending in
``.json``): ``model.new_cache("alloc.json")``, ``kvquant flips --codecs alloc.json``, a
frontier config. Result rows name such a configuration by that path.
"""
import json
import os
from dataclasses import dataclass, field

from kvquant.outputs import atomic_write
from kvquant.specs import CacheSpec, PairSpec, SpecKind, register_builtin_kind
from kvquant.streams.spec import StreamSpec
from kvquant.streams.store import stream_bytes

__all__ = ["CachePlan", "PLAN_KIND"]

PLAN_KIND = "kvquant-cache-plan"
PLAN_VERSION = 1
MAX_LAYERS = 4096          # no model comes near it; a damaged count is refused before any list
STREAMS = ("k", "v")


def _spec_text(value, where):
    """A layer's spec for one stream: a spec string, or a tuple of one per KV head."""
    if isinstance(value, str):
        try:
            StreamSpec.parse(value)   # a bad spec fails here, naming it
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return value.strip()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(_spec_text(v, where) for v in value)
    raise ValueError(f"{where}: expected a stream spec or a list of one per KV head, got "
                     f"{value!r}")


@dataclass(frozen=True)
class CachePlan(CacheSpec):
    """Stream specs per layer of a K/V cache: the ``plan`` kind of :class:`~kvquant.specs.CacheSpec`
    (its text is the file's path).

    Parameters
    ----------
    layers : tuple of (k, v)
        Per layer, the spec of its K rows and of its V rows: a stream spec string, or a tuple of
        one per KV head.
    n_kv_heads : int or None
        The KV heads the plan was made for (required when a layer lists specs per head).
    calibration : str or None
        Path of the calibrated statistics file (absolute, or relative to the working
        directory once loaded).
    meta : dict
        Whatever else the file holds (kept, never interpreted).
    source : str or None
        The file the plan was read from.
    """

    layers: tuple
    n_kv_heads: int = None
    calibration: str = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    source: str = field(default=None, compare=False)
    kind = "plan"

    def __post_init__(self):
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ValueError("a cache plan needs a non-empty tuple of layers")
        for i, pair in enumerate(self.layers):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"layer {i}: expected (k spec, v spec), got {pair!r}")
            for name, spec in zip(STREAMS, pair):
                if isinstance(spec, tuple):
                    if self.n_kv_heads is None or len(spec) != self.n_kv_heads:
                        raise ValueError(f"layer {i} {name}: {len(spec)} specs per head for "
                                         f"{self.n_kv_heads} KV heads (give n_kv_heads)")

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def uniform(cls, pair_spec, n_layers, n_kv_heads=None, calibration=None):
        """Every layer the pair ``pair_spec`` (``"K/V"`` or one spec for both)."""
        pair = tuple(str(s) for s in PairSpec.parse(str(pair_spec)).streams)
        return cls((pair,) * int(n_layers), n_kv_heads, calibration)

    @classmethod
    def from_dict(cls, obj, base_dir=None, source=None):
        """A plan from the JSON layout of the module docstring (``calibration`` resolved
        against ``base_dir``)."""
        where = source or "cache plan"
        if not isinstance(obj, dict) or obj.get("kind") != PLAN_KIND:
            raise ValueError(f"{where}: not a cache plan (expected a JSON object with "
                             f"\"kind\": \"{PLAN_KIND}\")")
        if obj.get("version") != PLAN_VERSION:
            raise ValueError(f"{where}: cache plan version {obj.get('version')!r}; this kvquant "
                             f"reads version {PLAN_VERSION}")
        layers = obj.get("layers")
        n_layers = obj.get("n_layers")
        if n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int)
                                     or not 1 <= n_layers <= MAX_LAYERS):
            raise ValueError(f"{where}: \"n_layers\" is {n_layers!r}; a count of layers from "
                             f"1 to {MAX_LAYERS} is expected")
        if "pair" in obj and layers is None:   # one pair for every layer
            if n_layers is None:
                raise ValueError(f"{where}: a plan of one \"pair\" needs \"n_layers\"")
            try:
                if not isinstance(obj["pair"], str):
                    raise ValueError(f"\"pair\" must be a pair spec, got {obj['pair']!r}")
                k, v = (str(s) for s in PairSpec.parse(obj["pair"]).streams)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            layers = [{"k": k, "v": v}] * obj["n_layers"]
        if not isinstance(layers, list) or not layers or len(layers) > MAX_LAYERS:
            raise ValueError(f"{where}: \"layers\" must be a non-empty list of {{\"k\": spec, "
                             "\"v\": spec}")
        pairs = []
        for i, entry in enumerate(layers):
            if not isinstance(entry, dict) or set(entry) != set(STREAMS):
                raise ValueError(f"{where}: layer {i} must be {{\"k\": spec, \"v\": spec}}, got "
                                 f"{entry!r}")
            try:
                pairs.append(tuple(_spec_text(entry[s], f"layer {i} {s}") for s in STREAMS))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        n_layers = obj.get("n_layers", len(pairs))
        if n_layers != len(pairs):
            raise ValueError(f"{where}: n_layers {n_layers} but {len(pairs)} layers listed")
        calibration = obj.get("calibration")
        if calibration is not None:
            if not isinstance(calibration, str) or not calibration:
                raise ValueError(f"{where}: \"calibration\" must be a file path")
            if base_dir and not os.path.isabs(calibration):
                calibration = os.path.join(base_dir, calibration)
        meta = {k: v for k, v in obj.items() if k not in (
            "kind", "version", "n_layers", "n_kv_heads", "layers", "pair", "calibration")}
        return cls(tuple(pairs), obj.get("n_kv_heads"), calibration, meta, source)

    @classmethod
    def load(cls, path):
        """Read a plan file (ValueError naming the file and what is wrong)."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                obj = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read the cache plan {path!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"cache plan {path!r} is not valid JSON: {exc}") from None
        return cls.from_dict(obj, os.path.dirname(os.path.abspath(path)), path)

    @classmethod
    def of(cls, spec):
        """``spec`` itself when it is a CachePlan, else :meth:`load` of the path."""
        return spec if isinstance(spec, cls) else cls.load(spec)

    # -- as a cache spec ---------------------------------------------------------------------
    @property
    def text(self):
        """The plan file's path (a plan made in memory has none: it travels as the object)."""
        return self.source or "<unsaved cache plan>"

    @property
    def label(self):
        return "plan " + os.path.basename(self.text)

    @property
    def family(self):
        return "cache plan"

    def new_kv_cache(self, layout):
        return self.new_cache(layout.n_layers, layout.n_kv_heads, layout.head_dim,
                              capacity=layout.capacity)

    def as_dict(self, base_dir=None):
        """The JSON layout (``calibration`` relative to ``base_dir`` when given)."""
        out = {"kind": PLAN_KIND, "version": PLAN_VERSION, "n_layers": self.n_layers}
        if self.n_kv_heads is not None:
            out["n_kv_heads"] = int(self.n_kv_heads)
        out["layers"] = [{s: list(v) if isinstance(v, tuple) else v for s, v in zip(STREAMS, p)}
                         for p in self.layers]
        if self.calibration is not None:
            out["calibration"] = (os.path.relpath(self.calibration, base_dir) if base_dir
                                  else self.calibration)
        out.update(self.meta)
        return out

    def save(self, path):
        """Write the plan as JSON (its calibration path relative to the file's folder),
        atomically: a reader never finds half a plan."""
        base = os.path.dirname(os.path.abspath(path))
        text = json.dumps(self.as_dict(base), indent=1) + "\n"
        atomic_write(path, lambda f: f.write(text))
        return path

    # -- what it is --------------------------------------------------------------------------
    @property
    def n_layers(self):
        return len(self.layers)

    def head_specs(self, layer, stream):
        """The spec of every KV head of ``stream`` ("k" or "v") in ``layer``: a list of
        ``n_kv_heads`` strings (one spec repeated when the layer gives one)."""
        spec = self.layers[layer][STREAMS.index(stream)]
        if isinstance(spec, tuple):
            return list(spec)
        return [spec] * (self.n_kv_heads or 1)

    def with_unit(self, layer, stream, spec, head=None):
        """A copy with one layer's stream (or one KV head of it) given ``spec``."""
        layers = list(self.layers)
        pair = list(layers[layer])
        i = STREAMS.index(stream)
        if head is None:
            pair[i] = spec
        else:
            heads = self.head_specs(layer, stream)
            heads[head] = spec
            pair[i] = tuple(heads)
        layers[layer] = tuple(pair)
        return CachePlan(tuple(layers), self.n_kv_heads, self.calibration, dict(self.meta))

    def check(self, n_layers, n_kv_heads, head_dim):
        """This plan, checked against a model's shape (every spec built for ``head_dim``)."""
        where = self.source or "cache plan"
        if self.n_layers != n_layers:
            raise ValueError(f"{where}: {self.n_layers} layers, the model has {n_layers}")
        if self.n_kv_heads is not None and self.n_kv_heads != n_kv_heads:
            raise ValueError(f"{where}: made for {self.n_kv_heads} KV heads, the model has "
                             f"{n_kv_heads}")
        for i, pair in enumerate(self.layers):
            for name, spec in zip(STREAMS, pair):
                for s in (spec if isinstance(spec, tuple) else (spec,)):
                    try:
                        StreamSpec.parse(s).check(head_dim)
                    except ValueError as exc:
                        raise ValueError(f"{where}: layer {i} {name.upper()} rows (width "
                                         f"{head_dim}): {exc}") from None
        return self

    def stream_specs(self, stream):
        """Per layer, the spec of ``stream`` as :class:`~kvquant.cache.QuantizedKVCache`
        takes it: a string, or a tuple of one per KV head."""
        return [pair[STREAMS.index(stream)] for pair in self.layers]

    def statistics(self):
        """The calibrated statistics the plan names (a StreamStatistics), or None."""
        if self.calibration is None:
            return None
        from kvquant.streams.calibration import StreamStatistics
        return StreamStatistics.load(self.calibration)

    def new_cache(self, n_layers, n_kv_heads, head_dim, capacity=256):
        """A :class:`~kvquant.cache.QuantizedKVCache` with streams ``k`` and ``v`` as planned
        (checked against the model's shape; the calibration loaded and checked when named)."""
        from kvquant.cache import QuantizedKVCache
        self.check(n_layers, n_kv_heads, head_dim)
        stats = self.statistics()
        if stats is not None:
            stats.check(n_layers, n_kv_heads, head_dim, self.calibration)
        elif any("calib" in s for layer in self.layers for spec in layer
                 for s in (spec if isinstance(spec, tuple) else (spec,))):
            raise ValueError(f"{self.source or 'cache plan'}: a stream says center=calib / "
                             "normalize=calib but the plan names no \"calibration\" file")
        streams = {name: (self.stream_specs(name), head_dim) for name in STREAMS}
        return QuantizedKVCache(n_layers, streams, n_kv_heads=n_kv_heads, capacity=capacity,
                                statistics=stats)

    def bits_per_value(self, head_dim, tokens=None):
        """Mean bits per value over every layer, stream and KV head: each row's codes and side
        values x 8 / head_dim, with ``tokens`` the fixed cost of stream options spread over
        that many rows (as the frontier counts a pair)."""
        total, rows = 0.0, 0
        for layer in range(self.n_layers):
            for stream in STREAMS:
                for spec in self.head_specs(layer, stream):
                    s = StreamSpec.parse(spec)
                    codec = s.codec(head_dim)
                    total += (stream_bytes(codec, s.options, tokens) / tokens if tokens
                              else codec.bytes_per_row)
                    rows += 1
        return 8.0 * total / (rows * head_dim)


# a string ending in .json names a plan file
register_builtin_kind(SpecKind("plan", lambda text: text.lower().endswith(".json"), CachePlan.load))
