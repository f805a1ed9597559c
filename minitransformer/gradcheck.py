"""Checking gradients: autograd against central finite differences.

For f: R^n -> R^m and a fixed random vector r in R^m, backward computes the vector-Jacobian
product r^T J in one pass. The same product, entry by entry, is

    (r^T J)_i  ~  [ r . f(x + eps e_i) - r . f(x - eps e_i) ] / (2 eps)

whose error is O(eps^2) (central differences). In float64 with eps = 1e-6 the two agree to
about 1e-8 for smooth functions, so a tolerance of 1e-5 separates a correct backward from a
wrong one (a wrong backward is off by O(1)). Projecting on a random r, instead of the all-ones
vector, means a backward that mixes up output positions cannot pass by symmetry.
"""

from __future__ import annotations

import numpy as np

from . import backend
from .autograd import no_grad
from .tensor import Tensor


def numerical_gradient(f, x, eps: float = 1e-6) -> np.ndarray:
    """d f() / d x by central differences, as a float64 NumPy array shaped like ``x``.

    ``f`` takes no arguments and returns a float computed from ``x`` (a contiguous NumPy or
    CuPy array), which is perturbed in place one entry at a time and restored."""
    flat = x.reshape(-1)  # a view: writing it perturbs x
    out = np.zeros(x.size)
    for i in range(x.size):
        orig = flat[i].item()
        flat[i] = orig + eps
        plus = f()
        flat[i] = orig - eps
        minus = f()
        flat[i] = orig
        out[i] = (plus - minus) / (2 * eps)
    return out.reshape(x.shape)


def gradcheck(fn, inputs, eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-4,
              seed: int = 0) -> None:
    """Raise ``AssertionError`` unless autograd's gradients of ``fn(*inputs)`` match finite
    differences for every input Tensor with ``requires_grad=True``.

    ``fn`` must be deterministic (reseed inside it if it draws random numbers) and the inputs
    should be float64. Other inputs are passed through unchanged.
    """
    checked = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input requires grad")
    for t in checked:
        if t.dtype != np.float64:
            raise ValueError(f"gradcheck needs float64 inputs, got {t.dtype}")
        t.data = backend.array_module_of(t.data).ascontiguousarray(t.data)  # so flat views alias
        t.grad = None

    out = fn(*inputs)
    xp = backend.array_module_of(out.data)
    r = xp.asarray(np.random.default_rng(seed).standard_normal(out.shape))
    (out * Tensor(r)).sum().backward()

    def projected() -> float:
        with no_grad():
            return float((fn(*inputs).data * r).sum())

    for k, t in enumerate(checked):
        analytic = t.grad.numpy() if t.grad is not None else np.zeros(t.shape)
        numeric = numerical_gradient(projected, t.data, eps)
        err = np.abs(analytic - numeric)
        bad = err > atol + rtol * np.abs(numeric)
        if bad.any():
            i = np.unravel_index(np.argmax(err), err.shape)
            raise AssertionError(
                f"gradcheck: gradient of input {k} (shape {t.shape}) is wrong at {bad.sum()} of "
                f"{t.size} entries; worst at {tuple(int(j) for j in i)}: autograd "
                f"{analytic[i]:.6g} vs finite differences {numeric[i]:.6g}"
            )
