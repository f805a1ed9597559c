"""Layer normalisation (Ba et al., 2016) over the last axis, as used after every sublayer
of the Transformer (paper section 3.1: LayerNorm(x + Sublayer(x))).

    mean = (1/D) sum_i x_i          var = (1/D) sum_i (x_i - mean)^2
    rstd = 1 / sqrt(var + eps)      xhat = (x - mean) * rstd
    y    = xhat * weight + bias

Forward saves only the per-row statistics ``mean`` and ``rstd`` (besides x and weight); backward
rebuilds xhat from them:

    dweight = sum_rows g * xhat        dbias = sum_rows g
    dxhat   = g * weight
    dx      = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))

16-bit inputs are normalised in float32 (the statistics are saved in float32) and the output
is rounded back to their dtype, as the fused kernel does.
"""

from __future__ import annotations

from .. import backend, kernels
from ..autograd import Function
from ..tensor import Tensor


def layer_norm_stats(x, eps: float):
    """Per-row ``(mean, rstd)`` with keepdims, in x's dtype (use float32 x for 16-bit data)."""
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    return mean, 1.0 / (var + eps) ** 0.5


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x32, w32, b32 = backend.upcast(x, weight, bias)
        mean, rstd = layer_norm_stats(x32, eps)
        y = (x32 - mean) * rstd  # (..., D)
        ctx.save_for_backward(x, weight, mean, rstd)
        if weight is not None:
            y *= w32
        if bias is not None:
            y += b32
        return y.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, rstd = ctx.saved
        x, weight, g = backend.upcast(x, weight, g)
        _, need_w, need_b, _ = ctx.needs_input_grad
        xhat = (x - mean) * rstd
        rows = tuple(range(g.ndim - 1))
        gw = (g * xhat).sum(axis=rows) if need_w else None
        gb = g.sum(axis=rows) if need_b else None
        gxhat = g * weight if weight is not None else g
        gx = rstd * (
            gxhat
            - gxhat.mean(axis=-1, keepdims=True)
            - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)
        )
        return gx, gw, gb, None


class FusedLayerNorm(Function):
    """csrc/layernorm.cu (see minitransformer.kernels): the same statistics, one warp per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = kernels.layernorm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, rstd = ctx.saved
        _, need_w, need_b, _ = ctx.needs_input_grad
        return (*kernels.layernorm_backward(x, weight, mean, rstd, g, need_w, need_b), None)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis of ``x``, then scale by ``weight`` and shift by ``bias``."""
    d = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (d,):
            raise ValueError(f"layer_norm: {name} of shape {p.shape} does not match the last axis of {x.shape}")
    if kernels.layernorm_supported(*(None if t is None else t.data for t in (x, weight, bias))) is None:
        return FusedLayerNorm.apply(x, weight, bias, eps)
    return LayerNorm.apply(x, weight, bias, eps)
