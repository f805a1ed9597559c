"""Weight initialisation, drawn from the CPU generator so that ``manual_seed`` gives the same
model on every device."""

from __future__ import annotations

import math

import numpy as np

from .. import backend


def xavier_uniform(fan_in: int, fan_out: int, dtype=np.float32, gain: float = 1.0) -> np.ndarray:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010), shape
    (fan_in, fan_out)."""
    return uniform((fan_in, fan_out), gain * math.sqrt(6.0 / (fan_in + fan_out)), dtype)


def uniform(shape, bound: float, dtype=np.float32) -> np.ndarray:
    """U(-bound, bound)."""
    return backend.generator("cpu").uniform(-bound, bound, shape).astype(dtype)


def normal(shape, std: float, dtype=np.float32) -> np.ndarray:
    return (backend.generator("cpu").standard_normal(shape) * std).astype(dtype)
