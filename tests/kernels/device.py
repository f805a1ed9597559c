"""The device sections: the CUDA kernels on "cuda" against float64 formulas, and F's dispatch
to them (test_dispatch.py).

On a GPU, or on the emulated device (MT_EMULATE_CUDA=1, which conftest sets without a GPU):
there the launchers, bindings and kernels are the same code, compiled for the CPU. The cases
marked ``gpu_sized`` draw shapes a CPU cannot run through per-thread emulation in CI's
minutes; the emulator sections check the same kernels at emulator sizes. Marked ``on_device``:
skipped, with the reason, where the kernels are unavailable. The tolerances and the 16-bit
rule (at most twice a naive same-precision implementation's error) are described in
checks.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import settings

from minitransformer import backend, kernels
from minitransformer.kernels.reference import formulas

import checks

on_device = pytest.mark.skipif(not kernels.available(),
                               reason=f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
gpu_sized = pytest.mark.skipif(
    backend.is_emulated("cuda"),
    reason="GPU-sized shapes; on the emulated device the emulator sections check these kernels")

cp = backend.get_array_module("cuda") if kernels.available() else None  # CuPy, or its stand-in
DEVICE_SETTINGS = settings(max_examples=30, deadline=None)
randn = functools.partial(checks.randn, xp=cp)


# --------------------------------------------------------------------------- the ladder's rungs


def check_rung(forward, dtype, B, H, T, S, D, lens, causal, seed):
    """A lower rung's launcher (kernels.attention_naive_forward or _tiled_forward) against the
    float64 formula, with the 16-bit rule against the naive same-precision output."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64) = (randn(rng, s, dtype) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D)))
    o = forward(q, k, v, lens, causal)
    naive = checks.naive_attention_output(q, k, v, lens, causal, dtype)
    checks.check("attention", dtype, o, formulas.attention(q64, k64, v64, lens, causal)[0], naive)


def check_rung_against_the_formula_and_the_fused_kernel(forward, dtype):
    """A fixed case against float64 (a batch entry with no keys), and the rung's output equal to
    the fused kernel's on the same arrays, at B 2 and H 3."""
    B, H, T, S, D = 2, 3, 9, 33, 32
    check_rung(forward, dtype, B, H, T, S, D, [33, 0], True, seed=1)
    rng = np.random.default_rng(2)
    q, k, v = (randn(rng, (B, H, n, D), dtype)[0] for n in (T, S, S))
    ours = forward(q, k, v, [20, 33], causal=False)
    fused, _ = kernels.attention_forward(q, k, v, [20, 33], causal=False)
    tol = 1e-2 if dtype != "float32" else 1e-5
    np.testing.assert_allclose(checks.to_f32(cp.asnumpy(ours)), checks.to_f32(cp.asnumpy(fused)), rtol=tol, atol=tol)


def check_rung_rejects_bad_arguments(forward):
    """Python errors, not a fault: a dtype the kernels do not take, mismatched k, the wrong
    number of key lengths; any head dim the fused kernels are not compiled for (48)."""
    q = cp.ones((1, 1, 8, 48), dtype=cp.float64)
    with pytest.raises(TypeError, match="float64"):
        forward(q, q, q)
    q = cp.ones((1, 1, 8, 48), dtype=cp.float32)
    with pytest.raises(ValueError, match="must both be"):
        forward(q, q[:, :, :, :32], q)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \(1,\)"):
        forward(q, q, q, kv_lens=[8, 8])

