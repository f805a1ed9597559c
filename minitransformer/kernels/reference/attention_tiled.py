"""NumPy twin of csrc/attention_tiled.cu: attention a tile of scores at a time, with a separate
pass for each row's maximum and so no online rescaling. Layout (B, H, T, D), masks as
attention.py's. Tested in tests/kernels/test_attention_tiled.py.

The kernel runs a block of 16 x 16 threads for each (batch, head, tile of BR queries); here a
loop over batches and query tiles, each step for all heads at once, and inside it the kernel's
two passes over the tiles of BC keys, a thread's score being one element of ``s``.
"""

from __future__ import annotations

import math

import numpy as np

from .common import acc_dtype

BR, BC = 16, 16  # queries per block, keys per tile: the kernel's


def block_end(kv_len: int, causal: bool, q0: int, T: int, S: int) -> int:
    """The keys j < block_end that some query of the tile starting at q0 sees: the tiles of K
    and V a block loads (its last query sees the most; at most 0 when none sees a key)."""
    return min(kv_len, min(q0 + BR, T) + (S - T)) if causal else kv_len


def attention_tiled_forward(q, k, v, lens=None, causal: bool = False, scale: float | None = None,
                            observer=None):
    """O = softmax(Q K^T * scale + M) V as the kernel computes it: for each tile of BR queries,
    pass 1 takes each row's maximum m over the tiles of scores, pass 2 computes the scores again,
    P = exp(S - m), the row sums l and acc = P V, and O = acc / l (0 for a query that sees no
    key). ``observer(rows, cols)``, if given, is called with the query and key indices of each
    tile of scores computed, in both passes."""
    dt = acc_dtype(q, k, v)
    q, k, v = (np.asarray(a, dtype=dt) for a in (q, k, v))
    B, H, T, D = q.shape
    S = k.shape[2]
    lens = np.full(B, S) if lens is None else np.clip(np.asarray(lens), 0, S)
    scale = dt.type(1 / math.sqrt(D) if scale is None else scale)
    o = np.zeros_like(q)
    for b in range(B):
        for q0 in range(0, T, BR):
            rows = np.arange(q0, min(q0 + BR, T))
            end = np.minimum(lens[b], rows + (S - T) + 1) if causal else np.full(len(rows), lens[b])
            last = block_end(int(lens[b]), causal, q0, T, S)
            qt = q[b, :, q0:q0 + BR]  # (H, rows, D)

            def scores(k0):
                """The tile's scores (H, rows, cols), -inf where masked: one per thread."""
                cols = np.arange(k0, min(k0 + BC, last))
                if observer is not None:
                    observer(rows, cols)
                s = qt @ k[b, :, k0:k0 + len(cols)].swapaxes(-1, -2) * scale
                return np.where(cols[None, None, :] < end[None, :, None], s, -np.inf), cols

            m = np.full((H, len(rows)), -np.inf, dtype=dt)
            for k0 in range(0, last, BC):  # pass 1
                m = np.maximum(m, scores(k0)[0].max(axis=-1))
            m_seen = np.where(m == -np.inf, 0, m)[..., None]  # exp(-inf - 0) = 0, never NaN
            l, acc = np.zeros((H, len(rows), 1), dtype=dt), np.zeros((H, len(rows), D), dtype=dt)
            for k0 in range(0, last, BC):  # pass 2
                s, cols = scores(k0)
                p = np.exp(s - m_seen)
                l += p.sum(axis=-1, keepdims=True)
                acc += p @ v[b, :, k0:k0 + len(cols)]
            o[b, :, q0:q0 + BR] = np.where(l > 0, acc / np.where(l > 0, l, 1), 0)
    return o


def forward_bytes(B: int, H: int, T: int, S: int, D: int, itemsize: int, causal: bool = False) -> int:
    """Bytes of global memory the kernel reads and writes at ``itemsize`` bytes an element: Q and
    O once; for each tile of BR queries, the rows of K up to its block_end twice (a pass each) and
    those of V once. No T x S array, but K's rows read twice where the fused kernel reads them once."""
    keys = sum(max(block_end(S, causal, q0, T, S), 0) for q0 in range(0, T, BR))
    return B * H * (2 * T + 3 * keys) * D * itemsize
