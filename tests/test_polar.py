"""PolarQuant polar<b>: engine compatibility, Lloyd codebooks and allocation, references, bad
input."""
import ctypes
import ctypes.util
import json
import math

import numpy as np
import pytest
from scipy import integrate

from kvquant import get_codec, reference
from kvquant._kernels import polar as polar_kernels
from kvquant.codebooks import polar_angle_density
from kvquant.codecs.polar import (DEFAULT_PATH, PolarCodebookError, engine_grid_centres,
                                  fit_polar_codebooks, load_polar_codebooks)
from kvquant.metrics import relative_l2
from kvquant.rotation import ENGINE_SEED

from conftest import gaussian_rows

ENGINE_RELL2 = {2: 0.57, 3: 0.29, 4: 0.147, 5: 0.074, 6: 0.037}   # docs/reference.md §1.4
VARIANTS = ("compat=colibri", "alloc=level", "alloc=radius")


def polar(bits, variant, d, **kw):
    return get_codec(f"polar{bits}:{variant}", d, **kw)


def padded_centroids(codec):
    cb = codec.codebooks
    out = np.zeros(cb.centroids.shape)
    for level in range(1, cb.n_levels + 1):
        for bits, c in enumerate(cb.centroids64[level]):
            out[level, bits, :c.size] = c
    return out


# -- sizes and specs -----------------------------------------------------------------------------

@pytest.mark.parametrize("d, bits, row_bytes", [(512, 4, 224), (512, 3, 160), (64, 4, 28),
                                                (64, 3, 20), (32, 4, 14), (8, 4, 4)])
def test_row_bytes_are_the_engine_formula(d, bits, row_bytes):
    for variant in VARIANTS:
        codec = polar(bits, variant, d)
        assert codec.code_bytes == row_bytes
        assert codec.bytes_per_row == row_bytes + 4
    # docs/reference.md §1.6: L = 512 plus R = 64 rows with their radii
    assert [get_codec(f"polar{b}", 512).bytes_per_row + get_codec(f"polar{b}", 64).bytes_per_row
            for b in range(2, 7)] == [116, 188, 260, 332, 404]


@pytest.mark.parametrize("spec", ["polar4", "polar2:compat=colibri", "polar3:alloc=level",
                                  "polar6:seed=0x2a", "polar5:compat=colibri,seed=0x7"])
def test_canonical_spec_reparses(spec):
    codec = get_codec(spec, 128)
    again = get_codec(codec.spec, 128)
    assert again.spec == codec.spec == spec
    assert again.codebook_checksum == codec.codebook_checksum


def test_engine_tag_and_codebook_identity():
    compat = get_codec("polar3:compat=colibri", 64)
    assert compat.engine_tag == 3 and compat.codebook_identity == "colibri-polar"
    assert get_codec("polar3:compat=colibri,seed=5", 64).engine_tag is None
    lloyd = get_codec("polar3", 64)
    assert lloyd.engine_tag is None
    stored = load_polar_codebooks()
    assert (lloyd.codebook_identity, lloyd.codebook_checksum) == (stored.identity, stored.checksum)
    assert len(lloyd.codebook_checksum) == 64
    # the default is the radius allocation
    assert get_codec("polar3:alloc=radius", 64).spec == "polar3"


# -- the engine's codec --------------------------------------------------------------------------

@pytest.mark.parametrize("d, n_rows", [(128, 1000), (512, 500)])
def test_distortion_compat_and_lloyd(rng, d, n_rows):
    X = gaussian_rows(rng, n_rows, d)
    for bits, expected in ENGINE_RELL2.items():
        compat, level, radius = (relative_l2(X, polar(bits, v, d).roundtrip(X)).mean()
                                 for v in VARIANTS)
        assert compat == pytest.approx(expected, rel=0.05)
        # the Lloyd variants are strictly better at the same bytes, at every width
        assert radius < level < compat
        if bits == 4:
            assert radius <= 0.12     # the goal (measured ~0.115 / 0.117)


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("bits", [2, 4, 6])
def test_compat_matches_float32_engine_reference(rng, d, bits):
    X = gaussian_rows(rng, 300, d) * rng.uniform(1e-3, 1e3, (300, 1)).astype(np.float32)
    X[7] = 0
    codec = polar(bits, "compat=colibri", d)
    enc = codec.encode(X)
    ref_codes, ref_radius = reference.polar_engine_encode_rows(X, bits)
    assert np.array_equal(enc.side[:, 0], ref_radius)
    # numpy's float32 atan2/hypot may differ from libm's in the last place: an angle on a grid
    # edge could then take the other code. In practice they agree.
    assert (enc.codes == ref_codes).all(axis=1).mean() >= 0.99
    decoded = codec.decode(enc)
    ref_decoded = reference.polar_engine_decode_rows(enc.codes, enc.side[:, 0], bits, d)
    assert np.abs(decoded - ref_decoded).max(axis=1).max() <= 1e-6 * np.abs(X).max()


@pytest.mark.parametrize("bits", range(1, 7))
@pytest.mark.parametrize("level", range(1, 10))
def test_engine_grid_centres_reencode_to_their_code(level, bits):
    centres = np.empty(2**bits, np.float32)
    polar_kernels.engine_grid_centres(level, bits, centres)
    assert np.array_equal(centres, engine_grid_centres(level, bits))
    codes = np.empty(2**bits, np.int32)
    polar_kernels.engine_grid_codes(level, bits, centres, codes)
    assert np.array_equal(codes, np.arange(2**bits))
    # floor then clamp: far outside the grid lands on the end codes
    far = np.array([-10.0, 10.0], np.float32)
    polar_kernels.engine_grid_codes(level, bits, far, codes[:2])
    assert codes[:2].tolist() == [0, 2**bits - 1]


def test_level_major_lsb_first_layout():
    """A row whose rotation is exactly (c, 0, ..., 0): every angle is atan2(0, .) = 0."""
    d, bits = 8, 3
    codec = polar(bits, "compat=colibri", d)
    x = (codec.rotation.signs * np.float32(1 / np.sqrt(8))).reshape(1, d)
    enc = codec.encode(x)
    zero = np.zeros(1, np.float32)
    code = np.empty(1, np.int32)
    polar_kernels.engine_grid_codes(1, bits, zero, code)
    level1 = int(code[0])
    # level 1: 4 codes of 3 bits, then level 2: 2 codes of 2 bits, level 3: 1 code of 2 bits;
    # angle 0 is the bottom of the level-2 grid and below the level-3 grid (clamped to 0)
    for level in (2, 3):
        polar_kernels.engine_grid_codes(level, 2, zero, code)
        assert code[0] == 0
    stream = sum(level1 << (3 * i) for i in range(4))
    assert enc.codes[0].tolist() == [stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16]


# -- Lloyd variants ------------------------------------------------------------------------------

@pytest.mark.parametrize("alloc", ["level", "radius"])
@pytest.mark.parametrize("d, bits", [(64, 2), (128, 4), (512, 3), (256, 6)])
def test_lloyd_matches_numpy_reference(rng, alloc, d, bits):
    X = gaussian_rows(rng, 200, d) * rng.uniform(1e-2, 1e2, (200, 1)).astype(np.float32)
    codec = polar(bits, f"alloc={alloc}", d)
    cb = codec.codebooks
    tables = (padded_centroids(codec), cb.log2_cos2, cb.log2_sin2, cb.gains,
              codec.level_total_bits, alloc)
    enc = codec.encode(X)
    ref_codes, ref_radius = reference.polar_lloyd_encode_rows(X, *tables)
    assert np.allclose(enc.side[:, 0], ref_radius, rtol=1e-7)
    # float32 angles against float64 ones: a rare angle within rounding of a boundary may move
    assert (enc.codes == ref_codes).all(axis=1).mean() >= 0.98
    # decoding is exact integer bookkeeping plus float rounding
    ref_decoded = reference.polar_lloyd_decode_rows(enc.codes, enc.side[:, 0], *tables, d)
    scale = enc.side[:, 0][:, None]
    assert np.abs(codec.decode(enc) - ref_decoded).max() <= 1e-5 * scale.max()


@pytest.mark.parametrize("alloc", ["level", "radius"])
@pytest.mark.parametrize("d, bits", [(8, 4), (32, 5), (128, 4), (128, 6), (512, 3), (256, 2)])
def test_portable_and_avx512_encoders_give_the_same_bits(rng, alloc, d, bits):
    """The encoder's AVX-512 helpers (vector Lloyd codes, the allocation's candidate scan) and
    the portable code they replace: the same codes, radii and decoded rows, on Gaussian rows and
    on rows of ties and zeros (angles on a boundary, pairs libm decides)."""
    X = gaussian_rows(rng, 300, d) * rng.uniform(1e-3, 1e3, (300, 1)).astype(np.float32)
    X[:20] = rng.integers(-2, 3, (20, d))
    X[20:40, ::2] = 0
    codec = polar(bits, f"alloc={alloc}", d)
    try:
        polar_kernels.set_portable(True)
        portable = codec.encode(X)
        portable_rows = codec.decode(portable)
    finally:
        polar_kernels.set_portable(False)
    auto = codec.encode(X)
    assert np.array_equal(auto.codes, portable.codes)
    assert np.array_equal(auto.side, portable.side)
    assert np.array_equal(codec.decode(auto), portable_rows)


# -- the encoder's forward transform (polar_encode.h): libm's radii, brackets around libm's angles

def _libm_atan2f():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.atan2f.restype = ctypes.c_float
    libm.atan2f.argtypes = (ctypes.c_float, ctypes.c_float)
    return libm.atan2f


def _pairs(rng, m):
    """Pairs (a, c) over the float range: Gaussian at scales 1e-40 .. 1e38, zeros of both signs,
    equal and opposite magnitudes, subnormals."""
    scale = (10.0 ** rng.uniform(-40, 37, (m, 1))).astype(np.float32)
    P = (rng.standard_normal((m, 2)) * scale).astype(np.float32)
    P[:64, 0] = 0.0
    P[64:128, 1] = -0.0
    P[128:192, 1] = P[128:192, 0]
    P[192:256, 1] = -P[192:256, 0]
    P[256:320] = np.float32(1e-45) * rng.integers(-3, 4, (64, 2))
    return P


def test_forward_level_radii_are_hypotf_and_brackets_hold_atan2f(rng):
    P = _pairs(rng, 200_000)
    half = P.shape[0]
    r, lo, hi = (np.empty(half, np.float32) for _ in range(3))
    assert not polar_kernels.forward_level(P.reshape(-1), r, lo, hi)
    a, c = P[:, 0], P[:, 1]
    assert np.array_equal(r.view(np.uint32), np.hypot(a, c).view(np.uint32))
    exact = (a != 0) & (c != 0)
    assert np.all(lo[~exact] == -4) and np.all(hi[~exact] == 4)    # libm decides those
    ang = np.arctan2(c, a)
    assert np.all((lo[exact] <= ang[exact]) & (ang[exact] <= hi[exact]))
    atan2f = _libm_atan2f()
    for i in rng.choice(np.flatnonzero(exact), 3000, replace=False):
        assert lo[i] <= atan2f(c[i], a[i]) <= hi[i]
    # narrow enough that an angle rarely needs libm: a relative 2^-15 plus float subnormals
    width = (hi - lo)[exact].astype(np.float64)
    assert np.all(width <= np.abs(ang[exact]) * 2.0**-14 + 1e-40)
    # the approximation at the bracket's centre is within the bound of polar_encode.h, far
    # inside the 2^-16 pad: 2e-6 of the angle in float (vectors of 8 pairs on the portable path,
    # of 16 on AVX-512); plus the ends' float rounding
    ang64 = np.arctan2(c[exact].astype(np.float64), a[exact].astype(np.float64))
    for portable, bound in ((True, 2e-6), (False, 2e-6)):
        polar_kernels.set_portable(portable)
        try:
            assert not polar_kernels.forward_level(P.reshape(-1), r, lo, hi)
            # a level whose last block is short gives each pair the same radius and bracket
            for m in (1, 7, 15, 16 * 20 + 11):
                r_m, lo_m, hi_m = (np.empty(m, np.float32) for _ in range(3))
                polar_kernels.forward_level(P[-m:].reshape(-1), r_m, lo_m, hi_m)
                assert np.array_equal(lo_m, lo[-m:]) and np.array_equal(hi_m, hi[-m:]), m
                assert np.array_equal(r_m.view(np.uint32), r[-m:].view(np.uint32)), m
        finally:
            polar_kernels.set_portable(False)
        centre = (lo[exact].astype(np.float64) + hi[exact]) / 2
        assert np.all(np.abs(centre - ang64) <= np.abs(ang64) * bound + 1e-40), portable
        assert np.all((lo[exact] <= ang[exact]) & (ang[exact] <= hi[exact]))


def test_forward_level_flags_non_finite_values():
    r, lo, hi = (np.empty(2, np.float32) for _ in range(3))
    for bad in (np.inf, -np.inf, np.nan):
        assert polar_kernels.forward_level(np.array([1, 2, bad, 1], np.float32), r, lo, hi)


def _forward_by_levels(x):
    """The row's forward transform level by level with forward_level, hypotf's radii and open
    brackets for a level holding a non-finite value (the encoder's rule)."""
    n = x.size
    tree = np.zeros(2 * n, np.float32)
    tree[:n] = x
    lo, hi = np.empty(n - 1, np.float32), np.empty(n - 1, np.float32)
    rlen, in_off, off = n, 0, 0
    while rlen > 1:
        half = rlen // 2
        r = np.empty(half, np.float32)
        pairs = tree[in_off:in_off + rlen].copy()
        if polar_kernels.forward_level(pairs, r, lo[off:off + half], hi[off:off + half]):
            with np.errstate(invalid="ignore", over="ignore"):
                r = np.hypot(pairs[0::2], pairs[1::2])
            lo[off:off + half], hi[off:off + half] = -4, 4
        tree[in_off + rlen:in_off + rlen + half] = r
        in_off, off, rlen = in_off + rlen, off + half, half
    return tree, lo, hi


@pytest.mark.parametrize("n", [2, 4, 32, 128, 512])
def test_forward_row_is_the_levels_one_after_another(rng, n):
    """The whole-row transform (every level's brackets in one pass on AVX-512) gives each level
    the radii and brackets of forward_level, on both paths, with zeros, subnormals and a
    non-finite value in some rows (that level and those below take hypotf and open brackets)."""
    rows = [_pairs(rng, 400).reshape(-1)[i:i + n] for i in range(0, 800 - n, max(n // 2, 7))]
    rows += [rng.standard_normal(n).astype(np.float32) for _ in range(20)]
    for bad in (np.inf, -np.inf, np.nan):
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(n)] = bad
        rows.append(x)
    # finite values whose radii overflow: the level below holds infinities
    rows.append(np.float32(3e38) * np.sign(rng.standard_normal(n)).astype(np.float32))
    for portable in (True, False):
        polar_kernels.set_portable(portable)
        try:
            for x in rows:
                tree = np.zeros(2 * n, np.float32)
                tree[:n] = x
                lo, hi = np.empty(n - 1, np.float32), np.empty(n - 1, np.float32)
                polar_kernels.forward_row(tree, lo, hi)
                ref_tree, ref_lo, ref_hi = _forward_by_levels(x)
                assert np.array_equal(tree[:2 * n - 1].view(np.uint32),
                                      ref_tree[:2 * n - 1].view(np.uint32)), portable
                assert np.array_equal(lo.view(np.uint32), ref_lo.view(np.uint32)), portable
                assert np.array_equal(hi.view(np.uint32), ref_hi.view(np.uint32)), portable
        finally:
            polar_kernels.set_portable(False)


def _greedy_widths(weight, gain, total):
    """The allocation's definition: key (j, k) = weight[j] + gain[k]; the `total` largest keys
    win, equal keys to the lower angle index; an angle's width is how many of its keys won."""
    keys = (weight.astype(np.int64)[:, None] + gain.astype(np.int64)[None, :]).ravel()
    angle = np.repeat(np.arange(weight.size), gain.size)
    order = np.lexsort((angle, -keys))            # larger key first, then the lower index
    return np.bincount(angle[order[:max(total, 0)]], minlength=weight.size).astype(np.uint8)


def _run_allocation(weight, gain, total, portable, near):
    polar_kernels.set_portable(portable)
    polar_kernels.set_near_guess(near)
    try:
        width = np.empty(weight.size, np.uint8)
        polar_kernels.allocate_bits(weight, gain, total, width)
    finally:
        polar_kernels.set_portable(False)
        polar_kernels.set_near_guess(True)
    return width


@pytest.mark.parametrize("cnt", [1, 2, 3, 4, 8, 16, 32, 64, 100, 256, 512])
def test_radius_allocation_is_the_greedy_on_both_paths(rng, cnt):
    """The allocation (polarops.h: the portable bracket search; under AVX-512 the guess at the
    mean weight, the vector search it falls back on (also run alone), the ranks of 2 angles, one
    angle directly) against a sort of all keys: weights with many ties, spans narrow and wide
    (past the ranks' 2^26 and the guess's int32 limit of 2^29), every total from none to all."""
    for trial in range(40):
        # strictly decreasing gains
        gain = np.ascontiguousarray(np.sort(rng.choice(2_000_000, 8, replace=False))[::-1]
                                    - 1_500_000, np.int32)
        if trial % 3 == 0:
            weight = rng.choice(np.array([-300_000, -250_000, 0], np.int32), cnt)
        elif trial % 3 == 1:
            weight = rng.integers(-3_000_000, 1, cnt).astype(np.int32)
        else:
            weight = rng.integers(-400_000_000, 400_000_001, cnt).astype(np.int32)
        totals = {0, 1, 8 * cnt - 1, 8 * cnt, 8 * cnt + 5, int(rng.integers(0, 8 * cnt + 1))}
        if trial % 8 == 7:
            weight = rng.integers(-2**31, 2**31 - 1, cnt).astype(np.int32) // 2
        for total in sorted(totals):
            expect = _greedy_widths(weight, gain, total)
            for portable, near in ((True, True), (False, True), (False, False)):
                width = _run_allocation(weight, gain, total, portable, near)
                assert np.array_equal(width, expect), (cnt, trial, total, portable, near)


def _codec_like_level(rng, cnt, spread):
    """A level's weights and gains as the encoder meets them: the gains of a real codebook,
    weights spread like the sub-radii of Gaussian rows (2^16 log2 r^2: a few 10^5)."""
    gains = get_codec("polar4", 128).codebooks.gains
    level = int(rng.integers(1, 8))
    gain = np.ascontiguousarray(gains[level], np.int32)
    weight = np.round(rng.normal(-2e5 * level, spread, cnt)).astype(np.int32)
    return weight, gain


@pytest.mark.parametrize("cnt", [2, 4, 8, 16, 32, 64, 128, 256])
def test_the_guess_at_the_mean_decides_typical_levels_exactly(rng, cnt):
    """The AVX-512 allocation from the guess at the mean weight alone (allocate_near): on levels
    like the encoder's (real gains, weights spread like Gaussian rows' sub-radii, the codec's
    level totals) it gives the widths nearly always (else it leaves them to the search), and
    whenever it gives them they are the greedy's."""
    width = np.empty(cnt, np.uint8)
    decided = 0
    n_trials = 120
    for trial in range(n_trials):
        weight, gain = _codec_like_level(rng, cnt, float(rng.choice([3e4, 1e5, 2e5])))
        # the codec's level totals: bits x angles, level 1 with a few spare bits on top
        total = int(rng.integers(2, 7)) * cnt + int(rng.integers(0, max(1, cnt // 8)))
        got = polar_kernels.allocate_near(weight, gain, total, width)
        if got == -1:
            pytest.skip("the guess at the mean runs under AVX-512 only")
        if got == 1:
            decided += 1
            assert np.array_equal(width, _greedy_widths(weight, gain, total)), (trial, total)
    assert decided >= 0.9 * n_trials, decided


def test_the_guess_at_the_mean_declines_what_it_cannot_decide(rng):
    """Levels where the keys next to the guess are not each angle's nearest two (a gain step of
    1, equal weights), weights past its int32 limit: allocate_near either leaves the level to
    the search (0) or gives the greedy's widths, and it does leave some; the full allocation
    (which then searches) is the greedy's on all of them."""
    cnt = 64
    width = np.empty(cnt, np.uint8)
    outcomes = set()
    for trial in range(200):
        weight, gain = _codec_like_level(rng, cnt, 1.5e5)
        gain = gain.copy()
        if trial % 2 == 0:
            k = int(rng.integers(1, 8))
            gain[k] = gain[k - 1] - 1                      # a gain step of one
            gain[k + 1:] = np.minimum(gain[k + 1:], gain[k] - 1 - np.arange(7 - k))
        else:
            weight[:] = weight[0] + rng.integers(0, 3, cnt) * (gain[3] - gain[4])   # ties
        total = int(rng.integers(1, 8 * cnt))
        got = polar_kernels.allocate_near(weight, gain, total, width)
        if got == -1:
            pytest.skip("the guess at the mean runs under AVX-512 only")
        outcomes.add(got)
        expect = _greedy_widths(weight, gain, total)
        if got == 1:
            assert np.array_equal(width, expect), (trial, total)
        assert np.array_equal(_run_allocation(weight, gain, total, False, True), expect)
    assert outcomes == {0, 1}
    big = np.full(cnt, 2**29, np.int32)
    assert polar_kernels.allocate_near(big, gain, 100, width) == 0


def _boundary_angle_rows(codec, rng, n_rows):
    """Rows whose rotated level-1 pairs sit on the level's code boundaries (Lloyd) up to the
    rotation's rounding: the angles that land inside a bracket and go to atan2f."""
    d = codec.dim
    bnd = codec.codebooks.boundaries[1, codec.level_bits[1]]
    bnd = bnd[np.isfinite(bnd)].astype(np.float64)
    Y = np.empty((n_rows, d), np.float64)
    theta = rng.choice(bnd, (n_rows, d // 2))
    radius = rng.uniform(0.5, 2, (n_rows, d // 2))
    Y[:, 0::2], Y[:, 1::2] = radius * np.cos(theta), radius * np.sin(theta)
    return codec.rotation.unrotate(Y.astype(np.float32))


def _pack_level_major(codes, widths):
    """LSB-first bit cursor over the angles in storage order (level 1 first)."""
    bits = [(int(q) >> k) & 1 for q, w in zip(codes, widths) for k in range(w)]
    bits += [0] * (-len(bits) % 8)
    return np.packbits(np.array(bits, np.uint8).reshape(-1, 8)[:, ::-1], axis=1).ravel()


@pytest.mark.parametrize("variant", ["alloc=level", "compat=colibri"])
@pytest.mark.parametrize("d, bits", [(8, 3), (64, 4), (128, 4), (256, 6), (512, 2)])
def test_fixed_width_codes_match_libm_replica(rng, variant, d, bits):
    """The fixed-width modes bit for bit against numpy plus libm: rotation (checked in
    test_rotation), hypotf and atan2f per pair (libm's, through ctypes: numpy's float32 arctan2
    is its own and may differ in the last place), the code of each angle (#{boundaries < angle},
    or the engine's grid), level-major packing; on Gaussian rows and on rows whose angles sit on
    code boundaries."""
    codec = polar(bits, variant, d)
    lloyd = polar(bits, "alloc=level", d)
    X = np.concatenate([gaussian_rows(rng, 20, d), _boundary_angle_rows(lloyd, rng, 20)])
    enc = codec.encode(X)
    atan2f = _libm_atan2f()
    bnd = lloyd.codebooks.boundaries
    for row, x in enumerate(X):
        y = codec.rotation.rotate(x)
        codes, widths = [], []
        level = 1
        while y.size > 1:
            a, c = y[0::2], y[1::2]
            ang = np.array([atan2f(ci, ai) for ai, ci in zip(a, c)], np.float32)
            w = codec.level_bits[level]
            if codec.compat:
                q = np.empty(ang.size, np.int32)
                polar_kernels.engine_grid_codes(level, w, ang, q)
            else:
                q = np.searchsorted(bnd[level, w, :2**w - 1], ang, side="left")
            codes += list(q)
            widths += [w] * ang.size
            y = np.hypot(a, c)
            level += 1
        expect = _pack_level_major(codes, widths)
        assert np.array_equal(enc.codes[row, :expect.size], expect), row


@pytest.mark.parametrize("variant", VARIANTS)
def test_many_rows_equal_one_row_at_a_time(rng, variant):
    codec = polar(4, variant, 128)
    X = np.concatenate([gaussian_rows(rng, 300, 128), _boundary_angle_rows(
        polar(4, "alloc=level", 128), rng, 300)])
    batch = codec.encode(X, n_threads=2)
    for i in (0, 1, 299, 300, 599):
        one = codec.encode(X[i:i + 1], n_threads=1)
        assert np.array_equal(one.codes[0], batch.codes[i]) and one.side[0] == batch.side[i]


def test_radius_allocation(rng):
    codec = get_codec("polar4", 64)
    assert sum(codec.level_total_bits) == 8 * codec.code_bytes   # spare bits go to level 1
    assert codec.level_total_bits[1] == 32 * 4 + (224 - 221)
    gains = codec.codebooks.gains[1]
    w = rng.integers(-2**22, 2**22, (40, 16))
    for total in (0, 1, 17, 64, 127, 128, 200):
        bits = reference.polar_allocate(w, gains, total)
        assert (bits.sum(axis=1) == min(total, 128)).all()
        # a larger radius never gets fewer bits
        order = np.argsort(w, axis=1, kind="stable")
        assert (np.diff(np.take_along_axis(bits, order, axis=1), axis=1) >= 0).all()
    # equal radii: the bits left after an even split go to the first angles
    even = reference.polar_allocate(np.zeros((1, 4), np.int64), gains, 13)
    assert even.tolist() == [[4, 3, 3, 3]]


@pytest.mark.parametrize("d", [64, 128, 512])
def test_level_alloc_distortion_matches_codebook_theory(rng, d):
    X = gaussian_rows(rng, 1000, d)
    for bits in range(2, 7):
        codec = polar(bits, "alloc=level", d)
        X_hat = codec.roundtrip(X)
        rel_mse = ((X_hat - X.astype(np.float64)) ** 2).sum() / (X.astype(np.float64) ** 2).sum()
        # each level adds its chordal distortion E[2 - 2 cos(err)] (errors of different levels
        # are orthogonal to first order)
        theory = sum(codec.codebooks.chordal[level, codec.level_bits[level]]
                     for level in range(1, codec.n_levels + 1))
        assert rel_mse == pytest.approx(theory, rel=0.05 if bits == 2 else 0.025)


def test_polar_angle_density():
    for level in (2, 3, 6, 11):
        dens = polar_angle_density(level)
        k = 2 ** (level - 1) - 1
        # normalised, mean pi/4, moments against adaptive quadrature of sin^k(2 psi)
        z = integrate.quad(lambda t: math.sin(2 * t) ** k, 0, math.pi / 2, limit=200)[0]
        for x in (0.3, 0.7, math.pi / 4):
            f = integrate.quad(lambda t: math.sin(2 * t) ** k / z, 0, x, limit=200)[0]
            m = integrate.quad(lambda t: t * math.sin(2 * t) ** k / z, 0, x, limit=200)[0]
            assert float(dens.cdf(x)) == pytest.approx(f, abs=1e-12)
            assert float(dens.partial_moment(np.array([x]))[0]) == pytest.approx(m, abs=1e-12)
        assert float(dens.cdf(math.pi / 2)) == pytest.approx(1.0, abs=1e-12)
        assert float(dens.ppf(0.5)) == pytest.approx(math.pi / 4, abs=1e-12)
    uniform = polar_angle_density(1)
    fit = uniform.fit(8)
    assert np.allclose(fit.levels, -math.pi + (np.arange(8) + 0.5) * math.pi / 4, atol=1e-12)


def test_stored_codebooks_are_the_fit(tmp_path):
    stored = load_polar_codebooks()
    fresh = fit_polar_codebooks(n_levels=3)
    for entry in fresh["levels"]:
        for book in entry["codebooks"][:5]:
            assert np.allclose(book["centroids"], stored.centroids64[entry["level"]][book["bits"]],
                               rtol=0, atol=1e-9)
        assert entry["gains"] == stored.gains[entry["level"]].tolist()
    # a hand-edited file is refused
    data = json.loads(DEFAULT_PATH.read_text())
    data["levels"][1]["codebooks"][3]["centroids"][0] += 1e-6
    bad = tmp_path / "polar-angles.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PolarCodebookError, match="checksum"):
        load_polar_codebooks(str(bad))


# -- properties of every variant -----------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_radius_is_norm_and_decoded_norm_is_radius(rng, variant):
    d = 256
    X = gaussian_rows(rng, 300, d, np.float64) * rng.uniform(1e-6, 1e6, (300, 1))
    codec = polar(4, variant, d)
    enc = codec.encode(X)
    norm = np.linalg.norm(X, axis=1)
    assert np.allclose(enc.side[:, 0], norm, rtol=1e-4, atol=0)
    decoded_norm = np.linalg.norm(codec.decode(enc).astype(np.float64), axis=1)
    assert np.allclose(decoded_norm, enc.side[:, 0], rtol=1e-3, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_hot_rows(variant):
    d = 256
    codec = polar(4, variant, d)
    X = np.zeros((5, d), np.float32)
    X[np.arange(5), [0, 1, 77, 128, 255]] = 1.0
    X[4] *= -3.0
    enc = codec.encode(X)
    assert np.allclose(enc.side[:, 0], [1, 1, 1, 1, 3], rtol=0, atol=1e-5)
    assert relative_l2(X, codec.decode(enc)).max() < 0.35     # the engine's bound


@pytest.mark.parametrize("variant", VARIANTS)
def test_inert_rows(rng, variant):
    d = 64
    X = gaussian_rows(rng, 6, d)
    X[1] = 0.0
    X[2, 5] = np.nan
    X[3, 0] = np.inf
    X[4] = 1e-38                       # subnormal: the norm is below the engine's 1e-35
    codec = polar(3, variant, d, nonfinite="inert")
    enc = codec.encode(X)
    for r in (1, 2, 3, 4):
        assert enc.side[r, 0] == 0 and not enc.codes[r].any()
    decoded = codec.decode(enc)
    assert not decoded[1:5].any() and np.isfinite(decoded).all()
    assert relative_l2(X[[0, 5]], decoded[[0, 5]]).max() < 0.5
    # damaged radii decode to zero rows
    for bad in (np.nan, -1.0, np.inf):
        enc.side[0, 0] = bad
        assert not codec.decode(enc)[0].any()
    # the default refuses NaN/inf rows and names them; a zero or tiny row is fine
    strict = polar(3, variant, d)
    with pytest.raises(ValueError, match=r"rows 2, 3"):
        strict.encode(X)
    assert strict.encode(X[[0, 1, 4]]).side[1:, 0].tolist() == [0.0, 0.0]
    huge = np.zeros((2, d), np.float32)
    huge[1, :2] = 3e38                 # finite elements, norm beyond float32
    with pytest.raises(ValueError, match=r"norm above 3\.4e38 .*\(rows 1\)"):
        strict.encode(huge)
    assert codec.encode(huge).side[1, 0] == 0


def test_float64_and_strided_input(rng):
    X = gaussian_rows(rng, 20, 256, np.float64)
    codec = get_codec("polar4", 128)
    strided = X[:, ::2]
    assert np.array_equal(codec.encode(strided).codes,
                          codec.encode(np.ascontiguousarray(strided, np.float32)).codes)
    assert codec.encode(X[:0, :128]).codes.shape == (0, 56)


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [48, 100, 1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_non_power_of_two_width_is_refused(d, variant):
    with pytest.raises(ValueError, match=rf"power-of-two.*{d}.*kv8"):
        polar(4, variant, d)


@pytest.mark.parametrize("bits", [0, 1, 7, 8])
def test_bits_out_of_range(bits):
    with pytest.raises(ValueError, match="2..6"):
        get_codec(f"polar{bits}", 64)
    with pytest.raises(ValueError, match="2..6"):
        get_codec(f"polar{bits}:compat=colibri", 64)


def test_bad_options():
    with pytest.raises(ValueError, match="without alloc"):
        get_codec("polar4:compat=colibri,alloc=level", 64)
    with pytest.raises(ValueError, match="alloc"):
        get_codec("polar4:alloc=greedy", 64)
    with pytest.raises(ValueError, match="compat"):
        get_codec("polar4:compat=llama", 64)
    with pytest.raises(ValueError, match="4096"):
        get_codec("polar4", 8192)
    assert get_codec("polar4:compat=colibri", 8192).code_bytes == (4096 * 4 + 4095 * 3 + 7) // 8
    with pytest.raises(ValueError, match="width 64"):
        get_codec("polar4", 64).encode(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="unknown option"):
        get_codec("polar4:side=unbiased", 64)
    assert get_codec("polar4", 64).seed == ENGINE_SEED
