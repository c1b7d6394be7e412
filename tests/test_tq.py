"""The rotated Lloyd-Max codec tq<b>: engine compatibility, theory, references, bad input."""
import numpy as np
import pytest

from kvquant import get_codec, reference
from kvquant.codebooks import load_codebook
from kvquant.codecs.lloyd import engine_tq4_levels
from kvquant.metrics import relative_l2

from conftest import gaussian_rows


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_engine_compat_is_bit_exact(rng, d):
    X = gaussian_rows(rng, 2000, d) * rng.uniform(0.001, 1000, (2000, 1)).astype(np.float32)
    X[3] = 0
    codec = get_codec("tq4:compat=colibri", d)
    enc = codec.encode(X)
    ref_codes, ref_radius = reference.engine_tq4_encode_rows(X, engine_tq4_levels())
    assert np.array_equal(enc.codes, ref_codes)
    assert np.array_equal(enc.side[:, 0], ref_radius)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_engine_compat_distortion(rng, d):
    X = gaussian_rows(rng, 2000, d)
    compat = relative_l2(X, get_codec("tq4:compat=colibri", d).roundtrip(X)).mean()
    ours = relative_l2(X, get_codec("tq4", d).roundtrip(X)).mean()
    assert 0.094 <= compat <= 0.098          # docs/reference.md §1.3: ~0.096
    assert ours <= compat * 1.002            # the exact-dimension fit is no worse


@pytest.mark.parametrize("d", [64, 128, 512])
@pytest.mark.parametrize("bits", range(1, 9))
def test_mse_matches_codebook_theory(rng, d, bits):
    X = gaussian_rows(rng, 8192 if d == 64 else 4096, d)
    codec = get_codec(f"tq{bits}", d)
    X_hat = codec.roundtrip(X)
    # Relative squared error per row equals the per-coordinate MSE of the unit-variance coordinate.
    rel_mse = (((X_hat - X) ** 2).sum(axis=1) / (X.astype(np.float64) ** 2).sum(axis=1)).mean()
    theory = load_codebook("beta", d, bits).mse
    assert rel_mse == pytest.approx(theory, rel=0.02)


def test_bytes_per_row(rng):
    for bits in range(1, 9):
        for d in (64, 128, 512):
            codec = get_codec(f"tq{bits}", d)
            assert codec.bytes_per_row == (d * bits + 7) // 8 + 4
            assert codec.encode(gaussian_rows(rng, 3, d)).codes.shape == (3, (d * bits + 7) // 8)
    assert get_codec("tq4:compat=colibri", 512).bytes_per_row == 256 + 4


@pytest.mark.parametrize("bits", [1, 3, 4, 6])
def test_codes_and_decode_match_numpy_reference(rng, bits):
    d = 128
    X = gaussian_rows(rng, 300, d)
    codec = get_codec(f"tq{bits}", d)
    enc = codec.encode(X)
    ref_packed, ref_side = reference.tq_encode_rows(X, codec.levels64, bits)
    ours = reference.unpack_bits(enc.codes, d, bits)
    theirs = reference.unpack_bits(ref_packed, d, bits)
    # float32 vs float64 arithmetic may move a coordinate lying within rounding of a boundary
    assert (ours != theirs).mean() < 1e-4
    assert np.allclose(enc.side[:, 0], ref_side, rtol=1e-6)
    ref_decoded = reference.tq_decode_rows(enc.codes, enc.side[:, 0], codec.levels64, bits, d)
    assert np.allclose(codec.decode(enc), ref_decoded, rtol=0, atol=1e-5 * np.abs(X).max())


@pytest.mark.parametrize("bits, shrink", [(2, 0.883), (3, 0.966), (4, 0.990)])
def test_unbiased_side_removes_inner_product_shrink(rng, bits, shrink):
    d = 256
    X = gaussian_rows(rng, 4000, d)
    Q = gaussian_rows(rng, 4000, d)
    exact = (X * Q).sum(axis=1)

    def slope(spec):
        approx = (get_codec(spec, d).roundtrip(X) * Q).sum(axis=1)
        return float((approx * exact).sum() / (exact * exact).sum())

    assert slope(f"tq{bits}") == pytest.approx(shrink, abs=0.01)        # docs/reference.md §2
    assert slope(f"tq{bits}:side=unbiased") == pytest.approx(1.0, abs=0.01)


def test_gaussian_codebook_option(rng):
    codec = get_codec("tq3:codebook=gaussian", 64)
    assert codec.spec == "tq3:codebook=gaussian"
    assert np.allclose(codec.levels64, load_codebook("gaussian", 64, 3).levels)
    assert codec.codebook_identity != get_codec("tq3", 64).codebook_identity


def test_seed_changes_rotation_and_roundtrips(rng):
    X = gaussian_rows(rng, 50, 64)
    a, b = get_codec("tq4", 64), get_codec("tq4:seed=0x1234", 64)
    assert b.spec == "tq4:seed=0x1234" and b.seed == 0x1234
    assert not np.array_equal(a.encode(X).codes, b.encode(X).codes)
    assert relative_l2(X, b.roundtrip(X)).mean() < 0.1


def test_thread_count_invariance(rng):
    X = gaussian_rows(rng, 3001, 512)
    for spec in ("tq4", "tq3:side=unbiased", "tq4:compat=colibri", "tq7"):
        codec = get_codec(spec, 512)
        a, b = codec.encode(X, n_threads=1), codec.encode(X, n_threads=2)
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.side, b.side)
        assert np.array_equal(codec.decode(a, n_threads=1), codec.decode(a, n_threads=2))


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [48, 100, 1, 3])
def test_non_power_of_two_width(d):
    with pytest.raises(ValueError, match=rf"width.*{d}.*kv8"):
        get_codec("tq4", d)


@pytest.mark.parametrize("spec", ["tq0", "tq9", "tq12"])
def test_bits_out_of_range(spec):
    with pytest.raises(ValueError, match=r"1\.\.8"):
        get_codec(spec, 64)


def test_nonfinite_rows_are_named(rng):
    X = gaussian_rows(rng, 10, 64)
    X[4, 7] = np.nan
    X[8, 0] = -np.inf
    codec = get_codec("tq4", 64)
    with pytest.raises(ValueError, match=r"rows 4, 8"):
        codec.encode(X)
    inert = get_codec("tq4", 64, nonfinite="inert").encode(X)
    assert np.all(inert.codes[[4, 8]] == 0) and np.all(inert.side[[4, 8]] == 0)
    decoded = get_codec("tq4", 64, nonfinite="inert").decode(inert)
    assert np.all(decoded[[4, 8]] == 0) and np.all(np.isfinite(decoded))


def test_zero_rows_and_empty_input():
    codec = get_codec("tq4", 64)
    enc = codec.encode(np.zeros((3, 64), np.float32))
    assert np.all(enc.side == 0) and np.all(codec.decode(enc) == 0)
    empty = codec.encode(np.zeros((0, 64), np.float32))
    assert empty.codes.shape == (0, 32) and codec.decode(empty).shape == (0, 64)


def test_float64_and_non_contiguous_input(rng):
    X = gaussian_rows(rng, 40, 128, dtype=np.float64)
    codec = get_codec("tq4", 128)
    base = codec.encode(X.astype(np.float32))
    assert np.array_equal(codec.encode(X).codes, base.codes)
    wide = np.zeros((40, 256), np.float32)
    wide[:, ::2] = X
    assert np.array_equal(codec.encode(wide[:, ::2]).codes, base.codes)
    assert np.array_equal(codec.encode(np.asfortranarray(X)).codes, base.codes)


@pytest.mark.parametrize("bad, err", [
    (np.zeros(64, np.float32), r"2-D.*X\[None, :\]"),
    (np.zeros((2, 2, 64), np.float32), r"2-D"),
    (np.zeros((2, 32), np.float32), r"width 64.*width 32"),
    (np.zeros((2, 64), np.int32), r"floating point"),
])
def test_wrong_shapes_and_dtypes(bad, err):
    with pytest.raises((ValueError, TypeError), match=err):
        get_codec("tq4", 64).encode(bad)


def test_decode_refuses_rows_of_another_codec(rng):
    enc = get_codec("tq3", 64).encode(gaussian_rows(rng, 2, 64))
    with pytest.raises(ValueError, match=r"encoded by 'tq3'"):
        get_codec("tq4", 64).decode(enc)


def test_compat_rejects_other_options():
    with pytest.raises(ValueError, match="compat"):
        get_codec("tq3:compat=colibri", 64)
    with pytest.raises(ValueError, match="compat"):
        get_codec("tq4:compat=colibri,side=unbiased", 64)
