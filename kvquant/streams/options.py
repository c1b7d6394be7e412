"""Stream options: what a sequence of rows does around its codec, which a codec alone cannot do.

A stream spec is a codec spec plus ``@`` options (``"polar5@center,normalize,sinks=1"``): an
offset and per-channel scales taken from the stream's first append, the first rows kept in
float32, a window of recent rows read from float32 copies. One
:class:`~kvquant.streams.store.StreamStore` applies them for the in-memory cache and for the
cache file alike, so that a row stored in either holds the same bits.
"""
import math
from dataclasses import dataclass

import numpy as np

STREAM_OPTIONS = ("center", "normalize", "sinks", "recent")
STREAM_FLAGS = ("center", "normalize")
CALIBRATED = "calib"   # the value of a flag whose statistics come from a calibration
STREAM_COUNTS = ("sinks", "recent")
MAX_SINKS = 1 << 16   # float32 rows kept at the start of a stream, at most
MAX_RECENT = 1 << 16  # float32 rows kept at its end, at most


def parse_stream_spec(spec):
    """Split a stream spec into its codec spec and stream options.

    A stream spec is a codec spec, optionally followed by ``@`` and comma-separated stream options
    (what a sequence of rows does around its codec, which a codec alone cannot do):

    ``center``
        Subtract the mean of the rows of the first append (the prompt's prefill) from every row
        before it is encoded, and add it back when the rows are read. Keys of real models share a
        large per-channel mean (on SmolLM2 it holds ~60% of the key energy); the codec then spends
        its bits on what differs between keys. Attention is unchanged in exact arithmetic: scores
        and contexts add the offset's share back (``q . mu`` and ``sum(w) mu``).
    ``normalize``
        Divide each channel by ``sqrt(sigma_c / rms(sigma))`` before encoding (sigma_c: the
        channel's standard deviation over the first append's rows; floored at 1e-3 rms(sigma)),
        multiply back when reading. Outlier channels then take a smaller share of the row's norm,
        which a rotated codec spreads over every coordinate. The square root (half-way
        normalization) measured better on SmolLM2 keys than full normalization (exponent 1).
        Reading costs nothing extra: scores use the query times the scales, contexts are scaled
        once.
    ``center=calib``, ``normalize=calib``
        The same, with the offset and the channel scales measured once on a calibration text
        (per model, layer, stream and KV head: :mod:`kvquant.streams.calibration`) and given
        to the stream when it is made, instead of taken from its first append: a stream fed
        one token at a time, or started empty, then reads through the same statistics as a
        prompt's prefill. Calibrated statistics are all or nothing: a stream that centers and
        normalizes takes both from the calibration.
    ``sinks=N``
        Keep the first N rows of the sequence in float32, unquantized (attention sinks: the first
        tokens draw much of the attention and their keys are outliers). N <= 65536.

    ``recent=W``
        Read the W most recent rows in float32: a query at position p reads rows p-W+1 .. p
        exactly and older rows through the codec (the rows next to a query draw much of its
        attention). Every row is encoded when it is appended (a row that leaves the window is
        read from its codes), and the stream holds float32 copies of the last W rows, plus,
        until the next append, those of the rows of the last append, so that each query of a
        prefill reads its own window. W <= 65536.

    Under ``nonfinite="inert"`` a NaN/inf row becomes the codec's inert zero row (a zero row
    for a sink or in the window): in a centered stream it then reads as the offset, not as zero.

    Examples
    --------
    >>> parse_stream_spec("polar5@center,normalize,sinks=1")
    ('polar5', {'center': True, 'normalize': True, 'sinks': 1})
    >>> parse_stream_spec("tq4@recent=16")
    ('tq4', {'recent': 16})
    >>> parse_stream_spec("tq4:side=unbiased")
    ('tq4:side=unbiased', {})
    >>> parse_stream_spec("polar4@center=calib,normalize=calib")
    ('polar4', {'center': True, 'normalize': True, 'calibrated': True})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a stream spec must be a non-empty string, got {spec!r}")
    codec_spec, at, opt_text = spec.strip().partition("@")
    options, calibrated = {}, []
    if at and not opt_text.strip():
        raise ValueError(f"stream spec {spec!r}: nothing after '@' (options: center, normalize, "
                         "sinks=N, recent=W)")
    for item in filter(None, (part.strip() for part in opt_text.split(","))):
        key, eq, value = item.partition("=")
        if key not in STREAM_OPTIONS:
            raise ValueError(f"stream spec {spec!r}: unknown stream option {key!r}; the options "
                             "are 'center', 'normalize', 'sinks=N' and 'recent=W'")
        if key in options:
            raise ValueError(f"stream spec {spec!r}: option {key!r} given twice")
        if key in STREAM_FLAGS:  # flags; the others (STREAM_COUNTS) take a count
            if eq and value.strip() != CALIBRATED:
                raise ValueError(f"stream spec {spec!r}: {key!r} takes no value, or "
                                 f"'{key}={CALIBRATED}' (statistics from a calibration), got "
                                 f"{item!r}")
            options[key] = True
            calibrated.append(bool(eq))
        else:
            try:
                n = int(value)
            except ValueError:
                n = -1
            limit = MAX_SINKS if key == "sinks" else MAX_RECENT
            if not eq or not 0 <= n <= limit:
                raise ValueError(f"stream spec {spec!r}: {key} must be '{key}=N' with "
                                 f"0 <= N <= {limit}, got {item!r}")
            options[key] = n
    if any(calibrated):
        if not all(calibrated):
            raise ValueError(f"stream spec {spec!r}: calibrated statistics are all or nothing; "
                             "write " + " and ".join(f"'{k}={CALIBRATED}'" for k in STREAM_FLAGS
                                                      if k in options))
        options["calibrated"] = True
    return codec_spec.strip(), options


def format_stream_spec(codec_spec, center=False, normalize=False, sinks=0, recent=0,
                       calibrated=False):
    """The canonical stream spec (inverse of :func:`parse_stream_spec`)."""
    flag = "=" + CALIBRATED if calibrated else ""
    opts = ((["center" + flag] if center else []) + (["normalize" + flag] if normalize else [])
            + ([f"sinks={sinks}"] if sinks else []) + ([f"recent={recent}"] if recent else []))
    return codec_spec + ("@" + ",".join(opts) if opts else "")


def finite_mean(X):
    """Per-channel mean over the finite rows (a bad row is refused later by the codec, or stored
    inert under nonfinite='inert': it must not poison the offset)."""
    ok = np.isfinite(X).all(axis=1)
    if not ok.any():
        return np.zeros(X.shape[1], np.float32)
    return X[ok].mean(axis=0, dtype=np.float64).astype(np.float32)


def channel_scale(X):
    """sqrt(sigma_c / rms(sigma)) per channel over the finite rows, floored at sqrt(1e-3); all
    ones when the rows do not vary (one row, or identical rows)."""
    ok = np.isfinite(X).all(axis=1)
    sigma = X[ok].std(axis=0, dtype=np.float64) if ok.sum() > 1 else np.zeros(X.shape[1])
    rms = math.sqrt(float((sigma ** 2).mean()))
    if not rms > 0.0:
        return np.ones(X.shape[1], np.float32)
    return np.sqrt(np.maximum(sigma / rms, 1e-3)).astype(np.float32)


@dataclass(frozen=True)
class StreamOptions:
    """The options of one stream (see :func:`parse_stream_spec`)."""

    center: bool = False
    normalize: bool = False
    sinks: int = 0
    recent: int = 0
    calibrated: bool = False   # offset / scales given by a calibration, not the first append

    def __post_init__(self):
        if self.calibrated and not (self.center or self.normalize):
            raise ValueError("calibrated statistics need center or normalize")
        for name, limit in (("sinks", MAX_SINKS), ("recent", MAX_RECENT)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
                    0 <= value <= limit):
                raise ValueError(f"{name} must be an integer in 0..{limit}, got {value!r}")

    @property
    def plain(self):
        """True when the stream only encodes its rows (no offset, scales, sinks or window)."""
        return not (self.center or self.normalize or self.sinks or self.recent)

    def as_dict(self):
        """The options as keyword arguments (``recent`` and ``calibrated`` only when set: files
        written before they existed hold the other three)."""
        out = {"center": bool(self.center), "normalize": bool(self.normalize),
               "sinks": int(self.sinks)}
        if self.recent:
            out["recent"] = int(self.recent)
        if self.calibrated:
            out["calibrated"] = True
        return out

    def stream_spec(self, codec_spec):
        return format_stream_spec(codec_spec, self.center, self.normalize, self.sinks,
                                  self.recent, self.calibrated)


def split_stream_spec(spec):
    """``(codec spec, StreamOptions)`` of a stream spec."""
    codec_spec, options = parse_stream_spec(spec)
    return codec_spec, StreamOptions(**options)


def window_start(length, recent, held_from, sinks):
    """First of the first ``length`` rows of a stream that a read of them takes from a float32
    copy (``recent=W``): its window ``length - W ..``, neither before the first copy the stream
    holds (``held_from``) nor among its sinks; ``length`` (no row) without a window. The same
    rule says which copies an append or a truncation keeps. ``length`` may be an int array."""
    if not recent:
        return length
    return np.minimum(length, np.maximum(np.subtract(length, recent), max(held_from, sinks)))


def split_rows(X, options, offset, scale, n_rows, nonfinite="raise", where=""):
    """What one append of rows ``X`` (n, dim) does to a stream with ``options``.

    ``offset`` / ``scale`` are the stream's (None before its first rows), ``n_rows`` the rows it
    holds (the first ``min(n_rows, sinks)`` of them in float32). Returns
    ``(offset, scale, exact, rest)``: the stream's offset and scales after this append (the
    first append sets them, unless they are calibrated), the new sink rows (float32; NaN/inf rows zeroed when
    ``nonfinite="inert"``, refused otherwise; ``where`` prefixes that error) and the other rows,
    centered and scaled, for the codec to encode. Nothing is changed in place.
    """
    first = n_rows == 0 and X.shape[0] > 0 and not options.calibrated
    n_exact = min(n_rows, options.sinks)
    if options.center and first:
        offset = finite_mean(X)
    if options.normalize and first:
        scale = channel_scale(X)
    take = max(0, min(options.sinks - n_exact, X.shape[0]))
    exact = X[:take]
    bad = np.flatnonzero(~np.isfinite(exact).all(axis=1))
    if bad.size:
        if nonfinite != "inert":
            raise ValueError(
                f"{where}sink row(s) {', '.join(str(n_exact + i) for i in bad)} contain NaN or "
                "inf; nothing was stored. Clean them, or build the codec with "
                "nonfinite='inert' to store them as zero rows")
        exact = exact.copy()
        exact[bad] = 0.0
    rest = X[take:]
    if offset is not None:
        rest = rest - offset
    if scale is not None:
        rest = rest / scale
    return offset, scale, np.asarray(exact, np.float32), rest
