"""NumPy twin of csrc/attention_naive.cu: attention as three steps through the whole score
matrix in memory, one function per kernel. Layout (B, H, T, D), masks as attention.py's.
Tested in tests/kernels/test_attention_naive.py.

Where a kernel runs one thread per element, its function here computes all the elements at
once; what each thread does is the expression for one element.
"""

from __future__ import annotations

import math

import numpy as np

from .common import acc_dtype


def visible_end(lens, causal: bool, T: int, S: int):
    """(B, 1, T, 1): query i of batch b sees exactly the keys j < visible_end[b, 0, i]."""
    B = len(lens)
    i = np.arange(T)[None, None, :, None]
    keys = np.asarray(lens).reshape(B, 1, 1, 1)
    return np.minimum(keys, i + (S - T) + 1) if causal else np.broadcast_to(keys, (B, 1, T, 1))


def scores(q, k, lens, causal: bool, scale: float):
    """The first kernel: P[bh, i, j] = scale * sum_d Q[bh, i, d] K[bh, j, d], -inf where masked."""
    S = k.shape[2]
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    return np.where(np.arange(S) < visible_end(lens, causal, q.shape[2], S), s, -np.inf)


def softmax_rows(p):
    """The second kernel, one row per thread: the row's maximum, then e = exp(P - max) and its
    sum, then e / sum; a row with no visible key becomes zeros."""
    m = p.max(axis=-1, keepdims=True)
    seen = m > -np.inf
    e = np.exp(p - np.where(seen, m, 0))
    return np.where(seen, e / np.where(seen, e.sum(axis=-1, keepdims=True), 1), 0)


def pv(p, v, lens, causal: bool):
    """The third kernel: O[bh, i, d] = sum_j P[bh, i, j] V[bh, j, d] over the visible keys j
    only, as a padding row of V may hold anything (0 * inf is NaN). Here: a sum over every j,
    the weights of the invisible keys and the padding rows of V zeroed."""
    T, S = p.shape[2], p.shape[3]
    j = np.arange(S)
    weights = np.where(j < visible_end(lens, causal, T, S), p, 0)
    values = np.where(j[None, None, :, None] < np.asarray(lens)[:, None, None, None], v, 0)
    return np.einsum("bhij,bhjd->bhid", weights, values)


def attention_naive_forward(q, k, v, lens=None, causal: bool = False, scale: float | None = None):
    """O = softmax(Q K^T * scale + M) V in the kernels' three steps, through P (B, H, T, S) in
    float32 (float64 for float64 inputs), as the kernels keep it in global memory."""
    dt = acc_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    B, H, T, D = q.shape
    S = k.shape[2]
    lens = np.full(B, S) if lens is None else np.asarray(lens)
    scale = 1 / math.sqrt(D) if scale is None else scale
    p = softmax_rows(scores(q, k, lens, causal, dt.type(scale)))
    return pv(p, v, lens, causal).astype(dt)


def forward_bytes(B: int, H: int, T: int, S: int, D: int, itemsize: int) -> int:
    """Bytes of global memory the three kernels read and write, counting each array once per
    kernel that touches it (re-reads that hit a cache left out): Q and K (scores), V and O (pv),
    at ``itemsize`` bytes an element; and P, float32, written by scores, read and written by
    softmax, read by pv: 16 B H T S bytes, which grows with T S where the rest grows with T + S."""
    return B * H * (2 * (T + S) * D * itemsize + 16 * T * S)
