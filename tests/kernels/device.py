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

import pytest
from hypothesis import settings

from minitransformer import backend, kernels

import checks

on_device = pytest.mark.skipif(not kernels.available(),
                               reason=f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
gpu_sized = pytest.mark.skipif(
    backend.is_emulated("cuda"),
    reason="GPU-sized shapes; on the emulated device the emulator sections check these kernels")

cp = backend.get_array_module("cuda") if kernels.available() else None  # CuPy, or its stand-in
DEVICE_SETTINGS = settings(max_examples=30, deadline=None)
randn = functools.partial(checks.randn, xp=cp)
