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

Importing it lets ``Tensor``'s operators and op methods (defined in tensor.py) reach these ops.
"""

import sys as _sys

from ..tensor import _ops as _tensor_ops
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


_tensor_ops.F = _sys.modules[__name__]  # Tensor's operators call the ops above (see tensor.py)
