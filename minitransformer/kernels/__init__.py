"""The Python side of csrc/: availability, the limits, the switch, and the launch wrappers.

    extension.py   the handle on ``minitransformer.kernels._C`` (optional: setup.py builds it only
                   where nvcc is found) and whether it can run; ``limits()``
    launch.py      one wrapper per launcher (CuPy arrays in and out), and
                   ``attention_refusal`` / ``layernorm_refusal``, which functional asks first
    reference/     each kernel's NumPy twin: the same algorithm, step by step (attention.py,
                   layernorm.py, softmax.py, cross_entropy.py beside csrc/'s files)

Importing this package never fails: without the extension, CuPy or a GPU, ``available()`` is
False, ``unavailable_reason()`` says why, and ``functional`` keeps using its CuPy composite
ops. Calling a launcher without them raises a RuntimeError that says what is missing.

    available()           the extension is built and a CUDA device is usable
    enabled()             available() and not switched off by MINITRANSFORMER_KERNELS=0
    enabled_for(*arrays)  enabled() and every array is a CuPy array of a dtype the kernels take
    limits()              what the kernels can take: csrc/limits.cuh, read through _C
    attention_naive_forward(q, k, v, ...), attention_tiled_forward(q, k, v, ...)
                          the ladder's lower rungs (naive kernels; tiled scores with a separate
                          softmax pass), for benchmarks and the reading
    attention_refusal(q, k, v), layernorm_refusal(x, weight, bias)
                          why the kernel cannot take these arrays on this device, None when it
                          can: the one place that decides (the binding checks only pointers
                          and sizes)
    shared_memory_limit() the current device's shared memory per block, which picks the tiles

bfloat16. CuPy has no bfloat16 dtype of its own; CuPy 14 can use ``ml_dtypes.bfloat16`` when
ml_dtypes is installed. The launchers take bfloat16 in either form: arrays whose dtype is named
"bfloat16", or uint16 arrays holding the raw bfloat16 bits (``to_bfloat16_bits`` /
``from_bfloat16_bits`` convert; this works on every CuPy and NumPy version). The autograd
dispatch in ``functional`` only sees float32/float16/(ml_dtypes) bfloat16 tensors.

Dispatch from ``functional`` (on "cuda" tensors, when enabled): scaled_dot_product_attention
-> fused attention where ``attention_refusal`` gives None and the mask is one the kernel can express
(none, a ``functional.KeyMask``, or a boolean (B, 1, 1, S) mask keeping a prefix of each row,
with is_causal as needed); layer_norm where ``layernorm_refusal`` gives None; softmax over the last
axis; cross_entropy. Otherwise the composite op runs. Inputs that are not contiguous (a
transposed q) are copied before the launch.
"""

from __future__ import annotations

from .extension import available, enabled, extension_built, limits, unavailable_reason
from .launch import (
    attention_backward, attention_forward, attention_naive_forward, attention_refusal,
    attention_tiled_forward, cross_entropy_forward, dtype_code, enabled_for, from_bfloat16_bits, key_lengths_from_mask,
    layernorm_backward, layernorm_forward, layernorm_refusal, loss_overwrites_logits, new_seed,
    set_loss_overwrites_logits, shared_memory_limit, softmax_backward, softmax_forward,
    to_bfloat16_bits,
)

__all__ = [
    "attention_backward", "attention_forward", "attention_naive_forward", "attention_refusal",
    "attention_tiled_forward", "available", "cross_entropy_forward", "dtype_code", "enabled", "enabled_for", "extension_built",
    "from_bfloat16_bits", "key_lengths_from_mask", "layernorm_backward", "layernorm_forward",
    "layernorm_refusal", "limits", "loss_overwrites_logits", "new_seed",
    "set_loss_overwrites_logits", "shared_memory_limit", "softmax_backward", "softmax_forward",
    "to_bfloat16_bits", "unavailable_reason",
]
