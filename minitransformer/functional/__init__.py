"""Differentiable ops on Tensors, imported as ``F`` (``import minitransformer.functional as F``).

One concept a file, each op's backward right under its forward:

    elementwise  add sub mul div neg pow exp log sqrt relu where masked_fill dropout cast
    reduce       sum mean max
    shape        reshape transpose permute concat stack getitem embedding
    matmul       matmul linear
    softmax      softmax log_softmax
    layernorm    layer_norm
    attention    scaled_dot_product_attention attention_weights KeyMask
    loss         cross_entropy

Importing it also gives ``Tensor`` its operators and op methods (see the end of this file).
"""

import numpy as _np

from ..tensor import Tensor as _Tensor
from ..tensor import as_shape as _as_shape
from .attention import KeyMask, attention_weights, scaled_dot_product_attention
from .elementwise import (
    add, cast, compare, div, dropout, exp, log, masked_fill, mul, neg, pow, relu, sqrt, sub,
    to_device, where,
)
from .layernorm import layer_norm
from .loss import cross_entropy
from .matmul import linear, matmul
from .reduce import max, mean, sum
from .shape import concat, embedding, getitem, permute, reshape, stack, transpose
from .softmax import log_softmax, softmax

__all__ = [
    "KeyMask", "add", "attention_weights", "cast", "compare", "concat", "cross_entropy", "div",
    "dropout", "embedding", "exp",
    "getitem", "layer_norm", "linear", "log", "log_softmax", "masked_fill", "matmul", "max",
    "mean", "mul", "neg", "permute", "pow", "relu", "reshape", "scaled_dot_product_attention",
    "softmax", "sqrt", "stack", "sub", "sum", "to_device", "transpose", "where",
]


# --------------------------------------------------------------------------- Tensor's methods
# tensor.py depends on backend alone; the ops give Tensor its operators and methods here, once
# they exist: ``a + b`` is ``add(a, b)``, ``x.sum(0)`` is ``sum(x, 0)``.


def _reflected(op):
    return lambda self, other: op(other, self)


def _comparison(name: str):
    return lambda self, other: compare(self, other, name)


def _reshape(self, *shape):
    """``x.reshape(2, 3)`` or ``x.reshape((2, 3))``."""
    return reshape(self, _as_shape(shape))


def _permute(self, *axes):
    """``x.permute(0, 2, 1)`` or ``x.permute((0, 2, 1))``."""
    return permute(self, _as_shape(axes))


def _to(self, device: str):
    """This tensor on ``device`` (itself if already there); differentiable, so gradients flow
    back across devices."""
    return self if device == self.device else to_device(self, device)


def _astype(self, dtype):
    """Cast to ``dtype``; differentiable between floating-point types."""
    return cast(self, dtype)


def _float(self):
    return cast(self, _np.float32)


_TENSOR_METHODS = {
    "__add__": add, "__radd__": _reflected(add), "__sub__": sub, "__rsub__": _reflected(sub),
    "__mul__": mul, "__rmul__": _reflected(mul), "__truediv__": div, "__rtruediv__": _reflected(div),
    "__pow__": pow, "__rpow__": _reflected(pow), "__neg__": neg,
    "__matmul__": matmul, "__rmatmul__": _reflected(matmul), "__getitem__": getitem,
    # Comparisons give boolean tensors (masks); they are not differentiable.
    "__eq__": _comparison("equal"), "__ne__": _comparison("not_equal"),
    "__lt__": _comparison("less"), "__le__": _comparison("less_equal"),
    "__gt__": _comparison("greater"), "__ge__": _comparison("greater_equal"),
    "sum": sum, "mean": mean, "max": max, "exp": exp, "log": log, "sqrt": sqrt, "relu": relu,
    "softmax": softmax, "log_softmax": log_softmax, "masked_fill": masked_fill, "transpose": transpose,
    "reshape": _reshape, "permute": _permute, "to": _to, "astype": _astype, "float": _float,
}
for _name, _method in _TENSOR_METHODS.items():
    setattr(_Tensor, _name, _method)
