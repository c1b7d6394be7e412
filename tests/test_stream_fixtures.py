"""The committed stream fixtures (data/streams/, written by tools/make_stream_fixtures.py):
cache files of every tier written again byte for byte, read back, and a quantized cache's
outputs bit for bit. They pin the stream state machine against any change of layout."""
import os

import numpy as np
import pytest

import kvquant_experiments.stream_fixtures as fx
from kvquant.kvfile import CacheFile

ALL_FILES = list(fx.FILE_RECIPES) + list(fx.UPGRADE_RECIPES)


def _fixture(name):
    path = os.path.join(fx.FIXTURES, name)
    assert os.path.exists(path), f"missing fixture {path}: run tools/make_stream_fixtures.py"
    return path


@pytest.mark.parametrize("name", ALL_FILES)
def test_file_written_again_is_byte_identical(tmp_path, name):
    path = tmp_path / name
    fx.write_file(name, str(path))
    with open(_fixture(name), "rb") as f:
        expected = f.read()
    assert path.read_bytes() == expected


def _open(name, path, **kw):
    setup = (fx.UPGRADE_RECIPES[name][1] if name in fx.UPGRADE_RECIPES
             else fx.FILE_RECIPES[name][0])
    if "streams" in setup:
        return CacheFile.open(path, streams=setup["streams"], vocab=256,
                              statistics=setup.get("statistics"), **kw)
    return CacheFile.open(path, fx.SHAPE, **{k: v for k, v in setup.items()}, **kw)


@pytest.mark.parametrize("name", ALL_FILES)
def test_fixture_reads_back_as_written(tmp_path, name):
    """Opening a fixture loads what the writer held in memory: tokens, rows as the model sees
    them, the stream state."""
    written = tmp_path / name
    fx.write_file(name, str(written))
    # the writer's records, as a reopened file of the same bytes and as the fixture
    ref = _open(name, str(written), readonly=True)
    got = _open(name, _fixture(name), readonly=True)
    assert got.report.status == "loaded" and got.report.events[-1].kind == "loaded"
    assert len(got) == len(ref) > 0
    np.testing.assert_array_equal(got.records.tokens, ref.records.tokens)
    for s in got.streams:
        a, b = got.records.decode(s.name, n_threads=1), ref.records.decode(s.name, n_threads=1)
        assert a.shape == (len(got), s.rows, s.dim)
        assert np.array_equal(a, b)
        assert got.records.window_start(s.name) == ref.records.window_start(s.name)
        for j in range(s.rows):
            st = got.records.row_stream(s.name, j)
            assert len(st) == len(got)
            assert np.array_equal(st.decode(n_threads=1), a[:, j])
    got.close()
    ref.close()


def test_cache_outputs_are_bit_identical():
    """What the compiled kernels compute alone is bit-identical to the fixture: every stream's
    decode, and the plain label's (no f32 rows) scores, contexts and decode steps. A prefill's
    decoded blocks and the f32 sink and recent rows of the other labels go through numpy's BLAS,
    whose rounding depends on the kernel OpenBLAS picks for the CPU (its Haswell, Sandybridge
    and Nehalem kernels moved them by up to 2e-7 of their largest value): those outputs agree
    to float32 rounding."""
    with np.load(_fixture(fx.CACHE_FIXTURE)) as data:
        expected = {k: data[k] for k in data.files}
    got = fx.cache_outputs()
    assert sorted(got) == sorted(expected)
    for key, value in got.items():
        assert value.dtype == expected[key].dtype, key
        last = key.rsplit("/", 1)[-1]
        kernels_alone = last in ("decode", "nbytes") or (key.startswith("plain/")
                                                         and not last.startswith("prefill"))
        if not kernels_alone:
            scale = float(np.abs(expected[key]).max())
            np.testing.assert_allclose(value, expected[key], rtol=0, atol=2e-6 * scale,
                                       err_msg=key)
        else:
            assert np.array_equal(value, expected[key]), key
