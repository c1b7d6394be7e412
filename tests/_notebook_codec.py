"""A codec as a notebook cell defines it (~20 lines), for the tests that run it wherever kvquant
promises a registered codec runs (tests/test_codec_contract.py,
tests/test_registered_codec_everywhere.py).

:data:`NOTEBOOK_CELL` is the cell's text: run by :func:`run_notebook_cell`, its class lives in
``__main__``, which worker processes cannot import, so executors must carry it to them by value.
The same class is also defined here at module level (:class:`HalfSign`, :func:`factory`), as an
installed package would define it behind an entry point of the group ``kvquant.codecs``: a
second, independent way in to the same codec.
"""
import contextlib

# The cell without its registration line: the codec's code, shared by the cell and the
# "installed" copy below, so that the two cannot drift apart.
CODEC_SOURCE = '''
import numpy as np
import kvquant

class HalfSign(kvquant.Codec):
    family = "half-sign"
    def __init__(self, dim, nonfinite="raise"):
        super().__init__(dim, nonfinite)
        self.spec, self.code_bytes, self.n_side = "halfsign", (dim + 7) // 8, 1
    def _encode(self, X, n_threads):
        status = (~np.isfinite(X).all(axis=1)).astype(np.uint8)
        X = np.where(np.isfinite(X), X, 0)
        scale = (0.5 * np.abs(X).max(axis=1)).astype(np.float32)[:, None]
        return np.packbits(X >= 0, axis=1, bitorder="little"), scale, status
    def _decode(self, codes, side, n_threads):
        bits = np.unpackbits(codes, axis=1, count=self.dim, bitorder="little")
        return ((2.0 * bits - 1.0) * side).astype(np.float32)
'''

NOTEBOOK_CELL = CODEC_SOURCE + '''
kvquant.register_codec("halfsign", lambda dim, **options: HalfSign(dim, **options))
'''

NAME = "halfsign"


def code_bytes(dim):
    """Bytes of one row as the cell's codec stores it: a sign bit per value, one float32
    scale."""
    return (dim + 7) // 8 + 4


@contextlib.contextmanager
def notebook_codec():
    """Run :data:`NOTEBOOK_CELL` as a notebook runs a cell (its names in ``__main__``'s
    namespace, not an importable module); unregister the codec on exit."""
    exec(compile(NOTEBOOK_CELL, "<cell>", "exec"), {"__name__": "__main__"})
    try:
        yield NAME
    finally:
        import kvquant
        kvquant.unregister_codec(NAME)


# The installed copy: the same class, defined in this module (importable as
# _notebook_codec.HalfSign, as a package's class is).
_namespace = {"__name__": __name__}
exec(compile(CODEC_SOURCE, __file__, "exec"), _namespace)
HalfSign = _namespace["HalfSign"]


def factory(dim, **options):
    """The codec's factory as a package's entry point names it (``_notebook_codec:factory``)."""
    return HalfSign(dim, **options)
