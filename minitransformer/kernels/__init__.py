"""The Python side of csrc/: availability, the switch, and the launch wrappers.

The CUDA extension ``minitransformer._C`` is optional (setup.py builds it only where nvcc is
found). Importing this package never fails: without the extension, CuPy or a GPU, ``available()``
is False, ``unavailable_reason()`` says why, and ``functional`` keeps using its CuPy composite
ops. Calling a launcher (``attention_forward`` ...) without them raises a RuntimeError that
says what is missing.

    available()           the extension is built and a CUDA device is usable
    enabled()             available() and not switched off by MINITRANSFORMER_KERNELS=0
    enabled_for(*arrays)  enabled() and every array is a CuPy array of a dtype the kernels take
    attention_supported(q, k, v)
                          None if the fused attention takes these arrays on this device, else why
    shared_memory_limit() the current device's shared memory per block, which picks the tiles

bfloat16. CuPy has no bfloat16 dtype of its own; CuPy 14 can use ``ml_dtypes.bfloat16`` when
ml_dtypes is installed. The launchers take bfloat16 in either form: arrays whose dtype is named
"bfloat16", or uint16 arrays holding the raw bfloat16 bits (``to_bfloat16_bits`` /
``from_bfloat16_bits`` convert; this works on every CuPy and NumPy version). The autograd
dispatch in ``functional`` only sees float32/float16/(ml_dtypes) bfloat16 tensors.

Dispatch from ``functional`` (on "cuda" tensors, when enabled): scaled_dot_product_attention
-> fused attention (where ``attention_supported``: (B, h, T, d_k) inputs, d_k in {32, 64, 128},
a tile configuration that fits the device's shared memory; and attn_mask None, a
``functional.KeyPadding`` (its key lengths are derived once per batch), or a boolean
key-padding mask of shape (B, 1, 1, S) whose True entries form a prefix of each row, combined
with is_causal as needed; otherwise the composite op), layer_norm (rows up to
LAYERNORM_MAX_D wide), softmax over the last axis, cross_entropy. Inputs that are not
contiguous (a transposed q) are copied before the launch.
"""

from __future__ import annotations

import os

from .. import backend

try:
    from .. import _C
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # not built (no nvcc at install time), built for another Python, ...
    _C = None
    _IMPORT_ERROR = str(exc)


def extension_built() -> bool:
    """True when ``minitransformer._C`` was compiled and imports."""
    return _C is not None


def available() -> bool:
    """True when the kernels can run: the extension is built and a CUDA device is usable."""
    return _C is not None and backend.has_cuda()


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if _C is None:
        return ("minitransformer._C is not built (install with nvcc on PATH or CUDA_HOME set, "
                f"and without MINITRANSFORMER_CUDA=0): {_IMPORT_ERROR}")
    if not backend.has_cupy():
        return "CuPy is not installed (pip install 'minitransformer[cuda]')"
    if not backend.has_cuda():
        return "CuPy finds no usable CUDA device"
    return None


def enabled() -> bool:
    """available(), unless MINITRANSFORMER_KERNELS=0 forces the CuPy composite ops."""
    return os.environ.get("MINITRANSFORMER_KERNELS", "1").strip() != "0" and available()


from .launch import (  # noqa: E402 - launch needs _C resolved above
    ATTENTION_HEAD_DIMS, LAYERNORM_MAX_D, attention_backward, attention_forward,
    attention_supported, cross_entropy_forward, dtype_code, enabled_for, from_bfloat16_bits,
    key_lengths_from_mask, layernorm_backward, layernorm_forward, loss_overwrites_logits,
    new_seed, set_loss_overwrites_logits, shared_memory_limit, softmax_backward, softmax_forward,
    to_bfloat16_bits,
)

__all__ = [
    "ATTENTION_HEAD_DIMS", "LAYERNORM_MAX_D", "attention_backward", "attention_forward",
    "attention_supported", "available", "cross_entropy_forward", "dtype_code", "enabled",
    "enabled_for", "extension_built", "from_bfloat16_bits", "key_lengths_from_mask",
    "layernorm_backward", "layernorm_forward", "loss_overwrites_logits", "new_seed",
    "set_loss_overwrites_logits", "shared_memory_limit", "softmax_backward", "softmax_forward",
    "to_bfloat16_bits", "unavailable_reason",
]
