"""Token embeddings and the sinusoidal positional encoding (paper sections 3.4 and 3.5)."""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from .. import functional as F
from ..tensor import Tensor
from . import init
from .layers import check_int
from .module import Module, Parameter


class Embedding(Module):
    r"""A (num_embeddings, d_model) table of learned vectors, looked up by integer id.

    Initialised from a normal distribution of standard deviation $d_{\mathrm{model}}^{-1/2}$
    (variance $1/d_{\mathrm{model}}$): the Transformer multiplies embeddings by
    $\sqrt{d_{\mathrm{model}}}$ (section 3.4), which brings them to unit scale, and with tied
    weights the same matrix maps decoder states to logits of moderate size.
    """

    def __init__(self, num_embeddings: int, d_model: int) -> None:
        super().__init__()
        check_int("Embedding", "num_embeddings", num_embeddings)
        check_int("Embedding", "d_model", d_model)
        self.weight = Parameter(init.normal((num_embeddings, d_model), d_model**-0.5))

    def forward(self, ids) -> Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


def sinusoid_table(length: int, d_model: int) -> np.ndarray:
    r"""$\mathrm{PE}_{(pos, 2i)} = \sin(pos / 10000^{2i/d_{\mathrm{model}}})$ and
    $\mathrm{PE}_{(pos, 2i+1)} = \cos(pos / 10000^{2i/d_{\mathrm{model}}})$, section 3.5: a
    (length, d_model) table."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    inv_freq = np.exp(-math.log(10000.0) * np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    table = np.zeros((length, d_model))
    table[:, 0::2] = np.sin(pos * inv_freq)
    table[:, 1::2] = np.cos(pos * inv_freq[: d_model // 2])
    return table


class PositionalEncoding(Module):
    """Adds position information to (B, T, d_model) inputs, starting at position ``offset``.

    Sinusoidal by default (section 3.5): a fixed formula, its table grown on demand, so a
    forward pass of any length works. ``learned=True`` is the paper's ablation (Table 3, row
    E): a trained table of ``max_len`` rows, which cannot extrapolate past them. Decoding reads
    sources of at most ``config.max_len`` tokens either way (it splits longer ones); outputs may
    run 50 tokens further with sinusoids (the export to CTranslate2 writes that many rows), and
    stop at ``max_len`` with a learned table.
    """

    def __init__(self, d_model: int, max_len: int = 1024, learned: bool = False) -> None:
        super().__init__()
        check_int("PositionalEncoding", "d_model", d_model)
        check_int("PositionalEncoding", "max_len", max_len)
        self.d_model, self.learned = d_model, learned
        if learned:
            self.weight = Parameter(init.normal((max_len, d_model), d_model**-0.5))
        else:
            self._table = Tensor(sinusoid_table(max_len, d_model).astype(np.float32))

    def table(self, length: int, device: str, dtype=np.float32) -> Tensor:
        """A table of at least ``length`` rows on ``device`` (the caller slices it); the
        sinusoids are kept in ``dtype`` (the activations', so that a 16-bit model stays 16-bit)."""
        if self.learned:
            if length > self.weight.shape[0]:
                raise ValueError(
                    f"learned positional encoding has {self.weight.shape[0]} positions, "
                    f"input needs {length}"
                )
            return self.weight
        rows = self._table.shape[0]
        if length > rows:  # grow by doubling: amortised O(1)
            rows = max(length, 2 * rows)
        if rows != self._table.shape[0] or self._table.device != device or self._table.dtype != dtype:
            # Rebuilt from the float64 formula, never cast from a cached 16-bit copy.
            table = sinusoid_table(rows, self.d_model).astype(dtype)
            self._table = Tensor(backend.to_device(table, device))
        return self._table

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        t = x.shape[-2]
        return x + self.table(offset + t, x.device, x.dtype)[offset: offset + t]

    def extra_repr(self) -> str:
        return f"{self.d_model}, learned={self.learned}"
