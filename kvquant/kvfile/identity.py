"""What fixes the meaning of a codec's stored bytes (its identity, as a kvq header records it)
and the rules of side values (checked on writing, made inert on loading as the engine does)."""
import numpy as np

from kvquant.codecs import get_codec
from kvquant.codecs.base import SIDE_DTYPES
from kvquant.kvfile.schema import SIDE_MAX
from kvquant.rotation import ORDERING, SIGN_HASH


def side_kind(codec):
    """What a codec's side values are: ``scale`` (> 0), ``none``, or a radius-like value
    (``norm``, ``unbiased``, ``radius``: >= 0)."""
    if codec.n_side == 0:
        return "none"
    if getattr(codec, "family", None) == "kv8":
        return "scale"
    return str(getattr(codec, "side_kind", "radius"))


def codec_identity(codec):
    """Everything that fixes what a codec's stored bytes mean, as a JSON-able dict."""
    rotation = getattr(codec, "rotation", None)
    ident = {
        "spec": codec.spec,
        "family": getattr(codec, "family", type(codec).__name__),
        "bits": getattr(codec, "bits", None),
        "dim": int(codec.dim),
        "code_bytes": int(codec.code_bytes),
        "n_side": int(codec.n_side),
        "side": side_kind(codec),
        "side_dtype": codec.side_dtype,
        "engine_tag": None if codec.engine_tag is None else int(codec.engine_tag),
        "rotation": None,
        "codebook": None,
    }
    if rotation is not None:
        ident["rotation"] = {
            "identity": rotation.identity,
            "seed": int(rotation.seed),
            "sign_hash": getattr(rotation, "sign_hash", SIGN_HASH),
            "ordering": getattr(rotation, "ordering", ORDERING),
        }
    if getattr(codec, "codebook_identity", None) is not None:
        ident["codebook"] = {"identity": codec.codebook_identity,
                             "checksum": getattr(codec, "codebook_checksum", None)}
    return ident


def side_bytes(side_dtype):
    """Bytes of one stored side value, or None for a dtype this kvquant does not know."""
    dtype = SIDE_DTYPES.get(side_dtype)
    return None if dtype is None else dtype.itemsize


def build_codec(spec, dim, nonfinite):
    return get_codec(spec, dim, nonfinite=nonfinite)


def sanitize_rows(codes, side, kind, kv8):
    """Make rows with bad side values inert, in place, as the engine's loader does.

    codes : (n, rows, code_bytes) uint8; side : (n, rows, n_side) float32.
    ``scale`` rows (fp8): a scale that is not in (0, 3.4e38) zeroes its group's bytes and
    becomes 1; radius-like rows: a radius not in [0, 3.4e38) becomes 0. fp8 bytes 0x7F/0xFF
    (NaN, never written by an encoder) become 0.

    Returns
    -------
    (bad_side_tokens, bad_code_tokens) : ndarray of token indices
    """
    n = side.shape[0]
    empty = np.zeros(0, np.int64)
    bad_side = bad_code = empty
    if kind != "none" and side.size:
        with np.errstate(invalid="ignore"):
            if kind == "scale":
                bad = ~((side > 0) & (side < SIDE_MAX))
            else:
                bad = ~((side >= 0) & (side < SIDE_MAX))
        if bad.any():
            bad_side = np.flatnonzero(bad.reshape(n, -1).any(axis=1))
            if kind == "scale":
                group = codes.shape[2] // side.shape[2]
                codes[np.repeat(bad, group, axis=2)] = 0
                side[bad] = 1.0
            else:
                side[bad] = 0.0
    if kv8 and codes.size:
        nan_bytes = (codes & 0x7F) == 0x7F
        if nan_bytes.any():
            bad_code = np.flatnonzero(nan_bytes.reshape(n, -1).any(axis=1))
            codes[nan_bytes] = 0
    return bad_side, bad_code


def check_side_values(side, kind, stream):
    """Refuse (ValueError) side values that the loader would have to make inert."""
    if kind == "none" or side.size == 0:
        return
    with np.errstate(invalid="ignore"):
        ok = (side > 0) if kind == "scale" else (side >= 0)
        ok &= side < SIDE_MAX
    if not ok.all():
        tokens = np.flatnonzero(~ok.reshape(side.shape[0], -1).all(axis=1))
        shown = ", ".join(str(t) for t in tokens[:10]) + (" ..." if tokens.size > 10 else "")
        rule = "in (0, 3.4e38)" if kind == "scale" else "in [0, 3.4e38)"
        raise ValueError(f"stream {stream!r}: side values ({kind}) must be {rule}; "
                         f"bad in token(s) {shown}: nothing was appended")
