"""The rotated Lloyd-Max codec tq<b>: engine compatibility, theory, references, bad input."""
import numpy as np
import pytest

from kvquant import get_codec, reference
from kvquant._kernels import _build_info, lloyd as lloyd_kernels
from kvquant.codebooks import load_codebook
from kvquant.codecs.lloyd import engine_tq4_levels
from kvquant.metrics import relative_l2

from conftest import gaussian_rows
from _simd import PATHS as SIMD_PATHS


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


# -- the nearest-level rule: counted compares (<= 31 boundaries) and bucket tables above ----------

def _adversarial_values(rng, bnd):
    """Every boundary, its float neighbours, both zeros, NaN, infinities, huge and tiny values,
    and Gaussian draws: the ties and the bucket edges where a table could go wrong."""
    b = bnd.astype(np.float32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, -1e-45],
                       np.float32)
    vals = [b, np.nextafter(b, np.float32(np.inf)), np.nextafter(b, np.float32(-np.inf)),
            special, rng.standard_normal(20000).astype(np.float32) * np.float32(2),
            rng.uniform(b[0] - 1, b[-1] + 1, 20000).astype(np.float32)]
    return np.concatenate(vals)


def _boundary_sets(rng):
    """The codecs' own boundaries (both codebooks, narrow and wide rows), plus sets a table
    finds hard: ties (repeated boundaries), a +-0 boundary, a dense cluster beside wide gaps."""
    sets = []
    for bits in range(1, 9):
        for d in (2, 64, 4096):
            for cb in ("beta", "gaussian"):
                sets.append(get_codec(f"tq{bits}:codebook={cb}", d).boundaries)
    sets.append(np.sort(np.concatenate([np.linspace(-1, 1, 40), [0.0, 0.0, 0.5, 0.5, 0.5]])))
    sets.append(np.sort(np.concatenate([rng.uniform(0, 1e-3, 200), [-50.0, 50.0]])))
    sets.append(np.sort(rng.standard_normal(255)))
    sets.append(np.array([-0.0] + list(np.linspace(1e-7, 1, 30))))
    return [np.ascontiguousarray(s, dtype=np.float32) for s in sets]


def test_nearest_code_is_the_count_of_boundaries_below(rng):
    """code = #{boundaries < y} (ties go down, NaN -> 0) by every path (the vector search tree,
    counted compares, the bucket table), against searchsorted."""
    tree_ran = []
    for bnd in _boundary_sets(rng):
        y = _adversarial_values(rng, bnd)
        table = lloyd_kernels.code_table(bnd)
        expect = np.searchsorted(bnd, y, side="left")
        expect[np.isnan(y)] = 0
        for search_tree in (True, False):
            out = np.empty(y.size, np.uint8)
            ran = lloyd_kernels.nearest_codes(y, bnd, table, out, search_tree)
            if search_tree:
                tree_ran.append(ran)
            assert np.array_equal(out, expect), (bnd.size, search_tree,
                                                 np.flatnonzero(out != expect)[:5])
    # the tree runs for 16 to 255 boundaries wherever AVX-512 is and the build has it (GCC on
    # x86-64): so it was checked above
    if "avx512" in SIMD_PATHS and _build_info.encoder_search_tree():
        assert any(tree_ran)


def test_code_table_is_small_for_the_codecs():
    """One boundary per bucket (window 1) in at most 4096 buckets for every stored codebook."""
    for bits in range(5, 9):
        for d in (2, 4, 64, 128, 4096):
            table = get_codec(f"tq{bits}", d).code_table
            n_buckets, window = int(table[2]), int(table[3])
            assert window == 1 and n_buckets <= 4096 and table.size == 4 + 2 * n_buckets


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096])
def test_codes_match_a_float32_replica_of_the_encoder(rng, bits, d):
    """Bit for bit against numpy doing the encoder's float32 steps (norm in double, rotation,
    x 1/sqrt(n) then x sqrt(n)/norm, #{boundaries < y}, LSB-first packing), at every width."""
    rows = 40 if d >= 1024 else 200
    X = gaussian_rows(rng, rows, d) * rng.uniform(1e-3, 1e3, (rows, 1)).astype(np.float32)
    X[0] = 0
    X[1, 0] = np.nan
    codec = get_codec(f"tq{bits}", d, nonfinite="inert")
    enc = codec.encode(X)
    norm = np.sqrt((X.astype(np.float64) ** 2).sum(axis=1))
    radius = norm.astype(np.float32)
    live = (radius > np.float32(1e-35)) & (radius <= np.float32(3.4e38))
    sqrt_n = np.sqrt(np.float32(d), dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        Y = codec.rotation.rotate(X)                           # checked bit-exact in test_rotation
        to_unit = (sqrt_n / radius).astype(np.float32)
        Y = (Y * to_unit[:, None]).astype(np.float32)
    codes = np.searchsorted(codec.boundaries, Y, side="left").astype(np.uint8)
    codes[~live] = 0
    assert np.array_equal(reference.unpack_bits(enc.codes, d, bits), codes)
    assert np.array_equal(enc.side[:, 0], np.where(live, radius, np.float32(0)))


@pytest.mark.parametrize("spec", ["tq3", "tq5", "tq6", "tq8", "tq7:side=unbiased"])
def test_many_rows_equal_one_row_at_a_time(rng, spec):
    X = gaussian_rows(rng, 700, 128)
    codec = get_codec(spec, 128)
    batch = codec.encode(X)
    for i in (0, 1, 350, 699):
        one = codec.encode(X[i:i + 1])
        assert np.array_equal(one.codes[0], batch.codes[i])
        assert np.array_equal(one.side[0], batch.side[i])


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
