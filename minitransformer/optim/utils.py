"""Gradient utilities: the global gradient norm (a non-finite norm flags a step to skip) and
global-norm clipping."""

from __future__ import annotations

import math

import numpy as np

from .. import backend


def grad_norm(params) -> float:
    """sqrt(sum of squared gradient entries) over all parameters (inf or nan if any is).

    The per-parameter sums stay on the device and are added there: one host sync, not one
    per parameter."""
    parts = [(p.grad.data * p.grad.data).sum(dtype=np.float64) for p in params if p.grad is not None]
    if not parts:
        return 0.0
    return math.sqrt(float(backend.array_module_of(parts[0]).stack(parts).sum()))


def clip_grad_norm_(params, max_norm: float) -> float:
    """Scale all gradients in place so their global norm is at most ``max_norm``;
    returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.data *= scale
    return norm
