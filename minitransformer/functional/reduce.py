"""Reductions: sum, mean, max over an axis, a tuple of axes, or everything (axis=None).

Backward broadcasts the output gradient back over the reduced axes. Sums of 16-bit tensors
accumulate in float32 and round once at the end (as PyTorch does): adding thousands of
float16 terms one by one in float16 would lose most of their digits.
"""

from __future__ import annotations

from .. import backend
from ..autograd import Function
from ..tensor import Tensor


def _normalize_axes(axis, ndim: int) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimensions")
    return tuple(sorted(a % ndim for a in axes))


def _expand(g, shape: tuple, axes: tuple, keepdims: bool):
    """Broadcast a reduced gradient back to ``shape`` (a read-only view)."""
    if not keepdims:
        g = g.reshape(tuple(1 if i in axes else n for i, n in enumerate(shape)))
    return backend.array_module_of(g).broadcast_to(g, shape)


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = x.shape, axes, keepdims
        out = x.sum(axis=axes, keepdims=keepdims, dtype=backend.compute_dtype(x.dtype))
        return out.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        return _expand(g, ctx.shape, ctx.axes, ctx.keepdims), None, None


class Mean(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = x.shape, axes, keepdims
        out = x.mean(axis=axes, keepdims=keepdims, dtype=backend.compute_dtype(x.dtype))
        return out.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        count = 1
        for a in ctx.axes:
            count *= ctx.shape[a]
        return _expand(g / count, ctx.shape, ctx.axes, ctx.keepdims), None, None


class Max(Function):
    """The gradient goes to the maximal elements, split evenly between ties."""

    @staticmethod
    def forward(ctx, x, axes, keepdims):
        out = x.max(axis=axes, keepdims=True)
        hits = x == out
        ctx.save_for_backward(hits, hits.sum(axis=axes, keepdims=True))
        ctx.axes, ctx.keepdims = axes, keepdims
        return out if keepdims else out.squeeze(axis=axes)

    @staticmethod
    def backward(ctx, g):
        hits, count = ctx.saved
        return _expand(g, hits.shape, ctx.axes, ctx.keepdims) * hits / count, None, None


def sum(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return Sum.apply(x, _normalize_axes(axis, x.ndim), keepdims)


def mean(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return Mean.apply(x, _normalize_axes(axis, x.ndim), keepdims)


def max(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return Max.apply(x, _normalize_axes(axis, x.ndim), keepdims)
