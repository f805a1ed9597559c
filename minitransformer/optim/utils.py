"""Gradient utilities: the global gradient norm (a non-finite norm flags a step to skip) and
global-norm clipping."""

from __future__ import annotations

import math

import numpy as np

from .. import backend


def grad_norm(params) -> float:
    """sqrt(sum of squared gradient entries) over all parameters (inf or nan if any is).

    Each parameter's sum of squares is a BLAS dot product of the gradient with itself in
    float32 (16-bit gradients are widened first), with no squared copy; the sums stay on the
    device and are added there in float64: one host sync, not one per parameter. A float32 sum
    overflows only for a norm beyond 1e19; then the sums are redone in float64, so only a truly
    non-finite gradient reads as one."""
    grads = [p.grad.data.reshape(-1) for p in params if p.grad is not None]
    if not grads:
        return 0.0
    xp = backend.array_module_of(grads[0])
    grads = [g.astype(np.float32) if g.dtype.itemsize < 4 else g for g in grads]
    total = float(xp.stack([xp.dot(g, g) for g in grads]).astype(np.float64).sum())
    if not math.isfinite(total):
        wide = [g.astype(np.float64) for g in grads]
        total = float(xp.stack([xp.dot(g, g) for g in wide]).sum())
    return math.sqrt(total)


def clip_grad_norm_(params, max_norm: float) -> float:
    """Scale all gradients in place so their global norm is at most ``max_norm``;
    returns the norm before clipping. A ``max_norm`` that is not a finite number > 0 is refused:
    nan would clip nothing, silently."""
    if not (isinstance(max_norm, (int, float, np.floating, np.integer)) and 0 < max_norm < math.inf):
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r}")
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.data *= scale
            p.grad.bump_version()
    return norm
