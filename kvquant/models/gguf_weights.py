"""A GGUF file's tensors, left in their GGUF types and memory-mapped, dequantized on demand.

:class:`~kvquant.models.gguf_file.GGUFFile` maps the file; a tensor stays as its quantized bytes until the forward asks
for it. Every GGUF type is blocked along rows (a block never crosses a row), so rows of a matrix
can be dequantized on their own: the embedding dequantizes only the rows of the tokens asked and
the output matrix is applied in row blocks.

Memory policy (``budget_bytes``): float32 copies are kept, in this order, while their total stays
within the budget: the output matrix (read by every logits call), then the blocks' matrices in
layer order. What does not fit is dequantized again each time the forward needs it (one matrix at
a time, freed after use), so the resident cost of a model is its mapped file plus the budget plus
one layer's float32 matrices.
"""
import numpy as np

__all__ = ["DEFAULT_BUDGET_BYTES", "GGUFWeights"]

DEFAULT_BUDGET_BYTES = 4 << 30      # 4 GiB of float32 copies
OUTPUT_ROW_BLOCK = 16384            # vocab rows per block when the output matrix is not kept


class GGUFWeights:
    """The tensors of a GGUF file, by GGUF name.

    Parameters
    ----------
    reader : kvquant.models.gguf_file.GGUFFile
    path : str
        For error messages.
    budget_bytes : int
        Bytes of float32 copies to keep (module docstring).
    """

    def __init__(self, reader, path, budget_bytes=DEFAULT_BUDGET_BYTES):
        from gguf.quants import dequantize
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._dequantize = dequantize
        self.path = path
        self.tensors = reader.tensors
        self.budget_bytes = int(budget_bytes)
        self.kept_bytes = 0
        self._kept = {}

    def __contains__(self, name):
        return name in self.tensors

    def shape(self, name):
        """(rows, cols) of a matrix as numpy sees it: ggml lists (cols, rows)."""
        t = self._tensor(name)
        return tuple(reversed(t.shape))

    def _tensor(self, name):
        if name not in self.tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name]

    def check_shape(self, name, shape):
        got = self.shape(name)
        # a vector may be stored as (n,) or (1, n)
        if got != tuple(shape) and not (len(shape) == 1 and got == (1,) + tuple(shape)):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {got}, expected {shape}")

    def keep(self, name):
        """Keep a float32 copy of ``name`` if it fits the budget; returns whether it is kept."""
        if name in self._kept:
            return True
        t = self._tensor(name)
        nbytes = 4 * int(t.n_elements)
        if self.kept_bytes + nbytes > self.budget_bytes:
            return False
        self._kept[name] = self._full(t)
        self.kept_bytes += nbytes
        return True

    def is_kept(self, name):
        return name in self._kept

    def get(self, name):
        """The float32 array (rows, cols), or (n,) for a vector: the kept copy or a new one."""
        if name in self._kept:
            return self._kept[name]
        return self._full(self._tensor(name))

    def _full(self, t):
        w = self._dequantize(t.data, t.tensor_type)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and w.shape[0] == 1:
            w = w[0]
        return w

    def rows(self, name, ids):
        """Rows ``ids`` of a matrix as float32 (len(ids), cols), dequantizing only those rows."""
        if name in self._kept:
            return self._kept[name][ids]
        t = self._tensor(name)
        ids = np.asarray(ids, dtype=np.int64)
        uniq, inverse = np.unique(ids, return_inverse=True)
        block = np.asarray(self._dequantize(t.data[uniq], t.tensor_type), dtype=np.float32)
        return block.reshape(uniq.size, -1)[inverse.reshape(-1)]

    def matmul_t(self, X, name):
        """``X @ W.T`` for the matrix W = ``name`` (rows, cols), X of shape (m, cols), float32;
        W is read in blocks of rows when it is not kept, so only one block is float32 at once."""
        if name in self._kept:
            return X @ self._kept[name].T
        t = self._tensor(name)
        n_rows = self.shape(name)[0]
        out = np.empty((X.shape[0], n_rows), np.float32)
        for r0 in range(0, n_rows, OUTPUT_ROW_BLOCK):
            r1 = min(r0 + OUTPUT_ROW_BLOCK, n_rows)
            W = np.asarray(self._dequantize(t.data[r0:r1], t.tensor_type), np.float32)
            np.matmul(X, W.reshape(r1 - r0, -1).T, out=out[:, r0:r1])
        return out
