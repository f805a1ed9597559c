"""The CUDA kernels of csrc/, run on the CPU (minitransformer/testing/emulator), against the formulas.

The very sources the GPU build compiles (bindings, launchers, kernels) are compiled with g++
against a small emulation of the CUDA runtime, warps, barriers and mma.sync, and driven with
NumPy arrays. That checks, without a GPU, their indexing, masking, tiling, synchronisation,
Philox bits (bit-exact with the NumPy twin's) and arithmetic. What it cannot check: that the
hardware's mma.sync / ldmatrix fragments are what the emulation reads in the PTX ISA,
tensor-core rounding, cp.async timing (copies complete at once here), races the emulation's
scheduling hides, speed. The GPU tests (test_cuda_kernels.py) remain the authority.

Shapes stay small: every emulated CUDA thread is an OS thread.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minitransformer.kernels import LAYERNORM_MAX_D
from minitransformer.kernels import reference as R

import formulas
from minitransformer.testing import emulator
from minitransformer.testing.resources import SHARED_MEMORY_PER_BLOCK
from formulas import check, naive_attention, rounder, seeds, to_f32

if emulator.unavailable_reason():
    # CI has nvcc's headers and g++: there a skip would hide the only CPU test of csrc/.
    if os.environ.get("MT_REQUIRE_EMULATOR"):
        raise RuntimeError(f"MT_REQUIRE_EMULATOR is set but the emulated kernels cannot be built: "
                           f"{emulator.unavailable_reason()}")
    pytest.skip(f"cannot build the emulated kernels: {emulator.unavailable_reason()}",
                allow_module_level=True)

DTYPES = ["float32", "float16", "bfloat16"]
CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
SETTINGS = settings(max_examples=6, deadline=None)
# The shared memory per block of each architecture the kernels are built for: the launchers
# choose their kernels' variants by it (csrc/launch_config.cuh).
LIMITS = sorted(set(SHARED_MEMORY_PER_BLOCK.values()))


@pytest.fixture(scope="module")
def C():
    return emulator.build()


def ptr(a) -> int:
    return 0 if a is None else a.ctypes.data


def aligned(a):
    """A C-contiguous copy of ``a`` whose data is 16-byte aligned, as the bindings require."""
    a = np.ascontiguousarray(a)
    raw = np.empty(a.nbytes + 16, dtype=np.uint8)
    offset = (-raw.ctypes.data) % 16
    out = raw[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def randn(rng, shape, dtype, scale=1.0):
    a, a64 = formulas.randn(rng, shape, dtype, np, scale)
    return aligned(a), a64


def attention(C, q, k, v, do, lens, causal, dtype, dropout_p=0.0, seed=0, smem_limit=LIMITS[-1]):
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1 / math.sqrt(D)
    lens = None if lens is None else aligned(np.asarray(lens, dtype=np.int32))
    o, lse = aligned(np.empty_like(q)), aligned(np.empty((B, H, T), np.float32))
    C.attention_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), ptr(lens), CODE[dtype], B, H, T,
                        S, D, scale, causal, dropout_p, seed, smem_limit, 0)
    dq, dk, dv = (aligned(np.empty_like(a)) for a in (q, k, v))
    acc, delta = np.empty((B, H, T, D), np.float32), np.empty((B, H, T), np.float32)
    C.attention_backward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(do), ptr(lse), ptr(lens), ptr(dq),
                         ptr(dk), ptr(dv), ptr(acc), ptr(delta), CODE[dtype], B, H, T, S, D,
                         scale, causal, dropout_p, seed, smem_limit, 0)
    return o, lse, dq, dk, dv


@st.composite
def attention_case(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S = draw(st.integers(1, 100)), draw(st.integers(1, 100))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return (B, H, T, S, draw(st.sampled_from([32, 64, 128])), lens, draw(st.booleans()),
            draw(st.sampled_from(LIMITS)))


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=attention_case(), seed=seeds)
def test_attention_kernels(C, dtype, case, seed):
    B, H, T, S, D, lens, causal, limit = case
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (
        randn(rng, s, dtype) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    o, lse, dq, dk, dv = attention(C, q, k, v, do, lens, causal, dtype, smem_limit=limit)
    o_r, lse_r, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, lens, causal, dout=do64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    finite = np.isfinite(lse_r)
    np.testing.assert_allclose(lse[finite], lse_r[finite], rtol=1e-4, atol=1e-4)
    naive = [None] * 4
    if dtype != "float32":
        naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), lens, causal, rounder(dtype))
    for name, got, ref, nv in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv),
                                  (o_r, dq_r, dk_r, dv_r), naive):
        check(name, dtype, got, ref, nv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_uses_the_twins_mask(C, dtype, causal):
    # float32: against the NumPy twin with the same seed (so the Philox bits agree exactly);
    # 16-bit: the 2x-naive rule, the naive implementation using the twin's dropout factors.
    rng = np.random.default_rng()
    B, H, T, S, D = 2, 1, 40, 75, 32
    (q, q64), (k, k64), (v, v64), (do, do64) = (
        randn(rng, s, dtype) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    lens, p, seed = [75, 50], 0.3, int(rng.integers(0, 2**63 - 1))
    o, lse, dq, dk, dv = attention(C, q, k, v, do, lens, causal, dtype, p, seed)
    o_t, lse_t = R.attention_forward(q64, k64, v64, lens, causal, dropout_p=p, seed=seed)
    grads_t = R.attention_backward(q64, k64, v64, o_t, lse_t, do64, lens, causal, dropout_p=p, seed=seed)
    naive = [None] * 4
    if dtype != "float32":
        bh = (np.arange(B)[:, None] * H + np.arange(H))[:, :, None, None]
        z = R.dropout_factor(bh, np.arange(T)[:, None], np.arange(S)[None, :], p, seed)
        naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), lens, causal, rounder(dtype), z)
    for name, got, ref, nv in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv),
                                  (o_t, *grads_t), naive):
        check(name, dtype, got, ref, nv)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 12), D=st.sampled_from([1, 7, 64, 100, 1030, LAYERNORM_MAX_D]),
       affine=st.booleans(), limit=st.sampled_from(LIMITS), seed=seeds)
def test_layernorm_kernels(C, dtype, N, D, affine, limit, seed):
    rng = np.random.default_rng(seed)
    (x, x64), (g, g64) = randn(rng, (N, D), dtype), randn(rng, (N, D), dtype)
    (w, w64), (b, b64) = (randn(rng, (D,), dtype) if affine else (None, None) for _ in range(2))
    y, dx = aligned(np.empty_like(x)), aligned(np.empty_like(x))
    mean, rstd = np.empty(N, np.float32), np.empty(N, np.float32)
    dw, db = np.empty(D, x.dtype), np.empty(D, x.dtype)
    blocks = 3
    partial = np.empty((blocks, 2, D), np.float32)
    C.layernorm_forward(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), CODE[dtype], N, D, 1e-5, 0)
    C.layernorm_backward(ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(g), ptr(dx), ptr(dw), ptr(db),
                         ptr(partial), blocks, CODE[dtype], N, D, limit, 0)
    y_r, dx_r, dw_r, db_r = formulas.layer_norm(x64, w64, b64, 1e-5, g=g64)
    np.testing.assert_allclose(mean, x64.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-4)
    naive = [None] * 4
    if dtype != "float32":
        ones, zeros = np.ones(D, np.float32), np.zeros(D, np.float32)
        naive = formulas.naive_layernorm(to_f32(x), ones if w is None else to_f32(w),
                                         zeros if b is None else to_f32(b), to_f32(g), 1e-5, rounder(dtype))
    for got, ref, nv in zip((y, dx, dw, db), (y_r, dx_r, dw_r, db_r), naive):
        check("layernorm", dtype, got, ref, nv)


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY_PER_BLOCK))
@pytest.mark.parametrize("D", [64, 128])
def test_attention_takes_the_largest_tiles_that_fit_each_architecture(C, arch, D):
    # float32 at D >= 64 has two tile sizes: on sm_86 / sm_89 (99 KiB) only the smaller fits.
    limit = SHARED_MEMORY_PER_BLOCK[arch]
    for launcher in ("attention_forward", "attention_backward"):
        variants = C.launch_configs(launcher, CODE["float32"], D)
        chosen = C.launch_config(launcher, CODE["float32"], D, limit)
        assert chosen["smem"] <= limit, (launcher, chosen)
        larger = variants[:variants.index(chosen)]
        assert all(v["smem"] > limit for v in larger), (launcher, variants, limit)
    rng = np.random.default_rng(arch)
    B, H, T, S, lens = 2, 1, 70, 90, [90, 41]
    (q, q64), (k, k64), (v, v64), (do, do64) = (
        randn(rng, s, "float32") for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    got = attention(C, q, k, v, do, lens, True, "float32", smem_limit=limit)
    ref = formulas.attention(q64, k64, v64, lens, True, dout=do64)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-4)
    for name, g, r in zip(["attention"] + ["attention_grad"] * 3, got[:1] + got[2:], ref[:1] + ref[2:]):
        check(name, "float32", g, r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_limit_no_variant_fits_raises_before_launching(C, dtype):
    rng = np.random.default_rng()
    B, H, T, S, D, limit = 1, 1, 8, 8, 128, 48 * 1024
    (q, _), (k, _), (v, _) = (randn(rng, (B, H, n, D), dtype) for n in (T, S, S))
    o, lse = aligned(np.zeros_like(q)), aligned(np.zeros((B, H, T), np.float32))
    smallest = C.launch_configs("attention_forward", CODE[dtype], D)[-1]
    message = f"attention_forward: {smallest['kernel']}, its smallest configuration, needs {smallest['smem']}"
    with pytest.raises(C.SharedMemoryLimitError, match=re.escape(message)):
        C.attention_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), 0, CODE[dtype], B, H, T, S, D,
                            0.1, False, 0.0, 0, limit, 0)
    dq, dk, dv = (aligned(np.zeros_like(a)) for a in (q, k, v))
    acc, delta = np.full((B, H, T, D), np.nan, np.float32), np.full((B, H, T), np.nan, np.float32)
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


# F.scaled_dot_product_attention on the emulated "cuda" device (MT_EMULATE_CUDA=1, a process of
# its own: the device is chosen at import), twice, on a GPU with `limit` bytes per block.
DISPATCH = """
import warnings
import numpy as np
import minitransformer as mt
import minitransformer.functional as F
from minitransformer.testing import emulated_cuda

emulated_cuda.configure(max_shared_memory_per_block_optin={limit})
rng = np.random.default_rng(0)
host = [rng.standard_normal((1, 2, 40, 128)).astype(np.float32) for _ in range(3)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        q, k, v = (mt.tensor(a, device="cuda", requires_grad=True) for a in host)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
print(out._ctx.fn.__name__)
for w in caught:
    print("warning:", w.message)
"""


@pytest.mark.parametrize("limit, function", [(SHARED_MEMORY_PER_BLOCK[86], "FusedAttention"),
                                             (64 * 1024, "ScaledDotProductAttention")])
def test_attention_falls_back_to_the_composite_op_with_one_warning(C, limit, function):
    env = {**os.environ, "MT_EMULATE_CUDA": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", DISPATCH.format(limit=limit)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    name, *warned = run.stdout.splitlines()
    assert name == function
    if function == "FusedAttention":
        assert warned == []
    else:  # once per process and configuration, naming the kernel, the limit and the way out
        smallest = C.launch_configs("attention_forward", CODE["float32"], 128)[-1]
        assert warned == [f"warning: fused attention: {smallest['kernel']} needs {smallest['smem']} "
                          f"bytes of shared memory per block, the device allows {limit}; "
                          f"scaled_dot_product_attention uses the composite op instead"]


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 6), V=st.sampled_from([1, 33, 1025, 3000]), masked=st.booleans(),
       scale=st.sampled_from([1.0, 0.125]), seed=seeds)
def test_softmax_kernels(C, dtype, N, V, masked, scale, seed):
    rng = np.random.default_rng(seed)
    (x, x64), (g, g64) = randn(rng, (N, V), dtype, scale=4.0), randn(rng, (N, V), dtype)
    mask = None
    if masked:
        mask = rng.random((N, V)) < 0.8
        mask[0] = False  # a fully masked row
    # A row with no finite entry: zeros, as the composite op gives (not NaN).
    x[-1], x64[-1] = formulas.to_kernel(np.full(V, -np.inf, np.float32), dtype), -np.inf
    y, dx = aligned(np.empty_like(x)), aligned(np.empty_like(x))
    mask_bytes = None if mask is None else aligned(mask.view(np.uint8))
    C.softmax_forward(ptr(x), ptr(mask_bytes), ptr(y), CODE[dtype], N, V, scale, 0)
    C.softmax_backward(ptr(y), ptr(g), ptr(dx), CODE[dtype], N, V, scale, 0)
    y64 = formulas.host64(y)
    y_r = formulas.softmax(x64, mask, scale)
    dx_r = scale * y64 * (g64 - (g64 * y64).sum(axis=1, keepdims=True))
    naive = [None, None]
    if dtype != "float32":
        rnd = rounder(dtype)
        naive = [formulas.naive_softmax(to_f32(x), mask, scale, rnd),
                 formulas.naive_softmax_backward(to_f32(y), to_f32(g), scale, rnd)]
    check("softmax", dtype, y, y_r, naive[0])
    check("softmax", dtype, dx, dx_r, naive[1])
    assert (y64[-1] == 0).all()
    if masked:
        assert (y64[0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 8), V=st.sampled_from([5, 1025, 3000]), eps=st.sampled_from([0.0, 0.1]),
       use_ignore=st.booleans(), inplace=st.booleans(), seed=seeds)
def test_cross_entropy_kernel(C, dtype, N, V, eps, use_ignore, inplace, seed):
    rng = np.random.default_rng(seed)
    z, z64 = randn(rng, (N, V), dtype, scale=3.0)
    t, ignore = formulas.targets(rng, N, V, use_ignore)
    target = aligned(t.astype(np.int64))
    loss = np.empty(N, np.float32)
    zf = to_f32(z)  # before the kernel may overwrite z
    grad = z if inplace else aligned(np.empty_like(z))
    C.cross_entropy_forward(ptr(z), ptr(target), ptr(loss), ptr(grad), CODE[dtype], N, V, eps,
                            ignore is not None, ignore if ignore is not None else 0, 0)
    loss_r, grad_r = formulas.cross_entropy(z64, t, eps, ignore)
    naive = [None, None]
    if dtype != "float32":
        naive = formulas.naive_cross_entropy(zf, t, eps, ignore, rounder(dtype))
    check("cross_entropy", dtype, loss.astype(np.float64), loss_r, naive[0])
    check("cross_entropy", dtype, grad, grad_r, naive[1])
