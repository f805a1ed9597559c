"""csrc/attention_tiled.cu and its NumPy twin, minitransformer/kernels/reference/attention_tiled.py,
in three sections: the twin against the formula (CPU, always run); the kernel in the CPU
emulator (emulated.py); the kernel on the device against float64 (device.py).

The kernel's blocks own 16 queries and stream keys in tiles of 16, each thread keeping the
outputs d = c, c + 16, ... < D of its query, and its tiles are loaded 256 elements a round; so
the boundaries are T and S at multiples of 16 and one either side, D at multiples of 16 and at
the kernel's largest (128), and the masks' edges: S - T of 0, +-1 and more with causal masking,
decoding's T = 1, and key lengths of 0, 1, a tile's edge, one short and full, with B >= 2 and
H >= 3 so that a batch or head index error cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitransformer import kernels
from minitransformer.kernels import reference as R
from minitransformer.kernels.reference import attention_tiled as tiled
from minitransformer.kernels.reference import formulas

import emulated
from checks import DTYPES, TWIN_SETTINGS, TWIN_TOL, seeds
import device
from device import DEVICE_SETTINGS, cp, gpu_sized, on_device
from emulated import EMULATOR_SETTINGS

# --------------------------------------------------------------------------- twin vs formula


@st.composite
def shapes(draw, max_len=50, max_dim=40):
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    T, S, D = draw(st.integers(1, max_len)), draw(st.integers(1, max_len)), draw(st.integers(1, max_dim))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, D, lens, draw(st.booleans())


@TWIN_SETTINGS
@given(shapes(), seeds)
def test_attention_tiled_twin_matches_formula(case, seed):
    B, H, T, S, D, lens, causal = case
    r = np.random.default_rng(seed)
    q, k, v = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)), r.standard_normal((B, H, S, D))
    np.testing.assert_allclose(R.attention_tiled_forward(q, k, v, lens, causal),
                               formulas.attention(q, k, v, lens, causal)[0], **TWIN_TOL)


def test_attention_tiled_twin_gives_zeros_where_no_key_is_seen_and_reads_no_padding():
    B, H, T, S, D = 2, 3, 40, 20, 4
    r = np.random.default_rng(5)
    q, k, v = r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)), r.standard_normal((B, H, S, D))
    lens = [12, 0]
    k[0, :, 12:], v[0, :, 12:] = np.nan, np.inf
    o = R.attention_tiled_forward(q, k, v, lens, causal=True)
    assert (o[1] == 0).all() and (o[0, :, : T - S] == 0).all()  # no keys; the causal past of key 0
    k[0, :, 12:] = v[0, :, 12:] = 0
    np.testing.assert_allclose(o, formulas.attention(q, k, v, lens, causal=True)[0], **TWIN_TOL)


@TWIN_SETTINGS
@given(st.integers(1, 100), st.integers(1, 100), st.booleans())
def test_forward_bytes_counts_the_rows_the_twin_reads(T, S, causal):
    """Q and O once, K twice (a pass each) and V once, over the tiles of scores the twin
    computes; no row past a block's last visible key."""
    tiles = []
    q, k, v = (np.ones((1, 1, n, 2)) for n in (T, S, S))
    R.attention_tiled_forward(q, k, v, causal=causal, observer=lambda rows, cols: tiles.append(len(cols)))
    keys = sum(tiles) // 2  # each tile's scores are computed once in each pass
    assert tiled.forward_bytes(1, 1, T, S, 2, 4, causal) == (2 * T + 3 * keys) * 2 * 4
    assert sum(tiles) % 2 == 0


# --------------------------------------------------------------------------- emulated kernel


TILE_EDGES = [(2, 3, T, S, D, None, False) for T, S, D in
              ((16, 16, 16), (15, 17, 15), (17, 15, 17), (33, 31, 1), (31, 33, 33), (1, 48, 32), (48, 1, 2))]
MASK_EDGES = (
    [(2, 3, T, S, 8, None, True) for T in (1, 20) for S in (T, T + 1, T - 1, T + 7, T - 7, T + 16) if S > 0]
    + [(5, 3, T, 33, 8, [0, 1, 16, 17, 33], causal) for T in (1, 16, 17, 33) for causal in (False, True)]
    + [(2, 3, 1, S, 8, (S, S - 1), causal) for S in emulated.DECODE_LENGTHS if S > 1 for causal in (True, False)]
)
HEAD_DIMS = [(2, 3, 18, 21, D, [21, 5], True) for D in (1, 3, 16, 31, 32, 64, 65, 127, 128)]


def check_cases(C, dtype, cases, **kwargs):
    emulated.check_rung_cases(C, emulated.check_attention_tiled, dtype, cases, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(case=shapes(max_len=70, max_dim=70), seed=seeds)
def test_attention_tiled_kernel(C, dtype, case, seed):
    emulated.check_attention_tiled(C, dtype, *case, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edges", ["tiles", "masks", "head dims"])
def test_attention_tiled_kernel_at_every_boundary(C, dtype, edges):
    check_cases(C, dtype, {"tiles": TILE_EDGES, "masks": MASK_EDGES, "head dims": HEAD_DIMS}[edges])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_tiled_kernel_with_scores_past_exps_range(C, dtype):
    """q and k scaled by 10: scores in the hundreds, whose exponentials overflow float32 unless
    the row's maximum is subtracted first."""
    check_cases(C, dtype, MASK_EDGES[:10], magnitude=10.0)


def test_attention_tiled_kernel_refuses_a_head_dim_past_its_registers(C):
    q = emulated.device_empty((1, 1, 4, 129), np.float32)
    with pytest.raises(ValueError, match="head dim 129 is past the kernel's 128"):
        C.attention_tiled_forward(*(emulated.ptr(q),) * 4, 0, 0, 1, 1, 4, 4, 129, 1.0, False, 0)


# --------------------------------------------------------------------------- kernel on the device


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_tiled_launcher_matches_the_formula_and_the_fused_kernel(dtype):
    device.check_rung_against_the_formula_and_the_fused_kernel(kernels.attention_tiled_forward, dtype)


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(case=shapes(max_len=600, max_dim=128), seed=seeds)
def test_attention_tiled_matches_float64(dtype, case, seed):
    device.check_rung(kernels.attention_tiled_forward, dtype, *case, seed)


@on_device
def test_attention_tiled_rejects_bad_arguments_with_python_errors():
    device.check_rung_rejects_bad_arguments(kernels.attention_tiled_forward)
    q = cp.ones((1, 1, 8, 129), dtype=cp.float32)
    with pytest.raises(ValueError, match="past the tiled kernel's 128"):
        kernels.attention_tiled_forward(q, q, q)
