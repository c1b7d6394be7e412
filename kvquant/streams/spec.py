"""``StreamSpec``: a stream spec string parsed once, validated, and carried from there on.

A stream spec is a codec spec and optional stream options after ``@``
(``"tq4:side_dtype=f16@center,sinks=1,recent=16"``; the options: :func:`parse_stream_spec`).
Code that takes a spec string makes a :class:`StreamSpec` of it at its door and hands the object
on: nothing parses the string a second time, and the codec a check built for a width is the
codec the stream then uses.
"""
from dataclasses import dataclass, field, fields, replace

from kvquant.codecs import (bit_ladder, get_codec, parse_spec, row_scaled_spec, spec_with_bits,
                            spec_with_options)
from kvquant.streams.options import StreamOptions, parse_stream_spec


# codec options in words (StreamSpec.describe)
_CODEC_WORDS = {"side_dtype": "{} side".format, "alloc": "{} alloc".format,
                "codebook": "{} codebook".format, "side": "{} side".format, "compat": str,
                "seed": "seed {:#x}".format}


@dataclass(frozen=True)
class StreamSpec:
    """A parsed stream spec: the codec spec and the :class:`StreamOptions`.

    Build it with :meth:`parse` (or :meth:`of`, which also takes a StreamSpec). Two specs are
    equal when their codec spec text and options are.

    Examples
    --------
    >>> s = StreamSpec.parse("tq4:side_dtype=f16@center,sinks=1,recent=16")
    >>> s.codec_spec, s.options.sinks, s.options.recent
    ('tq4:side_dtype=f16', 1, 16)
    >>> str(s)
    'tq4:side_dtype=f16@center,sinks=1,recent=16'
    """

    codec_spec: str
    options: StreamOptions = StreamOptions()
    # codecs built by codec(), by (dim, options): codecs are immutable, so one per width serves
    # every stream of this spec (and a width check's codec is not built again)
    _codecs: dict = field(default_factory=dict, init=False, compare=False, hash=False,
                          repr=False)

    def __post_init__(self):
        if not isinstance(self.codec_spec, str) or not self.codec_spec.strip():
            raise ValueError(f"a codec spec must be a non-empty string, got {self.codec_spec!r}")
        if not isinstance(self.options, StreamOptions):
            raise TypeError(f"options must be StreamOptions, got {self.options!r}")

    @classmethod
    def parse(cls, text):
        """The StreamSpec of a stream spec string (ValueError naming what is wrong)."""
        codec_spec, options = parse_stream_spec(text)
        return cls(codec_spec, StreamOptions(**options))

    @classmethod
    def of(cls, spec):
        """``spec`` itself when it is a StreamSpec, else :meth:`parse` of it."""
        return spec if isinstance(spec, cls) else cls.parse(spec)

    def __str__(self):
        return self.options.stream_spec(self.codec_spec)

    @property
    def plain(self):
        """True when the stream only encodes its rows (no stream options)."""
        return self.options.plain

    def describe(self):
        """The spec in words for a legend: ``"polar5 (f16 side, centered, 1 f32 sink)"``."""
        base, codec_options = parse_spec(self.codec_spec)
        words = [base] + [_CODEC_WORDS[k](v) if k in _CODEC_WORDS else f"{k}={v}"
                          for k, v in codec_options.items()]
        o = self.options
        words += (["centered"] if o.center else []) + (["normalized"] if o.normalize else [])
        if o.calibrated:
            words.append("calibrated")
        words += ([f"{o.sinks} f32 sink"] if o.sinks else []) + (
            [f"last {o.recent} rows f32"] if o.recent else [])
        return words[0] + (" (" + ", ".join(words[1:]) + ")" if len(words) > 1 else "")

    def codec(self, dim, **codec_options):
        """The codec of this spec for rows of width ``dim`` (:func:`kvquant.get_codec`; built
        once per width and options)."""
        try:
            key = (int(dim), tuple(sorted(codec_options.items())))
            hash(key)
        except TypeError:   # an unhashable option value: build, do not keep
            return get_codec(self.codec_spec, dim, **codec_options)
        if key not in self._codecs:
            self._codecs[key] = get_codec(self.codec_spec, dim, **codec_options)
        return self._codecs[key]

    @property
    def is_reference(self):
        """True when this stream stores its rows as the float32 reference does: the codec
        ``f32`` (``F32`` too) with no codec options and no stream options. ``f32@center`` is
        not the reference (its rows are rounded after centering): it is measured as any other
        spec."""
        base = self.codec_spec.strip().partition(":")[0]
        return (self.plain and base.lower() == "f32"
                and parse_spec(self.codec_spec) == ("f32", {}))

    @property
    def bits(self):
        """The bit width the codec's name carries (``tq4`` -> 4, ``polar5:side_dtype=f16`` ->
        5: :func:`kvquant.codecs.bit_ladder`); None when it carries none (kv8, q8_0, f32, a
        registered codec)."""
        ladder = bit_ladder(self.codec_spec)
        return None if ladder is None else ladder[0]

    @property
    def bit_widths(self):
        """The bit widths the codec's family takes (``range(1, 9)`` for tq, ``range(2, 7)`` for
        polar), None when its name carries no bit width."""
        ladder = bit_ladder(self.codec_spec)
        return None if ladder is None else ladder[1]

    def with_bits(self, bits):
        """This spec with its codec at ``bits`` bits, codec and stream options kept
        (``polar4:side_dtype=f16@center``, 3 -> ``polar3:side_dtype=f16@center``); ValueError
        when the codec's name carries no bit width or its family takes no ``bits``."""
        return StreamSpec(spec_with_bits(self.codec_spec, bits), self.options)

    def with_codec_options(self, **options):
        """This spec with codec options added (``tq3@center``, side_dtype="f16" ->
        ``tq3:side_dtype=f16@center``; :func:`kvquant.codecs.spec_with_options`: the spec's own
        options stay as written, one given again with another value is a ValueError)."""
        return StreamSpec(spec_with_options(self.codec_spec, **options), self.options)

    def with_options(self, **options):
        """This spec with stream options changed (``tq4@sinks=1``, recent=16 ->
        ``tq4@sinks=1,recent=16``); the fields of :class:`StreamOptions`, checked as it
        checks them."""
        unknown = sorted(set(options) - {f.name for f in fields(StreamOptions)})
        if unknown:
            raise ValueError(f"unknown stream option(s) {', '.join(unknown)}; the options are "
                             + ", ".join(f.name for f in fields(StreamOptions)))
        return StreamSpec(self.codec_spec, replace(self.options, **options))

    def with_row_scales(self):
        """This spec with one scale per row where its codec groups scales (``kv8-g32@sinks=1``
        -> ``kv8@sinks=1``, ``kv8:group=32`` -> ``kv8``:
        :func:`kvquant.codecs.row_scaled_spec`), itself otherwise."""
        codec_spec = row_scaled_spec(self.codec_spec)
        return self if codec_spec == self.codec_spec else StreamSpec(codec_spec, self.options)

    def check(self, dim, what=None):
        """This spec, after checking that its codec takes rows of width ``dim``; errors start
        with ``what`` (e.g. ``"K rows (width 64)"``) when given."""
        try:
            self.codec(dim)
        except ValueError as exc:
            if what is None:
                raise
            raise ValueError(f"{what}: {exc}") from None
        return self
