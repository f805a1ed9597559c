"""Elementwise ops: arithmetic, exp/log/sqrt, relu, where/masked_fill, dropout, casts.

Binary ops broadcast like NumPy. Their backward returns gradients of the broadcast shape;
the autograd engine sums them back to each input's shape (``autograd.sum_to_shape``), so no
op here has to. Either operand may be a plain Python number, which gets no gradient.
"""

from __future__ import annotations

from .. import backend
from ..autograd import Function
from ..tensor import Tensor


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        return g, g


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a - b

    @staticmethod
    def backward(ctx, g):
        return g, (-g if ctx.needs_input_grad[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        return (g * b if need_a else None), (g * a if need_b else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = a / b
        ctx.save_for_backward(b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        b, out = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        ga = g / b if need_a else None
        gb = -g * out / b if need_b else None  # d(a/b)/db = -a/b^2 = -out/b
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = a**b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        xp = backend.array_module_of(g)
        ga = g * b * a ** (b - 1) if need_a else None
        gb = g * out * xp.log(a) if need_b else None
        return ga, gb


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.array_module_of(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * out


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return backend.array_module_of(a).log(a)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved
        return g / a


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.array_module_of(a).sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g / (2 * out)


class ReLU(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.array_module_of(a).maximum(a, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * (out > 0)


class Where(Function):
    """``cond ? a : b`` elementwise; ``cond`` is a boolean array and gets no gradient."""

    @staticmethod
    def forward(ctx, cond, a, b):
        ctx.save_for_backward(cond)
        return backend.array_module_of(cond).where(cond, a, b)

    @staticmethod
    def backward(ctx, g):
        (cond,) = ctx.saved
        xp = backend.array_module_of(g)
        _, need_a, need_b = ctx.needs_input_grad
        ga = xp.where(cond, g, 0) if need_a else None
        gb = xp.where(cond, 0, g) if need_b else None
        return None, ga, gb


class Dropout(Function):
    """Zero each element with probability p and scale the rest by 1/(1-p) (inverted dropout).

    The boolean mask is saved, so backward applies exactly the mask forward drew.
    """

    @staticmethod
    def forward(ctx, x, p):
        keep, scale = backend.dropout_mask(backend.device_of(x), x.shape, p)
        ctx.save_for_backward(keep)
        ctx.scale = x.dtype.type(scale)
        return apply_dropout(x, keep, ctx.scale)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved
        return apply_dropout(g, keep, ctx.scale), None


def apply_dropout(x, keep, scale):
    """``x * keep * scale`` in a new array: a dropout mask applied (also by attention's)."""
    out = x * keep
    out *= scale
    return out


class Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src_dtype = x.dtype
        return x.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.src_dtype, copy=False), None


class ToDevice(Function):
    @staticmethod
    def forward(ctx, x, device):
        ctx.src_device = backend.device_of(x)
        return backend.to_device(x, device)

    @staticmethod
    def backward(ctx, g):
        return backend.to_device(g, ctx.src_device), None


# --------------------------------------------------------------------------- public API


def _weak(a, b):
    """Python numbers are "weak", as in PyTorch: ``x * 0.5`` keeps x's dtype. NumPy 2 (NEP 50)
    and CuPy already treat them so for their own dtypes, but ml_dtypes' bfloat16 would be
    promoted to float32; there the number is first made a bfloat16 scalar."""
    if isinstance(a, Tensor) and isinstance(b, (int, float)) and a.dtype == backend.bfloat16:
        return a, a.dtype.type(b)
    if isinstance(b, Tensor) and isinstance(a, (int, float)) and b.dtype == backend.bfloat16:
        return b.dtype.type(a), b
    return a, b


def add(a, b) -> Tensor:
    return Add.apply(*_weak(a, b))


def sub(a, b) -> Tensor:
    return Sub.apply(*_weak(a, b))


def mul(a, b) -> Tensor:
    return Mul.apply(*_weak(a, b))


def div(a, b) -> Tensor:
    return Div.apply(*_weak(a, b))


def neg(a) -> Tensor:
    return Neg.apply(a)


def pow(a, b) -> Tensor:  # noqa: A001 - mirrors torch.pow
    return Pow.apply(*_weak(a, b))


def exp(a) -> Tensor:
    return Exp.apply(a)


def log(a) -> Tensor:
    return Log.apply(a)


def sqrt(a) -> Tensor:
    return Sqrt.apply(a)


def relu(a) -> Tensor:
    return ReLU.apply(a)


def where(cond, a, b) -> Tensor:
    """Elements of ``a`` where ``cond`` is True, else of ``b`` (both may be numbers)."""
    return Where.apply(cond, a, b)


def masked_fill(x, mask, value) -> Tensor:
    """``x`` with ``value`` wherever the boolean ``mask`` (broadcast to ``x``) is True."""
    return Where.apply(mask, value, x)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Inverted dropout (Srivastava et al., 2014); the identity when not training or p == 0."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    return Dropout.apply(x, p)


def cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else Cast.apply(x, dtype)


def to_device(x: Tensor, device: str) -> Tensor:
    backend.check_device(device)
    return ToDevice.apply(x, device)


def compare(a, b, op: str) -> Tensor:
    """A boolean tensor from a NumPy comparison ufunc (``"less"``, ``"equal"``...)."""
    a_data = a.data if isinstance(a, Tensor) else a
    b_data = b.data if isinstance(b, Tensor) else b
    xp = backend.array_module_of(a_data if isinstance(a, Tensor) else b_data)
    return Tensor(getattr(xp, op)(a_data, b_data))
