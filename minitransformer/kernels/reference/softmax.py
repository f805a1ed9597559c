"""NumPy twin of csrc/softmax.cu's row softmax: the threads of a row, each with an online
(max, sum) over its columns, merged across the row. Rows (N, V). Tested in
tests/kernels/test_softmax.py. cross_entropy.py reads its logits the same way.
"""

from __future__ import annotations

import numpy as np

from .common import acc_dtype


def row_threads(V: int) -> int:
    """Threads that share a row in csrc/softmax.cu: a warp up to 1024 columns, else a block."""
    return 32 if V <= 1024 else 256


def _maxsum_merge(m_a, s_a, m_b, s_b):
    m = np.maximum(m_a, m_b)
    m_use = np.where(m == -np.inf, 0, m)
    return m, s_a * np.exp(m_a - m_use) + s_b * np.exp(m_b - m_use)


def online_max_sum(z, valid=None):
    """Per-row (max, sum exp(z - max)) in one read: every thread of the row keeps an online
    (m, s) over its strided columns (rescaling s whenever m grows), then the threads' pairs
    merge. Rows with no valid entry give (-inf, 0)."""
    N, V = z.shape
    threads = row_threads(V)
    m = np.full((N, threads), -np.inf, dtype=z.dtype)
    s = np.zeros((N, threads), dtype=z.dtype)
    for start in range(0, V, threads):  # column start + t belongs to thread t
        c = np.arange(start, start + threads)
        live = c < V
        x = np.where(live, z[:, np.minimum(c, V - 1)], -np.inf)
        if valid is not None:
            x = np.where(live & valid[:, np.minimum(c, V - 1)], x, -np.inf)
        m, s = _maxsum_merge(m, s, x, (x > -np.inf).astype(z.dtype))
    offset = threads // 2
    while offset:
        partner = np.arange(threads) ^ offset
        m, s = _maxsum_merge(m, s, m[:, partner], s[:, partner])
        offset //= 2
    return m[:, 0], s[:, 0]


def softmax_forward(x, mask=None, scale: float = 1.0):
    """Row softmax of scale * x over entries where mask is True; a fully masked row is 0."""
    z = x.astype(acc_dtype(x)) * scale
    m, s = online_max_sum(z, mask)
    m_use = np.where(m == -np.inf, 0, m)
    e = np.exp((np.where(mask, z, -np.inf) if mask is not None else z) - m_use[:, None])
    return e * np.where(s > 0, 1 / np.where(s > 0, s, 1), 0)[:, None]


def softmax_backward(y, g, scale: float = 1.0):
    acc = acc_dtype(y, g)
    y, g = y.astype(acc), g.astype(acc)
    return scale * y * (g - (g * y).sum(axis=1, keepdims=True))
