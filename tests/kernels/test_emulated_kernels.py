"""The CUDA kernels of csrc/, run on the CPU (minitransformer/testing/emulator), against the formulas.

The very sources the GPU build compiles (bindings, launchers, kernels) are compiled with g++
against a small emulation of the CUDA runtime, warps, barriers and mma.sync, and driven with
NumPy arrays. That checks, without a GPU, their indexing, masking, tiling, synchronisation,
Philox bits (bit-exact with the NumPy twin's) and arithmetic. What it cannot check: that the
hardware's mma.sync / ldmatrix fragments are what the emulation reads in the PTX ISA,
tensor-core rounding, cp.async timing (copies complete at once here), races that the
emulation's scheduling hides (test_sanitizers.py has ThreadSanitizer look for those within a
block), speed. The GPU tests (test_cuda_kernels.py) remain the authority.

Shapes stay small: every emulated CUDA thread is an OS thread. The calls and checks are in
emulated.py, which test_sanitizers.py runs under the compilers' sanitizers too.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulated
from emulated import DTYPES
from formulas import seeds
from minitransformer.testing import emulator

emulated.require_emulator()

SETTINGS = settings(max_examples=6, deadline=None)


@pytest.fixture(scope="module")
def C():
    return emulator.build()


@st.composite
def attention_case(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, draw(st.sampled_from([32, 64, 128])), lens, draw(st.booleans())


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=attention_case(), seed=seeds)
def test_attention_kernels(C, dtype, case, seed):
    emulated.check_attention(C, dtype, *case, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@SETTINGS
@given(seed=seeds)
def test_attention_dropout_uses_the_twins_mask(C, dtype, causal, seed):
    emulated.check_attention(C, dtype, 2, 1, 40, 75, 32, [75, 50], causal, seed, dropout_p=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 12), D=st.sampled_from([1, 7, 64, 100, 1030]), affine=st.booleans(),
       seed=seeds)
def test_layernorm_kernels(C, dtype, N, D, affine, seed):
    emulated.check_layernorm(C, dtype, N, D, affine, seed)


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
