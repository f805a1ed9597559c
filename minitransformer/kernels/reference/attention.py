"""NumPy twin of csrc/attention.cu: tiled attention with online softmax, FlashAttention-2's
backward that recomputes P from the saved log-sum-exp, and the Philox bits of its dropout mask.
Layout (B, H, T, D). Tested in tests/kernels/test_attention.py.
"""

from __future__ import annotations

import math

import numpy as np

from .common import acc_dtype

_U32 = np.uint64(0xFFFFFFFF)


# --------------------------------------------------------------------------- dropout bits


def philox_bits(c0, c1, c2, seed: int, c3=0):
    """Philox4x32-10 (Salmon et al. 2011) of counter (c0, c1, c2, c3) under the 64-bit key
    ``seed``; returns the first 32-bit output word, elementwise over the broadcast counters.
    The kernel always uses c3 = 0."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in np.broadcast_arrays(c0, c1, c2, c3))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for rnd in range(10):
        if rnd:
            k0 = (k0 + np.uint64(0x9E3779B9)) & _U32
            k1 = (k1 + np.uint64(0xBB67AE85)) & _U32
        p0 = np.uint64(0xD2511F53) * c0  # 32 x 32 -> 64-bit products: hi and lo halves
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32
    return c0.astype(np.uint32)


def dropout_factor(bh, i, j, dropout_p: float, seed: int, dtype=np.float32):
    r"""The factor dropout applies to attention weight (bh, i, j): 0 or $1/(1-p)$.

    Bit-exact with the kernel: kept where ``philox_bits(j, i, bh)`` $\ge p \cdot 2^{32}$, with
    $p$ and $1/(1-p)$ rounded to float32 as the kernel receives and computes them.
    """
    p32 = np.float32(dropout_p)
    threshold = np.uint32(min(float(p32) * 2.0**32, 2.0**32 - 1))
    if threshold == 0:  # p rounds to no dropout at all (the kernel's threshold 0 means off)
        return np.ones(np.broadcast_shapes(np.shape(bh), np.shape(i), np.shape(j)), dtype=dtype)
    keep_scale = np.float32(1) / (np.float32(1) - p32)
    bits = philox_bits(j, i, bh, seed)
    return np.where(bits >= threshold, keep_scale, np.float32(0)).astype(dtype)


# --------------------------------------------------------------------------- attention


def _visible(rows, cols, lens, causal: bool, shift: int):
    """(B, 1, rows, cols) bool: key col is not padding for batch b and not in row's future."""
    vis = cols[None, None, None, :] < lens[:, None, None, None]
    if causal:
        vis = vis & (cols[None, :] <= rows[:, None] + shift)[None, None]
    return vis


def _lens(kv_lens, B: int, S: int):
    if kv_lens is None:
        return np.full(B, S, dtype=np.int64)
    return np.clip(np.asarray(kv_lens, dtype=np.int64), 0, S)


def _bh(B: int, H: int):
    return (np.arange(B)[:, None] * H + np.arange(H)[None, :])[:, :, None, None]  # (B, H, 1, 1)


def attention_forward(q, k, v, kv_lens=None, causal: bool = False, scale: float | None = None,
                      dropout_p: float = 0.0, seed: int = 0, block_q: int = 64, block_k: int = 64,
                      observer=None):
    r"""Tiled attention with online softmax. q (B, H, T, D), k and v (B, H, S, D).

    Returns ``(o, lse)``: o (B, H, T, D) and the log-sum-exp of each query's scaled scores,
    lse (B, H, T), $-\infty$ for a query that sees no key (its o is 0).

    ``observer``: called as ``observer(rows, cols, m, l, o_acc)`` after each key tile of each
    query tile, to watch the online softmax: the tile's query and key indices, the max $m$ of
    the scores seen so far and the sum $\ell = \sum_j e^{s_j - m}$ over them (B, H, br), and
    the output o_acc (B, H, br, D), not yet normalised: $o_{acc} / \ell$ is the
    softmax-weighted mean of the values seen so far (without dropout). The arrays are the
    loop's own: read them, do not write them.
    """
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = acc_dtype(q, k, v)
    q, k, v = q.astype(acc), k.astype(acc), v.astype(acc)
    lens = _lens(kv_lens, B, S)
    shift = S - T  # causal: query i sees keys j <= i + shift
    bh = _bh(B, H)
    o = np.zeros((B, H, T, D), dtype=acc)
    lse = np.full((B, H, T), -np.inf, dtype=acc)

    for q0 in range(0, T, block_q):  # one CUDA block per query tile (and per b, h)
        rows = np.arange(q0, min(q0 + block_q, T))
        qt = q[:, :, rows]  # (B, H, br, D)
        m = np.full(qt.shape[:3], -np.inf, dtype=acc)  # running max
        l = np.zeros(qt.shape[:3], dtype=acc)  # running sum of exp(s - m)
        o_acc = np.zeros(qt.shape, dtype=acc)  # running unnormalised output
        k_end = int(lens.max())
        if causal:  # key tiles wholly in the future of every row of this tile are skipped
            k_end = min(k_end, rows[-1] + shift + 1)
        for k0 in range(0, max(k_end, 0), block_k):
            cols = np.arange(k0, min(k0 + block_k, S))
            pad = (cols[None, :] < lens[:, None])[:, None, :, None]  # padding keys load as 0
            kt = np.where(pad, k[:, :, cols], 0)
            vt = np.where(pad, v[:, :, cols], 0)
            s = (qt @ kt.swapaxes(-1, -2)) * scale  # (B, H, br, bc)
            s = np.where(_visible(rows, cols, lens, causal, shift), s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1))
            m_use = np.where(m_new == -np.inf, 0, m_new)  # no visible key yet: exp(-inf) = 0
            alpha = np.exp(m - m_use)
            p = np.exp(s - m_use[..., None])
            l = l * alpha + p.sum(axis=-1)
            if dropout_p > 0:
                p = p * dropout_factor(bh, rows[:, None], cols[None, :], dropout_p, seed, acc)
            o_acc = o_acc * alpha[..., None] + p @ vt
            m = m_new
            if observer is not None:
                observer(rows, cols, m, l, o_acc)
        seen = l > 0
        o[:, :, rows] = o_acc * np.where(seen, 1 / np.where(seen, l, 1), 0)[..., None]
        lse[:, :, rows] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


def forward_bytes(B: int, H: int, T: int, S: int, D: int, itemsize: int, block_q: int = 64,
                  block_k: int = 64, causal: bool = False) -> int:
    """Bytes of global memory the forward reads and writes, without padding: Q once; for each
    tile of ``block_q`` queries, the tiles of K and V rows that the loop above loads (under the
    causal mask, up to the tile holding its last visible key); O (``itemsize`` bytes an element)
    and lse (float32) once. No T x S array: the scores stay on chip."""
    keys = 0
    for q0 in range(0, T, block_q):
        k_end = min(S, min(q0 + block_q, T) + (S - T)) if causal else S
        keys += min(S, math.ceil(max(k_end, 0) / block_k) * block_k)
    return B * H * ((2 * T + 2 * keys) * D * itemsize + 4 * T)


def attention_backward(q, k, v, o, lse, dout, kv_lens=None, causal: bool = False,
                       scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                       block_q: int = 32, block_k: int = 64):
    """FlashAttention-2 backward: recompute P tile by tile from lse. Returns (dq, dk, dv)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = acc_dtype(q, k, v, o, dout)
    q, k, v, o, dout = (a.astype(acc) for a in (q, k, v, o, dout))
    lens = _lens(kv_lens, B, S)
    shift = S - T
    bh = _bh(B, H)
    delta = (dout * o).sum(axis=-1)  # (B, H, T): rowsum(dO * O) = rowsum(P * dP)
    seen = np.isfinite(lse)
    lse_safe = np.where(seen, lse, 0).astype(acc)
    dq = np.zeros(q.shape, dtype=acc)
    dk = np.zeros(k.shape, dtype=acc)
    dv = np.zeros(v.shape, dtype=acc)

    for k0 in range(0, S, block_k):  # one CUDA block per key tile (and per b, h)
        cols = np.arange(k0, min(k0 + block_k, S))
        pad = (cols[None, :] < lens[:, None])[:, None, :, None]
        kt = np.where(pad, k[:, :, cols], 0)
        vt = np.where(pad, v[:, :, cols], 0)
        dk_acc = np.zeros(kt.shape, dtype=acc)
        dv_acc = np.zeros(vt.shape, dtype=acc)
        q_begin = max(0, k0 - shift) if causal else 0  # earlier queries cannot see these keys
        for q0 in range(q_begin // block_q * block_q, T, block_q):
            rows = np.arange(q0, min(q0 + block_q, T))
            qt, dot = q[:, :, rows], dout[:, :, rows]
            s = (qt @ kt.swapaxes(-1, -2)) * scale
            vis = _visible(rows, cols, lens, causal, shift) & seen[:, :, rows, None]
            p = np.where(vis, np.exp(np.where(vis, s, 0) - lse_safe[:, :, rows, None]), 0)
            z = dropout_factor(bh, rows[:, None], cols[None, :], dropout_p, seed, acc)
            dv_acc += (p * z).swapaxes(-1, -2) @ dot
            dp = (dot @ vt.swapaxes(-1, -2)) * z
            ds = p * (dp - delta[:, :, rows, None]) * scale
            dk_acc += ds.swapaxes(-1, -2) @ qt
            dq[:, :, rows] += ds @ kt
        dk[:, :, cols] = dk_acc
        dv[:, :, cols] = dv_acc
    return dq, dk, dv
