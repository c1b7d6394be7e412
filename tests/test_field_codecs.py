"""The codecs from the 3-bit literature (kvquant_experiments.codecs), installed through the
``kvquant.codecs`` entry-point group as any package's: the codec contract, numpy references
written without the codecs' code, and the property each technique exists for."""
import math

import numpy as np
import pytest

import kvquant
from kvquant import reference
from kvquant.testing import check_codec

FIELD = ["ds:inner=tq3,k=1", "ds:inner=polar3,k=2,side_dtype=f16", "ds:inner=kv8,k=3",
         "tokmean:inner=tq3", "tokmean:inner=polar2,side_dtype=f16",
         "qjl:inner=tq2,seed=0", "qjl:inner=vq2,seed=5,side_dtype=f16",
         "vq1", "vq2", "vq3", "vq3:side=unbiased,side_dtype=f16", "vq2:side=match", "vq2.5:side=match", "vq1.5",
         "ds:inner=vq2,k=1",
         "chsplit:hi=tq3,lo=tq2,mask=0x5", "chsplit:hi=kv8,lo=polar2,mask=0x5",
         "chsplit:hi=vq3,lo=polar2,mask=0x5,side_dtype=f16"]
# Lloyd-Max MSE per coordinate of N(0, 1), 1..3 bits (docs/reference.md §2; Max 1960)
LLOYD_MAX_MSE = {1: 0.363380, 2: 0.117482, 3: 0.034548}


def rows(n, dim, seed=0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def test_they_are_installed_as_plug_ins():
    names = kvquant.available_codecs()
    for name in ("chsplit", "ds", "tokmean", "qjl", "vq1", "vq1.5", "vq2", "vq2.5", "vq3", "vq3.5",
                 "vq4"):
        assert name in names
    from kvquant.codecs import registry
    assert {"ds", "qjl", "vq3"} <= set(registry._installed())   # from the entry points


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("spec", FIELD)
def test_each_keeps_the_codec_contract(spec, dim):
    if spec.startswith("chsplit"):    # parts of power-of-two widths: dim/2 channels to each
        spec = spec.replace("0x5", hex(int("01" * (dim // 2), 2)))
    codec = kvquant.get_codec(spec, dim)
    check_codec(codec)
    assert codec.compressed_consumers


def top_k_reference(x, k):
    order = sorted(range(len(x)), key=lambda i: (-abs(float(x[i])), i))
    return sorted(order[:k])


@pytest.mark.parametrize("inner,k,dim", [("tq3", 1, 64), ("polar3", 2, 64), ("tq2", 3, 512)])
def test_dense_and_sparse_is_the_inner_codec_on_the_rest_plus_exact_outliers(inner, k, dim):
    X = rows(40, dim)
    X[::3, 5] *= 40.0                                   # a spike in some rows
    codec = kvquant.get_codec(f"ds:inner={inner},k={k}", dim)
    plain = kvquant.get_codec(inner, dim)
    index_bytes = 1 if dim <= 256 else 2
    assert codec.bytes_per_row == plain.bytes_per_row + k * (index_bytes + 2)
    dense = X.copy()
    want = np.zeros_like(X)
    for r in range(len(X)):
        idx = top_k_reference(X[r], k)
        want[r, idx] = X[r, idx].astype(np.float16).astype(np.float32)
        dense[r, idx] = 0.0
    want += plain.roundtrip(dense)
    got = codec.roundtrip(X)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(X).max())
    # the spiky rows: the spike costs the inner codec dearly, ds keeps it
    spiky = X[::3]
    err = lambda Y: np.linalg.norm(Y - spiky) / np.linalg.norm(spiky)
    assert err(codec.roundtrip(spiky)) < 0.5 * err(plain.roundtrip(spiky))


def test_dense_and_sparse_refuses_an_outlier_fp16_cannot_hold():
    X = rows(4, 64)
    X[2, 7] = 1e6
    with pytest.raises(ValueError, match=r"65504.*rows 2\b"):
        kvquant.get_codec("ds:inner=tq3,k=1", 64).encode(X)
    enc = kvquant.get_codec("ds:inner=tq3,k=1", 64, nonfinite="inert").encode(X)
    assert not enc.codes[2].any() and not enc.side[2].any()


def test_token_centring_removes_a_per_token_offset():
    X = rows(64, 64) + np.linspace(-30, 30, 64, dtype=np.float32)[:, None]
    codec = kvquant.get_codec("tokmean:inner=tq3", 64)
    plain = kvquant.get_codec("tq3", 64)
    mean = X.mean(axis=1, dtype=np.float64).astype(np.float32)[:, None]
    np.testing.assert_allclose(codec.roundtrip(X), plain.roundtrip(X - mean) + mean,
                               rtol=0, atol=1e-5)
    err = lambda Y: np.linalg.norm(Y - X) / np.linalg.norm(X)
    assert err(codec.roundtrip(X)) < 0.2 * err(plain.roundtrip(X))
    assert codec.bytes_per_row == plain.bytes_per_row + 4


def test_residual_signs_remove_the_inner_product_shrink():
    """MSE codecs shrink <x, x^> by (1 - D), D the per-coordinate MSE (docs/reference.md §2:
    0.883 at 2 bits); the QJL sketch of the residual is unbiased over its projection."""
    dim, n_seeds = 64, 300
    X = rows(16, dim, seed=3).astype(np.float64)
    plain = kvquant.get_codec("tq2", dim)
    shrink = np.einsum("ij,ij->i", X, plain.roundtrip(X)) / np.einsum("ij,ij->i", X, X)
    assert abs(shrink.mean() - (1 - LLOYD_MAX_MSE[2])) < 0.02
    ratios = np.array([
        np.einsum("ij,ij->i", X, kvquant.get_codec(f"qjl:inner=tq2,seed={s}", dim).roundtrip(X))
        / np.einsum("ij,ij->i", X, X) for s in range(n_seeds)])
    mean = ratios.mean()
    se = ratios.mean(axis=1).std(ddof=1) / math.sqrt(ratios.shape[1])
    assert abs(mean - 1.0) < max(4 * se, 0.01), (mean, se)
    assert ratios.var() > shrink.var()        # unbiased, not free: the sketch adds variance


def test_residual_signs_decode_as_the_estimator_says():
    dim = 64
    X = rows(8, dim, seed=4)
    codec = kvquant.get_codec("qjl:inner=tq2,seed=11", dim)
    inner = kvquant.get_codec("tq2", dim)
    S = np.random.default_rng(11).standard_normal((dim, dim))
    base = inner.roundtrip(X).astype(np.float64)
    residual = X - base
    signs = np.where(residual @ S.T >= 0, 1.0, -1.0)
    want = base + math.sqrt(math.pi / 2) / dim * np.linalg.norm(residual, axis=1)[:, None] * (
        signs @ S)
    np.testing.assert_allclose(codec.roundtrip(X), want, rtol=0, atol=1e-4)
    assert codec.bytes_per_row == inner.bytes_per_row + dim // 8 + 4


def test_half_bits_fill_the_gaps_between_whole_ones():
    """Rate-distortion of a Gaussian: MSE >= 4^-b at any rate, so also at 1.5, 2.5, 3.5 bits;
    each half bit lowers the codebook's MSE."""
    from kvquant_experiments.codecs.vector import pair_codebook
    pairs = np.random.default_rng(98).standard_normal((100_000, 2))
    mses = []
    for bits in (1, 1.5, 2, 2.5, 3):
        C = pair_codebook(bits)
        assert C.shape == (int(2 ** (2 * bits)), 2)
        mses.append(((pairs[:, None, :] - C[None]) ** 2).sum(axis=2).min(axis=1).mean() / 2)
        assert mses[-1] > 4.0 ** -bits
    assert all(a > 1.5 * b for a, b in zip(mses, mses[1:]))
    codec = kvquant.get_codec("vq2.5", 64)
    assert codec.bytes_per_row == 64 * 5 // 2 // 8 + 4 and codec.spec == "vq2.5"


@pytest.mark.parametrize("bits", [1.5, 3])
def test_the_stored_pair_codebooks_are_what_the_fit_gives(bits):
    """The codebooks vq reads from its package data equal a fresh fit (k-means on the fixed
    Gaussian sample), so the stored file can neither drift from the code nor be stale."""
    from kvquant_experiments.codecs.vector import BITS, _stored_codebooks, fit_pair_codebook
    from kvquant_experiments.codecs.vector import pair_codebook
    assert sorted(map(float, _stored_codebooks()["codebooks"])) == sorted(BITS)
    np.testing.assert_allclose(pair_codebook(bits), fit_pair_codebook(bits), rtol=0, atol=1e-12)
    assert not pair_codebook(bits).flags.writeable


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_the_pair_codebook_beats_scalar_lloyd_max_and_respects_the_bound(bits):
    from kvquant_experiments.codecs.vector import pair_codebook
    C = pair_codebook(bits)
    assert C.shape == (4 ** bits, 2)
    pairs = np.random.default_rng(99).standard_normal((200_000, 2))   # not the fitting sample
    d2 = ((pairs[:, None, :] - C[None]) ** 2).sum(axis=2).min(axis=1)
    mse = d2.mean() / 2
    assert 4.0 ** -bits < mse < 1.01 * LLOYD_MAX_MSE[bits]   # 1%: the sample's noise
    if bits > 1:   # at 1 bit the best 2-D code is the scalar one (four sign quadrants)
        assert mse < 0.95 * LLOYD_MAX_MSE[bits]


@pytest.mark.parametrize("spec,dim", [("vq2", 64), ("vq3", 32), ("vq3:side=unbiased", 64),
                                      ("vq2:side=match", 64)])
def test_vq_against_a_numpy_reference(spec, dim):
    from kvquant_experiments.codecs.vector import pair_codebook
    codec = kvquant.get_codec(spec, dim)
    C = pair_codebook(codec.bits)
    X = rows(30, dim, seed=8)
    X[4] = 0.0
    norm = np.linalg.norm(X.astype(np.float64), axis=1)
    Y = reference.rotate(X).astype(np.float64) * (math.sqrt(dim) / np.where(norm > 0, norm, 1))[
        :, None]
    pairs = Y.reshape(-1, 2)
    codes = ((pairs[:, None, :] - C[None]) ** 2).sum(axis=2).argmin(axis=1).reshape(len(X), -1)
    unit = C[codes].reshape(len(X), dim)
    radius = norm
    if "unbiased" in spec:
        radius = np.where(norm > 0, norm * dim / np.maximum((Y * unit).sum(axis=1), 1e-30), 0)
    if "match" in spec:
        radius = np.where(norm > 0, norm * math.sqrt(dim) / np.linalg.norm(unit, axis=1), 0)
    want = reference.unrotate((unit * (radius / math.sqrt(dim))[:, None]).astype(np.float32))
    enc = codec.encode(X)
    assert enc.codes.shape[1] == dim * codec.bits // 8
    np.testing.assert_allclose(enc.side[:, 0], radius, rtol=1e-5)
    np.testing.assert_allclose(codec.decode(enc), want, rtol=0, atol=2e-5 * np.abs(X).max())
    if "unbiased" in spec:
        live = norm > 0
        dots = np.einsum("ij,ij->i", X, codec.decode(enc))[live] / norm[live] ** 2
        np.testing.assert_allclose(dots, 1.0, atol=1e-4)
    if "match" in spec:      # the token's scale kept exactly
        np.testing.assert_allclose(np.linalg.norm(codec.decode(enc), axis=1), norm, rtol=1e-5)


def test_bad_options_are_named():
    for spec, words in [("ds:inner=tq3:side_dtype=f16", "bare codec spec"),
                        ("ds:k=64", "k=64"), ("vq5", "unknown codec"),
                        ("vq3:side=norms", "side='norms'"), ("tokmean:inner=nope", "nope")]:
        with pytest.raises(ValueError, match=words):
            kvquant.get_codec(spec, 64)
    with pytest.raises(ValueError, match="power-of-two"):
        kvquant.get_codec("vq3", 96)


def test_plug_ins_run_in_a_models_cache_on_spawned_workers():
    from kvquant_experiments.flip_runs import run_flips
    args = dict(codecs=["vq3/ds:inner=tq3,k=1", "tokmean:inner=tq3@center"], n_prompts=1)
    here = run_flips("tiny-mla", workers=1, scheduler="serial", **args)["rows"]
    spawned = run_flips("tiny-mla", workers=2, **args)["rows"]
    keys = ("codec", "tf", "greedy", "tf_kld_mean", "bytes_per_token", "decoded_streams")
    assert [{k: r[k] for k in keys} for r in spawned] == [{k: r[k] for k in keys} for r in here]
    assert all(r["tf_kld_mean"] > 0 and r["decoded_streams"] == [] for r in here[1:])


def test_channel_split_is_each_part_through_its_codec():
    dim = 64
    X = rows(20, dim, seed=6)
    hi_channels = np.array(sorted(np.random.default_rng(2).choice(dim, 32, replace=False)))
    mask = sum(1 << int(i) for i in hi_channels)
    codec = kvquant.get_codec(f"chsplit:hi=tq3,lo=polar2,mask={mask:#x}", dim)
    lo_channels = np.setdiff1d(np.arange(dim), hi_channels)
    want = np.empty_like(X)
    want[:, hi_channels] = kvquant.get_codec("tq3", 32).roundtrip(X[:, hi_channels])
    want[:, lo_channels] = kvquant.get_codec("polar2", 32).roundtrip(X[:, lo_channels])
    np.testing.assert_array_equal(codec.roundtrip(X), want)
    assert codec.bytes_per_row == (kvquant.get_codec("tq3", 32).bytes_per_row
                                   + kvquant.get_codec("polar2", 32).bytes_per_row)
    for bad, words in [("0x0", "one part empty"), (hex(1 << 64), "outside 0..63"),
                       ("0x7", "3 \\(hi=tq3\\) and 61"), ("zz", "not an integer")]:
        with pytest.raises(ValueError, match=words):
            kvquant.get_codec(f"chsplit:hi=tq3,lo=tq2,mask={bad}", dim)


def test_a_channel_split_plan_sends_the_widest_channels_high(tmp_path, capsys):
    from kvquant.models.plan import CachePlan
    from kvquant.streams.calibration import StreamStatistics
    from kvquant_experiments.codecs.channel_split import main
    rng = np.random.default_rng(0)
    scales = rng.uniform(0.5, 2.0, (3, 2, 64)).astype(np.float32)
    stats = StreamStatistics({}, {"k": scales, "v": scales})
    stats.save(tmp_path / "cal.npz")
    out = tmp_path / "plan.json"
    main(["plan", "--calibration", str(tmp_path / "cal.npz"), "--out", str(out),
          "--k", "chsplit:hi=tq3,lo=tq2,mask={mask}@center,normalize", "--v", "tq2@center"])
    plan = CachePlan.load(str(out))
    for layer in range(3):
        k_specs, v_spec = plan.layers[layer]
        assert v_spec == "tq2@center"
        for head in range(2):
            codec_spec = k_specs[head].split("@")[0]
            top = sorted(range(64), key=lambda c: -scales[layer, head, c])[:32]
            want = sum(1 << c for c in top)
            assert codec_spec == f"chsplit:hi=tq3,lo=tq2,mask={want:#x}"
    assert abs(plan.bits_per_value(64) - (3.5 + 2.5) / 2) < 1e-9
    before = out.read_text()
    capsys.readouterr()
    assert main(["plan", "--calibration", str(tmp_path / "cal.npz"), "--out", str(out),
                 "--k", "x{mask}", "--v", "tq2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("channel_split: --out ") and "exists" in err and err.count("\n") == 1
    assert out.read_text() == before      # a plan is never overwritten


@pytest.mark.parametrize("width", range(1, 9))
def test_code_packing_round_trips_at_every_width(width):
    from kvquant_experiments.codecs._layers import pack_codes, unpack_codes
    rng = np.random.default_rng(width)
    for k in (4, 12, 32, 33):
        codes = rng.integers(0, 1 << width, (5, k))
        packed = pack_codes(codes, width)
        assert packed.shape == (5, -(-k * width // 8))
        # bit j of the row is bit (j % width) of code j // width, LSB first
        bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :k * width]
        want = (codes[:, :, None] >> np.arange(width)) & 1
        assert np.array_equal(bits.reshape(5, k, width), want)
        assert np.array_equal(unpack_codes(packed, k, width), codes)
