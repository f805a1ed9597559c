"""Scaled dot-product attention, paper section 3.2.1, equation (1):

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

Shapes: q (..., T, d_k), k (..., S, d_k), v (..., S, d_v) -> (..., T, d_v); the leading axes
(batch B, heads h) broadcast. M comes from ``attn_mask``: a boolean mask (True = this query may
attend to this key, as in PyTorch's SDPA) or a float mask that is added to the scores. Both
broadcast to (..., T, S). ``is_causal`` masks future keys: query i sees keys j <= i + (S - T),
i.e. the mask is aligned to the bottom-right corner, so a single new query with a cache of S
keys sees them all (incremental decoding); for T == S it is the usual lower triangle.

One polarity everywhere: a boolean mask is True where a query may attend to a key. A batch's
key padding is a ``KeyMask``, built once from the token ids and shared by every layer that
attends to those keys: it holds the mask in both forms the two implementations take.

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
from .elementwise import apply_dropout
from .softmax import softmax_array


class KeyMask:
    """Which keys of a batch are real tokens, from (B, S) booleans (an array or a Tensor):
    True where a key may be attended, False at padding. ``model.src_key_mask(src)`` builds it.
    It holds the mask in the forms its users take:

    - ``mask``, (B, S), as given;
    - ``attn_mask``, (B, 1, 1, S), broadcasting over heads and queries, for the composite op;
    - ``lengths``, (B,) int32, the real keys of each row, for the fused kernel, which takes
      padding as lengths; None if some row's padding is not a suffix. Computed on first use,
      by the kernel's dispatch only, since the suffix check costs a device-to-host sync: once
      per batch this way, instead of once per attention layer.
    """

    def __init__(self, mask) -> None:
        self.mask = mask.data if isinstance(mask, Tensor) else mask  # (B, S)
        if self.mask.dtype != bool:
            raise TypeError(f"KeyMask: expected (B, S) booleans (True = may attend), got {self.mask.dtype}")
        if self.mask.ndim != 2:
            raise ValueError(f"KeyMask: expected (B, S) booleans (True = may attend), got shape {self.mask.shape}")
        self.attn_mask = self.mask[:, None, None, :]
        self._lengths, self._lengths_known = None, False

    @property
    def lengths(self):
        if not self._lengths_known:
            b, s = self.mask.shape
            self._lengths, self._lengths_known = kernels.key_lengths_from_mask(self.attn_mask, b, s), True
        return self._lengths

    def select(self, rows) -> KeyMask:
        """The mask of batch rows ``rows`` (beam search keeps its surviving beams); the lengths
        come along when known, so that the selection costs no new sync."""
        selected = KeyMask(self.mask[rows])
        if self._lengths_known:
            selected._lengths = None if self._lengths is None else self._lengths[rows]
            selected._lengths_known = True
        return selected

    def __repr__(self) -> str:
        return f"KeyMask(shape={self.mask.shape})"


def causal_mask(xp, t: int, s: int):
    r"""(T, S) boolean mask, True where query $i$ may see key $j$: $j \le i + (S - T)$."""
    return xp.tril(xp.ones((t, s), dtype=bool), k=s - t)


def attention_scores(q, k, attn_mask, is_causal: bool, scale: float):
    r"""Masked, scaled scores $QK^\top \cdot \mathrm{scale}$, $-\infty$ where masked: (..., T, S)."""
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
    if is_causal and q.shape[-2] > 1:  # a single query (a decoding step) sees every key
        scores = xp.where(causal_mask(xp, q.shape[-2], k.shape[-2]), scores, -xp.inf)
    return scores


class ScaledDotProductAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, dropout_p, scale):
        p = softmax_array(attention_scores(q, k, attn_mask, is_causal, scale))  # (..., T, S)
        p = p.astype(v.dtype, copy=False)
        keep = None
        if dropout_p > 0.0:
            keep, keep_scale = backend.dropout_mask(backend.device_of(q), p.shape, dropout_p)
            ctx.keep_scale = p.dtype.type(keep_scale)
        ctx.save_for_backward(q, k, v, p, keep)
        ctx.scale = scale
        p_used = p if keep is None else apply_dropout(p, keep, ctx.keep_scale)
        return (p_used @ v).astype(v.dtype, copy=False)  # (..., T, d_v)

    @staticmethod
    def backward(ctx, g):
        q, k, v, p, keep = ctx.saved
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        p_used = p if keep is None else apply_dropout(p, keep, ctx.keep_scale)
        gv = p_used.swapaxes(-1, -2) @ g if need_v else None  # (..., S, d_v)
        gp, p = backend.upcast(g @ v.swapaxes(-1, -2), p)  # (..., T, S)
        if keep is not None:
            gp *= keep
            gp *= ctx.keep_scale
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


def _fused_attention(q, k, v, mask, key_mask, is_causal, dropout_p, scale):
    """FusedAttention when the kernels take q, k, v (``kernels.attention_refusal`` decides)
    and the mask is one they can express: none, a ``KeyMask``, or a boolean key-padding mask
    (B, 1, 1, S) that keeps a prefix of each row; else None."""
    if kernels.attention_refusal(q.data, k.data, v.data) is not None:
        return None
    kv_lens = None
    if mask is not None:
        if key_mask is not None:
            kv_lens = key_mask.lengths if key_mask.mask.shape == (q.shape[0], k.shape[-2]) else None
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
    mask = attn_mask.attn_mask if isinstance(attn_mask, KeyMask) else attn_mask
    return backend.to_device(mask.data if isinstance(mask, Tensor) else mask, q.device)


def _checked_mask(q: Tensor, k: Tensor, v: Tensor, attn_mask):
    """Raise an error naming the arguments' shapes if q, k, v and the mask do not fit together;
    return the mask as an array on q's device (or None)."""
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"attention: q {q.shape}, k {k.shape} and v {v.shape} need (..., length, dim)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} differ in d_k")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: k {k.shape} and v {v.shape} differ in the number of keys")
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])  # (B, h) as a rule
    except ValueError:
        raise ValueError(f"attention: the batch and head axes of q {q.shape}, k {k.shape} and v "
                         f"{v.shape} differ") from None
    mask = _mask_array(attn_mask, q)
    if mask is None:
        return None
    if mask.dtype != bool and not backend.is_floating(mask.dtype):
        raise TypeError(f"attention: attn_mask must be boolean (True = may attend) or floating point "
                        f"(added to the scores), got {mask.dtype}")
    scores = (*lead, q.shape[-2], k.shape[-2])
    try:
        fits = np.broadcast_shapes(mask.shape, scores) == scores
    except ValueError:
        fits = False
    if not fits:
        what = "KeyMask of shape " + str(attn_mask.mask.shape) if isinstance(attn_mask, KeyMask) else \
            "attn_mask of shape " + str(mask.shape)
        raise ValueError(f"attention: {what} does not broadcast to the scores (..., T, S) = {scores} "
                         f"of q {q.shape} and k {k.shape}")
    return mask


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask=None,
                                 is_causal: bool = False, dropout_p: float = 0.0,
                                 scale: float | None = None) -> Tensor:
    r"""$\mathrm{softmax}(QK^\top \cdot \mathrm{scale} + M)\,V$, with scale $1/\sqrt{d_k}$ by default:
    equation (1), with the mask $M$ added to the scores (0 where a query may attend, $-\infty$
    where not).

    ``attn_mask``: None, a boolean (True = may attend) or float mask broadcasting to
    (..., T, S), or a ``KeyMask``. ``is_causal``: query $i$ sees keys $j \le i + (S - T)$.
    ``dropout_p`` drops attention weights (pass 0.0 when not training, as with PyTorch).
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    mask = _checked_mask(q, k, v, attn_mask)
    key_mask = attn_mask if isinstance(attn_mask, KeyMask) else None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    fused = _fused_attention(q, k, v, mask, key_mask, is_causal, dropout_p, scale)
    if fused is not None:
        return fused
    return ScaledDotProductAttention.apply(q, k, v, mask, is_causal, dropout_p, scale)


def attention_weights(q: Tensor, k: Tensor, attn_mask=None, is_causal: bool = False,
                      scale: float | None = None) -> Tensor:
    """The probabilities softmax(q k^T * scale + M), (..., T, S), for inspection and plots.

    Not differentiable: training goes through ``scaled_dot_product_attention``, which never
    hands the T x S matrix out (and, in the fused kernel, never stores it).
    """
    mask = _checked_mask(q, k, k, attn_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return Tensor(softmax_array(attention_scores(q.data, k.data, mask, is_causal, scale)))

