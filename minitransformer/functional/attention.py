"""Scaled dot-product attention, paper section 3.2.1, equation (1):

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

Shapes: q (..., T, d_k), k (..., S, d_k), v (..., S, d_v) -> (..., T, d_v); the leading axes
(batch B, heads h) broadcast. M comes from ``attn_mask``: a boolean mask (True = this query may
attend to this key, as in PyTorch's SDPA) or a float mask that is added to the scores. Both
broadcast to (..., T, S). ``is_causal`` masks future keys: query i sees keys j <= i + (S - T),
i.e. the mask is aligned to the bottom-right corner, so a single new query with a cache of S
keys sees them all (incremental decoding); for T == S it is the usual lower triangle.

A batch's key padding is best handed over as a ``KeyPadding``, built once and shared by every
layer that attends to those keys: it holds the mask in both forms the two implementations take.

A query whose keys are all masked gets the zero vector (softmax's fully-masked-row rule), and
zero gradient, never NaN.

Forward saves the probabilities P (T x S per head); backward is

    dV = P^T dO        dP = dO V^T        dS = P * (dP - rowsum(dP * P))
    dQ = dS K / sqrt(d_k)                 dK = dS^T Q / sqrt(d_k)

with the dropout mask applied to P exactly as in forward. (The fused CUDA kernel saves only
the log-sum-exp per row and recomputes P tile by tile instead.) For 16-bit inputs the scores,
the softmax and dS are computed in float32; P is saved, and multiplied, in the inputs' dtype.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend, kernels
from ..autograd import Function
from ..tensor import Tensor
from .softmax import softmax_array


class KeyPadding:
    """The key padding of a batch, from (B, S) flags that are True at padding keys:

        mask      (B, 1, 1, S) booleans, True where a key may be attended (the composite op)
        lengths   (B,) int32 keys per row, for the fused kernel, which takes padding as lengths;
                  None if some row's padding is not a suffix. Computed on first use, by the
                  kernel's dispatch only, since the suffix check costs a device-to-host sync:
                  once per batch this way, instead of once per attention layer.
    """

    def __init__(self, pad) -> None:
        self.pad = pad.data if isinstance(pad, Tensor) else pad  # (B, S)
        if self.pad.ndim != 2 or self.pad.dtype != bool:
            raise ValueError(f"KeyPadding: expected (B, S) booleans, got {self.pad.dtype} {self.pad.shape}")
        self.mask = ~self.pad[:, None, None, :]
        self._lengths, self._lengths_known = None, False

    @property
    def lengths(self):
        if not self._lengths_known:
            b, s = self.pad.shape
            self._lengths, self._lengths_known = kernels.key_lengths_from_mask(self.mask, b, s), True
        return self._lengths


def causal_mask(xp, t: int, s: int):
    """(T, S) boolean mask, True where query i may see key j: j <= i + (S - T)."""
    return xp.tril(xp.ones((t, s), dtype=bool), k=s - t)


def attention_scores(q, k, attn_mask, is_causal: bool, scale: float):
    """Masked, scaled scores Q K^T * scale, -inf where masked: (..., T, S)."""
    xp = backend.array_module_of(q)
    # Scaled before the product, as PyTorch's math path does: in float16, q . k itself can
    # exceed 65504 (64 terms of 32 x 32) while the scaled score is far from it.
    q = q * q.dtype.type(scale)
    scores = (q @ k.swapaxes(-1, -2)).astype(backend.compute_dtype(q.dtype), copy=False)
    if attn_mask is not None:
        if attn_mask.dtype == bool:
            scores = xp.where(attn_mask, scores, -xp.inf)
        else:
            scores = scores + attn_mask.astype(scores.dtype, copy=False)
    if is_causal:
        scores = xp.where(causal_mask(xp, q.shape[-2], k.shape[-2]), scores, -xp.inf)
    return scores


class ScaledDotProductAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, dropout_p, scale):
        p = softmax_array(attention_scores(q, k, attn_mask, is_causal, scale))  # (..., T, S)
        p = p.astype(v.dtype, copy=False)
        keep = None
        if dropout_p > 0.0:
            gen = backend.generator(backend.device_of(q))
            keep = (gen.random(p.shape, dtype=np.float32) >= dropout_p) * p.dtype.type(1 / (1 - dropout_p))
            p_used = p * keep
        else:
            p_used = p
        ctx.save_for_backward(q, k, v, p, keep)
        ctx.scale = scale
        return (p_used @ v).astype(v.dtype, copy=False)  # (..., T, d_v)

    @staticmethod
    def backward(ctx, g):
        q, k, v, p, keep = ctx.saved
        p_used = p if keep is None else p * keep
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        gv = p_used.swapaxes(-1, -2) @ g if need_v else None  # (..., S, d_v)
        gp, p = backend.upcast(g @ v.swapaxes(-1, -2), p)  # (..., T, S)
        if keep is not None:
            gp *= keep
        gs = p * (gp - (gp * p).sum(axis=-1, keepdims=True))
        gs *= ctx.scale
        gs = gs.astype(q.dtype, copy=False)
        gq = gs @ k if need_q else None  # (..., T, d_k)
        gk = gs.swapaxes(-1, -2) @ q if need_k else None  # (..., S, d_k)
        return gq, gk, gv, None, None, None, None


class FusedAttention(Function):
    """The fused kernel of csrc/attention.cu (see minitransformer.kernels): saves the output and
    one log-sum-exp per query instead of P, and backward recomputes P tile by tile. Key padding
    arrives as per-sequence lengths; dropout is drawn in the kernel from ``seed``."""

    @staticmethod
    def forward(ctx, q, k, v, kv_lens, is_causal, dropout_p, scale, seed):
        o, lse = kernels.attention_forward(q, k, v, kv_lens, is_causal, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, o, lse, kv_lens)
        ctx.options = (is_causal, scale, dropout_p, seed)
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse, kv_lens = ctx.saved
        is_causal, scale, dropout_p, seed = ctx.options
        dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, g, kv_lens, is_causal, scale,
                                                dropout_p, seed)
        return dq, dk, dv, None, None, None, None, None


def _fused_attention(q, k, v, mask, padding, is_causal, dropout_p, scale):
    """FusedAttention when the kernels take q, k, v (``kernels.attention_supported`` decides)
    and the mask is one they can express: none, a ``KeyMask``, or a boolean key-padding mask
    (B, 1, 1, S) that keeps a prefix of each row; else None."""
    if kernels.attention_supported(q.data, k.data, v.data) is not None:
        return None
    kv_lens = None
    if mask is not None:
        if padding is not None:
            kv_lens = padding.lengths if padding.pad.shape == (q.shape[0], k.shape[-2]) else None
        else:
            kv_lens = kernels.key_lengths_from_mask(mask, q.shape[0], k.shape[-2])
        if kv_lens is None:
            return None
    seed = kernels.new_seed() if dropout_p > 0.0 else 0
    return FusedAttention.apply(q, k, v, kv_lens, is_causal, dropout_p, scale, seed)


def _mask_array(attn_mask, q: Tensor):
    """The mask as an array on q's device (CuPy refuses host arrays), or None."""
    if attn_mask is None:
        return None
    mask = attn_mask.mask if isinstance(attn_mask, KeyPadding) else attn_mask
    return backend.to_device(mask.data if isinstance(mask, Tensor) else mask, q.device)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask=None,
                                 is_causal: bool = False, dropout_p: float = 0.0,
                                 scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale + M) v with scale = 1/sqrt(d_k) by default; see the module doc.

    ``attn_mask``: None, a boolean or float mask broadcasting to (..., T, S), or a ``KeyPadding``.
    ``dropout_p`` drops attention weights (pass 0.0 when not training, as with PyTorch).
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} differ in d_k")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: k {k.shape} and v {v.shape} differ in the number of keys")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    padding = attn_mask if isinstance(attn_mask, KeyPadding) else None
    mask = _mask_array(attn_mask, q)
    if mask is not None:
        t, s = q.shape[-2], k.shape[-2]
        if mask.ndim < 2 or mask.shape[-2] not in (1, t) or mask.shape[-1] not in (1, s):
            raise ValueError(
                f"attention: mask of shape {mask.shape} does not broadcast to (..., {t}, {s}) "
                f"for q {q.shape} and k {k.shape}"
            )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    fused = _fused_attention(q, k, v, mask, padding, is_causal, dropout_p, scale)
    if fused is not None:
        return fused
    return ScaledDotProductAttention.apply(q, k, v, mask, is_causal, dropout_p, scale)


def attention_weights(q: Tensor, k: Tensor, attn_mask=None, is_causal: bool = False,
                      scale: float | None = None) -> Tensor:
    """The probabilities softmax(q k^T * scale + M), (..., T, S), for inspection and plots.

    Not differentiable: training goes through ``scaled_dot_product_attention``, which never
    hands the T x S matrix out (and, in the fused kernel, never stores it).
    """
    mask = _mask_array(attn_mask, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return Tensor(softmax_array(attention_scores(q.data, k.data, mask, is_causal, scale)))

