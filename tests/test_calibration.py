"""Calibrated stream statistics (``center=calib``, ``normalize=calib``): the spec syntax, the
stores that use them from the first row on, the statistics file, the cache that routes them to
each layer and KV head, and the kvq file that records them and refuses others."""
import numpy as np
import pytest

from kvquant import get_codec
from kvquant.cache import QuantizedKVCache
from kvquant.kvfile import CacheFile, CacheFileMismatch, Stream, inspect_file
from kvquant.streams.calibration import StreamStatistics, statistics_digest
from kvquant.streams.options import StreamOptions, parse_stream_spec, split_stream_spec
from kvquant.streams.store import StreamStore

DIM = 64
SLOTS = 3


def keys(rng, n, slots=SLOTS):
    """Key-like rows: a large per-channel mean, one outlier channel."""
    X = rng.standard_normal((n, slots, DIM)).astype(np.float32)
    X += np.linspace(-3, 3, DIM, dtype=np.float32)
    X[..., 5] *= 8.0
    return X


def numpy_statistics(X):
    """Offsets and half-way scales of rows X (n, slots, dim), written out in plain numpy."""
    mu = X.astype(np.float64).mean(axis=0)
    sigma = X.astype(np.float64).std(axis=0)
    rms = np.sqrt((sigma ** 2).mean(axis=1, keepdims=True))
    return mu.astype(np.float32), np.sqrt(np.maximum(sigma / rms, 1e-3)).astype(np.float32)


# -- the spec ------------------------------------------------------------------------------------
def test_calib_flags_parse_and_print_back():
    spec = "polar4@center=calib,normalize=calib,sinks=1"
    codec, opts = split_stream_spec(spec)
    assert (codec, opts) == ("polar4", StreamOptions(True, True, 1, 0, True))
    assert opts.stream_spec(codec) == spec
    assert parse_stream_spec("tq4@center=calib")[1] == {"center": True, "calibrated": True}
    assert not split_stream_spec("tq4@center,normalize")[1].calibrated


@pytest.mark.parametrize("spec, match", [
    ("tq4@center=calib,normalize", "all or nothing"),
    ("tq4@center=mean", "center=calib"),
    ("tq4@sinks=calib", "sinks=N"),
])
def test_bad_calib_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_stream_spec(spec)


# -- the store -----------------------------------------------------------------------------------
def test_a_calibrated_store_encodes_every_row_after_the_given_statistics():
    rng = np.random.default_rng(0)
    calib, X = keys(rng, 400), keys(rng, 9)
    mu, s = numpy_statistics(calib)
    codec = get_codec("tq4", DIM)
    opts = split_stream_spec("tq4@center=calib,normalize=calib")[1]
    store = StreamStore(codec, opts, SLOTS, offsets=mu, channel_scales=s)
    for t in range(len(X)):   # a decode-only stream: one row per append
        store.append(X[t:t + 1])
    for j in range(SLOTS):
        # reference: the codec on (x - mu) / s, scaled and offset back
        ref = codec.decode(codec.encode((X[:, j] - mu[j]) / s[j])) * s[j] + mu[j]
        np.testing.assert_allclose(store.decode(j), ref, rtol=1e-6, atol=1e-5)
        q = rng.standard_normal(DIM).astype(np.float32)
        np.testing.assert_allclose(store.scores(q, j), ref @ q, rtol=1e-4, atol=1e-3)
    block = StreamStore(codec, opts, SLOTS, offsets=mu, channel_scales=s)
    block.append(X)   # the same rows as a prefill: the same codes
    np.testing.assert_array_equal(block.coded_rows()[0], store.coded_rows()[0])
    store.truncate(0)   # the calibration stays
    np.testing.assert_array_equal(store.offsets, mu)
    np.testing.assert_array_equal(store.channel_scales, s)


def test_calibration_helps_a_stream_fed_one_token_at_a_time():
    """First-append statistics of a one-row first append: offset = that row, scales = 1."""
    rng = np.random.default_rng(1)
    calib, X = keys(rng, 2000), keys(rng, 200)
    mu, s = numpy_statistics(calib)
    codec = get_codec("tq3", DIM)
    first = StreamStore(codec, split_stream_spec("tq3@center,normalize")[1], SLOTS)
    cal = StreamStore(codec, split_stream_spec("tq3@center=calib,normalize=calib")[1], SLOTS,
                      offsets=mu, channel_scales=s)
    for t in range(len(X)):
        first.append(X[t:t + 1])
        cal.append(X[t:t + 1])
    np.testing.assert_array_equal(first.offsets, X[0])
    np.testing.assert_array_equal(first.channel_scales, np.ones((SLOTS, DIM), np.float32))
    err = {name: np.mean([((st.decode(j) - X[:, j]) ** 2).sum() for j in range(SLOTS)])
           for name, st in (("first", first), ("calibrated", cal))}
    assert err["calibrated"] < 0.8 * err["first"]


def test_calibrated_stores_refuse_missing_or_bad_statistics():
    codec = get_codec("tq4", DIM)
    opts = split_stream_spec("tq4@center=calib,normalize=calib")[1]
    ones = np.ones((SLOTS, DIM), np.float32)
    with pytest.raises(ValueError, match="calibrated channel scales"):
        StreamStore(codec, opts, SLOTS, offsets=ones)
    with pytest.raises(ValueError, match=r"shape \(3, 64\)"):
        StreamStore(codec, opts, SLOTS, offsets=ones[:2], channel_scales=ones)
    with pytest.raises(ValueError, match="<= 0"):
        StreamStore(codec, opts, SLOTS, offsets=ones, channel_scales=0 * ones)
    with pytest.raises(ValueError, match="do not say calibrated"):
        StreamStore(codec, split_stream_spec("tq4@center")[1], SLOTS, offsets=ones)


def test_a_slot_copy_and_a_state_round_trip_keep_the_calibration():
    rng = np.random.default_rng(2)
    mu, s = numpy_statistics(keys(rng, 100))
    opts = split_stream_spec("polar4@center=calib,normalize=calib,sinks=1")[1]
    store = StreamStore(get_codec("polar4", DIM), opts, SLOTS, offsets=mu, channel_scales=s)
    empty = store.state().store()   # no rows yet: still calibrated
    np.testing.assert_array_equal(empty.offsets, mu)
    X = keys(rng, 5)
    store.append(X)
    copy = store.slot_store(1)
    np.testing.assert_array_equal(copy.decode(0), store.decode(1))
    np.testing.assert_array_equal(copy.channel_scales, s[1:2])


# -- the statistics and their file ---------------------------------------------------------------
def test_statistics_from_rows_match_numpy_and_survive_their_file(tmp_path):
    rng = np.random.default_rng(3)
    rows = {"k": [keys(rng, 300) for _ in range(2)], "v": [keys(rng, 300) for _ in range(2)]}
    stats = StreamStatistics.from_rows(rows, center=("k", "v"), normalize=("k",),
                                       meta={"model": "test"})
    for layer in range(2):
        mu, s = numpy_statistics(rows["k"][layer])
        np.testing.assert_allclose(stats.vectors(layer, "k")[0], mu, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(stats.vectors(layer, "k")[1], s, rtol=1e-5)
        assert stats.vectors(layer, "v")[1] is None
    path = str(tmp_path / "calib.npz")
    stats.save(path)
    back = StreamStatistics.load(path)
    assert back.digest() == stats.digest() and back.meta == {"model": "test"}
    np.testing.assert_array_equal(back.offsets["v"], stats.offsets["v"])
    with pytest.raises(ValueError, match=r"\(2, 3, 32\)"):
        back.check(2, 3, 32)
    other = StreamStatistics({"k": stats.offsets["k"] + 1e-3}, {"k": stats.scales["k"]})
    assert other.digest() != StreamStatistics({"k": stats.offsets["k"]},
                                              {"k": stats.scales["k"]}).digest()


def test_an_edited_statistics_file_is_refused(tmp_path):
    import json
    stats = StreamStatistics({"k": np.zeros((1, 1, 4), np.float32)}, {})
    path = str(tmp_path / "calib.npz")
    stats.save(path)
    with np.load(path) as z:
        meta = str(z["meta"])
    np.savez(path, meta=np.array(meta), **{"k.offsets": np.ones((1, 1, 4), np.float32)})
    with pytest.raises(ValueError, match="digest"):
        StreamStatistics.load(path)
    np.savez(path, meta=np.array(json.dumps({"format": "other"})))
    with pytest.raises(ValueError, match="not a stream statistics file"):
        StreamStatistics.load(path)


def test_the_cache_gives_each_layer_and_head_its_statistics():
    rng = np.random.default_rng(4)
    L = 2
    off = rng.standard_normal((L, SLOTS, DIM)).astype(np.float32)
    sc = rng.uniform(0.5, 2.0, (L, SLOTS, DIM)).astype(np.float32)
    stats = StreamStatistics({"k": off, "v": -off}, {"k": sc, "v": sc})
    k_spec = ["tq4@center=calib,normalize=calib",
              ("tq4@center=calib,normalize=calib", "tq5@center=calib,normalize=calib",
               "tq4@center=calib,normalize=calib")]
    # V centers only: it takes the offsets and leaves the calibration's scales
    cache = QuantizedKVCache(L, {"k": (k_spec, DIM), "v": ("tq4@center=calib", DIM)},
                             n_kv_heads=SLOTS, statistics=stats)
    assert cache.stream(1, "v", 2).channel_scale is None
    np.testing.assert_array_equal(cache.stream(1, "v", 2).offset, -off[1, 2])
    for layer in range(L):
        for h in range(SLOTS):
            np.testing.assert_array_equal(cache.stream(layer, "k", h).offset, off[layer, h])
            np.testing.assert_array_equal(cache.stream(layer, "k", h).channel_scale,
                                          sc[layer, h])
    assert cache.stream(1, "k", 1).codec.spec == "tq5"
    with pytest.raises(ValueError, match="give them"):
        QuantizedKVCache(L, {"k": (k_spec, DIM), "v": ("tq4", DIM)}, n_kv_heads=SLOTS)


# -- the cache file ------------------------------------------------------------------------------
def _open(path, stats, spec="tq4@center=calib,normalize=calib,sinks=1"):
    return CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)],
                          statistics={"K": stats})


def test_a_kvq_file_records_its_statistics_and_refuses_others(tmp_path):
    rng = np.random.default_rng(5)
    mu, s = numpy_statistics(keys(rng, 200))
    path = str(tmp_path / "c.kvq")
    X = keys(rng, 6)
    cf = _open(path, (mu, s))
    for t in range(len(X)):
        cf.append([t], streams={"K": X[t:t + 1]})
    before = cf.records.decode("K")
    cf.close()
    entry = inspect_file(path)["header"]["streams"][0]
    assert entry["statistics"] == statistics_digest(mu, s)
    assert entry["options"]["calibrated"] is True
    back = _open(path, (mu, s))
    assert len(back.records) == len(X)
    np.testing.assert_array_equal(back.records.decode("K"), before)
    back.close()
    with pytest.raises(CacheFileMismatch, match="calibrated statistics") as exc:
        _open(path, (mu + 0.01, s))
    assert exc.value.reason == "statistics"
    with pytest.raises(CacheFileMismatch):
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, "tq4@center,normalize,sinks=1")])


def test_a_cache_file_needs_the_statistics_its_spec_asks_for(tmp_path):
    with pytest.raises(ValueError, match="reads calibrated statistics"):
        CacheFile.open(str(tmp_path / "c.kvq"),
                       streams=[Stream("K", DIM, SLOTS, "tq4@center=calib")])
    with pytest.raises(ValueError, match="do not say center=calib"):
        CacheFile.open(str(tmp_path / "c.kvq"), streams=[Stream("K", DIM, SLOTS, "tq4")],
                       statistics={"K": (None, None)})
