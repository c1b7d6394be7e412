"""Lloyd-Max codebooks: published constants, independent quadrature and Monte Carlo checks,
stored files (fixed point, symmetry, refit, checksum) and argument validation."""
import argparse
import json
import math
from decimal import Decimal

import numpy as np
import pytest
from scipy import integrate

from kvquant import codebooks as cbm
from kvquant.codebooks import (
    Codebook,
    CodebookFileError,
    ConvergenceError,
    fit_codebook,
    fit_lloyd_max,
    load_codebook,
    read_codebook,
    write_codebook,
)

ALL_BITS = range(1, 9)
STORED = [("gaussian", None, b) for b in ALL_BITS] + [
    ("beta", d, b) for d in cbm.STORED_BETA_DIMS for b in ALL_BITS]


def assert_matches_digits(value, published):
    """``value`` rounds to ``published`` (a string): within half a unit of its last digit."""
    exponent = Decimal(published).as_tuple().exponent
    half_unit = 0.5 * 10.0**exponent
    assert abs(value - float(published)) <= half_unit, (value, published)


# -- published constants (docs/reference.md §2) ---------------------------------------------------

GAUSSIAN_MSE = ["0.363380", "0.117482", "0.034548", "0.009501", "0.0025047", "0.00064424"]
GAUSSIAN_RATIO = ["1.45", "1.88", "2.21", "2.43", "2.56", "2.64"]
BETA128_MSE = ["0.3609", "0.1160", "0.0340", "0.00931"]
GAUSSIAN_POSITIVE_LEVELS = {
    1: ["0.7979"],
    2: ["0.4528", "1.5104"],
    3: ["0.2451", "0.7560", "1.3439", "2.1519"],
}


@pytest.mark.parametrize("bits", range(1, 7))
def test_gaussian_mse_matches_max_1960(bits):
    cb = load_codebook("gaussian", None, bits)
    assert_matches_digits(cb.mse, GAUSSIAN_MSE[bits - 1])
    assert_matches_digits(cb.mse * 4.0**bits, GAUSSIAN_RATIO[bits - 1])


def test_gaussian_1bit_is_exact():
    # One bit: levels +-E|X| = +-sqrt(2/pi), MSE = 1 - 2/pi.
    cb = load_codebook("gaussian", None, 1)
    np.testing.assert_allclose(cb.levels, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)],
                               rtol=1e-15)
    assert cb.mse == pytest.approx(1 - 2 / math.pi, rel=1e-14)


@pytest.mark.parametrize("bits", sorted(GAUSSIAN_POSITIVE_LEVELS))
def test_gaussian_centroids(bits):
    positive = load_codebook("gaussian", None, bits).levels[2 ** (bits - 1):]
    for value, published in zip(positive, GAUSSIAN_POSITIVE_LEVELS[bits], strict=True):
        assert_matches_digits(value, published)


@pytest.mark.parametrize("bits", range(1, 5))
def test_beta_d128_mse(bits):
    assert_matches_digits(load_codebook("beta", 128, bits).mse, BETA128_MSE[bits - 1])


@pytest.mark.parametrize("dist,dim,bits", STORED)
def test_lower_bound(dist, dim, bits):
    assert load_codebook(dist, dim, bits).mse >= 4.0**-bits


# -- independent checks of the closed forms --------------------------------------------------


def _quad_cells(dim, levels):
    """Cell probabilities, centroids and MSE in N(0,1) units by quadrature of (1 - t^2)^a."""
    a = 0.5 * (dim - 3)
    scale = math.sqrt(dim)

    def kernel(t):
        return (1.0 - t * t) ** a

    norm = integrate.quad(kernel, -1, 1, epsabs=0, epsrel=1e-13)[0]
    edges = np.concatenate([[-1.0], 0.5 * (levels[:-1] + levels[1:]) / scale, [1.0]])
    probs, centroids, sq_err = [], [], 0.0
    for lo, hi, level in zip(edges[:-1], edges[1:], levels):
        mass = integrate.quad(kernel, lo, hi, epsabs=0, epsrel=1e-13)[0]
        first = integrate.quad(lambda t: t * kernel(t), lo, hi, epsabs=0, epsrel=1e-13)[0]
        err = integrate.quad(lambda t: (scale * t - level) ** 2 * kernel(t), lo, hi,
                             epsabs=0, epsrel=1e-13)[0]
        probs.append(mass / norm)
        centroids.append(scale * first / mass)
        sq_err += err / norm
    return np.array(probs), np.array(centroids), sq_err


@pytest.mark.parametrize("dim,bits", [(64, 3), (16, 5)])
def test_beta_closed_forms_against_quadrature(dim, bits):
    cb = load_codebook("beta", dim, bits)
    probs, centroids, mse = _quad_cells(dim, cb.levels)
    density = cbm.beta_density(dim)
    edges = np.concatenate([[-math.sqrt(dim)], cb.boundaries, [math.sqrt(dim)]])
    np.testing.assert_allclose(np.diff(density.cdf(edges)), probs, rtol=1e-11)
    np.testing.assert_allclose(cb.levels, centroids, rtol=0, atol=1e-10)
    assert cb.mse == pytest.approx(mse, rel=1e-9)


def test_mse_off_the_fixed_point_against_quadrature():
    # The engine's 3-decimal levels are not a fixed point: the per-cell closed form must still
    # give the true MSE (E[X^2] - sum p c^2 would not).
    positive = np.array([0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733])
    levels = np.concatenate([-positive[::-1], positive])
    assert cbm.quantizer_mse(levels, cbm.beta_density(128)) == pytest.approx(
        _quad_cells(128, levels)[2], rel=1e-9)
    edges = np.concatenate([[-np.inf], 0.5 * (levels[:-1] + levels[1:]), [np.inf]])
    gauss = sum(integrate.quad(lambda x, c=c: (x - c) ** 2 * np.exp(-x * x / 2), lo, hi,
                               epsabs=0, epsrel=1e-13)[0]
                for lo, hi, c in zip(edges[:-1], edges[1:], levels)) / math.sqrt(2 * math.pi)
    assert cbm.quantizer_mse(levels, cbm.gaussian_density()) == pytest.approx(gauss, rel=1e-9)


@pytest.mark.parametrize("dim,bits", [(128, 3), (16, 2)])
def test_beta_mse_monte_carlo(rng, dim, bits):
    # Random unit vectors; cb.mse is the expected relative squared L2 error of a whole row.
    cb = load_codebook("beta", dim, bits)
    x = rng.standard_normal((20_000, dim))
    y = x / np.linalg.norm(x, axis=1, keepdims=True) * math.sqrt(dim)
    q = cb.levels[np.searchsorted(cb.boundaries, y)]
    per_row = np.sum((y - q) ** 2, axis=1) / dim  # rows are independent, coordinates are not
    stderr = per_row.std(ddof=1) / math.sqrt(per_row.size)
    assert abs(per_row.mean() - cb.mse) < 4 * stderr


# -- structure of the stored codebooks -------------------------------------------------------


def _density(cb):
    return cbm.gaussian_density() if cb.dist == "gaussian" else cbm.beta_density(cb.dim)


@pytest.mark.parametrize("dist,dim,bits", STORED)
def test_stored_is_a_symmetric_lloyd_fixed_point(dist, dim, bits):
    cb = load_codebook(dist, dim, bits)
    assert (cb.dist, cb.dim, cb.bits, cb.identity) == (
        dist, dim, bits, f"gaussian-b{bits}" if dim is None else f"beta-d{dim}-b{bits}")
    levels = cb.levels
    assert levels.dtype == np.float64 and levels.shape == (2**bits,)
    np.testing.assert_array_equal(levels, -levels[::-1])
    np.testing.assert_array_equal(cb.boundaries, 0.5 * (levels[:-1] + levels[1:]))
    # Centroids of the lower half (by symmetry the upper half agrees) where tails are accurate.
    density = _density(cb)
    half = 2 ** (bits - 1)
    edges = np.concatenate([[density.lo], cb.boundaries[:half]])
    F = np.concatenate([[0.0], density.cdf(edges[1:])])
    M = np.concatenate([[0.0], density.partial_moment(edges[1:])])
    centroids = np.diff(M) / np.diff(F)
    assert np.max(np.abs(centroids - levels[:half])) < cb.tol
    assert cb.mse == pytest.approx(cbm.quantizer_mse(levels, density), rel=1e-12)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_beta_tends_to_gaussian(bits):
    gauss = load_codebook("gaussian", None, bits)
    dims = cbm.STORED_BETA_DIMS
    gaps = np.array([np.max(np.abs(load_codebook("beta", d, bits).levels - gauss.levels))
                     for d in dims])
    mses = np.array([load_codebook("beta", d, bits).mse for d in dims])
    # The Beta density differs from N(0,1) by O(1/d): doubling d halves the gap.
    np.testing.assert_allclose(gaps[3:-1] / gaps[4:], 2.0, rtol=0.05)
    assert gaps[-1] < 1e-2
    # Lighter tails than the Gaussian: smaller MSE, increasing towards the Gaussian one.
    assert np.all(np.diff(mses) > 0) and mses[-1] < gauss.mse
    assert mses[-1] == pytest.approx(gauss.mse, rel=1e-3)


@pytest.mark.parametrize("dist,dim,bits", [("beta", 64, b) for b in range(1, 5)]
                         + [("gaussian", None, 3), ("beta", 4096, 8)])
def test_refit_reproduces_stored_file(dist, dim, bits):
    stored = load_codebook(dist, dim, bits)
    refit = fit_codebook(dist, dim, bits)
    np.testing.assert_allclose(refit.levels, stored.levels, rtol=0, atol=1e-10)
    assert refit.mse == pytest.approx(stored.mse, rel=1e-10)
    assert refit.tol == stored.tol


# -- files -----------------------------------------------------------------------------------


def test_write_read_round_trip_is_exact_and_deterministic(tmp_path):
    cb = load_codebook("beta", 256, 8)
    path = write_codebook(cb, tmp_path / "a")
    again = write_codebook(cb, tmp_path / "b")
    assert path.name == "beta-d256-b8.json"
    assert path.read_bytes() == again.read_bytes()
    back = read_codebook(path)
    assert back == cb and back.checksum == cb.checksum
    np.testing.assert_array_equal(back.levels, cb.levels)
    data = json.loads(path.read_text())
    for key in ("dist", "dim", "bits", "levels", "mse", "tol", "iterations", "scipy_version",
                "numpy_version", "checksum"):
        assert key in data


def test_checksum_mismatch_names_the_file(tmp_path):
    cb = load_codebook("beta", 128, 4)
    data = json.loads(write_codebook(cb, tmp_path).read_text())
    data["levels"][3] = np.nextafter(data["levels"][3], 0.0)  # one ulp off
    bad = tmp_path / "corrupt.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(CodebookFileError, match=r"corrupt\.json.*checksum"):
        read_codebook(bad)


def test_malformed_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(CodebookFileError, match="broken.json"):
        read_codebook(bad)
    data = json.loads(write_codebook(load_codebook("gaussian", None, 2), tmp_path).read_text())
    del data["levels"]
    bad.write_text(json.dumps(data))
    with pytest.raises(CodebookFileError, match="broken.json.*levels"):
        read_codebook(bad)


# -- the loader and arguments ----------------------------------------------------------------


def test_load_is_cached_and_immutable():
    cb = load_codebook("beta", 128, 4)
    assert load_codebook("beta", np.int64(128), 4) is cb
    with pytest.raises(ValueError):
        cb.levels[0] = 0.0
    with pytest.raises(ValueError):
        cb.boundaries[0] = 0.0
    assert cb.levels_f32.dtype == np.float32
    np.testing.assert_array_equal(cb.levels_f32, cb.levels.astype(np.float32))
    assert cb.checksum == cbm.levels_checksum(cb.levels) and len(cb.checksum) == 64


def test_gaussian_ignores_dim():
    # The codecs pass their width for both codebook kinds; N(0,1) does not depend on it.
    assert load_codebook("gaussian", 512, 4) is load_codebook("gaussian", None, 4)
    assert load_codebook("gaussian", 512, 4).dim is None


@pytest.mark.parametrize("dim", [2, 3, 24, 8192])
def test_unstored_dims_are_fitted_on_the_fly(dim):
    cb = load_codebook("beta", dim, 3)
    assert cb.dim == dim and cb.identity == f"beta-d{dim}-b3"
    gauss = load_codebook("gaussian", None, 3)
    assert cb.mse < gauss.mse
    if dim >= 16:
        # 4^-b is a large-d bound: at d = 2 (arcsine) the scalar codebook goes below it.
        assert cb.mse >= 4.0**-3
    if dim == 3:
        # d = 3: t is uniform on [-1, 1] (Archimedes), so the uniform quantizer is optimal.
        width = 2 * math.sqrt(3) / 8
        np.testing.assert_allclose(cb.levels, -math.sqrt(3) + width * (np.arange(8) + 0.5),
                                   atol=1e-12)
        assert cb.mse == pytest.approx(width**2 / 12, rel=1e-9)


@pytest.mark.parametrize("args,bad", [
    (("gauss", None, 4), "'gauss'"),
    (("beta", 128, 0), "got 0"),
    (("beta", 128, 9), "got 9"),
    (("beta", 128, 2.0), "got 2.0"),
    (("beta", 1, 4), "got 1"),
    (("beta", None, 4), "None"),
    (("gaussian", 0, 4), "got 0"),
])
def test_bad_arguments(args, bad):
    for func in (load_codebook, fit_codebook):
        with pytest.raises(ValueError, match=bad) as info:
            func(*args)
        message = str(info.value)
        assert any(hint in message for hint in ("1..8", ">= 2", "one of"))


def test_codebook_validates_levels():
    with pytest.raises(ValueError, match="16 levels"):
        Codebook("gaussian", None, 4, np.linspace(-1, 1, 8), mse=0.1, tol=1e-12)
    with pytest.raises(ValueError, match="ascending"):
        Codebook("gaussian", None, 1, [1.0, -1.0], mse=0.1, tol=1e-12)


# -- the generic core ------------------------------------------------------------------------


def _uniform(lo, hi):
    width = hi - lo
    return dict(
        cdf=lambda x: (np.asarray(x) - lo) / width,
        partial_moment=lambda x: (np.asarray(x) ** 2 - lo**2) / (2 * width),
        partial_second_moment=lambda x: (np.asarray(x) ** 3 - lo**3) / (3 * width),
        pdf=lambda x: np.full(np.shape(x), 1 / width),
    )


@pytest.mark.parametrize("n_levels", [1, 2, 5, 8])
@pytest.mark.parametrize("center", [None, 0.25 * math.pi])
def test_uniform_density_gives_uniform_quantizer(n_levels, center):
    lo, hi = 0.0, 0.5 * math.pi
    step = (hi - lo) / n_levels
    init = lo + step * (np.arange(n_levels) + 0.5) ** 1.3 / n_levels**0.3  # off the answer
    result = fit_lloyd_max(lo=lo, hi=hi, n_levels=n_levels, center=center, init=init,
                           **_uniform(lo, hi))
    np.testing.assert_allclose(result.levels, lo + step * (np.arange(n_levels) + 0.5),
                               atol=1e-12)
    assert result.mse == pytest.approx(step**2 / 12, rel=1e-9)


def test_core_paths_agree_on_the_gaussian():
    # Symmetric (mirrored half) vs full fit, Newton vs plain Lloyd: one fixed point.
    g = cbm.gaussian_density()
    init = g.ppf((np.arange(16) + 0.5) / 16)
    common = dict(cdf=g.cdf, partial_moment=g.partial_moment, lo=g.lo, hi=g.hi, n_levels=16,
                  init=init)
    reference = load_codebook("gaussian", None, 4).levels
    full = fit_lloyd_max(pdf=g.pdf, **common)
    plain = fit_lloyd_max(center=0.0, **common)
    assert plain.newton_steps == 0 and plain.iterations > 100
    np.testing.assert_allclose(full.levels, reference, atol=1e-12)
    np.testing.assert_allclose(plain.levels, reference, atol=1e-9)
    with pytest.raises(ConvergenceError, match="did not converge"):
        fit_lloyd_max(max_iter=10, center=0.0, **common)


def test_core_rejects_bad_input():
    u = _uniform(0.0, 1.0)
    with pytest.raises(ValueError, match="init is required"):
        fit_lloyd_max(u["cdf"], u["partial_moment"], -np.inf, np.inf, 4)
    with pytest.raises(ValueError, match="ascending"):
        fit_lloyd_max(u["cdf"], u["partial_moment"], 0.0, 1.0, 3, init=[0.5, 0.2, 0.7])
    with pytest.raises(ValueError, match="not symmetric"):
        fit_lloyd_max(u["cdf"], u["partial_moment"], 0.0, 1.0, 4, center=0.4)


# -- command line ----------------------------------------------------------------------------


def _cli():
    parser = argparse.ArgumentParser(prog="kvquant")
    cbm.add_cli(parser.add_subparsers(dest="command"))
    return parser


def test_cli_fit_writes_loadable_files(tmp_path, capsys):
    parser = _cli()
    args = parser.parse_args(["codebooks", "fit", "--dist", "beta,gaussian", "--dim", "24,32",
                              "--bits", "2-3", "--out", str(tmp_path)])
    assert args.func(args) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["beta-d24-b2.json", "beta-d24-b3.json", "beta-d32-b2.json",
                     "beta-d32-b3.json", "gaussian-b2.json", "gaussian-b3.json"]
    assert read_codebook(tmp_path / "beta-d32-b3.json") == load_codebook("beta", 32, 3)
    assert "wrote 6 codebook file(s)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["codebooks", "fit", "--dist", "beta"],
    ["codebooks", "fit", "--dist", "beta", "--dim", "64", "--bits", "0-3"],
    ["codebooks", "fit", "--dist", "cauchy", "--dim", "64"],
    ["codebooks", "fit", "--all", "--dim", "64"],
])
def test_cli_rejects_bad_arguments(argv, tmp_path):
    parser = _cli()
    args = parser.parse_args(argv + ["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        args.func(args)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--bits", "9"], "--bits 9 is out of range: bit widths are 1..8"),
    (["--dist", "beta", "--dim", "64", "--bits", "0-3"], "--bits 0 is out of range"),
    (["--dist", "cauchy", "--dim", "64"], "--dist 'cauchy' is not one of"),
    (["--dist", "beta", "--dim", "1"], "--dim 1 is out of range"),
    (["--bits", "x"], "--bits takes"),
    # checked before the range is built (it filled the memory: a MemoryError after 18 s)
    (["--bits", "1-100000000"], "--bits 100000000 is out of range"),
    # a width the fit never settles on (it ran for minutes)
    (["--dist", "beta", "--dim", "1000000000"], "--dim 1000000000 is out of range"),
])
def test_cli_names_the_bad_value_first(argv, message, tmp_path, capsys):
    """A bad value is named even when other arguments are missing (--bits 9 alone is about the
    bits, not about the missing --dist)."""
    parser = _cli()
    args = parser.parse_args(["codebooks", "fit"] + argv + ["--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("failure, message", [
    (ConvergenceError("Lloyd-Max did not converge"), "Lloyd-Max did not converge"),
    (OSError(28, "No space left on device"), "No space left on device"),
])
def test_cli_a_failed_fit_or_write_is_one_line(failure, message, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise failure
    monkeypatch.setattr(cbm.store, "regenerate", fail)
    parser = _cli()
    args = parser.parse_args(["codebooks", "fit", "--dist", "gaussian", "--bits", "2",
                              "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert isinstance(exc.value.code, str) and message in exc.value.code
    assert str(tmp_path) in exc.value.code


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import kvquant.outputs
    cb = load_codebook("gaussian", None, 2)

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kvquant.outputs.os, "fsync", full_disk)
    with pytest.raises(OSError):
        cbm.write_codebook(cb, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_use_codebooks_lends_levels_to_codecs_built_inside(tmp_path):
    from kvquant import get_codec
    from kvquant.kvfile import CacheFile, CacheFileMismatch, Stream
    stored = load_codebook("beta", 64, 3)
    # Levels 10% wider than the fit: a codebook the codec must visibly use.
    lent = Codebook(dist="beta", dim=64, bits=3, levels=stored.levels * 1.1, mse=math.nan,
                    tol=stored.tol)
    with cbm.use_codebooks(lent):
        assert load_codebook("beta", 64, 3) is lent
        inside = get_codec("tq3", 64)
    outside = get_codec("tq3", 64)
    assert load_codebook("beta", 64, 3) is stored
    np.testing.assert_array_equal(inside.levels, lent.levels_f32)
    np.testing.assert_array_equal(outside.levels, stored.levels_f32)
    assert inside.codebook_checksum == lent.checksum != outside.codebook_checksum
    # Decoded coordinates (rotated basis, unit rows) lie on the lent levels.
    X = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    enc = inside.encode(X)
    Y = inside.rotation.rotate(inside.decode(enc)) * np.sqrt(64) / enc.side
    assert np.abs(Y[..., None] - lent.levels).min(axis=-1).max() < 1e-4 * np.abs(lent.levels).max()
    # A cache file written with the lent codebook is refused under the stored one.
    with cbm.use_codebooks(lent):
        with CacheFile.open(tmp_path / "c.kvq", streams=[Stream("K", 64, 1, "tq3")]) as cf:
            cf.append([1, 2], streams={"K": X[:2, None, :]})
    with pytest.raises(CacheFileMismatch):
        CacheFile.open(tmp_path / "c.kvq", streams=[Stream("K", 64, 1, "tq3")])


def test_use_codebooks_refuses_bad_arguments():
    stored = load_codebook("beta", 64, 3)
    with pytest.raises(TypeError, match="Codebook"):
        with cbm.use_codebooks(stored.levels):
            pass
    with pytest.raises(ValueError, match="beta-d64-b3"):
        with cbm.use_codebooks(stored, stored):
            pass
    with cbm.use_codebooks(stored):
        with pytest.raises(ValueError, match="beta-d64-b3"):
            with cbm.use_codebooks(stored):
                pass
    assert load_codebook("beta", 64, 3) is stored
