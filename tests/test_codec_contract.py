"""The codec contract (kvquant.testing.check_codec) on every built-in codec, on a codec written
as a user would write one and registered through the public API, and its failures on codecs
that break it; the registry's name rules and its entry-point group."""
from importlib.metadata import EntryPoint

import numpy as np
import pytest

import kvquant
from kvquant.codecs import registry
from kvquant.testing import check_codec

from _notebook_codec import NOTEBOOK_CELL
from _toy_codec import SignCodec, factory as toy_factory

# Every family, bit width and option that changes what the kernels do. This one contract test
# replaces the per-family thread-invariance tests (test_tq, test_fp8, test_polar, test_ggml,
# test_ggml_more each had one, with small inputs that could leave a second thread idle).
BUILTIN = (["f32", "kv8", "kv8-g16", "kv8-g32", "tq4:compat=colibri", "tq3:side=unbiased",
            "tq3:codebook=gaussian,side=unbiased", "tq4:side_dtype=f16",
            "polar4:compat=colibri", "polar5:compat=colibri", "polar5:alloc=level",
            "polar5:alloc=radius", "polar3:side_dtype=f16"]
           + [f"tq{b}" for b in range(1, 9)] + [f"polar{b}" for b in range(2, 7)]
           + [k + r for k in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
              for r in ("", "+rot")])


@pytest.mark.parametrize("dim", [64, 128, 512])
@pytest.mark.parametrize("spec", BUILTIN)
def test_every_builtin_codec_keeps_the_contract(spec, dim):
    check_codec(kvquant.get_codec(spec, dim))


@pytest.mark.parametrize("spec", ["f32", "kv8", "q8_0", "q4_0"])
def test_codecs_of_any_width_keep_it_at_odd_widths(spec):
    check_codec(kvquant.get_codec(spec, 96))


@pytest.fixture
def toysign():
    kvquant.register_codec("toysign", toy_factory)
    yield
    kvquant.unregister_codec("toysign")


def test_a_registered_codec_runs_where_the_builtins_run(toysign):
    assert "toysign" in kvquant.available_codecs()
    for spec in ("toysign", "toysign:scale=rms"):
        codec = kvquant.get_codec(spec, 64)
        assert isinstance(codec, SignCodec) and codec.bytes_per_row == 8 + 4
        check_codec(codec)
    # in a model's cache, as a stream spec with options, beside the built-ins
    from kvquant import flips
    from kvquant.models import load_model
    model = load_model("tiny-mla")
    prompts = flips.protocol_prompts("tiny-mla", None, 1)
    rows = flips.flip_protocol(model, ["f32", "toysign/kv8", "toysign@center"], prompts,
                               flips.NEW_TOKENS)["rows"]
    f32, pair, centered = rows
    assert pair["streams"] == {"L": "toysign", "R": "kv8"}
    assert 0 < pair["bytes_per_token"] < f32["bytes_per_token"]
    assert centered["tf"]["n"] == f32["tf"]["n"]
    # it has no compressed-domain consumer: attention reads its rows decoded, and rows say so
    assert not codec.compressed_consumers and kvquant.get_codec("tq4", 64).compressed_consumers
    assert [r["decoded_streams"] for r in rows] == [[], ["L"], ["L", "R"]]
    from kvquant_experiments.flip_tables import format_markdown
    table = format_markdown({"meta": {"model": {"model": "tiny-mla", "attention": "consumers"},
                                      "protocol": {"prompts": 1, "prompt_tokens": 8,
                                                   "new_tokens": 8}},
                             "rows": rows}, llama=False)
    assert "Read as decoded rows" in table and "toysign/kv8 (L)" in table


def test_the_check_catches_each_broken_promise():
    class WrongSize(SignCodec):
        def __init__(self, dim, **kw):
            super().__init__(dim, **kw)
            self.code_bytes += 1                        # claims a byte it never writes

    class GlobalScale(SignCodec):                       # a row's bytes depend on the others
        def _encode(self, X, n_threads):
            codes, side, status = super()._encode(X, n_threads)
            return codes, np.full_like(side, np.abs(X).max()), status

    class Float64Decode(SignCodec):
        def _decode(self, codes, side, n_threads):
            return super()._decode(codes, side, n_threads).astype(np.float64)

    class BadScores(SignCodec):                         # a consumer that drifts from decode
        def _scores(self, codes, side, Q, out, n_threads):
            X = self._decode(codes, side, n_threads)
            np.matmul(X, Q.T, out=out.T)
            out += 0.1

    class ThreadDependent(SignCodec):                   # a scale summed in per-thread order
        def _encode(self, X, n_threads):
            codes, side, status = super()._encode(X, n_threads)
            return codes, side * np.float32(1 + 1e-6 * (n_threads - 1)), status

    for cls, message in ((WrongSize, "code_bytes"), (GlobalScale, "encoded alone"),
                         (Float64Decode, "expected float32"), (BadScores, "scores"),
                         (ThreadDependent, "encode with 2 threads")):
        with pytest.raises(AssertionError, match=message):
            check_codec(cls(64), rebuild=False)
    with pytest.raises(AssertionError, match="get_codec"):
        check_codec(SignCodec(64))                      # never registered: its spec names nothing


def test_names_are_checked(toysign):
    for name in ("tq4", "polar3", "kv8-g32", "q4_0+rot", "f32"):
        with pytest.raises(ValueError, match="built-in"):
            kvquant.register_codec(name, toy_factory)
    for name in ("Bad", "a:b", "a/b", "a@b", "a,b", "", "1x"):
        with pytest.raises(ValueError, match="codec name"):
            kvquant.register_codec(name, toy_factory)
    with pytest.raises(ValueError, match="registered already"):
        kvquant.register_codec("toysign", toy_factory)
    kvquant.register_codec("toysign", toy_factory, replace=True)
    with pytest.raises(ValueError, match="must be callable"):
        kvquant.register_codec("other", "not a function")


def test_a_factory_that_returns_no_codec_is_named():
    kvquant.register_codec("notacodec", lambda dim, **kw: object())
    try:
        with pytest.raises(ValueError, match="not a kvquant Codec"):
            kvquant.get_codec("notacodec", 64)
        with pytest.raises(ValueError, match="refuses its options"):
            kvquant.register_codec("strict", lambda dim: SignCodec(dim), replace=True)
            kvquant.get_codec("strict:level=3", 64)
    finally:
        kvquant.unregister_codec("notacodec")
        kvquant.unregister_codec("strict")


def test_installed_codecs_come_from_the_entry_point_group(monkeypatch):
    """A package declaring ``[project.entry-points."kvquant.codecs"] epsign = "mod:factory"``:
    found by name in any process, listed, and a broken one is a named error."""
    eps = {"epsign": EntryPoint("epsign", "_toy_codec:factory", registry.ENTRY_POINT_GROUP),
           "broken": EntryPoint("broken", "no_such_module_here:factory",
                                registry.ENTRY_POINT_GROUP)}
    monkeypatch.setattr(registry, "_entry_points", eps)
    monkeypatch.setattr(registry, "_registered", {})
    assert {"epsign", "broken"} <= set(kvquant.available_codecs())
    codec = kvquant.get_codec("epsign", 32)
    assert isinstance(codec, SignCodec)
    with pytest.raises(ValueError, match="entry point 'no_such_module_here:factory'.*fails"):
        kvquant.get_codec("broken", 32)
    with pytest.raises(ValueError, match="unknown codec spec 'absent'.*epsign"):
        kvquant.get_codec("absent", 32)


# A codec as a notebook cell defines it (tests/_notebook_codec.py): its class lives in
# __main__, which worker processes cannot import; executors carry it to them by value.
def test_a_codec_from_a_notebook_cell_runs_in_worker_processes_and_on_dask(tmp_path):
    from kvquant_experiments.executor import open_executor
    from kvquant_experiments.flip_runs import run_flips
    exec(compile(NOTEBOOK_CELL, "<cell>", "exec"), {"__name__": "__main__"})
    try:
        args = dict(codecs=["halfsign/kv8", "halfsign@center"], n_prompts=1)
        here = run_flips("tiny-mla", workers=1, scheduler="serial", **args)["rows"]
        spawned = run_flips("tiny-mla", workers=2, **args)["rows"]
        keys = ("codec", "tf", "greedy", "tf_kld_mean", "bytes_per_token", "decoded_streams")
        assert [{k: r[k] for k in keys} for r in spawned] == [{k: r[k] for k in keys}
                                                             for r in here]
        assert here[1]["tf_kld_mean"] > 0 and here[1]["decoded_streams"] == ["L"]
        distributed = pytest.importorskip("distributed")
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                      protocol="tcp", host="127.0.0.1",
                                      dashboard_address=None) as cluster:
            with open_executor(cluster.scheduler_address) as ex:
                from kvquant_experiments.distortion import distortion_cell
                cell = {"kind": "gaussian", "dim": 64, "rows": 32, "seed": 1,
                        "codec": "halfsign"}
                remote = ex.submit(distortion_cell, cell).result()
        assert remote == distortion_cell(cell) and remote["available"]
        # and in a cache file (the .kvq tier records it by its spec), read back bit for bit
        from _kvfile_data import SHAPE, make_rows
        from kvquant.kvfile import CacheFile
        rows = make_rows(np.random.default_rng(5), 6, mode="halfsign")
        cf = CacheFile.open(tmp_path / "cache", SHAPE, mode="halfsign")
        cf.append(rows["tokens"], L=rows["L"], R=rows["R"], index=rows["index"])
        cf.close()
        back = CacheFile.open(tmp_path / "cache", SHAPE, mode="halfsign")
        assert back.tier == "kvq" and len(back) == 6
        for layer in range(SHAPE.n_layers):
            got = back.records.rows("L", layer)
            assert np.array_equal(got.codes, rows["L"][layer].codes)
            assert np.array_equal(got.side, rows["L"][layer].side)
    finally:
        kvquant.unregister_codec("halfsign")
