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
    "KeyMask", "add", "attention_weights", "cast", "compare", "concat", "cross_entropy", "div", "dropout", "embedding", "exp",
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
    "reshape": lambda self, *shape: reshape(self, _as_shape(shape)),
    "permute": lambda self, *axes: permute(self, _as_shape(axes)),
    # Differentiable moves and casts: gradients flow back across devices and float dtypes.
    "to": lambda self, device: self if device == self.device else to_device(self, device),
    "astype": cast,
    "float": lambda self: cast(self, _np.float32),
}
for _name, _method in _TENSOR_METHODS.items():
    setattr(_Tensor, _name, _method)
