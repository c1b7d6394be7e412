"""What a user names as a KV cache, parsed once at the door: :class:`CacheSpec`.

Everything that takes a cache configuration (a model's ``new_cache``, ``KVQuantCache``, the
``flips``/``tasks``/frontier commands, the experiments) takes a CacheSpec or a string, and makes
the string a CacheSpec with :func:`parse_cache_spec` before anything else. Above this module no
code reads spec text: it asks the object (``text``, ``label``, ``family``, ``bits_per_value``,
``is_reference``, ``new_kv_cache``; a stream's :class:`~kvquant.streams.spec.StreamSpec` makes
the specs derived from it: ``with_bits``, ``with_codec_options``, ``with_options``,
``with_row_scales``). The grammar of every kind is documented in ``docs/specs.md``.

The kinds, each parsed by its own module and registered here:

``pair`` (:class:`PairSpec`, this module; what a string is when no other kind claims it)
    ``"tq4"`` (one stream spec for K and V), ``"kv8/tq4"`` (K / V; L / R on the MLA model);
    each side a stream spec, ``codec[:options][@stream options]``.
``plan`` (:class:`kvquant.models.plan.CachePlan`)
    the path of a per-layer plan file, a string ending in ``.json``.
``ggml`` (:class:`kvquant.ggml_attention.GGMLPair`)
    llama.cpp's attention as it runs: ``"ggml:q8_0/q4_0"``, ``"ggml-norot:..."``.
plug-in kinds
    registered with :func:`register_spec_kind` in the running process, or installed through the
    entry-point group ``kvquant.cache_specs`` (its object a :class:`SpecKind`), loaded on first
    use in any process: e.g. ``sim:`` (the experiments' simulated caches).

CacheSpecs are immutable and pickle, so worker processes and Dask receive objects.

:class:`StreamListSpec` is the per-stream form of a pair for a model whose cache holds any
number of streams per layer (``"kv8/tq4/f32"``; the memory budget's model shapes): it counts
bytes and builds no cache, so no kind claims a string for it.
"""
import re
from dataclasses import dataclass

from kvquant.codecs import describe_codec
from kvquant.streams.spec import StreamSpec
from kvquant.streams.store import stream_bytes

__all__ = ["CacheSpec", "KVLayout", "PairSpec", "SpecKind", "StreamListSpec",
           "parse_cache_spec", "parse_cache_specs", "process_registrations",
           "register_spec_kind", "restore_registrations", "split_spec_text",
           "unregister_spec_kind"]

ENTRY_POINT_GROUP = "kvquant.cache_specs"
# the stream options' bare flags (kvquant.streams.options): a list piece that is one of them
# continues the spec before it
_STREAM_FLAGS = ("center", "normalize")


class CacheSpec:
    """A cache configuration, parsed. Subclasses set ``kind`` and implement ``text``,
    ``bits_per_value`` and ``new_kv_cache``; ``label``, ``family`` and ``is_reference`` have
    defaults."""

    kind = None

    @property
    def text(self):
        """The canonical spec string (parsing it gives an equal spec)."""
        raise NotImplementedError

    def __str__(self):
        return self.text

    @property
    def label(self):
        """A short name for tables and figures (the text unless the kind knows better)."""
        return self.text

    @property
    def family(self):
        """The group the report's figures draw it in."""
        return self.kind

    @property
    def is_reference(self):
        """True when this cache is the float32 reference every other spec is measured against
        (``f32``, however spelled: ``f32/f32``, ``F32``); a kind says so itself, else False."""
        return False

    def describe(self, streams=("K", "V")):
        """The spec in words for a legend (``streams``: the two streams' names)."""
        return self.label

    def bits_per_value(self, head_dim, tokens=None):
        """(K + V bytes per row) x 8 / (2 x head_dim), side values included; with ``tokens``
        (a context length) fixed costs are spread over that many rows."""
        raise NotImplementedError

    def new_kv_cache(self, layout):
        """A cache for a K/V model of :class:`KVLayout` ``layout`` (ValueError when this kind
        cannot serve that model)."""
        raise ValueError(f"{self.text!r}: a {self.kind} spec builds no cache for "
                         f"{layout.describe()}")


@dataclass(frozen=True)
class KVLayout:
    """What a K/V model's cache must hold: the shape, the model's architecture (some kinds
    follow it, as llama.cpp does for Gemma 3's query scale) and a starting capacity."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    architecture: str = ""
    capacity: int = 256

    def describe(self):
        return (f"a model of {self.n_layers} layers, {self.n_kv_heads} KV heads, head_dim "
                f"{self.head_dim}" + (f" ({self.architecture})" if self.architecture else ""))


@dataclass(frozen=True)
class PairSpec(CacheSpec):
    """One stream spec for the first stream (K; L on the MLA model) and one for the second
    (V; R), the same for every layer.

    Examples
    --------
    >>> s = parse_cache_spec("kv8/tq4@sinks=1")
    >>> s.k.codec_spec, s.v.options.sinks, s.text
    ('kv8', 1, 'kv8/tq4@sinks=1')
    >>> parse_cache_spec("tq4").text
    'tq4'
    """

    k: StreamSpec
    v: StreamSpec
    kind = "pair"

    @classmethod
    def parse(cls, text):
        parts = _stream_parts(text)
        if len(parts) == 1:
            parts = parts * 2
        if len(parts) != 2 or not all(parts):
            raise ValueError(
                f"{text!r}: expected one stream spec, or two separated by '/' (e.g. 'kv8/tq4' "
                "for K kv8 and V tq4, or L and R on the MLA model)")
        return cls(*(StreamSpec.parse(p) for p in parts))

    @property
    def text(self):
        return str(self.k) if self.k == self.v else f"{self.k}/{self.v}"

    @property
    def streams(self):
        """(first stream's StreamSpec, second's)."""
        return self.k, self.v

    @property
    def is_reference(self):
        """True when both streams are the float32 reference (:attr:`StreamSpec.is_reference`:
        ``f32`` with no codec or stream options)."""
        return self.k.is_reference and self.v.is_reference

    @property
    def family(self):
        """``"simulation"`` when a stream's codec is a simulated one (:attr:`Codec.simulated`:
        a bar to compare with, not an entrant), ``"plug-in codec"`` when a stream's codec is not
        a built-in one (registered or installed), else ``"recent window"`` or ``"stream
        options"`` when a stream has them, else the codec's series
        (:attr:`kvquant.codecs.Codec.series`) when K and V share the codec, else ``"K/V
        split"``."""
        from kvquant.codecs import is_simulated_codec, parse_spec, registry
        plugins = registry.plugin_names()
        plugin_streams = [s for s in self.streams if parse_spec(s.codec_spec)[0] in plugins]
        if any(is_simulated_codec(s.codec_spec) for s in plugin_streams):
            return "simulation"
        if plugin_streams:
            return "plug-in codec"
        if self.k.options.recent or self.v.options.recent:
            return "recent window"
        if not (self.k.plain and self.v.plain):
            return "stream options"
        return describe_codec(self.k.codec_spec)[0] if self.k == self.v else "K/V split"

    def describe(self, streams=("K", "V")):
        if self.k == self.v:
            return self.k.describe()
        return f"{streams[0]} {self.k.describe()} / {streams[1]} {self.v.describe()}"

    def bits_per_value(self, head_dim, tokens=None):
        nbytes = 0.0
        for stream in self.streams:
            codec = stream.codec(head_dim)
            nbytes += (stream_bytes(codec, stream.options, tokens) / tokens if tokens
                       else codec.bytes_per_row)
        return 8.0 * nbytes / (2 * head_dim)

    def checked(self, dims, names):
        """The two StreamSpecs, each checked for rows of its width (errors name the stream)."""
        return tuple(s.check(d, f"{n} rows (width {d})") for s, d, n in
                     zip(self.streams, dims, names))

    def new_kv_cache(self, layout):
        from kvquant.cache import QuantizedKVCache
        d = layout.head_dim
        k, v = self.checked((d, d), ("K", "V"))
        return QuantizedKVCache(layout.n_layers, {"k": (k, d), "v": (v, d)},
                                n_kv_heads=layout.n_kv_heads, capacity=layout.capacity)


def _stream_parts(text):
    """The stream specs of a per-stream list, ``/`` between them (stripped; empty ones kept for
    the caller to refuse)."""
    return [p.strip() for p in text.split("/")]


@dataclass(frozen=True)
class StreamListSpec:
    """One stream spec for every stream of a model, or one per stream in the model's order,
    ``/`` between them: ``"tq4"``, ``"kv8/tq4@recent=16"``, ``"kv8/tq4/f32"``.

    The per-stream form of :class:`PairSpec` for a model whose cache holds any number of streams
    per layer and token (K and V of a GQA model, L and R of the MLA model, or more; the memory
    budget's model shapes, :mod:`kvquant.budget`). It counts bytes and builds no cache.

    Examples
    --------
    >>> s = StreamListSpec.parse("kv8/tq4@recent=16/f32")
    >>> [str(x) for x in s.for_streams(("k", "v", "x"))]
    ['kv8', 'tq4@recent=16', 'f32']
    >>> [str(x) for x in StreamListSpec.of(parse_cache_spec("tq4")).for_streams(("L", "R"))]
    ['tq4', 'tq4']
    """

    streams: tuple

    def __post_init__(self):
        if (not isinstance(self.streams, tuple) or not self.streams
                or not all(isinstance(s, StreamSpec) for s in self.streams)):
            raise TypeError(f"streams must be a non-empty tuple of StreamSpecs, got "
                            f"{self.streams!r}")

    @classmethod
    def parse(cls, text):
        """The StreamListSpec of ``text`` (ValueError naming what is wrong, or the kind that
        claims ``text`` when it is another kind's spec, e.g. ``ggml:q8_0/q4_0``)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a cache spec must be a non-empty string, got {text!r}")
        text = text.strip()
        for kind in _load_kinds().values():
            if kind.claims(text):
                raise ValueError(
                    f"{text!r} is a {kind.name} spec, not a list of stream specs: give one "
                    "stream spec for every stream, or one per stream separated by '/' (e.g. "
                    "'kv8' or 'kv8/tq4')")
        parts = _stream_parts(text)
        if not all(parts):
            raise ValueError(f"{text!r}: an empty stream spec beside a '/'; give one stream "
                             "spec for every stream, or one per stream separated by '/'")
        return cls(tuple(StreamSpec.parse(p) for p in parts))

    @classmethod
    def of(cls, spec):
        """``spec`` itself when it is a StreamListSpec; the streams of a :class:`PairSpec` (one
        when K and V are equal) or of a StreamSpec; else :meth:`parse` of a string. Another
        kind's CacheSpec (a plan, llama.cpp's attention) holds no per-stream list: ValueError."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, StreamSpec):
            return cls((spec,))
        if isinstance(spec, PairSpec):
            return cls((spec.k,) if spec.k == spec.v else spec.streams)
        if isinstance(spec, CacheSpec):
            raise ValueError(f"{spec.text!r} is a {spec.kind} spec, not a list of stream specs")
        return cls.parse(spec)

    @property
    def text(self):
        """The canonical text (parsing it gives an equal spec)."""
        return "/".join(str(s) for s in self.streams)

    def __str__(self):
        return self.text

    @property
    def is_reference(self):
        """True when every stream is the float32 reference (:attr:`StreamSpec.is_reference`)."""
        return all(s.is_reference for s in self.streams)

    def for_streams(self, names, model="the model"):
        """One StreamSpec per stream named in ``names``: the one spec for all of them, or the
        list's specs in order (ValueError when their count is another; ``model`` names the model
        in it)."""
        names = tuple(names)
        if len(self.streams) == 1:
            return self.streams * len(names)
        if len(self.streams) != len(names):
            raise ValueError(
                f"{self.text!r} gives {len(self.streams)} stream specs separated by '/', but "
                f"{model} has {len(names)} streams ({', '.join(names)}): give one spec for all "
                "of them or one per stream")
        return self.streams


# --------------------------------------------------------------------------------------------
# The kinds
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecKind:
    """A kind of cache spec: ``claims(text) -> bool`` says whether a string is of this kind,
    ``parse(text) -> CacheSpec`` parses it (ValueError naming what is wrong)."""

    name: str
    claims: object
    parse: object


_kinds = {}                 # name -> SpecKind, this process (the built-ins first)
_registered_here = set()    # names registered by register_spec_kind (not built-ins, entry points)
_entry_points_loaded = False


def register_spec_kind(kind, replace=False):
    """Make a :class:`SpecKind` parseable in this process (an installed package registers its
    kinds through the entry-point group ``kvquant.cache_specs`` instead, so that every process
    finds them)."""
    if not isinstance(kind, SpecKind):
        raise ValueError(f"expected a kvquant.specs.SpecKind, got {kind!r}")
    if kind.name in _kinds and not replace and _kinds[kind.name] != kind:
        raise ValueError(f"spec kind {kind.name!r} is registered already (replace=True to "
                         "replace it)")
    _kinds[kind.name] = kind
    _registered_here.add(kind.name)


def register_builtin_kind(kind):
    """Register a kind that kvquant itself defines (its module calls this on import)."""
    _kinds[kind.name] = kind


def unregister_spec_kind(name):
    del _kinds[name]
    _registered_here.discard(name)


def process_registrations():
    """What this process registered by hand (``register_codec``, ``register_spec_kind``), for an
    executor to carry to its worker processes, which find only built-ins and entry points on
    their own: ``{"codecs": {name: factory}, "kinds": {name: SpecKind}}`` (both empty when
    nothing was registered)."""
    from kvquant.codecs import registry
    return {"codecs": registry.process_registrations(),
            "kinds": {name: _kinds[name] for name in sorted(_registered_here)}}


def restore_registrations(registrations):
    """Register in this process what :func:`process_registrations` gave in another one
    (replacing registrations of the same names)."""
    from kvquant.codecs import register_codec
    for name, factory in registrations["codecs"].items():
        register_codec(name, factory, replace=True)
    for kind in registrations["kinds"].values():
        register_spec_kind(kind, replace=True)


def _load_kinds():
    global _entry_points_loaded
    if not _entry_points_loaded:
        # the built-in kinds live beside what they build; importing them registers them
        import kvquant.ggml_attention  # noqa: F401
        import kvquant.models.plan  # noqa: F401,F811
        from importlib.metadata import entry_points
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in _kinds:
                kind = ep.load()
                if not isinstance(kind, SpecKind) or kind.name != ep.name:
                    raise ValueError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} "
                                     f"({ep.value}) is not a SpecKind named {ep.name!r}")
                _kinds[ep.name] = kind
        _entry_points_loaded = True
    return _kinds


def parse_cache_spec(spec):
    """The :class:`CacheSpec` of ``spec`` (itself when it is one already)."""
    if isinstance(spec, CacheSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a cache spec must be a non-empty string, got {spec!r}")
    text = spec.strip()
    for kind in _load_kinds().values():
        if kind.claims(text):
            return kind.parse(text)
    return PairSpec.parse(text)


def split_spec_text(text, separator=","):
    """Split a comma-separated list of specs whose options may hold commas too.

    A piece that starts with an option (``key=value``, or a stream flag ``center`` /
    ``normalize``) continues the spec before it when that spec is open for options (its last
    ``/`` part has ``:`` codec options or ``@`` stream options):
    ``"kv8,tq3:codebook=gaussian,side=unbiased,tq4"`` -> ``["kv8", "tq3:codebook=gaussian,side=unbiased", "tq4"]``;
    ``"polar5@center,sinks=1/polar4@sinks=1,q8_0"`` -> ``["polar5@center,sinks=1/polar4@sinks=1", "q8_0"]``.

    ``separator=";"``: a list whose specs are separated by ``;``, which no spec holds, each
    piece a whole spec (``"tq4;polar4:alloc=level,side_dtype=f16"``); empty pieces are
    skipped.
    """
    if separator != ",":
        return [p.strip() for p in text.split(separator) if p.strip()]
    specs = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        head = re.split(r"[/@]", piece)[0]
        if head in _STREAM_FLAGS or ("=" in head and ":" not in head):
            if not specs or not any(c in specs[-1].split("/")[-1] for c in ":@"):
                raise ValueError(f"option {piece!r} in {text!r} follows no spec with options")
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse_cache_specs(text):
    """The CacheSpecs of a comma-separated list (:func:`split_spec_text`); a list of specs or
    strings is parsed item by item."""
    items = split_spec_text(text) if isinstance(text, str) else list(text)
    return [parse_cache_spec(s) for s in items]
