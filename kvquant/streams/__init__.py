"""A stream of rows: its spec (:class:`StreamSpec`, a spec string parsed once), its options
(:mod:`kvquant.streams.options`) and its store (:class:`StreamStore`: codes, side values,
sinks, offsets and scales, recent-window copies). The in-memory cache and the cache file both
hold their rows in stores: one implementation of what a stream does with its rows."""
from kvquant.streams.options import (
    MAX_RECENT, MAX_SINKS, StreamOptions, format_stream_spec, parse_stream_spec, split_stream_spec,
    window_start)
from kvquant.streams.spec import StreamSpec
from kvquant.streams.row_stream import RowStream
from kvquant.streams.store import PreparedRows, StreamState, StreamStore

__all__ = ["MAX_RECENT", "MAX_SINKS", "PreparedRows", "RowStream", "StreamOptions", "StreamSpec",
           "StreamState", "StreamStore", "format_stream_spec", "parse_stream_spec",
           "split_stream_spec", "window_start"]
