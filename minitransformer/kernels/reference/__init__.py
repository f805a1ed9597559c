"""NumPy twins of the CUDA kernels in csrc/: the same algorithms, step by step, on the CPU.

Each function here does what its kernel does, in the same order (tiles, online softmax, the
saved statistics, the per-thread partial results and how they merge), vectorised over the
things a GPU runs in parallel. They serve two purposes: reading (the algorithm without the
CUDA bookkeeping) and testing (the CPU tests check each twin against the plain formula; the GPU
tests check each kernel against a float64 formula, and the twins pin down what "the same
algorithm" means, down to the dropout mask's random bits).

Arithmetic is done in float32, or float64 when the inputs are float64 (the tests use that to
compare the algorithm, not the rounding, with the formula).

A kernel, its twin and its test share a name:

    csrc/attention.cu   attention.py       attention_forward / attention_backward, (B, H, T, D)
                                           philox_bits / dropout_factor (the dropout mask)
    csrc/attention_naive.cu
                        attention_naive.py attention_naive_forward, (B, H, T, D): attention
                                           as three plain steps through the T x S matrix
    csrc/attention_tiled.cu
                        attention_tiled.py attention_tiled_forward, (B, H, T, D): tiles of
                                           scores, a pass for the maxima and one for the rest
    csrc/layernorm.cu   layernorm.py       layernorm_forward / layernorm_backward, (N, D) rows
    csrc/softmax.cu     softmax.py         softmax_forward / softmax_backward, (N, V) rows
                        cross_entropy.py   cross_entropy_forward, (N, V) logits, (N,) targets

each tested in tests/kernels/test_<name>.py: the twin against the formula, the kernel in the
CPU emulator, the kernel on the device against float64.
"""

from __future__ import annotations

from .attention import attention_backward, attention_forward, dropout_factor, philox_bits
from .attention_naive import attention_naive_forward
from .attention_tiled import attention_tiled_forward
from .cross_entropy import cross_entropy_forward
from .layernorm import layernorm_backward, layernorm_forward
from .softmax import online_max_sum, row_threads, softmax_backward, softmax_forward

__all__ = [
    "attention_backward", "attention_forward", "attention_naive_forward", "attention_tiled_forward",
    "cross_entropy_forward",
    "dropout_factor", "layernorm_backward", "layernorm_forward", "online_max_sum", "philox_bits",
    "row_threads", "softmax_backward", "softmax_forward",
]
