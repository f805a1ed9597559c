"""The launchers' last guard (csrc/launch_config.cuh), in the CPU emulator: where no variant of a
kernel fits the device's shared memory per block, the launcher raises before anything runs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import emulated
from emulated import CODE, device_empty, ptr
from checks import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_limit_no_variant_fits_raises_before_launching(C, dtype):
    rng = np.random.default_rng()
    B, H, T, S, D, limit = 1, 1, 8, 8, 128, 48 * 1024
    (q, _), (k, _), (v, _) = (emulated.randn(rng, (B, H, n, D), dtype) for n in (T, S, S))
    o, lse = device_empty(q.shape, q.dtype), device_empty((B, H, T), np.float32)
    o[...], lse[...] = 0, 0
    smallest = C.launch_configs("attention_forward", CODE[dtype], D)[-1]
    message = f"attention_forward: {smallest['kernel']}, its smallest configuration, needs {smallest['smem']}"
    with pytest.raises(C.SharedMemoryLimitError, match=re.escape(message)):
        C.attention_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), 0, CODE[dtype], B, H, T, S, D,
                            0.1, False, 0.0, 0, limit, 0)
    dq, dk, dv = (device_empty(a.shape, a.dtype) for a in (q, k, v))
    acc, delta = device_empty((B, H, T, D), np.float32), device_empty((B, H, T), np.float32)
    with pytest.raises(C.SharedMemoryLimitError, match="attention_backward: "):
        C.attention_backward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(q), ptr(lse), 0, ptr(dq), ptr(dk),
                             ptr(dv), ptr(acc), ptr(delta), CODE[dtype], B, H, T, S, D, 0.1, False,
                             0.0, 0, limit, 0)
    # Nothing ran: not the forward kernel, not backward's zeroing of dq or its delta kernel.
    assert not o.any() and not lse.any()
    assert np.isnan(acc).all() and np.isnan(delta).all()
    with pytest.raises(C.SharedMemoryLimitError, match="layernorm_backward: "):
        C.layernorm_backward(ptr(q), 0, ptr(lse), ptr(lse), ptr(q), ptr(o), 0, 0, ptr(acc), 1,
                             CODE[dtype], T, D, 2 * D * 4, 0)
