"""Codec registry: ``get_codec(spec, dim, **options)``.

A spec is a base name with optional options after a colon, e.g. ``kv8``, ``kv8-g32``, ``tq4``,
``tq3:codebook=gaussian,side=unbiased``, ``tq4:compat=colibri``, ``tq4:seed=0x1234``,
``polar4:side_dtype=f16`` (side values stored as fp16, 2 bytes, on tq and polar). Keyword
options given to ``get_codec`` are merged with those in the spec (a conflict is an error).
Each family module exposes ``parse(base, dim, options)`` returning a codec or None; codecs
from elsewhere come in through :mod:`kvquant.codecs.registry` (``register_codec`` or the
``kvquant.codecs`` entry-point group) and are looked up after the built-in families.
"""
import numbers

from kvquant.codecs import fp8, ggml, identity, lloyd, polar
from kvquant.codecs import registry
from kvquant.codecs.base import (WIDTH_RULE, Codec, CodecWidthError, EncodedRows,
                                 UnknownCodecError)
from kvquant.codecs.registry import register_codec, unregister_codec

_FAMILIES = (identity.parse, fp8.parse, lloyd.parse, polar.parse, ggml.parse)
_INT_OPTIONS = ("seed", "group", "bits")
# the built-in families' spec forms, as users write them
BUILTIN_FORMS = ("f32", "kv8", "kv8-g<N>", "tq<b> (b = 1..8)", "polar<b> (b = 2..6)",
                 *(f"{k} (+rot)" for k in ggml.KINDS))

__all__ = ["BUILTIN_FORMS", "WIDTH_RULE", "Codec", "CodecWidthError", "EncodedRows",
           "UnknownCodecError", "available_codecs", "bit_ladder", "codec_for_width",
           "describe_codec", "get_codec", "is_simulated_codec", "parse_spec", "register_codec",
           "row_scaled_spec", "spec_with_bits", "spec_with_options", "unregister_codec"]
# the families whose names carry their bit width (tq<b>, polar<b>): each family's bit_ladder
_BIT_LADDERS = (lloyd.bit_ladder, polar.bit_ladder)


def available_codecs():
    """Every codec spec form this process can build: the built-in families' (``tq<b>`` ...),
    then the registered and installed plug-ins' names."""
    return list(BUILTIN_FORMS) + registry.plugin_names()


def parse_spec(spec):
    """Split ``"tq4:side=unbiased,seed=7"`` into ``("tq4", {"side": "unbiased", "seed": 7})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a codec spec must be a non-empty string, got {spec!r}")
    base, _, opt_text = spec.strip().partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in opt_text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"option {item!r} in spec {spec!r} is not of the form key=value")
        if key in options:
            raise ValueError(f"option {key!r} given twice in spec {spec!r}")
        if key in _INT_OPTIONS:
            try:
                value = int(value, 0)
            except ValueError:
                raise ValueError(f"option {key}={value!r} in spec {spec!r} must be an integer")
        options[key] = value
    return base.lower(), options


def get_codec(spec, dim, **options):
    """Build the codec named by ``spec`` for rows of width ``dim``.

    Examples
    --------
    >>> get_codec("tq4", 128).bytes_per_row
    68
    """
    if isinstance(spec, str) and "@" in spec:
        raise ValueError(
            f"{spec!r}: what follows '@' are stream options (center, normalize, sinks=N, "
            "recent=W) of a stream of rows (kvquant.cache.QuantizedKVCache, model pair specs, "
            "cache file streams), not codec options; give the codec "
            f"{spec.partition('@')[0]!r} here")
    base, spec_options = parse_spec(spec)
    for key, value in options.items():
        if key in spec_options and spec_options[key] != value:
            raise ValueError(
                f"option {key!r} is {spec_options[key]!r} in the spec and {value!r} as a keyword"
            )
    merged = {**spec_options, **options}
    try:
        codec = builtin_codec(base, dim, merged)
    except TypeError as exc:
        raise ValueError(f"spec {spec!r}: unknown option ({exc})") from None
    if codec is not None:
        return codec
    factory = registry.registered_factory(base)
    if factory is None:
        raise UnknownCodecError(f"unknown codec spec {spec!r}; known: "
                                f"{', '.join(available_codecs())} (kvquant.register_codec adds "
                                "one)")
    try:
        codec = factory(dim, **merged)
    except TypeError as exc:
        raise ValueError(f"spec {spec!r}: the codec's factory refuses its options ({exc})") \
            from None
    if not isinstance(codec, Codec) or codec.dim != dim:
        raise ValueError(f"spec {spec!r}: its factory returned {codec!r}, not a kvquant Codec "
                         f"of width {dim}")
    return codec


def _built_at_some_width(spec):
    """The codec of ``spec`` at the first of a few widths that it takes (ValueError naming the
    spec when it takes none): for what a codec declares whatever its width."""
    error = None
    for dim in (64, 128, 512, 96):
        try:
            return get_codec(spec, dim)
        except ValueError as exc:   # a width this codec refuses (a group size, a block)
            error = error or exc
    raise error


def codec_for_width(spec, dim):
    """:func:`get_codec` of ``spec`` for rows of width ``dim``, its refusals told apart.

    Raises
    ------
    UnknownCodecError
        ``spec`` names no codec this process can build at any width (an unknown name, or bits
        or options its family refuses).
    CodecWidthError
        The codec exists but refuses rows of width ``dim``; a plug-in's plain ValueError counts
        as one when the spec builds at another width.
    """
    try:
        return get_codec(spec, dim)
    except (UnknownCodecError, CodecWidthError):
        raise
    except ValueError as exc:
        try:
            _built_at_some_width(spec)
        except ValueError:
            raise UnknownCodecError(str(exc)) from None
        raise CodecWidthError(str(exc)) from None


def _option_items(spec):
    """The codec options of ``spec`` as written: ``(key, "key=value")`` in order (a spec
    :func:`parse_spec` took)."""
    items = (item.strip() for item in spec.strip().partition(":")[2].split(","))
    return [(item.partition("=")[0], item) for item in items if item]


def _spec_text(base, items):
    return base + (":" + ",".join(text for _, text in items) if items else "")


def row_scaled_spec(spec):
    """``spec`` with one scale per row in place of scale groups (``"kv8-g32"`` and
    ``"kv8:group=32"`` -> ``"kv8"``, other codec options kept as written), ``spec`` itself when
    its codec keeps no scale groups: the codec of rows whose producer scales each row whole (the
    engine groups the MLA model's latent L, not its rope row R)."""
    base, options = parse_spec(spec)
    row = fp8.row_scaled(base, options)
    if row is None:
        return spec
    row_base, kept = row
    return _spec_text(row_base, [i for i in _option_items(spec) if i[0] in kept])


def _ladder_of(spec):
    """``(family name, bits, widths)`` from the family whose ladder takes ``spec``'s name, or
    None."""
    base, _ = parse_spec(spec)
    for ladder in _BIT_LADDERS:
        found = ladder(base)
        if found is not None:
            return found
    return None


def bit_ladder(spec):
    """``(bits, widths)`` of a codec spec whose name carries its bit width (``tq<b>``, widths
    1..8; ``polar<b>``, 2..6): ``"polar4:side_dtype=f16"`` -> ``(4, range(2, 7))``; None for a
    codec whose name carries none (kv8, the llama.cpp types, f32, a registered codec)."""
    found = _ladder_of(spec)
    return None if found is None else (found[1], found[2])


def spec_with_bits(spec, bits):
    """``spec`` with its codec's bit width ``bits``, its options kept as written
    (``"polar4:side_dtype=f16"``, 3 -> ``"polar3:side_dtype=f16"``).

    Raises
    ------
    ValueError
        The codec's name carries no bit width (:func:`bit_ladder`), or its family takes no
        codec of ``bits`` bits.
    """
    found = _ladder_of(spec)
    if found is None:
        raise ValueError(f"{spec!r}: the codec's name carries no bit width to change (tq<b>, "
                         "polar<b>)")
    name, _, widths = found
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in widths:
        raise ValueError(f"{spec!r}: {name} takes {widths[0]}..{widths[-1]} bits, not {bits!r}")
    return _spec_text(f"{name}{int(bits)}", _option_items(spec))


def spec_with_options(spec, **options):
    """``spec`` with the codec options ``options`` added after its own, which stay as written
    (``"tq3:side=unbiased"``, side_dtype="f16" -> ``"tq3:side=unbiased,side_dtype=f16"``). An
    option the spec gives already with the same value is not repeated; with another value it
    is a ValueError, as is a key or value that the spec grammar cannot hold."""
    given = parse_spec(spec)[1]
    items = _option_items(spec)
    for key, value in options.items():
        text = str(value)
        if any(not t or t.strip() != t or any(c in t for c in ",:@/=") for t in (key, text)):
            raise ValueError(f"codec option {key}={value!r}: a key and a value are non-empty "
                             "text without ',', ':', '@', '/', '=' or surrounding spaces")
        if key in given:
            if parse_spec(f"x:{key}={text}")[1][key] != given[key]:
                raise ValueError(f"{spec!r} gives {key}={given[key]!r} already, not {text!r}")
            continue
        items.append((key, f"{key}={text}"))
    return _spec_text(spec.strip().partition(":")[0], items)


def describe_codec(spec):
    """``(series, nominal_bits)`` a codec spec declares (:attr:`Codec.series`,
    :attr:`Codec.nominal_bits`), whatever width it is built for."""
    codec = _built_at_some_width(spec)
    return codec.series, codec.nominal_bits


def is_simulated_codec(spec):
    """Whether the codec of ``spec`` is a simulation (:attr:`Codec.simulated`: float32 rows
    after a quantize-dequantize, nominal bytes), whatever width it is built for."""
    return bool(_built_at_some_width(spec).simulated)


def builtin_codec(base, dim, options):
    """The built-in family's codec of spec base ``base``, or None when no family has it."""
    for family_parse in _FAMILIES:
        codec = family_parse(base, dim, options)
        if codec is not None:
            return codec
    return None
