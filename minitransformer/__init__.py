"""minitransformer: the Transformer of "Attention Is All You Need", built from scratch.

    import minitransformer as mt
    model = mt.nn.Transformer(mt.nn.TransformerConfig(vocab_size=8000))
    optimizer = mt.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)

Layers, each importing only those before it (``LAYERS`` below lists every folder and module
in this order; tests/test_layers.py checks it):

    settings           SettingsError, and boolean environment variables read one way
    emulated           device "cuda" on the CPU (MT_EMULATE_CUDA=1): beneath backend, as CuPy is
    backend            NumPy (cpu) / CuPy (cuda) arrays, devices, random generators
    tensor             Tensor: an array and its autograd fields
    autograd           Function, the reverse-mode walk (Tensor.backward calls it), no_grad
    gradcheck          autograd against finite differences
    kernels            the CUDA kernels' launchers and limits, and their NumPy twins
    functional (F)     differentiable ops, each with its backward (Tensor's operators call them)
    data, bleu, nn, optim, amp, checkpoint, distributed
    run_folder         a training run's folder: its lock, its resume record and checks
    decoding, export, train
"""

import numpy as np

from .backend import bfloat16, has_cuda, manual_seed
from .tensor import (
    Tensor, arange, full, full_like, ones, ones_like, rand, randn, randn_like, tensor, zeros,
    zeros_like,
)
from .autograd import Function, enable_grad, is_grad_enabled, no_grad
from . import functional  # noqa: I001 - in layer order, as after ``import torch``
from . import amp, checkpoint, data, distributed, nn, optim
from . import decoding, train

# dtype names, as in torch.float32; NumPy's dtypes serve both backends (bfloat16 comes from
# ml_dtypes, and is None without it).
float16 = np.dtype("float16")
float32 = np.dtype("float32")
float64 = np.dtype("float64")
int64 = np.dtype("int64")

__version__ = "0.1.0"

# The package's units (folders and top-level modules), lowest first: each imports only units
# before it (tests/test_layers.py reads every import and checks it; docs/internals/layers.md
# says what each holds).
LAYERS = (
    "settings", "emulated", "backend", "files", "schema", "records", "cli", "tensor", "autograd", "gradcheck", "kernels",
    "functional", "data", "bleu", "nn", "optim", "amp", "checkpoint", "distributed", "run_folder", "decoding", "export", "train",
)

__all__ = [
    "Function", "Tensor", "amp", "arange", "bfloat16", "checkpoint", "data", "decoding",
    "distributed", "enable_grad", "full", "full_like", "functional", "has_cuda", "is_grad_enabled",
    "manual_seed", "nn", "no_grad", "ones", "ones_like", "optim", "rand", "randn", "randn_like",
    "tensor", "train", "zeros", "zeros_like",
]
