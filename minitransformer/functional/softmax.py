"""Softmax and log-softmax along an axis, numerically stable, safe on fully masked rows.

    softmax(x)_i     = exp(x_i - m) / sum_j exp(x_j - m),   m = max_j x_j
    log_softmax(x)_i = x_i - m - log sum_j exp(x_j - m)

Subtracting the row maximum m keeps exp() from overflowing (logits of 1e4 are fine). A row
whose entries are all -inf (every key masked out) has no maximum to subtract; there m is
taken as 0, the row's exponentials are all 0, and the row's softmax is defined as all zeros
(its log-softmax all -inf) instead of the 0/0 = NaN that the formula would give.

16-bit inputs are computed in float32 (the sums over a row would lose digits in float16) and
the result is rounded back to the input's dtype.

Backward, with y = softmax(x) and upstream gradient g:
    dx = y * (g - sum(g * y))              for softmax
    dx = g - exp(out) * sum(g)             for log-softmax
"""

from __future__ import annotations

import numpy as np

from .. import backend, kernels
from ..autograd import Function
from ..tensor import Tensor


def row_max(x, axis: int):
    """``x.max(axis, keepdims=True)``, the same numbers. NumPy reduces a short last axis row by
    row, some 100 ns a row (attention's rows of a decoding step hold 5 to 60 keys); across a
    transposed copy, the maximum runs down whole rows of elements at once, 2 to 20 times faster."""
    width = x.shape[axis] if x.ndim else 1
    if backend.array_module_of(x) is not np or axis not in (-1, x.ndim - 1) or not 1 < width <= _SHORT_ROW:
        return x.max(axis=axis, keepdims=True)
    columns = np.ascontiguousarray(x.reshape(-1, width).T)  # (width, rows)
    return columns.max(axis=0).reshape(x.shape[:-1] + (1,))


_SHORT_ROW = 64  # keys; from about 96 on, NumPy's own reduction is as fast


def stable_softmax_parts(x, axis: int):
    r"""$x - m$, $e^{x - m}$ and $\sum e^{x - m}$ per row, $m$ the row's maximum, with the
    fully-masked-row guard; in float32 for 16-bit ``x``."""
    xp = backend.array_module_of(x)
    x = x.astype(backend.compute_dtype(x.dtype), copy=False)
    m = row_max(x, axis)
    m = xp.where(xp.isfinite(m), m, 0)
    shifted = x - m
    e = xp.exp(shifted)
    s = e.sum(axis=axis, keepdims=True)
    return shifted, e, s


def softmax_array(x, axis: int = -1):
    """The softmax of an array (no autograd), in float32 for 16-bit ``x``: also used by
    attention."""
    xp = backend.array_module_of(x)
    _, e, s = stable_softmax_parts(x, axis)
    e /= xp.where(s == 0, 1, s)  # an all -inf row: 0 / 1 = zeros
    return e


def log_softmax_parts(x, axis: int = -1):
    """``(x - m, log sum exp(x - m))``: the log-softmax is their difference. Beam search keeps
    the two apart and subtracts only for the candidates it scores."""
    xp = backend.array_module_of(x)
    shifted, _, s = stable_softmax_parts(x, axis)
    return shifted, xp.log(xp.where(s == 0, 1, s))


def log_softmax_parts_(x):
    """``log_softmax_parts(x)`` over the last axis of a 2-D array, overwriting ``x`` on the CPU:
    there ``x`` becomes the shifted part, computed in blocks of rows small enough to stay in
    cache while they are reduced, exponentiated and summed, on every CPU thread
    (``backend.row_blocks``). For beam search, whose (rows, V) logits are a step's largest array
    and are not needed once shifted. The shifted part is the same numbers; the sums are a
    product with a vector of ones, which BLAS computes four times as fast as NumPy's pairwise
    sum, in another order: the log-sums agree to float rounding."""
    if backend.array_module_of(x) is not np or x.dtype not in (np.float32, np.float64):
        return log_softmax_parts(x)
    rows, width = x.shape
    log_sum = np.empty((rows, 1), x.dtype)
    step = max(1, _BLOCK_BYTES // (width * x.itemsize))
    ones = np.ones(width, x.dtype)

    def shift(start: int, stop: int) -> None:
        exp = np.empty((min(step, stop - start), width), x.dtype)  # one buffer for every block
        for i in range(start, stop, step):
            block = x[i:min(i + step, stop)]
            m = block.max(axis=1, keepdims=True)
            block -= np.where(np.isfinite(m), m, 0)
            e = np.exp(block, out=exp[:len(block)])
            s = (e @ ones)[:, None]
            log_sum[i:i + len(block)] = np.log(np.where(s == 0, 1, s))

    backend.row_blocks(shift, rows, x, min_rows=_SPLIT_ELEMENTS // width)
    return x, log_sum


# Rows of a log_softmax_parts_ block: 1 MB, a core's L2 cache here. Smaller blocks pay NumPy's
# cost per call more often: 256 KB blocks took 7.2 ms, 1 MB blocks 4.6 ms, on a 1,024 x 8,000 step.
_BLOCK_BYTES = 1 << 20
# Elements a thread takes at least: below some 500,000 (64 rows of 8,000) one thread is as fast.
_SPLIT_ELEMENTS = 1 << 19


def log_softmax_array(x, axis: int = -1):
    shifted, log_sum = log_softmax_parts(x, axis)
    shifted -= log_sum
    return shifted


class Softmax(Function):
    @staticmethod
    def forward(ctx, x, axis):
        y = softmax_array(x, axis).astype(x.dtype, copy=False)
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        y, g = backend.upcast(y, g)  # backward sums over rows too
        return y * (g - (g * y).sum(axis=ctx.axis, keepdims=True)), None


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, x, axis):
        out = log_softmax_array(x, axis).astype(x.dtype, copy=False)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        out, g = backend.upcast(out, g)
        xp = backend.array_module_of(g)
        return g - xp.exp(out) * g.sum(axis=ctx.axis, keepdims=True), None


class FusedSoftmax(Function):
    """csrc/softmax.cu over the last axis (see minitransformer.kernels)."""

    @staticmethod
    def forward(ctx, x):
        y = kernels.softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return kernels.softmax_backward(y, g)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    if axis in (-1, len(x.shape) - 1) and x.data.size and kernels.enabled_for(x.data):  # empty: no launch
        return FusedSoftmax.apply(x)
    return Softmax.apply(x, axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return LogSoftmax.apply(x, axis)
