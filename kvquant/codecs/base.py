"""What every codec shares: the encoded-rows container and input validation."""
from dataclasses import dataclass

import numpy as np

from kvquant._threads import resolve_n_threads

NONFINITE_POLICIES = ("raise", "inert")


@dataclass(frozen=True)
class EncodedRows:
    """Rows as a codec stores them.

    Attributes
    ----------
    codes : ndarray of shape (n_rows, code_bytes), dtype uint8
        The packed codes of each row.
    side : ndarray of shape (n_rows, n_side), dtype float32
        Side values of each row (scale, radius, ...), as stored.
    spec : str
        Canonical spec of the codec that wrote them.
    dim : int
        Row width.
    """

    codes: np.ndarray
    side: np.ndarray
    spec: str
    dim: int

    @property
    def n_rows(self):
        return self.codes.shape[0]

    def __len__(self):
        return self.codes.shape[0]

    @property
    def nbytes(self):
        return self.codes.nbytes + self.side.nbytes

    def __getitem__(self, rows):
        """A subset of rows (slice, index array or mask); always 2-D."""
        if isinstance(rows, (int, np.integer)):
            rows = slice(int(rows), int(rows) + 1 if rows != -1 else None)
        return EncodedRows(self.codes[rows], self.side[rows], self.spec, self.dim)


class Codec:
    """Base class: subclasses set ``dim``, ``spec``, ``code_bytes``, ``n_side`` and implement
    ``_encode(X32, n_threads) -> (codes, side, status)`` and ``_decode(enc, n_threads)``.

    ``status`` is a uint8 array per row: 0 ok, 1 the row held NaN/inf, 2 its norm overflows f32.
    """

    family = "base"
    engine_tag = None  # the engine's format tag where this codec is one of its tiers

    def __init__(self, dim, nonfinite="raise"):
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite={nonfinite!r} is not one of {NONFINITE_POLICIES}: 'raise' rejects rows "
                "with NaN/inf, 'inert' stores them as zero rows as the engine does"
            )
        self.dim = int(dim)
        self.nonfinite = nonfinite

    # -- sizes -------------------------------------------------------------------------------
    @property
    def bytes_per_row(self):
        """Stored bytes per row, side values included."""
        return self.code_bytes + 4 * self.n_side

    @property
    def bits_per_value(self):
        """Stored bits per element, side values included."""
        return 8.0 * self.bytes_per_row / self.dim

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

    def check_encoded(self, enc):
        """Refuse rows written by another codec or with the wrong layout."""
        if not isinstance(enc, EncodedRows):
            raise TypeError(f"expected EncodedRows, got {type(enc).__name__}")
        if enc.spec != self.spec or enc.dim != self.dim:
            raise ValueError(
                f"rows were encoded by {enc.spec!r} (dim {enc.dim}); "
                f"this codec is {self.spec!r} (dim {self.dim})"
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
        return (np.ascontiguousarray(enc.codes), np.ascontiguousarray(enc.side))

    def _raise_on_bad_rows(self, status):
        bad = np.flatnonzero(status)
        if bad.size == 0 or self.nonfinite == "inert":
            return
        overflow = bad[status[bad] == 2]
        nonfinite = bad[status[bad] == 1]
        shown = ", ".join(str(i) for i in bad[:10]) + (" ..." if bad.size > 10 else "")
        what = "contain NaN or inf" if overflow.size == 0 else (
            "have a norm that overflows float32" if nonfinite.size == 0
            else "contain NaN/inf or have a norm that overflows float32")
        raise ValueError(
            f"{bad.size} row(s) {what} (rows {shown}); nothing was stored. Clean them, or build "
            f"the codec with nonfinite='inert' to store them as inert zero rows as the engine does"
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
        codes, side, status = self._encode(X32, resolve_n_threads(n_threads))
        if status is not None:
            self._raise_on_bad_rows(status)
        return EncodedRows(codes, side, self.spec, self.dim)

    def decode(self, enc, n_threads=None):
        """Rebuild rows, float32 of shape (n_rows, dim)."""
        codes, side = self.check_encoded(enc)
        return self._decode(codes, side, resolve_n_threads(n_threads))

    def roundtrip(self, X, n_threads=None):
        """decode(encode(X))."""
        return self.decode(self.encode(X, n_threads), n_threads)
