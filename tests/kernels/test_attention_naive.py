"""csrc/attention_naive.cu and its NumPy twin, minitransformer/kernels/reference/attention_naive.py,
in three sections: the twin against the formula (CPU, always run); the kernels in the CPU
emulator (emulated.py); the kernels on the device against float64 (device.py).

The kernels run one thread per element in blocks of 256 over flat indices, and a query sees
the keys j < visible_end, so the boundaries are element counts at multiples of 256 and one
either side, and the masks' edges: S - T of 0, +-1 and more with causal masking, decoding's
T = 1, and key lengths of 0, 1, one short and full.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitransformer import kernels
from minitransformer.kernels import reference as R
from minitransformer.kernels.reference import formulas

import emulated
from checks import DTYPES, TWIN_SETTINGS, TWIN_TOL, seeds
import device
from device import DEVICE_SETTINGS, gpu_sized, on_device
from emulated import EMULATOR_SETTINGS


# --------------------------------------------------------------------------- twin vs formula


@st.composite
def shapes(draw, max_len=40, max_dim=16):
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    T, S, D = draw(st.integers(1, max_len)), draw(st.integers(1, max_len)), draw(st.integers(1, max_dim))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, D, lens, draw(st.booleans())


@TWIN_SETTINGS
@given(shapes(), seeds)
def test_attention_naive_twin_matches_formula(case, seed):
    B, H, T, S, D, lens, causal = case
    r = np.random.default_rng(seed)
    q, k, v = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)), r.standard_normal((B, H, S, D))
    np.testing.assert_allclose(R.attention_naive_forward(q, k, v, lens, causal),
                               formulas.attention(q, k, v, lens, causal)[0], **TWIN_TOL)


def test_attention_naive_twin_gives_zeros_where_no_key_is_seen_and_reads_no_padding():
    B, H, T, S, D = 2, 1, 30, 20, 4
    r = np.random.default_rng(5)
    q, k, v = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)), r.standard_normal((B, H, S, D))
    lens = [12, 0]
    k[0, :, 12:], v[0, :, 12:] = np.nan, np.inf
    o = R.attention_naive_forward(q, k, v, lens, causal=True)
    assert (o[1] == 0).all() and (o[0, :, : T - S] == 0).all()  # no keys; the causal past of key 0
    k[0, :, 12:] = v[0, :, 12:] = 0
    np.testing.assert_allclose(o, formulas.attention(q, k, v, lens, causal=True)[0], **TWIN_TOL)


# --------------------------------------------------------------------------- emulated kernels


# Element counts at a multiple of the 256-thread blocks and one either side: T queries of S keys
# (the scores), of one key (the rows of the softmax), of D = 1 (the outputs).
BLOCK_EDGES = [(1, 1, T, S, D, None, False) for T, S, D in
               ((16, 16, 1), (15, 17, 1), (257, 1, 1), (255, 1, 1), (128, 2, 2), (1, 257, 1), (256, 1, 1))]
MASK_EDGES = (
    [(1, 2, T, S, 8, None, True) for T in (1, 20) for S in (T, T + 1, T - 1, T + 7, T - 7) if S > 0]
    + [(4, 3, T, 9, 8, [0, 1, 8, 9], causal) for T in (1, 8, 9, 10) for causal in (False, True)]
    + [(B, 3, 1, S, 8, lens, causal) for S in emulated.DECODE_LENGTHS for causal in (True, False)
       for B, lens in ((1, None), (2, (S, S - 1)))]
)
HEAD_DIMS = [(1, 1, 5, 7, D, [7], True) for D in (1, 3, 31, 32, 64, 65, 128)]


def check_cases(C, dtype, cases, **kwargs):
    emulated.check_rung_cases(C, emulated.check_attention_naive, dtype, cases, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(case=shapes(max_len=70, max_dim=40), seed=seeds)
def test_attention_naive_kernels(C, dtype, case, seed):
    emulated.check_attention_naive(C, dtype, *case, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edges", ["blocks", "masks", "head dims"])
def test_attention_naive_kernels_at_every_boundary(C, dtype, edges):
    check_cases(C, dtype, {"blocks": BLOCK_EDGES, "masks": MASK_EDGES, "head dims": HEAD_DIMS}[edges])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_naive_kernels_with_scores_past_exps_range(C, dtype):
    """q and k scaled by 10: scores in the hundreds, whose exponentials overflow float32 unless
    the row's maximum is subtracted first."""
    check_cases(C, dtype, [case for case in MASK_EDGES if case[0] == 1][:10], magnitude=10.0)


# --------------------------------------------------------------------------- kernels on the device


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_naive_launcher_matches_the_formula_and_the_fused_kernel(dtype):
    device.check_rung_against_the_formula_and_the_fused_kernel(kernels.attention_naive_forward, dtype)


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(case=shapes(max_len=600, max_dim=128), seed=seeds)
def test_attention_naive_matches_float64(dtype, case, seed):
    device.check_rung(kernels.attention_naive_forward, dtype, *case, seed)


@on_device
def test_attention_naive_rejects_bad_arguments_with_python_errors():
    device.check_rung_rejects_bad_arguments(kernels.attention_naive_forward)
