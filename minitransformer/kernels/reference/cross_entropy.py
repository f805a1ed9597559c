"""NumPy twin of csrc/softmax.cu's softmax fused with label-smoothed cross-entropy. Logits
(N, V), targets (N,). Tested in tests/kernels/test_cross_entropy.py.
"""

from __future__ import annotations

import numpy as np

from .common import acc_dtype
from .softmax import online_max_sum


def cross_entropy_forward(logits, target, label_smoothing: float = 0.0, ignore_index=None,
                          nll: bool = False):
    """Per-row label-smoothed cross-entropy and its gradient d loss_row / d logits.

    One read gathers max, sum of exponentials and the sum of logits; lse = m + log s;
    loss = (1 - eps)(lse - z_t) + eps (lse - mean z); grad = softmax - eps/V - (1-eps)[k == t];
    with ``nll`` also the unsmoothed lse - z_t. Ignored rows get 0 in each.
    Returns (loss (N,), grad (N, V)), and with ``nll`` the (N,) NLL third.
    """
    N, V = logits.shape
    z = logits.astype(acc_dtype(logits))
    t = np.asarray(target).astype(np.int64)
    ignored = t == ignore_index if ignore_index is not None else np.zeros(N, dtype=bool)
    t = np.where(ignored, 0, t)
    m, s = online_max_sum(z)
    lse = m + np.log(s)
    eps = label_smoothing
    z_t = z[np.arange(N), t]
    loss = (1 - eps) * (lse - z_t) + eps * (lse - z.sum(axis=1) / V)
    grad = np.exp(z - lse[:, None]) - eps / V
    grad[np.arange(N), t] -= 1 - eps
    loss = np.where(ignored, 0, loss)
    grad = np.where(ignored[:, None], 0, grad)
    return (loss, grad) + ((np.where(ignored, 0, lse - z_t),) if nll else ())
