"""Matrix products: ``matmul`` (batched, broadcasting over leading axes) and ``linear``.

``linear`` keeps the weight as (in_features, out_features) so the code reads as the paper's
``xW + b`` (section 3.3: FFN(x) = max(0, xW1 + b1)W2 + b2).
"""

from __future__ import annotations

from ..autograd import Function
from ..tensor import Tensor


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        # NumPy multiplies bfloat16 matrices in float32 and returns float32 (as tensor cores
        # accumulate in float32): round back, so that a bfloat16 model stays bfloat16.
        return (a @ b).astype(a.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        ga = g @ b.swapaxes(-1, -2) if need_a else None
        gb = None
        if need_b:
            if b.ndim == 2 and g.ndim > 2:  # shared weight: one GEMM over all rows
                gb = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                gb = a.swapaxes(-1, -2) @ g
        return ga, gb


class Linear(Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        # Rows of all leading axes in one GEMM: NumPy would loop over a batch axis instead.
        out = x.reshape(-1, x.shape[-1]) @ weight  # (rows, out_features)
        if bias is not None:
            out += bias
        return out.astype(x.dtype, copy=False).reshape(x.shape[:-1] + (weight.shape[1],))  # as in MatMul

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (rows, out_features)
        gx = (g2 @ weight.T).reshape(x.shape) if need_x else None
        gw = x.reshape(-1, x.shape[-1]).T @ g2 if need_w else None
        gb = g2.sum(axis=0) if need_b else None
        return gx, gw, gb


def _check_matmul_shapes(a_shape, b_shape, name: str) -> None:
    k_a = a_shape[-1]
    k_b = b_shape[-2] if len(b_shape) >= 2 else b_shape[0]
    if k_a != k_b:
        raise ValueError(
            f"{name}: shapes {tuple(a_shape)} and {tuple(b_shape)} are not aligned "
            f"({k_a} != {k_b} in the contracted dimension)"
        )


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with NumPy's rules: batch axes broadcast; a 1-D operand is a vector."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: both operands need at least one dimension, got {a.shape} and {b.shape}")
    _check_matmul_shapes(a.shape, b.shape, "matmul")
    if a.ndim == 1 and b.ndim == 1:
        return matmul(a.reshape((1, -1)), b.reshape((-1, 1))).reshape(())
    if a.ndim == 1:
        return matmul(a.reshape((1, -1)), b).reshape(b.shape[:-2] + b.shape[-1:])
    if b.ndim == 1:
        return matmul(a, b.reshape((-1, 1))).reshape(a.shape[:-1])
    try:
        return MatMul.apply(a, b)
    except ValueError as e:
        raise ValueError(f"matmul: batch shapes of {a.shape} and {b.shape} do not broadcast") from e


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """$xW + b$: ``x @ weight + bias``, with ``weight`` of shape (in_features, out_features)."""
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D (in_features, out_features), got {weight.shape}")
    _check_matmul_shapes(x.shape, weight.shape, "linear")
    if bias is not None and bias.shape != (weight.shape[1],):
        raise ValueError(f"linear: bias of shape {bias.shape} does not match weight {weight.shape}")
    return Linear.apply(x, weight, bias)
