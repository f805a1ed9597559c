"""csrc/layernorm.cu and its NumPy twin, minitransformer/kernels/reference/layernorm.py, in
three sections: the twin against the formula (CPU, always run); the kernels in the CPU emulator
(emulated.py); the kernels on the device against float64 (device.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import kernels
from minitransformer.kernels import reference as R

import checks
import emulated
from minitransformer.kernels.reference import formulas
from device import DEVICE_SETTINGS, cp, gpu_sized, on_device, randn
from emulated import EMULATOR_SETTINGS, LIMITS
from checks import (
    DTYPES, TWIN_SETTINGS, TWIN_TOL, check, host64, naive_layernorm, rounder, seeds, to_f32,
    to_kernel,
)


# --------------------------------------------------------------------------- twin vs formula


@TWIN_SETTINGS
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([1, 2, 4, 8]),
       st.booleans(), st.floats(-1e3, 1e3), seeds)
def test_layernorm_twin_matches_formula(N, D, vec, affine, offset, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((N, D)) * r.uniform(0.1, 10) + offset
    w, b = (r.standard_normal(D), r.standard_normal(D)) if affine else (None, None)
    g = r.standard_normal((N, D))
    y, mean, rstd = R.layernorm_forward(x, w, b, eps=1e-5, vec=vec)
    y_ref, dx_ref, dw_ref, db_ref = formulas.layer_norm(x, w, b, 1e-5, g=g)
    np.testing.assert_allclose(y, y_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(mean, x.mean(1), rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(1) + 1e-5), rtol=1e-9)
    dx, dw, db = R.layernorm_backward(x, w, mean, rstd, g, blocks=3)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(db, db_ref, rtol=1e-9, atol=1e-9)


def test_layernorm_one_pass_statistics_survive_a_large_mean_in_float32():
    # Welford + Chan in float32 keeps the variance of data sitting at 1e4; the textbook
    # one-pass E[x^2] - E[x]^2 would lose it all to cancellation.
    r = np.random.default_rng(5)
    x = (r.standard_normal((64, 512)) + 1e4).astype(np.float32)
    _, mean, rstd = R.layernorm_forward(x, eps=1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-3)
    naive_var = (x * x).mean(1) - x.mean(1) ** 2
    assert np.abs(naive_var - x64.var(1)).max() > 0.1  # what the one-pass shortcut would do


def test_layernorm_twin_matches_the_engine_composite_op():
    r = np.random.default_rng(6)
    x, w, b, g = r.standard_normal((7, 5, 96)), r.standard_normal(96), r.standard_normal(96), r.standard_normal((7, 5, 96))
    y, mean, rstd = R.layernorm_forward(x.reshape(-1, 96), w, b)
    dx, dw, db = R.layernorm_backward(x.reshape(-1, 96), w, mean, rstd, g.reshape(-1, 96))
    tx, tw, tb = (mt.tensor(a, requires_grad=True) for a in (x, w, b))
    out = F.layer_norm(tx, tw, tb, eps=1e-5)
    out.backward(g)
    np.testing.assert_allclose(y.reshape(x.shape), out.numpy(), **TWIN_TOL)
    np.testing.assert_allclose(dx.reshape(x.shape), tx.grad.numpy(), **TWIN_TOL)
    np.testing.assert_allclose(dw, tw.grad.numpy(), **TWIN_TOL)
    np.testing.assert_allclose(db, tb.grad.numpy(), **TWIN_TOL)


# --------------------------------------------------------------------------- emulated kernels


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(N=st.integers(1, 12), D=st.sampled_from([1, 7, 64, 100, 1030, "widest"]),
       affine=st.booleans(), limit=st.sampled_from(LIMITS), seed=seeds)
def test_layernorm_kernels(C, dtype, N, D, affine, limit, seed):
    D = C.limits()["layernorm_max_d"] if D == "widest" else D
    emulated.check_layernorm(C, dtype, N, D, affine, seed, smem_limit=limit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 64, 100, 1030])  # vectorised loads and scalar ones
def test_layernorm_kernels_on_constant_and_narrow_rows(C, dtype, D):
    """Constant rows (variance 0: y is the bias, dx is 0), rows whose spread is a tenth of their
    mean (narrower ones lose digits to float32 in any one-pass mean: an ulp of the mean over the
    spread, times rstd in dx), and rows whose variance is below eps, at every warp count of the
    backward (each architecture's limit)."""
    for spread, offset in ((0.0, 3.0), (0.1, 1.0), (1e-3, 0.0)):
        for limit in LIMITS:
            emulated.check_layernorm(C, dtype, 13, D, True, D, smem_limit=limit, spread=spread, offset=offset)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layernorm_rounds_its_16_bit_outputs_to_nearest_even(C, dtype):
    """No output is biased towards zero (a truncating conversion): checks.check_rounding."""
    outputs = emulated.rounding_of_layernorm(C, dtype)
    for name, (got, ref) in outputs.items():
        checks.check_rounding(f"layernorm {name}", dtype, got, ref)


# --------------------------------------------------------------------------- kernels on the device


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(N=st.integers(1, 200), D=st.sampled_from([1, 7, 32, 64, 100, 512, 768, 1030, 4096]),
       offset=st.sampled_from([0.0, 5.0]), seed=seeds)
def test_layernorm_matches_float64(dtype, N, D, offset, seed):
    rng = np.random.default_rng(seed)
    x, x64 = randn(rng, (N, D), dtype)
    if offset:
        x = to_kernel(to_f32(x) + offset, dtype)
        x64 = host64(x)
    (w, w64), (b, b64), (g, g64) = randn(rng, (D,), dtype), randn(rng, (D,), dtype), randn(rng, (N, D), dtype)
    y, mean, rstd = kernels.layernorm_forward(x, w, b, eps=1e-5)
    dx, dw, db = kernels.layernorm_backward(x, w, mean, rstd, g)
    y_r, dx_r, dw_r, db_r = formulas.layer_norm(x64, w64, b64, 1e-5, g=g64)
    np.testing.assert_allclose(cp.asnumpy(mean), x64.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(rstd), 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-4)
    naive = [None] * 4
    if dtype != "float32":
        naive = naive_layernorm(*(to_f32(a) for a in (x, w, b, g)), 1e-5, rounder(dtype))
    for got, ref, nv in zip((y, dx, dw, db), (y_r, dx_r, dw_r, db_r), naive):
        check("layernorm", dtype, got, ref, nv)


@on_device
def test_layernorm_without_affine_parameters():
    rng = np.random.default_rng()
    x, x64 = randn(rng, (33, 96), "float32")
    g, g64 = randn(rng, (33, 96), "float32")
    y, mean, rstd = kernels.layernorm_forward(x)
    dx, dw, db = kernels.layernorm_backward(x, None, mean, rstd, g, weight_grad=False, bias_grad=False)
    y_r, dx_r, _, _ = formulas.layer_norm(x64, g=g64)
    check("layernorm", "float32", y, y_r)
    check("layernorm", "float32", dx, dx_r)
    assert dw is None and db is None
