"""minitransformer: the Transformer of "Attention Is All You Need", built from scratch.

Layers, each importing only those before it (except that tensor's operators call functional,
imported at the end of tensor.py):

    backend            NumPy (cpu) / CuPy (cuda) arrays, devices, random generators
    tensor, autograd   Tensor, Function, the reverse-mode engine, no_grad
    functional (F)     differentiable ops, each with its backward
"""

import numpy as np

from .backend import bfloat16, has_cuda, manual_seed
from .tensor import (  # noqa: I001 - tensor must be imported before autograd
    Tensor, arange, full, full_like, ones, ones_like, rand, randn, randn_like, tensor, zeros,
    zeros_like,
)
from .autograd import Function, enable_grad, is_grad_enabled, no_grad
from . import functional

# dtype names, as in torch.float32; NumPy's dtypes serve both backends (bfloat16 comes from
# ml_dtypes, and is None without it).
float16 = np.dtype("float16")
float32 = np.dtype("float32")
float64 = np.dtype("float64")
int64 = np.dtype("int64")

__version__ = "0.1.0"

__all__ = [
    "Function", "Tensor", "arange", "bfloat16", "enable_grad", "full", "full_like", "functional",
    "has_cuda", "is_grad_enabled", "manual_seed", "no_grad", "ones", "ones_like", "rand",
    "randn", "randn_like", "tensor", "zeros", "zeros_like",
]
