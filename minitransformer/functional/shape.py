"""Ops that move elements without arithmetic: reshape, transpose/permute, concat/stack,
indexing, and the embedding lookup (indexing rows of a weight matrix).
"""

from __future__ import annotations

from .. import backend
from ..autograd import Function
from ..tensor import Tensor


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class Transpose(Function):
    @staticmethod
    def forward(ctx, x, axis0, axis1):
        ctx.axes = (axis0, axis1)
        return x.swapaxes(axis0, axis1)

    @staticmethod
    def backward(ctx, g):
        return g.swapaxes(*ctx.axes), None, None


class Permute(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, g):
        inverse = [0] * len(ctx.axes)
        for i, a in enumerate(ctx.axes):
            inverse[a] = i
        return g.transpose(inverse), None


class Concat(Function):
    @staticmethod
    def forward(ctx, axis, *xs):
        ctx.axis = axis
        ctx.bounds = [x.shape[axis] for x in xs]
        return backend.array_module_of(xs[0]).concatenate(xs, axis=axis)

    @staticmethod
    def backward(ctx, g):
        grads, start = [], 0
        for n in ctx.bounds:
            index = [slice(None)] * g.ndim
            index[ctx.axis] = slice(start, start + n)
            grads.append(g[tuple(index)])
            start += n
        return (None, *grads)


class Stack(Function):
    @staticmethod
    def forward(ctx, axis, *xs):
        ctx.axis = axis
        return backend.array_module_of(xs[0]).stack(xs, axis=axis)

    @staticmethod
    def backward(ctx, g):
        xp = backend.array_module_of(g)
        n = g.shape[ctx.axis]
        return (None, *(xp.take(g, i, axis=ctx.axis) for i in range(n)))


def _has_integer_array(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(hasattr(i, "dtype") and i.dtype.kind in "iu" for i in items)


class GetItem(Function):
    """``x[index]`` with basic (slices, ints, None, ...) or advanced (integer/bool array) indexing."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.shape, ctx.index = x.shape, index
        return x[index]

    @staticmethod
    def backward(ctx, g):
        xp = backend.array_module_of(g)
        grad = xp.zeros(ctx.shape, dtype=g.dtype)
        if _has_integer_array(ctx.index):  # an index may repeat: its gradients must add up
            backend.index_add(grad, ctx.index, g)
        else:
            grad[ctx.index] = g
        return grad, None


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``ids``; a repeated id accumulates gradient."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved
        xp = backend.array_module_of(g)
        # A frequent token's row sums thousands of terms: accumulate 16-bit gradients in float32.
        (g,) = backend.upcast(g)
        grad = xp.zeros(ctx.weight_shape, dtype=g.dtype)
        backend.index_add(grad, ids.reshape(-1), g.reshape(-1, ctx.weight_shape[-1]))
        return None, grad


# --------------------------------------------------------------------------- public API


def reshape(x: Tensor, shape) -> Tensor:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return Reshape.apply(x, shape)


def transpose(x: Tensor, axis0: int, axis1: int) -> Tensor:
    return Transpose.apply(x, axis0, axis1)


def permute(x: Tensor, axes) -> Tensor:
    axes = tuple(a % x.ndim for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"permute: {axes} is not a permutation of the {x.ndim} axes of {x.shape}")
    return Permute.apply(x, axes)


def concat(tensors, axis: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concat needs at least one tensor")
    return Concat.apply(axis, *tensors)


def stack(tensors, axis: int = 0) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack needs at least one tensor")
    return Stack.apply(axis, *tensors)


def _raw_index(index, xp):
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(_raw_index(i, xp) if isinstance(i, (Tensor, list)) else i for i in index)
    if isinstance(index, list):  # x[[0, 2]] selects rows, as in NumPy
        return xp.asarray(index)
    return index


def getitem(x: Tensor, index) -> Tensor:
    return GetItem.apply(x, _raw_index(index, backend.array_module_of(x.data)))


def embedding(ids, weight: Tensor) -> Tensor:
    """``weight[ids]``: (...,) integer ids and a (num_embeddings, dim) weight give (..., dim)."""
    ids_data = ids.data if isinstance(ids, Tensor) else ids
    if ids_data.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got {ids_data.dtype}")
    backend.check_ids(ids_data, weight.shape[0], "embedding: token id")
    return Embedding.apply(ids, weight)
