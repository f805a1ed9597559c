"""NumPy twin of csrc/layernorm.cu: one-pass statistics (Welford per lane, Chan's merge across
the warp), and a backward whose weight and bias gradients are summed in two deterministic
stages. Rows (N, D). Tested in tests/kernels/test_layernorm.py.
"""

from __future__ import annotations

import numpy as np

from .common import acc_dtype


def _lane_of_columns(D: int, lanes: int, vec: int):
    """Columns in the order a warp visits them: step t, lane l, element e of its pack."""
    steps = -(-D // (lanes * vec))
    cols = (np.arange(steps)[:, None, None] * lanes + np.arange(lanes)[None, :, None]) * vec \
        + np.arange(vec)[None, None, :]  # (steps, lanes, vec)
    return cols


def layernorm_forward(x, weight=None, bias=None, eps: float = 1e-5, vec: int = 1):
    """One-pass statistics: Welford per lane, then Chan et al.'s pairwise merge across the 32
    lanes of the row's warp (the butterfly of __shfl_xor). Returns (y, mean, rstd)."""
    N, D = x.shape
    lanes = 32
    acc = acc_dtype(x)
    xf = x.astype(acc)
    count = np.zeros((N, lanes), dtype=acc)
    mu = np.zeros((N, lanes), dtype=acc)
    m2 = np.zeros((N, lanes), dtype=acc)
    for step in _lane_of_columns(D, lanes, vec):  # (lanes, vec) columns per step
        for c in step.T:  # the pack's elements, one after another
            live = c < D
            v = xf[:, np.minimum(c, D - 1)]
            n = count + live
            d = v - mu
            mu = np.where(live, mu + d / np.maximum(n, 1), mu)
            m2 = np.where(live, m2 + d * (v - mu), m2)
            count = n
    offset = lanes // 2
    while offset:  # lane l merges with lane l ^ offset
        partner = np.arange(lanes) ^ offset
        cb, mub, m2b = count[:, partner], mu[:, partner], m2[:, partner]
        total = count + cb
        frac = np.where(total > 0, cb / np.maximum(total, 1), 0)
        delta = mub - mu
        mu = mu + delta * frac
        m2 = m2 + m2b + delta * delta * count * frac
        count = total
        offset //= 2
    mean, var = mu[:, 0], m2[:, 0] / D
    rstd = 1 / np.sqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y, mean, rstd


def layernorm_backward(x, weight, mean, rstd, g, blocks: int = 4, rows_per_block: int = 4):
    """dx row by row; dweight, dbias as per-block partial column sums, then summed over blocks
    (the kernel's deterministic two-stage reduction). Returns (dx, dweight, dbias)."""
    N, D = x.shape
    acc = acc_dtype(x, g)
    xf, gf = x.astype(acc), g.astype(acc)
    xhat = (xf - mean[:, None]) * rstd[:, None]
    gh = gf * weight.astype(acc) if weight is not None else gf
    dx = rstd[:, None] * (gh - gh.mean(axis=1, keepdims=True)
                          - xhat * (gh * xhat).mean(axis=1, keepdims=True))
    # Block b handles rows whose group of rows_per_block is b modulo the grid size.
    block_of_row = (np.arange(N) // rows_per_block) % blocks
    partial = np.zeros((blocks, 2, D), dtype=acc)
    np.add.at(partial[:, 0], block_of_row, gf * xhat)
    np.add.at(partial[:, 1], block_of_row, gf)
    return dx, partial[:, 0].sum(axis=0), partial[:, 1].sum(axis=0)
