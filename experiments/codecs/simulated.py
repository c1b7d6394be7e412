"""Simulated codecs of the probes (:mod:`kvquant_experiments.probes`): rows are stored as float32
after a numpy quantize-dequantize, sizes count what the real format would store. They measure
what a format's rounding does to a model, not its speed or memory.

``fp8-e4m3``, ``fp8-e5m2`` (``-g32``: one f32 scale per 32 values)
    fp8 with kv8's scale arithmetic, rounded by ``ml_dtypes``; the simulated e4m3 is the real
    ``kv8`` codec bit for bit (a test checks).
``tq<b>h+qjl``, ``tq<b>h+qjl-gauss`` (b = 2, 3, 4)
    the real ``tq<b>:side_dtype=f16`` codec plus a 1-bit QJL sketch of its residual and the
    residual's norm in fp16 (TurboQuant_prod, arXiv 2504.19874), with an orthogonal (default) or
    Gaussian sketch: at d = 64 exactly the bits of ``tq<b+1>``.

Each name is an entry point of the group ``kvquant.codecs`` (setup.cfg), so every model, worker
and command takes it like any codec. Only these ten names exist (the probes' grid); another group
size or bit width is one more entry point (``_factory`` below). The per-stream outlier split (``split<n>:...``) chooses its
channels from a stream's first rows and so cannot be one shared codec object: it stays a stream
factory of the probes.
"""
import math

import numpy as np

from kvquant.codecs import Codec, get_codec
from kvquant.codecs.identity import F32Codec

__all__ = ["FP8_FORMATS", "FP8SimCodec", "QJLResidualCodec", "SimulatedCodec", "fp8_roundtrip",
           "qjl_scale", "qjl_sketch"]

QJL_SEED = 20250425                 # the sketch matrix's seed (any fixed value)
RESIDUAL_NORM_BYTES = 2             # |r| of the QJL residual, stored as fp16
FP8_FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}
INERT_AMAX = 1e-35                  # kv8's rule: a group whose max is not above it is stored as 0


class SimulatedCodec(F32Codec):
    """A codec simulated by its quantize-dequantize: rows are stored as float32 after
    :meth:`quantize`, scores and contexts go through the f32 codec's kernels, and sizes count
    ``nominal_bytes_per_row`` (what the real format would store, side values included).

    Subclasses set ``spec`` and implement ``quantize(X) -> X_hat``: X of shape (n, dim), float32,
    finite rows; X_hat of the same shape.

    Parameters
    ----------
    dim : int
    nominal_bytes_per_row : int
    fixed_bytes : int
        Bytes stored once per stream (not per row), e.g. a channel assignment.
    """

    family = "simulated"
    simulated = True
    engine_tag = None

    def __init__(self, dim, nominal_bytes_per_row, fixed_bytes=0):
        super().__init__(dim)
        self.nominal_bytes_per_row = int(nominal_bytes_per_row)
        self.fixed_bytes = int(fixed_bytes)

    @property
    def bytes_per_row(self):
        return self.nominal_bytes_per_row

    def quantize(self, X):
        raise NotImplementedError

    def _encode(self, X, n_threads):
        bad = ~np.isfinite(X).all(axis=1)
        # the quantizer sees finite rows only; bad rows are refused (or stored as zeros)
        clean = np.where(bad[:, None], np.float32(0), X) if bad.any() else X
        X_hat = np.ascontiguousarray(self.quantize(clean), dtype=np.float32)
        if X_hat.shape != X.shape:
            raise AssertionError(f"{self.spec}: quantize returned {X_hat.shape} for {X.shape}")
        codes = X_hat.view(np.uint8).copy()
        codes[bad] = 0
        return codes, np.zeros((X.shape[0], 0), np.float32), bad.astype(np.uint8)


def fp8_roundtrip(X, fmt="e4m3", group=None):
    """Rows through fp8 with one f32 scale per ``group`` values (per row when None).

    The scale maps the group's largest magnitude to the format's maximum; the arithmetic is
    kv8's (docs/reference.md §1.1): y = x * (max / amax) in float32, rounded to fp8 (nearest, ties to
    even, by ``ml_dtypes``), decoded as y * (amax / max); a group whose amax is not above 1e-35
    decodes to zeros.

    Parameters
    ----------
    X : ndarray of shape (n, d), float32, finite
    fmt : {"e4m3", "e5m2"}
    group : int or None
        Values per scale; must divide d.

    Returns
    -------
    ndarray of shape (n, d), float32
    """
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("the fp8 simulation rounds with ml_dtypes: pip install ml_dtypes "
                          "(in kvquant's 'test' extra)") from None
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format {fmt!r} is not one of {sorted(FP8_FORMATS)}")
    X = np.asarray(X, dtype=np.float32)
    n, d = X.shape
    group = d if group is None else int(group)
    if group < 1 or d % group:
        raise ValueError(f"group {group} must be a positive divisor of the width {d}")
    dtype_name, fmax = FP8_FORMATS[fmt]
    G = X.reshape(n, d // group, group)
    amax = np.abs(G).max(axis=2)
    live = amax > np.float32(INERT_AMAX)
    amax = np.where(live, amax, np.float32(1))
    inv = np.float32(fmax) / amax                       # float32, as the kernel
    y = (G * inv[..., None]).astype(getattr(ml_dtypes, dtype_name)).astype(np.float32)
    out = y * (amax / np.float32(fmax))[..., None]
    out[~live] = 0.0
    return out.reshape(n, d)


class FP8SimCodec(SimulatedCodec):
    """fp8 (e4m3fn or e5m2) with f32 scales per row or per group: :func:`fp8_roundtrip`.

    Bytes per row: d codes + 4 per scale (kv8's layout)."""

    def __init__(self, dim, fmt="e4m3", group=None):
        if fmt not in FP8_FORMATS:
            raise ValueError(f"fp8 format {fmt!r} is not one of {sorted(FP8_FORMATS)}")
        group = int(dim) if group is None else int(group)
        if group < 1 or dim % group:
            raise ValueError(f"group {group} must be a positive divisor of the width {dim}")
        super().__init__(dim, dim + 4 * (dim // group))
        self.fmt, self.group = fmt, group
        self.spec = f"fp8-{fmt}" + ("" if group == dim else f"-g{group}")

    def quantize(self, X):
        return fp8_roundtrip(X, self.fmt, self.group)


def qjl_scale(d, sketch):
    """The constant c of the QJL estimator x_r = |r| c S^T sign(S r), which makes
    E_S[x_r] = r (arXiv 2504.19874).

    For S with i.i.d. N(0, 1) entries each row s gives E[s sign(s . u)] = sqrt(2/pi) u (u a unit
    vector), so c = sqrt(pi/2) / d (d rows). For S = sqrt(d) O, O uniformly random orthogonal,
    each row is sqrt(d) times a uniform unit vector o with E[o sign(o . u)] = E|o_1| u,
    E|o_1| = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)); so c = 1 / (d sqrt(d) E|o_1|).
    """
    if sketch == "gauss":
        return math.sqrt(math.pi / 2) / d
    if sketch == "orth":
        mean_abs = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
        return 1.0 / (d * math.sqrt(d) * mean_abs)
    raise ValueError(f"sketch {sketch!r} is not 'orth' or 'gauss'")


def qjl_sketch(d, sketch, seed=QJL_SEED):
    """The d x d sketch matrix S, float64: sqrt(d) times a uniformly random orthogonal matrix
    (QR of a Gaussian matrix, signs fixed by R's diagonal) or i.i.d. N(0, 1) entries."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((d, d))
    if sketch == "gauss":
        return G
    if sketch != "orth":
        raise ValueError(f"sketch {sketch!r} is not 'orth' or 'gauss'")
    Q, R = np.linalg.qr(G)
    return math.sqrt(d) * Q * np.sign(np.diag(R))[None, :]


class QJLResidualCodec(SimulatedCodec):
    """An MSE codec plus a 1-bit QJL sketch of its residual (TurboQuant_prod).

    x^ = x_mse + |r| c S^T sign(S r), r = x - x_mse, |r| rounded to fp16 (stored in 2 bytes).

    Parameters
    ----------
    dim : int
    mse : str or Codec
        The MSE codec (a real codec: its own encode and decode).
    sketch : {"orth", "gauss"}
    seed : int
        Seed of S.
    spec : str, optional
        The codec's name (default: the MSE codec's spec + ``+qjl`` or ``+qjl-gauss``).
    """

    def __init__(self, dim, mse, sketch="orth", seed=QJL_SEED, spec=None):
        mse = mse if isinstance(mse, Codec) else get_codec(mse, dim)
        if mse.dim != dim:
            raise ValueError(f"the MSE codec has width {mse.dim}, not {dim}")
        super().__init__(dim, mse.bytes_per_row + (dim + 7) // 8 + RESIDUAL_NORM_BYTES)
        self.mse = mse
        self.sketch = sketch
        self.S = qjl_sketch(dim, sketch, seed)
        self.c = qjl_scale(dim, sketch)
        self.spec = spec or f"{mse.spec}+qjl" + ("-gauss" if sketch == "gauss" else "")

    def residual_norm(self, r):
        """|r| per row, rounded to fp16 as stored; float64 (n,)."""
        norm = np.sqrt(np.einsum("ij,ij->i", r, r))
        with np.errstate(over="ignore"):
            stored = norm.astype(np.float16)
        if not np.isfinite(stored).all():
            raise ValueError(f"{self.spec}: a residual norm exceeds the fp16 maximum 65504")
        return stored.astype(np.float64)

    def quantize(self, X):
        x_mse = self.mse.decode(self.mse.encode(X)).astype(np.float64)
        r = X.astype(np.float64) - x_mse
        signs = np.where(r @ self.S.T >= 0.0, 1.0, -1.0)
        return x_mse + (self.residual_norm(r) * self.c)[:, None] * (signs @ self.S)


# --------------------------------------------------------------------------------------------
# Entry points (setup.cfg): one factory per name
# --------------------------------------------------------------------------------------------
def _factory(name, build):
    def factory(dim, **options):
        if options.pop("nonfinite", "raise") != "raise":
            raise ValueError(f"{name}: a simulated codec refuses non-finite rows only")
        if options:
            raise ValueError(f"{name} takes no options, got {sorted(options)}")
        return build(int(dim))
    factory.__name__ = name.replace("-", "_").replace("+", "_")
    return factory


fp8_e4m3 = _factory("fp8-e4m3", lambda d: FP8SimCodec(d, "e4m3"))
fp8_e5m2 = _factory("fp8-e5m2", lambda d: FP8SimCodec(d, "e5m2"))
fp8_e4m3_g32 = _factory("fp8-e4m3-g32", lambda d: FP8SimCodec(d, "e4m3", 32))
fp8_e5m2_g32 = _factory("fp8-e5m2-g32", lambda d: FP8SimCodec(d, "e5m2", 32))


def _qjl(bits, sketch):
    name = f"tq{bits}h+qjl" + ("-gauss" if sketch == "gauss" else "")
    return _factory(name, lambda d: QJLResidualCodec(d, f"tq{bits}:side_dtype=f16",
                                                     sketch=sketch, spec=name))


tq2h_qjl, tq3h_qjl, tq4h_qjl = (_qjl(b, "orth") for b in (2, 3, 4))
tq2h_qjl_gauss, tq3h_qjl_gauss, tq4h_qjl_gauss = (_qjl(b, "gauss") for b in (2, 3, 4))
