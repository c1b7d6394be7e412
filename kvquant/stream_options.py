"""Moved to :mod:`kvquant.streams.options`; this name stays for code that still imports it."""
from kvquant.streams.options import (  # noqa: F401
    MAX_RECENT, MAX_SINKS, STREAM_COUNTS, STREAM_FLAGS, STREAM_OPTIONS, StreamOptions,
    channel_scale, finite_mean, format_stream_spec, parse_stream_spec, split_rows,
    split_stream_spec, window_start)
