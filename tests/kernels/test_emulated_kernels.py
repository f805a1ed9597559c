"""The CUDA kernels of csrc/, run on the CPU (minitransformer/testing/emulator), against the formulas.

The very sources the GPU build compiles (bindings, launchers, kernels) are compiled with g++
against a small emulation of the CUDA runtime, warps, barriers and mma.sync, and driven with
NumPy arrays. That checks, without a GPU, their indexing, masking, tiling, synchronisation,
Philox bits (bit-exact with the NumPy twin's) and arithmetic, and each launcher's choice of
kernel variant by the device's shared memory per block (every architecture's limit is drawn).
What it cannot check: that the hardware's mma.sync / ldmatrix fragments are what the emulation
reads in the PTX ISA, tensor-core rounding, cp.async timing (copies complete at once here),
races that the emulation's scheduling hides (test_sanitizers.py has ThreadSanitizer look for
those within a block), speed. The GPU tests (test_cuda_kernels.py) remain the authority.

Shapes stay small: every emulated CUDA thread is an OS thread. The calls and checks are in
emulated.py, which test_sanitizers.py runs under the compilers' sanitizers too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulated
from emulated import CODE, DTYPES, LIMITS, device_empty, ptr
from formulas import seeds
from minitransformer.testing import emulator
from minitransformer.testing.resources import SHARED_MEMORY_PER_BLOCK

emulated.require_emulator()

SETTINGS = settings(max_examples=6, deadline=None)


@pytest.fixture(scope="module")
def C():
    return emulator.build()


@st.composite
def attention_case(draw, head_dims):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, draw(st.sampled_from(head_dims)), lens, draw(st.booleans())


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data(), limit=st.sampled_from(LIMITS), seed=seeds)
def test_attention_kernels(C, dtype, data, limit, seed):
    case = data.draw(attention_case(C.limits()["attention_head_dims"]))  # every dim csrc/limits.cuh names
    emulated.check_attention(C, dtype, *case, seed, smem_limit=limit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@SETTINGS
@given(seed=seeds)
def test_attention_dropout_uses_the_twins_mask(C, dtype, causal, seed):
    emulated.check_attention(C, dtype, 2, 1, 40, 75, 32, [75, 50], causal, seed, dropout_p=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 12), D=st.sampled_from([1, 7, 64, 100, 1030, "widest"]),
       affine=st.booleans(), limit=st.sampled_from(LIMITS), seed=seeds)
def test_layernorm_kernels(C, dtype, N, D, affine, limit, seed):
    D = C.limits()["layernorm_max_d"] if D == "widest" else D
    emulated.check_layernorm(C, dtype, N, D, affine, seed, smem_limit=limit)


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
    emulated.check_attention(C, "float32", 2, 1, 70, 90, D, [90, 41], True, arch, smem_limit=limit)


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
    emulated.check_softmax(C, dtype, N, V, masked, scale, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 8), V=st.sampled_from([5, 1025, 3000]), eps=st.sampled_from([0.0, 0.1]),
       use_ignore=st.booleans(), inplace=st.booleans(), seed=seeds)
def test_cross_entropy_kernel(C, dtype, N, V, eps, use_ignore, inplace, seed):
    emulated.check_cross_entropy(C, dtype, N, V, eps, use_ignore, inplace, seed)
