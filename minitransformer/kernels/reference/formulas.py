"""The plain formulas, in float64 NumPy: full matrices, no tiling, no online anything.

The first rung of each kernel's ladder: formula (here), NumPy twin (the other files of this
folder: the kernel's own algorithm, tile by tile), CUDA kernel (csrc/). The twins, the emulated
kernels and the CUDA kernels are all tested against these (tests/kernels/), and these against
finite differences (tests/kernels/test_formulas.py). Each returns the forward result and, given
the output's gradient, the inputs' gradients too. Layout (B, H, T, D) for attention.
"""

from __future__ import annotations

import numpy as np


def attention_mask(B, T, S, lens, causal):
    """(B, 1, T, S) bool: key j exists (j < lens[b]) and, if causal, j <= i + (S - T)."""
    lens = np.full(B, S) if lens is None else np.asarray(lens)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    mask = (j[None] < lens[:, None, None])[:, None]
    if causal:
        mask = mask & (j <= i + (S - T))[None, None]
    return mask


def attention(q, k, v, lens=None, causal=False, scale=None, z=None, dout=None):
    r"""$O = (\mathrm{softmax}(QK^\top \cdot \mathrm{scale}, \text{masked}) \odot Z)\,V$ and the
    log-sum-exp of each row's scores; with ``dout`` also (dq, dk, dv).

    $Z$ is the dropout factor array (B, H, T, S) or None. Fully masked rows: $O = 0$ and
    $\mathrm{lse} = -\infty$.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    mask = attention_mask(B, T, S, lens, causal)
    s = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total > 0, total, 1))[..., 0], -np.inf)
    z = np.ones_like(p) if z is None else np.asarray(z, dtype=np.float64)
    o = (p * z) @ v
    if dout is None:
        return o, lse
    dout = np.asarray(dout, dtype=np.float64)
    dv = (p * z).swapaxes(-1, -2) @ dout
    dp = (dout @ v.swapaxes(-1, -2)) * z
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
    return o, lse, ds @ k, ds.swapaxes(-1, -2) @ q, dv


def layer_norm(x, w=None, b=None, eps=1e-5, g=None):
    """y; with g also (dx, dw, db)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    xhat = (x - mean) / np.sqrt(var + eps)
    w = np.ones(x.shape[-1]) if w is None else np.asarray(w, dtype=np.float64)
    b = np.zeros(x.shape[-1]) if b is None else np.asarray(b, dtype=np.float64)
    y = xhat * w + b
    if g is None:
        return y
    g = np.asarray(g, dtype=np.float64).reshape(-1, x.shape[-1])
    xh = xhat.reshape(-1, x.shape[-1])
    gh = g * w
    dx = (gh - gh.mean(-1, keepdims=True) - xh * (gh * xh).mean(-1, keepdims=True)) \
        / np.sqrt(var.reshape(-1, 1) + eps)
    return y, dx.reshape(x.shape), (g * xh).sum(0), g.sum(0)


def softmax(x, mask=None, scale=1.0, g=None):
    """softmax(scale x) over unmasked entries of the last axis (fully masked rows: 0);
    with g also dx."""
    z = np.asarray(x, dtype=np.float64) * scale
    if mask is not None:
        z = np.where(mask, z, -np.inf)
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(m), m, 0))
    total = e.sum(axis=-1, keepdims=True)
    y = e / np.where(total > 0, total, 1)
    if g is None:
        return y
    g = np.asarray(g, dtype=np.float64)
    return y, scale * y * (g - (g * y).sum(axis=-1, keepdims=True))


def cross_entropy(logits, target, eps=0.0, ignore_index=None):
    r"""Per-row loss $-\sum_k q_k \log \mathrm{softmax}(z)_k$ with $q = (1 - \varepsilon)\,
    \mathrm{onehot} + \varepsilon / V$, and its gradient $\mathrm{softmax}(z) - q$; rows with
    ``target == ignore_index``: 0 and 0."""
    z = np.asarray(logits, dtype=np.float64)
    N, V = z.shape
    t = np.asarray(target)
    ignored = t == ignore_index if ignore_index is not None else np.zeros(N, dtype=bool)
    t = np.where(ignored, 0, t)
    logp = z - z.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    q = np.full((N, V), eps / V)
    q[np.arange(N), t] += 1 - eps
    loss = -(q * logp).sum(1)
    grad = np.exp(logp) - q
    return np.where(ignored, 0, loss), np.where(ignored[:, None], 0, grad)
