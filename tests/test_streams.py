"""kvquant.streams: the stream spec parsed once (StreamSpec) and the one stream store
(StreamStore) that the cache and the cache file share: slots independent of each other, a
prepare that changes nothing, state round trips, one encode call per layer and stream."""
import subprocess
import sys

import numpy as np
import pytest

from kvquant import get_codec
from kvquant.cache import QuantizedKVCache
from kvquant.streams import (
    PreparedRows, RowStream, StreamOptions, StreamSpec, StreamStore, parse_stream_spec)

D = 32
SPECS = ["tq4", "kv8@center,sinks=2", "polar4:side_dtype=f16@center,normalize,sinks=1,recent=4",
         "tq3@recent=3", "q8_0@normalize"]


def _rows(rng, n, slots):
    X = rng.standard_normal((n, slots, D)).astype(np.float32)
    return X * np.linspace(0.5, 3.0, D, dtype=np.float32) + np.linspace(-1, 1, D,
                                                                       dtype=np.float32)


# -- StreamSpec ------------------------------------------------------------------------------
def test_stream_spec_parses_once_and_prints_canonically():
    s = StreamSpec.parse(" tq4:side_dtype=f16@recent=16,sinks=1,center ")
    assert s.codec_spec == "tq4:side_dtype=f16"
    assert s.options == StreamOptions(center=True, sinks=1, recent=16)
    assert str(s) == "tq4:side_dtype=f16@center,sinks=1,recent=16"
    assert StreamSpec.parse(str(s)) == s and StreamSpec.of(s) is s
    assert StreamSpec.parse("kv8").plain and not s.plain
    # the string language is the options module's
    assert parse_stream_spec(str(s)) == (s.codec_spec, {"center": True, "sinks": 1,
                                                        "recent": 16})


@pytest.mark.parametrize("bad, match", [("tq4@", "nothing after '@'"),
                                        ("tq4@sink=1", "unknown stream option"),
                                        ("tq4@center,center", "given twice"),
                                        ("", "non-empty")])
def test_stream_spec_refuses_bad_text(bad, match):
    with pytest.raises(ValueError, match=match):
        StreamSpec.parse(bad)


def test_stream_spec_builds_its_codec_once_per_width_and_names_a_bad_width():
    s = StreamSpec.parse("tq4@center")
    c = s.check(64).codec(64)
    assert s.codec(64) is c and c.dim == 64 and c.spec == "tq4"
    assert s.codec(32) is not c and s.codec(32).dim == 32
    assert s.codec(64, nonfinite="inert") is not c
    with pytest.raises(ValueError, match=r"K rows \(width 48\): .*48"):
        s.check(48, "K rows (width 48)")


def test_a_model_cache_takes_the_checked_spec_without_building_a_second_codec():
    from kvquant.specs import parse_cache_spec
    spec, _ = parse_cache_spec("polar4@center,sinks=1").checked((64, 64), ("K", "V"))
    assert isinstance(spec, StreamSpec)
    cache = QuantizedKVCache(2, {"k": (spec, 64), "v": (spec, 64)}, n_kv_heads=3)
    assert cache.codec(0, "k") is spec.codec(64) is cache.codec(1, "v")
    assert cache.stream(1, "v", 2).spec == "polar4@center,sinks=1"


# -- StreamStore -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_slots_are_independent_streams(spec, rng):
    """Slot j of a store holds exactly what a store of slot j's rows alone holds, through
    appends and truncations; its offset is the mean of its own first append."""
    s = StreamSpec.parse(spec)
    codec = s.codec(D)
    multi = StreamStore(codec, s.options, slots=3)
    singles = [RowStream(codec, **s.options.as_dict()) for _ in range(3)]
    first = None
    for n, cut in ((7, None), (1, None), (5, 10), (4, None), (0, 3), (2, None)):
        X = _rows(rng, n, 3)
        first = X if first is None else first
        multi.append(X, n_threads=1)
        for j, single in enumerate(singles):
            single.append(X[:, j], n_threads=1)
        if cut is not None:
            multi.truncate(cut)
            for single in singles:
                single.truncate(cut)
        for j, single in enumerate(singles):
            view = RowStream.of(multi, j)
            assert len(view) == len(single) == multi.n_rows
            assert np.array_equal(view.decode(n_threads=1), single.decode(n_threads=1))
            q = rng.standard_normal((2, D)).astype(np.float32)
            assert np.array_equal(view.scores(q, n_threads=1), single.scores(q, n_threads=1))
            w = rng.random(len(single)).astype(np.float32)
            assert np.array_equal(view.context(w, n_threads=1), single.context(w, n_threads=1))
    if s.options.center:
        ref = first.astype(np.float64).mean(axis=0).astype(np.float32)   # (slots, dim)
        np.testing.assert_allclose(multi.offsets, ref, rtol=1e-6, atol=1e-6)
    assert multi.nbytes == sum(single.nbytes for single in singles)
    assert multi.fixed_bytes == sum(single.fixed_bytes for single in singles)


@pytest.mark.parametrize("spec", SPECS)
def test_a_read_from_a_later_row_is_the_tail_of_a_read_from_row_0(spec, rng):
    """scores/context from row ``start`` (a sliding window): for every start, through sinks,
    coded rows and the recent window, the scores are those of a read from row 0 from that row
    on, and the context is that of weights with zeros before it."""
    s = StreamSpec.parse(spec)
    store = StreamStore(s.codec(D), s.options, slots=2)
    store.append(_rows(rng, 9, 2), n_threads=1)
    store.append(_rows(rng, 3, 2), n_threads=1)
    n = store.n_rows
    q = rng.standard_normal((2, D)).astype(np.float32)
    full = store.scores(q, 1, n_threads=1)
    for start in range(n + 1):
        tail = store.scores(q, 1, n_threads=1, start=start)
        assert tail.shape == (2, n - start)
        np.testing.assert_allclose(tail, full[:, start:], rtol=1e-6, atol=1e-6)
        w = rng.random((2, n - start)).astype(np.float32)
        padded = np.concatenate([np.zeros((2, start), np.float32), w], axis=1)
        np.testing.assert_allclose(store.context(w, 1, n_threads=1, start=start),
                                   store.context(padded, 1, n_threads=1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="start 13 is outside 0..12"):
        store.scores(q, 0, start=n + 1)
    with pytest.raises(ValueError, match="outside 0..12"):
        store.context(np.ones(2, np.float32), 0, start=n - 1)


@pytest.mark.parametrize("spec", SPECS)
def test_prepare_changes_nothing_and_store_keeps_it(spec, rng):
    s = StreamSpec.parse(spec)
    store = StreamStore(s.codec(D), s.options, slots=2)
    store.append(_rows(rng, 3, 2))
    before = store.state()
    held = (before.codes.copy(), before.sinks.copy(), store.n_rows, store.recent_start)
    prepared = store.prepare(_rows(rng, 4, 2))
    assert isinstance(prepared, PreparedRows) and prepared.n_rows == 4
    assert prepared.codes.shape == (4 - prepared.sinks.shape[0], 2, store.codec.code_bytes)
    after = store.state()
    assert np.array_equal(after.codes, held[0]) and np.array_equal(after.sinks, held[1])
    assert (store.n_rows, store.recent_start) == held[2:]
    store.store(prepared)
    assert store.n_rows == 7


def test_a_bad_row_in_any_slot_leaves_the_store_as_it_was(rng):
    store = StreamStore(get_codec("tq4", D), StreamOptions(center=True, sinks=1), slots=3)
    store.append(_rows(rng, 4, 3))
    X = _rows(rng, 3, 3)
    X[1, 2, 5] = np.nan
    codes = store.state().codes.copy()
    with pytest.raises(ValueError, match="NaN"):
        store.append(X)
    assert store.n_rows == 4 and np.array_equal(store.state().codes, codes)
    X = _rows(rng, 2, 3)
    empty = StreamStore(get_codec("tq4", D), StreamOptions(sinks=2), slots=3)
    X[1, 1, 0] = np.inf
    with pytest.raises(ValueError, match="slot 1: sink row"):
        empty.prepare(X, where="slot {slot}: ")
    assert empty.n_rows == 0


@pytest.mark.parametrize("spec", SPECS)
def test_state_round_trip_reads_the_same(spec, rng):
    s = StreamSpec.parse(spec)
    store = StreamStore(s.codec(D), s.options, slots=2)
    for n in (6, 2, 3):
        store.append(_rows(rng, n, 2))
    store.truncate(9)
    back = store.state().store()
    assert back is not store and back.n_rows == store.n_rows == 9
    for j in range(2):
        assert np.array_equal(back.decode(j), store.decode(j))
        q = rng.standard_normal(D).astype(np.float32)
        assert np.array_equal(back.scores(q, j), store.scores(q, j))
        one = store.slot_store(j)
        assert one.slots == 1 and np.array_equal(one.decode(0), store.decode(j))
    # a store read back from its state holds its window from the last rows on
    assert back.window_start() == store.window_start()


def test_a_view_is_read_only_and_counts_its_own_slot(rng):
    store = StreamStore(get_codec("kv8", D), StreamOptions(sinks=1), slots=2)
    store.append(_rows(rng, 5, 2))
    view = RowStream.of(store, 1)
    with pytest.raises(ValueError, match="slot 1 of a store of 2 slots"):
        view.append(_rows(rng, 1, 1)[:, 0])
    with pytest.raises(IndexError):
        RowStream.of(store, 2)
    assert view.nbytes * 2 == store.nbytes
    assert view.nbytes == 4 * D + 4 * get_codec("kv8", D).bytes_per_row


def test_the_cache_encodes_once_per_layer_and_stream(rng, monkeypatch):
    cache = QuantizedKVCache(2, {"k": ("tq4@center,recent=2", D), "v": ("kv8", D)},
                             n_kv_heads=4)
    calls = []
    for name in ("k", "v"):
        codec = cache.codec(0, name)
        real = codec.encode
        monkeypatch.setattr(codec, "encode",
                            lambda X, n_threads=None, _r=real, _n=name: calls.append(
                                (_n, np.shape(X))) or _r(X, n_threads))
    cache.append(1, k=_rows(rng, 5, 4), v=_rows(rng, 5, 4))
    assert calls == [("k", (20, D)), ("v", (20, D))]


def test_the_cache_file_never_imports_the_cache():
    code = ("import sys, kvquant.kvfile; "
            "sys.exit(int('kvquant.cache' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
