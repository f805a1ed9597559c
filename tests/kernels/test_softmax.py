"""csrc/softmax.cu's row softmax and its NumPy twin, minitransformer/kernels/reference/softmax.py
(the online max and sum that cross-entropy shares), in three sections: the twin against the
formula (CPU, always run); the kernels in the CPU emulator (emulated.py); the kernels on the
device against float64 (device.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitransformer import kernels
from minitransformer.kernels import reference as R

import emulated
import checks
from minitransformer.kernels.reference import formulas
from device import DEVICE_SETTINGS, cp, gpu_sized, on_device, randn
from emulated import EMULATOR_SETTINGS
from checks import DTYPES, TWIN_SETTINGS, TWIN_TOL, check, host64, rounder, seeds, to_f32


# --------------------------------------------------------------------------- twin vs formula


@TWIN_SETTINGS
@given(st.integers(1, 20), st.sampled_from([1, 7, 32, 100, 1024, 1025, 3000]),
       st.booleans(), st.floats(0.05, 4.0), seeds)
def test_softmax_twin_matches_formula(N, V, masked, scale, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((N, V)) * 5
    mask = r.random((N, V)) < 0.7 if masked else None
    if masked:
        mask[0] = False  # a fully masked row
    g = r.standard_normal((N, V))
    y = R.softmax_forward(x, mask, scale)
    y_ref, dx_ref = formulas.softmax(x, mask, scale, g=g)
    np.testing.assert_allclose(y, y_ref, **TWIN_TOL)
    np.testing.assert_allclose(R.softmax_backward(y, g, scale), dx_ref, **TWIN_TOL)
    if masked:
        assert (y[0] == 0).all()


def test_online_max_sum_handles_huge_logits():
    x = np.array([[1e4, 1e4 - 1, -1e4], [-np.inf, -np.inf, -np.inf]])
    m, s = R.online_max_sum(x)
    np.testing.assert_allclose(m[0], 1e4)
    np.testing.assert_allclose(s[0], 1 + np.exp(-1.0))
    assert m[1] == -np.inf and s[1] == 0


# --------------------------------------------------------------------------- emulated kernels


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(N=st.integers(1, 6), V=st.sampled_from([1, 33, 1025, 3000]), masked=st.booleans(),
       scale=st.sampled_from([1.0, 0.125]), seed=seeds)
def test_softmax_kernels(C, dtype, N, V, masked, scale, seed):
    emulated.check_softmax(C, dtype, N, V, masked, scale, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [33, 1024, 1025, 3000])  # rows of a warp, and of a block
def test_softmax_kernels_across_the_range(C, dtype, V):
    for spread, offset in checks.LOGIT_RANGES[dtype]:
        for masked in (False, True):
            emulated.check_softmax(C, dtype, 5, V, masked, 1.0, V, spread, offset)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softmax_rounds_its_16_bit_outputs_to_nearest_even(C, dtype):
    """No output is biased towards zero (a truncating conversion): checks.check_rounding. The rows of
    y sum to 1 within the spread of their elements' roundings to nearest (five standard deviations
    of a sum of independent errors, each uniform over one ulp)."""
    outputs = emulated.rounding_of_softmax(C, dtype)
    for name, (got, ref) in outputs.items():
        checks.check_rounding(f"softmax {name}", dtype, got, ref)
    y = checks.host64(outputs["y"][0])
    ulp = np.exp2(np.floor(np.log2(y)) - checks.MANTISSA_BITS[dtype])
    spread = 5 * np.sqrt((ulp**2 / 12).sum(axis=1))
    assert (np.abs(y.sum(axis=1) - 1) <= spread).all(), np.abs(y.sum(axis=1) - 1).max()


# --------------------------------------------------------------------------- kernels on the device


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(N=st.integers(1, 64), V=st.sampled_from([1, 33, 1024, 1025, 5000, 37000]),
       masked=st.booleans(), scale=st.sampled_from([1.0, 0.125]), values=st.integers(0, 3), seed=seeds)
def test_softmax_matches_float64(dtype, N, V, masked, scale, values, seed):
    """values: logits of spread 4, or one of the ranges of checks.LOGIT_RANGES."""
    rng = np.random.default_rng(seed)
    ranges = [(4.0, 0.0), *checks.LOGIT_RANGES[dtype]]
    x, x64 = checks.logits(rng, (N, V), dtype, *ranges[values % len(ranges)], xp=cp)
    g, g64 = randn(rng, (N, V), dtype)
    mask = None
    if masked:
        mask_h = rng.random((N, V)) < 0.8
        mask_h[0] = False  # a fully masked row
        mask = cp.asarray(mask_h)
    y = kernels.softmax_forward(x, mask, scale)
    dx = kernels.softmax_backward(y, g, scale)  # backward from the kernel's own y
    y_r = formulas.softmax(x64, None if mask is None else mask_h, scale)
    y64 = host64(y)
    dx_r = scale * y64 * (g64 - (g64 * y64).sum(axis=1, keepdims=True))
    naive = [None, None]
    if dtype != "float32":
        rnd, yf, gf = rounder(dtype), to_f32(y), to_f32(g)
        naive = [checks.naive_softmax(to_f32(x), mask, scale, rnd),
                 checks.naive_softmax_backward(yf, gf, scale, rnd)]
    check("softmax", dtype, y, y_r, naive[0])
    check("softmax", dtype, dx, dx_r, naive[1])
    if masked:
        assert (y64[0] == 0).all()
