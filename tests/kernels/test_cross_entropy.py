"""csrc/softmax.cu's softmax fused with label-smoothed cross-entropy, and its NumPy twin,
minitransformer/kernels/reference/cross_entropy.py, in three sections: the twin against the
formula (CPU, always run); the kernel in the CPU emulator (emulated.py); the kernel on the
device against float64 (device.py).
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

import emulated
import checks
from minitransformer.kernels.reference import formulas
from device import DEVICE_SETTINGS, cp, gpu_sized, on_device, randn
from emulated import EMULATOR_SETTINGS
from checks import DTYPES, TWIN_SETTINGS, TWIN_TOL, check, rounder, seeds, to_f32


# --------------------------------------------------------------------------- twin vs formula


@TWIN_SETTINGS
@given(st.integers(1, 30), st.sampled_from([2, 33, 1024, 1500, 5000]),
       st.sampled_from([0.0, 0.1, 1.0]), st.booleans(), seeds)
def test_cross_entropy_twin_matches_formula(N, V, eps, use_ignore, seed):
    r = np.random.default_rng(seed)
    logits = r.standard_normal((N, V)) * 3
    target, ignore = checks.targets(r, N, V, use_ignore)
    loss, grad, nll = R.cross_entropy_forward(logits, target, eps, ignore, nll=True)
    loss_ref, grad_ref = formulas.cross_entropy(logits, target, eps, ignore)
    np.testing.assert_allclose(loss, loss_ref, **TWIN_TOL)
    np.testing.assert_allclose(grad, grad_ref, **TWIN_TOL)
    np.testing.assert_allclose(nll, formulas.cross_entropy(logits, target, 0.0, ignore)[0], **TWIN_TOL)


def test_cross_entropy_twin_matches_the_engine_loss():
    r = np.random.default_rng(7)
    logits = r.standard_normal((6, 9, 50)) * 2
    target = r.integers(0, 50, (6, 9))
    target[0, :4] = 0  # padding id, ignored
    loss, grad = R.cross_entropy_forward(logits.reshape(-1, 50), target.reshape(-1), 0.1, 0)
    tz = mt.tensor(logits, requires_grad=True)
    out = F.cross_entropy(tz, target, label_smoothing=0.1, ignore_index=0, reduction="sum")
    out.backward()
    np.testing.assert_allclose(loss.sum(), out.item(), **TWIN_TOL)
    np.testing.assert_allclose(grad.reshape(logits.shape), tz.grad.numpy(), **TWIN_TOL)


# --------------------------------------------------------------------------- emulated kernels


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(N=st.integers(1, 8), V=st.sampled_from([5, 1025, 3000]), eps=st.sampled_from([0.0, 0.1]),
       use_ignore=st.booleans(), inplace=st.booleans(), nll=st.booleans(), seed=seeds)
def test_cross_entropy_kernel(C, dtype, N, V, eps, use_ignore, inplace, nll, seed):
    emulated.check_cross_entropy(C, dtype, N, V, eps, use_ignore, inplace, nll, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [5, 1024, 1025, 3000])  # rows of a warp, and of a block
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_kernel_across_the_range(C, dtype, V, eps):
    """Ignored targets, the NLL, and the gradient over the logits and beside them, at each range."""
    for spread, offset in checks.LOGIT_RANGES[dtype]:
        for use_ignore, inplace in ((False, False), (True, True)):
            emulated.check_cross_entropy(C, dtype, 7, V, eps, use_ignore, inplace, True, V, spread, offset)


def test_cross_entropy_smoothing_constants_at_a_realistic_vocabulary(C):
    """eps / V, not eps / (V - 1), at V = 1,000, where the two differ by 1e-7 an entry: below
    the gradient's tolerance, but not in its row sums, which the smoothed target's mass makes
    exactly 0 (eps / (V - 1) leaves -1e-4; float32 leaves < 1e-6), nor in the loss's mean term
    at logits around 10 (a 1 / (V - 1) there moves the loss by ~1e-4)."""
    N, V = 64, 1000
    rng = np.random.default_rng(0)
    z, z64 = emulated.logits(rng, (N, V), "float32", 1.0, 10.0)
    t, _ = checks.targets(rng, N, V, False)
    loss, grad = emulated.cross_entropy(C, z, t, "float32", 0.1)
    loss_r, _ = formulas.cross_entropy(z64, t, 0.1, None)
    assert np.abs(grad.astype(np.float64).sum(axis=1)).max() <= 1e-5
    np.testing.assert_allclose(loss, loss_r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cross_entropy_rounds_its_16_bit_outputs_to_nearest_even(C, dtype):
    """No output is biased towards zero (a truncating conversion): checks.check_rounding."""
    outputs = emulated.rounding_of_cross_entropy(C, dtype)
    for name, (got, ref) in outputs.items():
        checks.check_rounding(f"cross_entropy {name}", dtype, got, ref)


# --------------------------------------------------------------------------- kernels on the device


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(N=st.integers(1, 64), V=st.sampled_from([5, 1000, 1025, 37000]),
       eps=st.sampled_from([0.0, 0.1]), use_ignore=st.booleans(), values=st.integers(0, 3), seed=seeds)
def test_cross_entropy_matches_float64(dtype, N, V, eps, use_ignore, values, seed):
    """values: logits of spread 3, or one of the ranges of checks.LOGIT_RANGES."""
    rng = np.random.default_rng(seed)
    ranges = [(3.0, 0.0), *checks.LOGIT_RANGES[dtype]]
    z, z64 = checks.logits(rng, (N, V), dtype, *ranges[values % len(ranges)], xp=cp)
    t, ignore = checks.targets(rng, N, V, use_ignore, ignore_index=0)
    loss, grad, nll = kernels.cross_entropy_forward(z, cp.asarray(t), eps, ignore, nll=True)
    loss_r, grad_r = formulas.cross_entropy(z64, t, eps, ignore)
    naive = [None, None, None]
    if dtype != "float32":  # the unsmoothed NLL is the loss at eps = 0
        zf, tc, rnd = to_f32(z), cp.asarray(t), rounder(dtype)
        naive = [*checks.naive_cross_entropy(zf, tc, eps, ignore, rnd),
                 checks.naive_cross_entropy(zf, tc, 0.0, ignore, rnd)[0]]
    check("cross_entropy", dtype, cp.asnumpy(loss).astype(np.float64), loss_r, naive[0])
    check("cross_entropy", dtype, grad, grad_r, naive[1])
    check("cross_entropy", dtype, cp.asnumpy(nll).astype(np.float64),
          formulas.cross_entropy(z64, t, 0.0, ignore)[0], naive[2])


@on_device
def test_cross_entropy_gradient_in_place_of_the_logits():
    rng = np.random.default_rng()
    z, z64 = randn(rng, (50, 3000), "float32")
    t = rng.integers(0, 3000, 50)
    loss, grad = kernels.cross_entropy_forward(z, cp.asarray(t), 0.1, grad="inplace")
    assert grad.data.ptr == z.data.ptr
    loss_r, grad_r = formulas.cross_entropy(z64, t, 0.1)
    check("cross_entropy", "float32", cp.asnumpy(loss).astype(np.float64), loss_r)
    check("cross_entropy", "float32", z, grad_r)


@on_device
def test_cross_entropy_rejects_out_of_range_targets():
    z = cp.ones((4, 10), dtype=cp.float32)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        kernels.cross_entropy_forward(z, cp.asarray([1, 2, 10, 3]))
