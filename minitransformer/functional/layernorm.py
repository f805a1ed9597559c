"""Layer normalisation (Ba et al., 2016) over the last axis, as used after every sublayer
of the Transformer (paper section 3.1: LayerNorm(x + Sublayer(x))).

    mean = (1/D) sum_i x_i          var = (1/D) sum_i (x_i - mean)^2
    rstd = 1 / sqrt(var + eps)      xhat = (x - mean) * rstd
    y    = xhat * weight + bias

Forward saves xhat and rstd (besides weight); backward is

    dweight = sum_rows g * xhat        dbias = sum_rows g
    dxhat   = g * weight
    dx      = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))

Each line is as few passes over the (rows, D) arrays as NumPy allows: the products that are
summed at once go through ``einsum``, which never builds the product array, and the rest
works in place. (The fused kernel saves mean and rstd instead and rebuilds xhat, trading
compute for memory, which a GPU has less of.)

16-bit inputs are normalised in float32 (the statistics and xhat are saved in float32) and
the output is rounded back to their dtype, as the fused kernel does.
"""

from __future__ import annotations

from .. import backend, kernels
from ..autograd import Function
from ..tensor import Tensor


class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x32, w32, b32 = backend.upcast(x, weight, bias)
        xp = backend.array_module_of(x32)
        d = x.shape[-1]
        xhat = x32 - x32.mean(axis=-1, keepdims=True)  # (..., D), centred
        var = xp.einsum("...d,...d->...", xhat, xhat)[..., None] / d
        rstd = 1.0 / xp.sqrt(var + eps)
        xhat *= rstd
        ctx.save_for_backward(xhat, weight, rstd)
        y = xhat * w32 if weight is not None else xhat.copy()
        if bias is not None:
            y += b32
        return y.astype(x.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        xhat, weight, rstd = ctx.saved
        weight, g = backend.upcast(weight, g)
        xp = backend.array_module_of(g)
        _, need_w, need_b, _ = ctx.needs_input_grad
        d = g.shape[-1]
        gw = xp.einsum("nd,nd->d", g.reshape(-1, d), xhat.reshape(-1, d)) if need_w else None
        gb = g.reshape(-1, d).sum(axis=0) if need_b else None
        gx = g * weight if weight is not None else g.copy()  # dxhat, then dx in place
        a = gx.mean(axis=-1, keepdims=True)
        b = xp.einsum("...d,...d->...", gx, xhat)[..., None] / d
        gx -= a
        gx -= xhat * b
        gx *= rstd
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
    if kernels.layernorm_refusal(*(None if t is None else t.data for t in (x, weight, bias))) is None:
        return FusedLayerNorm.apply(x, weight, bias, eps)
    return LayerNorm.apply(x, weight, bias, eps)
