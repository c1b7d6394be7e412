"""What every codec shares: the encoded-rows container and input validation."""
from dataclasses import dataclass

import numpy as np

from kvquant._threads import resolve_n_threads

NONFINITE_POLICIES = ("raise", "inert")
# How side values are stored: the in-memory array is float32 either way; "f16" holds
# fp16-exact values and costs 2 bytes each in sizes and files.
SIDE_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
# Row status of the encoders (kvquant/_kernels/_common.pxd), plus one of the Python layer.
ROW_OK, ROW_NONFINITE, ROW_NORM_OVERFLOW = 0, 1, 2   # NORM_OVERFLOW: norm (kv8: amax) > ROW_LIMIT
ROW_SIDE_OVERFLOW = 3  # side value above the fp16 maximum (side_dtype="f16")
ROW_RANGE = 4          # finite, but the codec's float32 arithmetic cannot carry the row
# The engine's inert threshold, the float literal 3.4e38f (= 3.39999995e38, a little below
# FLT_MAX): no codec stores a row whose norm (kv8: an element) is above it.
ROW_LIMIT = float(np.float32(3.4e38))
FLT_MAX = float(np.finfo(np.float32).max)
F16_MAX = 65504.0


class UnknownCodecError(ValueError):
    """A spec that names no codec this process can build at any width: a name no built-in
    family or plug-in has, or bits or options its family refuses."""


class CodecWidthError(ValueError):
    """A codec that exists but refuses rows of the width asked (a rotated codec on a width that
    is not a power of two, a block or scale group that does not divide it)."""


@dataclass(frozen=True)
class EncodedRows:
    """Rows as a codec stores them.

    Attributes
    ----------
    codes : ndarray of shape (n_rows, code_bytes), dtype uint8
        The packed codes of each row.
    side : ndarray of shape (n_rows, n_side), dtype float32
        Side values of each row (scale, radius, ...). Always float32 in memory; a codec with
        ``side_dtype=f16`` stores fp16-exact values here and 2 bytes per value in sizes and files.
    spec : str
        Canonical spec of the codec that wrote them.
    dim : int
        Row width.
    side_dtype : {"f32", "f16"}
        How the side values are stored (the writing codec's ``side_dtype``).
    """

    codes: np.ndarray
    side: np.ndarray
    spec: str
    dim: int
    side_dtype: str = "f32"

    @property
    def n_rows(self):
        return self.codes.shape[0]

    def __len__(self):
        return self.codes.shape[0]

    @property
    def nbytes(self):
        """Stored bytes: codes plus side values at their stored width (not the float32 array)."""
        return self.codes.nbytes + self.side.size * SIDE_DTYPES[self.side_dtype].itemsize

    def __getitem__(self, rows):
        """A subset of rows (slice, index array or boolean mask, as numpy indexes the first axis);
        always 2-D: an integer ``i`` gives the one row ``i`` (negative from the end), and an index
        out of range raises IndexError."""
        if isinstance(rows, (int, np.integer)) and not isinstance(rows, (bool, np.bool_)):
            i = int(rows)
            n = self.codes.shape[0]
            if not -n <= i < n:
                raise IndexError(f"row index {i} is out of range for {n} encoded rows")
            i %= n
            rows = slice(i, i + 1)
        elif isinstance(rows, tuple):
            raise IndexError("EncodedRows take one index (rows), not a tuple")
        return EncodedRows(self.codes[rows], self.side[rows], self.spec, self.dim,
                           self.side_dtype)


class Codec:
    """Base class: subclasses set ``dim``, ``spec``, ``code_bytes``, ``n_side`` and implement
    ``_encode(X32, n_threads) -> (codes, side, status)`` and ``_decode(enc, n_threads)``.

    ``status`` is a uint8 array per row: 0 ok, 1 the row held NaN/inf, 2 its norm (kv8: an
    element) is above ROW_LIMIT, 4 its float32 arithmetic cannot carry it (``range_rule``).

    A subclass whose codes do not depend on the side values may set ``side_dtype = "f16"``:
    ``encode`` then rounds the side values to fp16 (nearest even) after ``_encode``; a value that
    overflows fp16 makes the row bad (status 3).
    """

    family = "base"
    # bits per element a spec names (tq4 -> 4), None when the codec names none; subclasses set it
    nominal_bits = None
    engine_tag = None  # the engine's format tag where this codec is one of its tiers
    # True for a research codec that stores rows after a quantize-dequantize and counts the
    # bytes its real format would store (bytes_per_row is then that nominal size, not its codes')
    simulated = False
    side_dtype = "f32"
    # what nonfinite="inert" does with a refused row (error messages)
    inert_rule = "stores them as inert zero rows (zero codes, side value 0), as the engine does"
    # what a row above ROW_LIMIT is (status ROW_NORM_OVERFLOW)
    limit_rule = "have a norm above 3.4e38 (the engine's limit, the float 3.4e38f)"
    # why a row is ROW_RANGE, and norms that are always accepted (None: no simple bound)
    range_rule = "its float32 arithmetic overflows"
    safe_norm = None

    def __init__(self, dim, nonfinite="raise"):
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite={nonfinite!r} is not one of {NONFINITE_POLICIES}: 'raise' rejects rows "
                f"with NaN/inf (or beyond the codec's range), 'inert' {self.inert_rule}"
            )
        self.dim = int(dim)
        self.nonfinite = nonfinite

    # -- sizes -------------------------------------------------------------------------------
    @property
    def bytes_per_row(self):
        """Stored bytes per row, side values included."""
        return self.code_bytes + SIDE_DTYPES[self.side_dtype].itemsize * self.n_side

    @property
    def bits_per_value(self):
        """Stored bits per element, side values included."""
        return 8.0 * self.bytes_per_row / self.dim

    @property
    def series(self):
        """The line this codec is drawn on in figures and grouped under in tables: the family,
        or a finer name where options change what the codec is (``tq gaussian``)."""
        return self.family

    @property
    def compression_ratio(self):
        """f32 bytes over stored bytes."""
        return 4.0 * self.dim / self.bytes_per_row

    def __repr__(self):
        return f"<{type(self).__name__} {self.spec!r} dim={self.dim} {self.bytes_per_row} B/row>"

    # -- validation --------------------------------------------------------------------------
    def as_rows(self, X):
        """Validate rows and return them C-contiguous float32 of shape (n_rows, dim)."""
        X = np.asarray(X)
        if X.dtype.kind != "f":
            raise TypeError(
                f"rows must be floating point (float32 or float64), got dtype {X.dtype}"
            )
        if X.ndim != 2:
            hint = "; use X[None, :] for a single row" if X.ndim == 1 else ""
            raise ValueError(
                f"expected a 2-D array of rows of shape (n_rows, {self.dim}), "
                f"got shape {X.shape}{hint}"
            )
        if X.shape[1] != self.dim:
            raise ValueError(
                f"codec {self.spec!r} was built for rows of width {self.dim}, "
                f"got rows of width {X.shape[1]}"
            )
        return np.ascontiguousarray(X, dtype=np.float32)

    def encoded_rows(self, codes, side):
        """``codes`` and ``side`` as EncodedRows of this codec (its spec, width, side dtype)."""
        return EncodedRows(codes, side, self.spec, self.dim, self.side_dtype)

    def check_encoded(self, enc):
        """Refuse rows written by another codec or with the wrong layout."""
        if not isinstance(enc, EncodedRows):
            raise TypeError(f"expected EncodedRows, got {type(enc).__name__}")
        if (enc.spec, enc.dim, enc.side_dtype) != (self.spec, self.dim, self.side_dtype):
            raise ValueError(
                f"rows were encoded by {enc.spec!r} (dim {enc.dim}, {enc.side_dtype} side "
                f"values); this codec is {self.spec!r} (dim {self.dim}, {self.side_dtype})"
            )
        if (enc.codes.dtype != np.uint8 or enc.codes.ndim != 2
                or enc.codes.shape[1] != self.code_bytes):
            raise ValueError(
                f"codes must be uint8 of shape (n_rows, {self.code_bytes}), "
                f"got {enc.codes.dtype} {enc.codes.shape}"
            )
        if (enc.side.dtype != np.float32 or enc.side.shape != (enc.codes.shape[0], self.n_side)):
            raise ValueError(
                f"side values must be float32 of shape ({enc.codes.shape[0]}, {self.n_side}), "
                f"got {enc.side.dtype} {enc.side.shape}"
            )
        if self.side_dtype == "f16":
            self._check_f16_exact(enc.side)
        return (np.ascontiguousarray(enc.codes), np.ascontiguousarray(enc.side))

    def _check_f16_exact(self, side):
        # Rows of an f16 codec came through encode or a file of 2-byte sides: anything else
        # was forged or damaged; decoding it would give sizes and results that disagree.
        with np.errstate(over="ignore", invalid="ignore"):
            exact = side.astype(np.float16).astype(np.float32)
        bad = (exact != side) & ~(np.isnan(exact) & np.isnan(side))
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1))
            raise ValueError(
                f"codec {self.spec!r} stores side values as float16, but {rows.size} row(s) hold "
                f"side values that float16 cannot represent (rows {_show_rows(rows)}): they were "
                "not written by this codec")

    def _round_side_f16(self, codes, side, status):
        """Round side values to fp16 in place (kept float32); a value that overflows fp16 marks
        its row ROW_SIDE_OVERFLOW and, as every bad row, leaves it inert (zero codes, side 0)."""
        with np.errstate(over="ignore"):
            side[:] = side.astype(np.float16)
        over = np.isinf(side).any(axis=1) & (status == ROW_OK)
        if over.any():
            status[over] = ROW_SIDE_OVERFLOW
            codes[over] = 0
            side[over] = 0.0

    def _raise_on_bad_rows(self, status):
        bad = np.flatnonzero(status)
        if bad.size == 0 or self.nonfinite == "inert":
            return
        kinds = set(status[bad].tolist())
        range_text = f"are beyond {self.spec}'s float32 range ({self.range_rule}"
        if self.safe_norm is not None:
            range_text += f"; rows of norm up to {self.safe_norm:.4g} always encode"
        range_text += ")"
        reasons = ((ROW_NONFINITE, "contain NaN or inf"),
                   (ROW_NORM_OVERFLOW, self.limit_rule),
                   (ROW_RANGE, range_text),
                   (ROW_SIDE_OVERFLOW, "have a side value above the float16 maximum 65504"))
        what = " or ".join(text for code, text in reasons if code in kinds)
        fix = "Clean them"
        if kinds & {ROW_NORM_OVERFLOW, ROW_RANGE}:
            fix = "Clean or scale them down"
        if ROW_SIDE_OVERFLOW in kinds:
            fix = ("Clean or scale them down (side_dtype=f16 holds side values up to 65504), "
                   "use side_dtype=f32")
        raise ValueError(
            f"{bad.size} row(s) {what} (rows {_show_rows(bad)}); nothing was stored. {fix}, or "
            f"build the codec with nonfinite='inert', which {self.inert_rule}"
        )

    # -- public API --------------------------------------------------------------------------
    def encode(self, X, n_threads=None):
        """Encode rows.

        Parameters
        ----------
        X : array-like of shape (n_rows, dim), float32 or float64, any strides
        n_threads : int or None
            None: the OpenMP default; -1: all cores.

        Returns
        -------
        EncodedRows
        """
        X32 = self.as_rows(X)
        codes, side, status = self._encode(X32, resolve_n_threads(n_threads, X32.size))
        if self.side_dtype == "f16":
            self._round_side_f16(codes, side, status)
        if status is not None:
            self._raise_on_bad_rows(status)
        return self.encoded_rows(codes, side)

    def decode(self, enc, n_threads=None):
        """Rebuild rows, float32 of shape (n_rows, dim)."""
        codes, side = self.check_encoded(enc)
        return self._decode(codes, side, resolve_n_threads(n_threads, codes.shape[0] * self.dim))

    def roundtrip(self, X, n_threads=None):
        """decode(encode(X))."""
        return self.decode(self.encode(X, n_threads), n_threads)

    # -- compressed-domain consumers ---------------------------------------------------------
    def scores(self, enc, q, n_threads=None):
        """Dot products of queries with every stored row, read from the codes (never decoded).

        Parameters
        ----------
        enc : EncodedRows
            T rows written by this codec.
        q : array-like of shape (dim,) or (m, dim), float32 or float64
        n_threads : int or None

        Returns
        -------
        ndarray of shape (T,) or (m, T), dtype float32
            ``q . x^_t`` with ``x^ = decode(enc)``, to rounding (docs/reference.md §1.5).
        """
        return self.scores_checked(*self.check_encoded(enc), q, n_threads)

    def scores_checked(self, codes, side, q, n_threads=None):
        """:meth:`scores` on rows already accepted by :meth:`check_encoded` (a cache checks its
        rows once, when it stores them, not at every read)."""
        Q, one = _as_matrix(q, self.dim, "queries q", f"the row width {self.dim}")
        out = np.empty((Q.shape[0], codes.shape[0]), np.float32)
        self._scores(codes, side, Q, out, resolve_n_threads(n_threads))
        return out[0] if one else out

    def context(self, enc, w, n_threads=None):
        """Weighted sums of the stored rows, read from the codes (never decoded).

        Parameters
        ----------
        enc : EncodedRows
            T rows written by this codec.
        w : array-like of shape (T,) or (m, T), float32 or float64
        n_threads : int or None

        Returns
        -------
        ndarray of shape (dim,) or (m, dim), dtype float32
            ``sum_t w_t x^_t``, to rounding. The same bits for any ``n_threads``.
        """
        return self.context_checked(*self.check_encoded(enc), w, n_threads)

    def context_checked(self, codes, side, w, n_threads=None):
        """:meth:`context` on rows already accepted by :meth:`check_encoded`."""
        W, one = _as_matrix(w, codes.shape[0], "weights w", f"the number of rows {codes.shape[0]}")
        out = np.empty((W.shape[0], self.dim), np.float32)
        self._context(codes, side, W, out, resolve_n_threads(n_threads))
        return out[0] if one else out

    @property
    def compressed_consumers(self):
        """True when attention reads this codec's codes directly (it overrides both consumer
        hooks); False when it reads decoded rows through the prototype hooks below (results
        that use such a codec say so)."""
        cls = type(self)
        return cls._scores is not Codec._scores and cls._context is not Codec._context

    # Consumer hooks. Q (m, dim) and W (m, T) arrive C-contiguous float32, codes and side checked;
    # fill `out`. The versions here decode and then multiply: a reference for prototyping a new
    # codec, NOT for shipping. Every built-in codec overrides both with a compressed-domain
    # kernel (kvquant._kernels.consumers); tests/test_consumers.py fails on one that does not.
    def _scores(self, codes, side, Q, out, n_threads):
        X = self._decode(codes, side, n_threads)
        np.matmul(Q, X.T, out=out)

    def _context(self, codes, side, W, out, n_threads):
        X = self._decode(codes, side, n_threads)
        np.matmul(W, X, out=out)


# Which widths each family takes (kv8 takes any width).
WIDTH_RULE = ("tq<b>, polar<b> and the +rot codecs need a power-of-two width (>= 2), q8_0/q4_0 "
              "a multiple of 32, kv8-g<N> a multiple of N; kv8 takes any width")


def codecs_for_width(dim):
    """The codecs to suggest for a width the rotated codecs refuse: kv8, and q8_0/q4_0 when
    their 32-value blocks divide it."""
    return "kv8 (or q8_0/q4_0)" if dim % 32 == 0 else "kv8"


def _show_rows(rows):
    return ", ".join(str(i) for i in rows[:10]) + (" ..." if rows.size > 10 else "")


def _as_matrix(a, width, what, width_name):
    """Coerce a vector (width,) or a matrix (m, width) of floats to C-contiguous float32 (m, width);
    also return whether the input was a vector."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise TypeError(f"{what} must be floating point (float32 or float64), got dtype {a.dtype}")
    if a.ndim not in (1, 2) or a.shape[-1] != width:
        raise ValueError(
            f"{what} must have shape ({width},) or (m, {width}) to match {width_name}, "
            f"got shape {a.shape}"
        )
    one = a.ndim == 1
    return np.ascontiguousarray(a.reshape(1, -1) if one else a, dtype=np.float32), one
