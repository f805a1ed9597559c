"""Gradient utilities: the global gradient norm (a non-finite norm flags a step to skip) and
global-norm clipping."""

from __future__ import annotations

import math


def grad_norm(params) -> float:
    """sqrt(sum of squared gradient entries) over all parameters (inf or nan if any is)."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            g = p.grad.data
            total += float((g * g).sum())
    return math.sqrt(total)


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
