"""csrc/attention.cu and its NumPy twin, minitransformer/kernels/reference/attention.py (with the
Philox bits of the dropout mask), in three sections: the twin against the formula (CPU, always
run); the kernels in the CPU emulator (emulated.py); the kernels on the device against float64
(device.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import kernels
from minitransformer.kernels import reference as R
from minitransformer.kernels.resources import SHARED_MEMORY_PER_BLOCK

import checks
import emulated
from minitransformer.kernels.reference import formulas
from device import DEVICE_SETTINGS, cp, gpu_sized, on_device, randn
from emulated import CODE, EMULATOR_SETTINGS, LIMITS
from checks import (
    DTYPES, TWIN_SETTINGS, TWIN_TOL, check, naive_attention, rounder, seeds, to_f32,
)


# --------------------------------------------------------------------------- twin vs formula


@st.composite
def twin_case(draw):
    """Shapes with lengths around and off the tile sizes, batch 1, optional padding lengths
    (including 0: a sequence with no keys at all), causal or not, T != S."""
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 2))
    T = draw(st.integers(1, 80))
    S = draw(st.integers(1, 80))
    D = draw(st.sampled_from([4, 8, 16]))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    causal = draw(st.booleans())
    blocks = draw(st.sampled_from([(64, 64), (16, 16), (8, 32), (32, 8)]))
    return B, H, T, S, D, lens, causal, blocks


def qkv(B, H, T, S, D, seed=None):
    r = np.random.default_rng(seed)
    return (r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)),
            r.standard_normal((B, H, S, D)), r.standard_normal((B, H, T, D)))


@TWIN_SETTINGS
@given(twin_case(), seeds)
def test_attention_twin_matches_formula(case, seed):
    B, H, T, S, D, lens, causal, (bq, bk) = case
    q, k, v, dout = qkv(B, H, T, S, D, seed)
    o, lse = R.attention_forward(q, k, v, lens, causal, block_q=bq, block_k=bk)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = formulas.attention(q, k, v, lens, causal, dout=dout)
    np.testing.assert_allclose(o, o_ref, **TWIN_TOL)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], **TWIN_TOL)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, causal, block_q=bq, block_k=bk)
    np.testing.assert_allclose(dq, dq_ref, **TWIN_TOL)
    np.testing.assert_allclose(dk, dk_ref, **TWIN_TOL)
    np.testing.assert_allclose(dv, dv_ref, **TWIN_TOL)


@TWIN_SETTINGS
@given(st.integers(1, 200), st.integers(1, 200), st.booleans(), st.sampled_from([(64, 64), (16, 32), (32, 8)]))
def test_forward_bytes_counts_the_rows_of_k_and_v_the_twin_loads(T, S, causal, blocks):
    loaded = []
    q, k, v, _ = qkv(1, 1, T, S, 2, seed=0)
    R.attention_forward(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1],
                        observer=lambda rows, cols, *_: loaded.append(len(cols)))
    assert R.attention.forward_bytes(1, 1, T, S, 2, 4, *blocks, causal=causal) == (2 * T + 2 * sum(loaded)) * 2 * 4 + 4 * T


def test_attention_fully_masked_rows_are_zero_not_nan():
    # Batch 1 has no keys; with T > S and causal, the first T - S queries see nothing either.
    B, H, T, S, D = 2, 2, 50, 30, 8
    q, k, v, dout = qkv(B, H, T, S, D, seed=1)
    lens = [17, 0]
    o, lse = R.attention_forward(q, k, v, lens, causal=True, block_q=16, block_k=16)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, causal=True, block_q=16, block_k=16)
    assert np.isfinite(o).all() and np.isfinite(dq).all() and np.isfinite(dk).all()
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()
    assert (o[0, :, : T - S] == 0).all() and (dq[0, :, : T - S] == 0).all()
    assert (dk[0, :, 17:] == 0).all() and (dv[0, :, 17:] == 0).all()  # padding keys


def test_attention_padding_memory_is_never_read():
    # Whatever sits in the padded key/value rows (here NaN and inf) must not leak out.
    B, H, T, S, D = 2, 1, 20, 40, 8
    q, k, v, dout = qkv(B, H, T, S, D, seed=2)
    lens = [25, 40]
    k[0, :, 25:] = np.nan
    v[0, :, 25:] = np.inf
    o, lse = R.attention_forward(q, k, v, lens, block_k=16)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, block_k=16)
    k[0, :, 25:] = 0
    v[0, :, 25:] = 0
    o_ref, _, dq_ref, _, _ = formulas.attention(q, k, v, lens, dout=dout)
    np.testing.assert_allclose(o, o_ref, **TWIN_TOL)
    np.testing.assert_allclose(dq, dq_ref, **TWIN_TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_twin_matches_the_engine_composite_op(causal):
    # The twin's mask semantics (padding by length, bottom-right causal) are the engine's.
    B, H, T, S, D = 2, 3, 33, 47, 16
    q, k, v, dout = qkv(B, H, T, S, D, seed=3)
    lens = np.array([47, 20])
    o, lse = R.attention_forward(q, k, v, lens, causal)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, causal)
    tq, tk, tv = (mt.tensor(a, requires_grad=True) for a in (q, k, v))
    pad = (np.arange(S)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=pad, is_causal=causal)
    out.backward(dout)
    np.testing.assert_allclose(o, out.numpy(), **TWIN_TOL)
    for mine, t in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(mine, t.grad.numpy(), **TWIN_TOL)


# The dropout mask: Philox bits, and the factor they give each attention weight.


def test_philox_known_answers():
    # Random123's published known-answer vectors for philox4x32_10 (first output word).
    assert R.philox_bits(0, 0, 0, 0, c3=0) == 0x6627E8D5
    assert R.philox_bits(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, c3=0xFFFFFFFF) == 0x408F276D
    assert R.philox_bits(0x243F6A88, 0x85A308D3, 0x13198A2E, (0x299F31D0 << 32) | 0xA4093822,
                         c3=0x03707344) == 0xD16CFE09


def test_dropout_keeps_the_right_fraction_and_scales():
    p = 0.3
    z = R.dropout_factor(np.arange(4)[:, None, None], np.arange(100)[None, :, None],
                         np.arange(250)[None, None, :], p, seed=12345)
    kept = z > 0
    assert abs(kept.mean() - (1 - p)) < 0.01  # 1e5 draws: std 0.0015
    np.testing.assert_allclose(z[kept], 1 / (1 - np.float32(p)), rtol=1e-6)
    other = R.dropout_factor(np.arange(4)[:, None, None], np.arange(100)[None, :, None],
                             np.arange(250)[None, None, :], p, seed=54321)
    assert 0.3 < ((other > 0) == kept).mean() < 0.8  # another seed, another mask


@pytest.mark.parametrize("causal", [False, True])
def test_attention_twin_with_dropout_matches_formula(causal):
    B, H, T, S, D = 2, 2, 45, 70, 8
    q, k, v, dout = qkv(B, H, T, S, D, seed=4)
    lens, p, seed = [70, 33], 0.25, 987654321
    bh = (np.arange(B)[:, None] * H + np.arange(H))[:, :, None, None]
    z = R.dropout_factor(bh, np.arange(T)[:, None], np.arange(S)[None, :], p, seed, np.float64)
    o, lse = R.attention_forward(q, k, v, lens, causal, dropout_p=p, seed=seed, block_q=16, block_k=32)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, causal, dropout_p=p, seed=seed,
                                      block_q=16, block_k=32)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = formulas.attention(q, k, v, lens, causal, z=z, dout=dout)
    for mine, ref in ((o, o_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        np.testing.assert_allclose(mine, ref, **TWIN_TOL)


# --------------------------------------------------------------------------- emulated kernels


# Lengths anywhere up to 300, or on a multiple of a tile size and one either side of it.
lengths = st.one_of(
    st.integers(1, 300),
    st.builds(lambda k, m, d: max(1, k * m + d), st.integers(1, 4), st.sampled_from([16, 32, 64]),
              st.integers(-1, 1)))


@st.composite
def emulator_case(draw, head_dims):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S = draw(lengths), draw(lengths)
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, draw(st.sampled_from(head_dims)), lens, draw(st.booleans())


@pytest.mark.parametrize("dtype", DTYPES)
@EMULATOR_SETTINGS
@given(data=st.data(), limit=st.sampled_from(LIMITS), seed=seeds)
def test_attention_kernels(C, dtype, data, limit, seed):
    case = data.draw(emulator_case(C.limits()["attention_head_dims"]))  # every dim csrc/limits.cuh names
    emulated.check_attention(C, dtype, *case, seed, smem_limit=limit,
                             poison=data.draw(st.sampled_from((None, *emulated.POISONS))))


def check_cases(C, dtype, cases, **kwargs):
    """check_attention on each (D, limit, B, T, S, lens, causal) at H = 3 heads, naming the case
    that fails; the padding rows of K and V hold NaN in one case and the largest finite value
    in the next (emulated.poisoned), so that each way of tiling meets both. No cases is an
    error: a filter that selects none would pass."""
    assert cases, "no cases to check"
    for n, (D, limit, B, T, S, lens, causal) in enumerate(cases):
        poison = emulated.POISONS[n % 2]
        try:
            emulated.check_attention(C, dtype, B, 3, T, S, D, lens, causal, seed=T * 1000 + S,
                                     smem_limit=limit, poison=poison, **kwargs)
        except AssertionError as e:
            raise AssertionError(f"D={D}, smem_limit={limit}, B={B}, H=3, T={T}, S={S}, lens={lens}, "
                                 f"causal={causal}, padding {poison}: {e}") from None


def every_tiling(C, dtype):
    """(D, limit, tiles) for every head dim and every way the launchers tile it."""
    return [(D, limit, tiles) for D in C.limits()["attention_head_dims"]
            for tiles, limit in emulated.attention_tiles(C, dtype, D).items()]


# float32 in the fast tier; the 16-bit tilings, a minute more, in the slow one.
@pytest.mark.parametrize("dtype", [d if d == "float32" else pytest.param(d, marks=pytest.mark.slow) for d in DTYPES])
def test_attention_kernels_at_every_tile_boundary(C, dtype):
    check_cases(C, dtype, [(D, limit, *case) for D, limit, tiles in every_tiling(C, dtype)
                           for case in emulated.attention_boundaries(tiles)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernels_as_decoding_calls_them(C, dtype):
    """One query against a KV cache of S keys (the newest is its own), and a batch whose other
    cache is one shorter."""
    check_cases(C, dtype, [(D, limit, B, 1, S, lens, causal) for D, limit, _ in every_tiling(C, dtype)
                           for S in emulated.DECODE_LENGTHS for causal in (True, False)
                           for B, lens in ((1, None), (2, (S, S - 1)))])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernels_with_scores_past_exps_range(C, dtype):
    """Scores in the hundreds (q and k scaled by 10): exp of a score overflows float32, so the
    online softmax must subtract the running maximum; causal and unpadded, the first four
    offsets S - T at the smallest tile of every tiling."""
    check_cases(C, dtype, [(D, limit, *case) for D, limit, tiles in every_tiling(C, dtype)
                           for case in [c for c in emulated.attention_boundaries(tiles) if c[3] is None][:4]],
                magnitude=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@EMULATOR_SETTINGS
@given(seed=seeds)
def test_attention_dropout_uses_the_twins_mask(C, dtype, causal, seed):
    emulated.check_attention(C, dtype, 2, 1, 40, 75, 32, [75, 50], causal, seed, dropout_p=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dropout_keeps_a_weight_whose_bits_equal_the_threshold(C, dtype):
    """Dropout keeps weight (bh, i, j) where its Philox bits >= p * 2^32. With p chosen so that
    one visible weight's bits are the threshold exactly (bits with at most 24 significant
    digits, so that p is a float32), the kernels must keep it, as the twin does."""
    T, S, drop_seed = 40, 75, 20261204
    i, j = np.meshgrid(np.arange(T), np.arange(S), indexing="ij")
    bits = R.philox_bits(j, i, 0, drop_seed).astype(np.int64)
    exact = (bits >= 2**24) & (bits < 2**31) & (bits % (1 << 8) == 0) & (j <= i + S - T)
    exact &= np.array([np.float32(b / 2**32) * np.float64(2**32) == b for b in bits.ravel()]).reshape(bits.shape)
    assert exact.any()
    b = int(bits[exact][0])
    p = float(np.float32(b / 2**32))
    assert np.uint32(float(np.float32(p)) * 2.0**32) == b
    emulated.check_attention(C, dtype, 1, 1, T, S, 32, None, True, 0, dropout_p=p, drop_seed=drop_seed)


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


# F.scaled_dot_product_attention on the emulated "cuda" device (MT_EMULATE_CUDA=1, a process of
# its own: the device is chosen at import), twice, on a GPU with `limit` bytes per block.
DISPATCH = """
import warnings
import numpy as np
import minitransformer as mt
import minitransformer.functional as F
from minitransformer.emulated import cupy as emulated_cupy

emulated_cupy.configure(max_shared_memory_per_block_optin={limit})
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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_rounds_its_16_bit_outputs_to_nearest_even(C, dtype):
    """No output is biased towards zero (a truncating conversion): checks.check_rounding."""
    outputs = emulated.rounding_of_attention(C, dtype)
    for name, (got, ref) in outputs.items():
        checks.check_rounding(f"attention {name}", dtype, got, ref)


# --------------------------------------------------------------------------- kernels on the device


@st.composite
def device_case(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    T = draw(st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 257])))
    S = draw(st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 257])))
    D = draw(st.sampled_from([32, 64, 128]))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, D, lens, draw(st.booleans())


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@DEVICE_SETTINGS
@given(case=device_case(), seed=seeds)
def test_attention_matches_float64(dtype, case, seed):
    B, H, T, S, D, lens, causal = case
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (
        randn(rng, shape, dtype) for shape in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    o, lse = kernels.attention_forward(q, k, v, lens, causal)
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, lens, causal)
    o_r, lse_r, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, lens, causal, dout=do64)

    lse = cp.asnumpy(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    finite = np.isfinite(lse_r)
    np.testing.assert_allclose(lse[finite], lse_r[finite], rtol=1e-3 if dtype != "float32" else 1e-5, atol=1e-3)
    naive = [None] * 4
    if dtype != "float32":
        naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), lens, causal, rounder(dtype))
    for name, got, ref, nv in (("attention", o, o_r, naive[0]), ("attention_grad", dq, dq_r, naive[1]),
                               ("attention_grad", dk, dk_r, naive[2]), ("attention_grad", dv, dv_r, naive[3])):
        check(name, dtype, got, ref, nv)


def device_check(dtype, B, H, T, S, D, lens, causal, seed, smem_limit, magnitude=1.0):
    """kernels.attention_forward and _backward on the device, planned for smem_limit, against
    the float64 formulas."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64) = (randn(rng, shape, dtype, scale=magnitude) for shape in ((B, H, T, D), (B, H, S, D)))
    (v, v64), (do, do64) = (randn(rng, shape, dtype) for shape in ((B, H, S, D), (B, H, T, D)))
    o, lse = kernels.attention_forward(q, k, v, lens, causal, smem_limit=smem_limit)
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, lens, causal, smem_limit=smem_limit)
    o_r, lse_r, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, lens, causal, dout=do64)
    lse = cp.asnumpy(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    naive, slack = [None] * 4, [0.0] * 4
    if dtype != "float32":
        naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), lens, causal, rounder(dtype))
        slack = checks.attention_grad_slack(q64, k64, o, do64, lens, causal, dtype)
    for name, got, ref, nv, sl in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv),
                                      (o_r, dq_r, dk_r, dv_r), naive, slack):
        check(name, dtype, got, ref, nv, sl)


def device_tilings(dtype):
    """(D, limit, tiles) for every head dim and every tiling that this GPU's shared memory
    allows: those of the architectures with as much or less, and its own."""
    from minitransformer.kernels import _C

    limit = kernels.shared_memory_limit()
    limits = sorted({x for x in LIMITS if x <= limit} | {limit})
    return [(D, smem, tiles) for D in kernels.limits()["attention_head_dims"]
            for tiles, smem in emulated.attention_tiles(_C, dtype, D, limits).items()]


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_at_every_tile_boundary_on_the_device(dtype):
    """The emulator sections' boundary shapes, decoding's shapes and scores past exp's range,
    on the GPU at every tiling it can run, with 1 head and with 8 (more blocks at once)."""
    for D, smem, tiles in device_tilings(dtype):
        boundaries = emulated.attention_boundaries(tiles)
        cases = [(B, H, T, S, lens, causal, 1.0) for B, T, S, lens, causal in boundaries for H in (1, 8)]
        cases += [(2, 4, 1, S, (S, S - 1), True, 1.0) for S in emulated.DECODE_LENGTHS]
        cases += [(1, 2, T, S, lens, causal, 10.0) for B, T, S, lens, causal in boundaries if lens is None]
        for B, H, T, S, lens, causal, magnitude in cases:
            device_check(dtype, B, H, T, S, D, lens, causal, T * 1000 + S, smem, magnitude)


@on_device
@gpu_sized
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_long_sequence(dtype, causal):
    rng = np.random.default_rng()
    B, H, T, D = 1, 2, 1500, 64
    (q, q64), (k, k64), (v, v64), (do, do64) = (randn(rng, (B, H, T, D), dtype) for _ in range(4))
    o, lse = kernels.attention_forward(q, k, v, causal=causal)
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, causal=causal)
    ref = formulas.attention(q64, k64, v64, causal=causal, dout=do64)
    naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), None, causal, rounder(dtype))
    for name, got, r, nv in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv),
                                (ref[0], *ref[2:]), naive):
        check(name, dtype, got, r, nv)


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_is_the_twins_mask_in_forward_and_backward(dtype, causal):
    rng = np.random.default_rng()
    B, H, T, S, D = 2, 3, 100, 130, 64
    (q, q64), (k, k64), (v, v64), (do, do64) = (
        randn(rng, shape, dtype) for shape in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    lens, p, seed = [130, 77], 0.2, int(rng.integers(0, 2**63 - 1))
    o, lse = kernels.attention_forward(q, k, v, lens, causal, dropout_p=p, seed=seed)
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, lens, causal, dropout_p=p, seed=seed)
    bh = (np.arange(B)[:, None] * H + np.arange(H))[:, :, None, None]
    z = R.dropout_factor(bh, np.arange(T)[:, None], np.arange(S)[None, :], p, seed)
    o_r, _, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, lens, causal, z=z, dout=do64)
    naive = [None] * 4
    if dtype != "float32":
        naive = naive_attention(*(to_f32(a) for a in (q, k, v, do)), lens, causal, rounder(dtype), cp.asarray(z))
    for name, got, ref, nv in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv),
                                  (o_r, dq_r, dk_r, dv_r), naive):
        check(name, dtype, got, ref, nv)


@on_device
def test_attention_rejects_bad_arguments_with_python_errors():
    q = cp.ones((1, 1, 8, 48), dtype=cp.float32)
    with pytest.raises(ValueError, match="head dim 48"):
        kernels.attention_forward(q, q, q)
    q = cp.ones((1, 1, 8, 64), dtype=cp.float64)
    with pytest.raises(TypeError, match="float64"):
        kernels.attention_forward(q, q, q)
    q = cp.ones((1, 1, 8, 64), dtype=cp.float32)
    with pytest.raises(ValueError, match="must both be"):
        kernels.attention_forward(q, q[:, :, :, :32], q)
