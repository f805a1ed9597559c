"""NumPy twins of the CUDA kernels in csrc/: the same algorithms, step by step, on the CPU.

Each function here does what its kernel does, in the same order (tiles, online softmax, the
saved statistics, the per-thread partial results and how they merge), vectorised over the
things a GPU runs in parallel. They serve two purposes: reading (the algorithm without the
CUDA bookkeeping) and testing (the CPU tests check each twin against the plain formula; the GPU
tests check each kernel against a float64 formula, and the twins pin down what "the same
algorithm" means, down to the dropout mask's random bits).

Arithmetic is done in float32, or float64 when the inputs are float64 (the tests use that to
compare the algorithm, not the rounding, with the formula).

    attention_forward / attention_backward   csrc/attention.cu   (B, H, T, D) layout
    layernorm_forward / layernorm_backward   csrc/layernorm.cu   (N, D) rows
    softmax_forward / softmax_backward       csrc/softmax.cu     (N, V) rows
    cross_entropy_forward                    csrc/softmax.cu     (N, V) logits, (N,) targets
"""

from __future__ import annotations

import math

import numpy as np

_U32 = np.uint64(0xFFFFFFFF)


def _acc_dtype(*arrays):
    return np.result_type(np.float32, *[a.dtype for a in arrays])


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
    """The factor dropout applies to attention weight (bh, i, j): 0 or 1/(1-p).

    Bit-exact with the kernel: keep where philox_bits(j, i, bh) >= p * 2^32, with p and
    1/(1-p) rounded to float32 as the kernel receives and computes them.
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
                      dropout_p: float = 0.0, seed: int = 0, block_q: int = 64, block_k: int = 64):
    """Tiled attention with online softmax. q (B, H, T, D), k and v (B, H, S, D).

    Returns ``(o, lse)``: o (B, H, T, D) and the log-sum-exp of each query's scaled scores,
    lse (B, H, T), -inf for a query that sees no key (its o is 0).
    """
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = _acc_dtype(q, k, v)
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
        seen = l > 0
        o[:, :, rows] = o_acc * np.where(seen, 1 / np.where(seen, l, 1), 0)[..., None]
        lse[:, :, rows] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)
    return o, lse


def attention_backward(q, k, v, o, lse, dout, kv_lens=None, causal: bool = False,
                       scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                       block_q: int = 32, block_k: int = 64):
    """FlashAttention-2 backward: recompute P tile by tile from lse. Returns (dq, dk, dv)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = _acc_dtype(q, k, v, o, dout)
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


# --------------------------------------------------------------------------- layernorm


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
    acc = _acc_dtype(x)
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
    acc = _acc_dtype(x, g)
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


# --------------------------------------------------------------------------- softmax


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
    z = x.astype(_acc_dtype(x)) * scale
    m, s = online_max_sum(z, mask)
    m_use = np.where(m == -np.inf, 0, m)
    e = np.exp((np.where(mask, z, -np.inf) if mask is not None else z) - m_use[:, None])
    return e * np.where(s > 0, 1 / np.where(s > 0, s, 1), 0)[:, None]


def softmax_backward(y, g, scale: float = 1.0):
    acc = _acc_dtype(y, g)
    y, g = y.astype(acc), g.astype(acc)
    return scale * y * (g - (g * y).sum(axis=1, keepdims=True))


def cross_entropy_forward(logits, target, label_smoothing: float = 0.0, ignore_index=None):
    """Per-row label-smoothed cross-entropy and its gradient d loss_row / d logits.

    One read gathers max, sum of exponentials and the sum of logits; lse = m + log s;
    loss = (1 - eps)(lse - z_t) + eps (lse - mean z); grad = softmax - eps/V - (1-eps)[k == t].
    Ignored rows get loss 0 and gradient 0. Returns (loss (N,), grad (N, V)).
    """
    N, V = logits.shape
    z = logits.astype(_acc_dtype(logits))
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
    return loss, grad
