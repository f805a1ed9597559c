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

    One read gathers max m, s = sum of exp(z - m) and the mean of z - z_0 (z_0 the row's first
    logit, a sum of (z - z_0) / V); lse = m + log s, lse - z_t is taken as (m - z_t) + log s and
    lse - mean z as (m - z_0) - mean (z - z_0) + log s, as the kernel does (in float32 the
    plain order loses the loss to cancellation at large logits);
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
    log_s = np.log(s)
    eps = label_smoothing
    nll_t = (m - z[np.arange(N), t]) + log_s
    z_0 = z[:, 0]
    loss = (1 - eps) * nll_t + eps * (((m - z_0) - ((z - z_0[:, None]) / V).sum(axis=1)) + log_s)
    grad = np.exp((z - m[:, None]) - log_s[:, None]) - eps / V
    grad[np.arange(N), t] -= 1 - eps
    loss = np.where(ignored, 0, loss)
    grad = np.where(ignored[:, None], 0, grad)
    return (loss, grad) + ((np.where(ignored, 0, nll_t),) if nll else ())
