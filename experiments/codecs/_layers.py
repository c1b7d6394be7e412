"""What the layered codecs share: an inner kvquant codec whose codes and side values come first,
this layer's bytes and side values after them; and LSB-first bit packing of small codes."""
import numpy as np

from kvquant._kernels import bitpack
from kvquant._threads import resolve_n_threads
from kvquant.codecs import Codec, get_codec
from kvquant.codecs.base import ROW_NONFINITE, SIDE_DTYPES


def pack_codes(codes, width):
    """Pack unsigned codes of ``width`` (<= 8) bits, shape (n, k), LSB first -> uint8
    (n, ceil(k*width/8)): kvquant's compiled bit packing, the layout its codecs use."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    packed = np.empty((codes.shape[0], (codes.shape[1] * width + 7) // 8), np.uint8)
    bitpack.pack_rows(codes, width, packed, resolve_n_threads(None, codes.size))
    return packed


def unpack_codes(packed, k, width):
    """The inverse of :func:`pack_codes`: uint8 (n, bytes) -> uint8 codes (n, k)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    codes = np.empty((packed.shape[0], k), np.uint8)
    bitpack.unpack_rows(packed, width, codes, resolve_n_threads(None, codes.size))
    return codes


class LayeredCodec(Codec):
    """A codec over an inner kvquant codec (``inner``, a bare spec such as ``tq3`` or ``polar3``).

    Subclasses set ``own_bytes`` and ``own_side`` (their part of each row's codes and side
    values) and implement ``_encode`` / ``_decode`` through :meth:`split`; the side values of both
    parts are stored at ``side_dtype``.
    """

    own_bytes = 0
    own_side = 0

    def __init__(self, dim, inner, side_dtype="f32", nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if not isinstance(inner, str) or not inner or any(c in inner for c in ":@/,="):
            raise ValueError(
                f"inner={inner!r}: a bare codec spec (tq3, polar3, kv8, q4_0+rot ...); give its "
                "side value width as this codec's side_dtype option")
        if side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype={side_dtype!r} is not one of {tuple(SIDE_DTYPES)}")
        extra = {"side_dtype": side_dtype} if side_dtype != "f32" else {}
        self.inner = get_codec(inner, dim, nonfinite=nonfinite, **extra)
        self.inner_spec = inner.lower()
        self.side_dtype = side_dtype

    def _finish_layout(self):
        self.code_bytes = self.inner.code_bytes + self.own_bytes
        self.n_side = self.inner.n_side + self.own_side

    def _spec(self, name, **options):
        opts = [f"inner={self.inner_spec}"] + [f"{k}={v}" for k, v in options.items()]
        if self.side_dtype != "f32":
            opts.append(f"side_dtype={self.side_dtype}")
        return f"{name}:" + ",".join(opts)

    def split(self, codes, side):
        """(inner codes, inner side, own codes, own side) of stored rows."""
        cb, sb = self.inner.code_bytes, self.inner.n_side
        return (np.ascontiguousarray(codes[:, :cb]), np.ascontiguousarray(side[:, :sb]),
                codes[:, cb:], side[:, sb:])

    def finite_rows(self, X):
        """Rows holding NaN/inf get status ROW_NONFINITE and are zeroed in a copy (their bytes
        become an inert zero row); returns (X to encode, status)."""
        status = np.zeros(X.shape[0], np.uint8)
        bad = ~np.isfinite(X).all(axis=1)
        if bad.any():
            status[bad] = ROW_NONFINITE
            X = X.copy()
            X[bad] = 0.0
        return X, status

    def encode_inner(self, X, n_threads):
        enc = self.inner.encode(X, n_threads)
        return np.asarray(enc.codes), np.asarray(enc.side)

    def decode_inner(self, codes, side, n_threads):
        return self.inner.decode(self.inner.encoded_rows(codes, side), n_threads)

    def join(self, inner_codes, inner_side, own_codes, own_side, status):
        codes = np.concatenate([inner_codes, own_codes.reshape(len(inner_codes), -1)], axis=1)
        side = np.concatenate([inner_side, own_side.reshape(len(inner_side), -1)], axis=1)
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        side = np.ascontiguousarray(side, dtype=np.float32)
        bad = status != 0
        codes[bad] = 0
        side[bad] = 0.0
        return codes, side, status

    def round_side(self, values):
        """Side values as they will be stored (fp16-exact under side_dtype=f16), float32."""
        values = np.asarray(values, dtype=np.float32)
        if self.side_dtype == "f16":
            with np.errstate(over="ignore"):
                values = values.astype(np.float16).astype(np.float32)
        return values
