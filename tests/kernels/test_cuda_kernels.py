"""The CUDA kernels against float64 formulas, and F's dispatch to them.

On a GPU, or on the emulated device (MT_EMULATE_CUDA=1, which conftest sets without a GPU):
there the launchers, bindings and kernels are the same code, compiled for the CPU. The cases
marked ``gpu_sized`` draw shapes a CPU cannot run through per-thread emulation in CI's
minutes; test_emulated_kernels.py checks the same kernels at emulator sizes. Skipped, with the
reason, where the kernels are unavailable. The tolerances and the 16-bit rule (at most twice a
naive same-precision implementation's error) are described in formulas.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import backend, kernels
from minitransformer.kernels import reference as R

import formulas
from formulas import check, host64, naive_attention, naive_layernorm, rounder, seeds, to_f32, to_kernel

if not kernels.available():
    pytest.skip(f"CUDA kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

import cupy as cp  # noqa: E402

gpu_sized = pytest.mark.skipif(
    backend.is_emulated("cuda"),
    reason="GPU-sized shapes; on the emulated device test_emulated_kernels.py checks these kernels")

DTYPES = ["float32", "float16", "bfloat16"]
SETTINGS = settings(max_examples=30, deadline=None)
randn = functools.partial(formulas.randn, xp=cp)


# --------------------------------------------------------------------------- attention


@st.composite
def attention_case(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 2))
    T = draw(st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 257])))
    S = draw(st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 257])))
    D = draw(st.sampled_from([32, 64, 128]))
    lens = draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    return B, H, T, S, D, lens, draw(st.booleans())


@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=attention_case(), seed=seeds)
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


# --------------------------------------------------------------------------- layernorm


@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
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


# --------------------------------------------------------------------------- softmax, loss


@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 64), V=st.sampled_from([1, 33, 1024, 1025, 5000, 37000]),
       masked=st.booleans(), scale=st.sampled_from([1.0, 0.125]), seed=seeds)
def test_softmax_matches_float64(dtype, N, V, masked, scale, seed):
    rng = np.random.default_rng(seed)
    x, x64 = randn(rng, (N, V), dtype, scale=4.0)
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
        naive = [formulas.naive_softmax(to_f32(x), mask, scale, rnd),
                 formulas.naive_softmax_backward(yf, gf, scale, rnd)]
    check("softmax", dtype, y, y_r, naive[0])
    check("softmax", dtype, dx, dx_r, naive[1])
    if masked:
        assert (host64(y)[0] == 0).all()


@gpu_sized
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(N=st.integers(1, 64), V=st.sampled_from([5, 1000, 1025, 37000]),
       eps=st.sampled_from([0.0, 0.1]), use_ignore=st.booleans(), seed=seeds)
def test_cross_entropy_matches_float64(dtype, N, V, eps, use_ignore, seed):
    rng = np.random.default_rng(seed)
    z, z64 = randn(rng, (N, V), dtype, scale=3.0)
    t, ignore = formulas.targets(rng, N, V, use_ignore, ignore_index=0)
    loss, grad = kernels.cross_entropy_forward(z, cp.asarray(t), eps, ignore)
    loss_r, grad_r = formulas.cross_entropy(z64, t, eps, ignore)
    naive = [None, None]
    if dtype != "float32":
        naive = formulas.naive_cross_entropy(to_f32(z), cp.asarray(t), eps, ignore, rounder(dtype))
    check("cross_entropy", dtype, cp.asnumpy(loss).astype(np.float64), loss_r, naive[0])
    check("cross_entropy", dtype, grad, grad_r, naive[1])


def test_cross_entropy_gradient_in_place_of_the_logits():
    rng = np.random.default_rng()
    z, z64 = randn(rng, (50, 3000), "float32")
    t = rng.integers(0, 3000, 50)
    loss, grad = kernels.cross_entropy_forward(z, cp.asarray(t), 0.1, grad="inplace")
    assert grad.data.ptr == z.data.ptr
    loss_r, grad_r = formulas.cross_entropy(z64, t, 0.1)
    check("cross_entropy", "float32", cp.asnumpy(loss).astype(np.float64), loss_r)
    check("cross_entropy", "float32", z, grad_r)


def test_cross_entropy_rejects_out_of_range_targets():
    z = cp.ones((4, 10), dtype=cp.float32)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        kernels.cross_entropy_forward(z, cp.asarray([1, 2, 10, 3]))


# --------------------------------------------------------------------------- F dispatch


def run_both(monkeypatch, fn):
    """fn() with the kernels, then with MINITRANSFORMER_KERNELS=0; returns both results."""
    monkeypatch.delenv("MINITRANSFORMER_KERNELS", raising=False)
    fused = fn()
    monkeypatch.setenv("MINITRANSFORMER_KERNELS", "0")
    composite = fn()
    monkeypatch.delenv("MINITRANSFORMER_KERNELS")
    return fused, composite


def leaves(rng, *shapes):
    return [mt.tensor(rng.standard_normal(s).astype(np.float32), device="cuda", requires_grad=True)
            for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_attention(monkeypatch, causal):
    rng = np.random.default_rng()
    B, H, T, S, D = 2, 4, 70, 90, 64
    host = [rng.standard_normal(s).astype(np.float32) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D))]
    dout = cp.asarray(rng.standard_normal((B, H, T, D)).astype(np.float32))
    pad = cp.asarray((np.arange(S)[None, :] < np.array([90, 41])[:, None])[:, None, None, :])

    def run():
        q, k, v = (mt.tensor(a, device="cuda", requires_grad=True) for a in host)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(pad, device="cuda"), is_causal=causal)
        out.backward(dout)
        return out._ctx.fn.__name__, out.numpy(), [t.grad.numpy() for t in (q, k, v)]

    (name_f, o_f, g_f), (name_c, o_c, g_c) = run_both(monkeypatch, run)
    assert (name_f, name_c) == ("FusedAttention", "ScaledDotProductAttention")
    np.testing.assert_allclose(o_f, o_c, rtol=2e-4, atol=2e-4)
    for a, b in zip(g_f, g_c):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_dispatch_attention_falls_back_for_masks_it_cannot_express():
    rng = np.random.default_rng()
    q, k, v = leaves(rng, (1, 2, 16, 32), (1, 2, 16, 32), (1, 2, 16, 32))
    holes = cp.asarray(rng.random((1, 1, 1, 16)) < 0.5)
    holes[..., 0] = True
    holes[..., 1] = False  # not a prefix
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mt.tensor(holes, device="cuda"))
    assert out._ctx.fn.__name__ == "ScaledDotProductAttention"


def test_dispatch_attention_dropout_is_reproducible_and_differentiable():
    rng = np.random.default_rng()
    q, k, v = leaves(rng, (2, 2, 40, 64), (2, 2, 40, 64), (2, 2, 40, 64))
    outs = []
    for _ in range(2):
        mt.manual_seed(7)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        assert out._ctx.fn.__name__ == "FusedAttention"
        out.sum().backward()
        outs.append((out.numpy(), q.grad.numpy()))
        q.grad = None
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    plain = F.scaled_dot_product_attention(q, k, v).numpy()
    assert not np.allclose(outs[0][0], plain) and np.isfinite(outs[0][1]).all()


def test_dispatch_layer_norm_softmax_and_loss(monkeypatch):
    rng = np.random.default_rng()
    xh, wh, bh = (rng.standard_normal(s).astype(np.float32) for s in ((6, 11, 512), (512,), (512,)))
    th = rng.integers(0, 512, (6, 11))
    th[0, :3] = 0

    def run():
        x, w, b = (mt.tensor(a, device="cuda", requires_grad=True) for a in (xh, wh, bh))
        y = F.layer_norm(x, w, b)
        p = F.softmax(y * 3.0)
        loss = F.cross_entropy(y * 2.0, mt.tensor(th, device="cuda"), label_smoothing=0.1, ignore_index=0)
        (loss + (p * p).sum()).backward()
        names = (y._ctx.fn.__name__, p._ctx.fn.__name__, loss._ctx.fn.__name__)
        return names, loss.item(), p.numpy(), [t.grad.numpy() for t in (x, w, b)]

    (names_f, loss_f, p_f, g_f), (names_c, loss_c, p_c, g_c) = run_both(monkeypatch, run)
    assert names_f == ("FusedLayerNorm", "FusedSoftmax", "FusedCrossEntropy")
    assert names_c == ("LayerNorm", "Softmax", "CrossEntropy")
    np.testing.assert_allclose(loss_f, loss_c, rtol=1e-5)
    np.testing.assert_allclose(p_f, p_c, rtol=1e-4, atol=1e-6)
    for a, b in zip(g_f, g_c):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_dispatch_loss_reductions_and_stats(monkeypatch, reduction):
    rng = np.random.default_rng()
    zh = rng.standard_normal((3, 5, 40)).astype(np.float32)
    th = rng.integers(1, 40, (3, 5))
    th[0, :2] = 0  # the ignored id: 13 positions count
    r = cp.asarray(rng.standard_normal((3, 5)).astype(np.float32))  # "none": a random upstream gradient

    def run():
        z, stats = mt.tensor(zh, device="cuda", requires_grad=True), {}
        loss = F.cross_entropy(z, mt.tensor(th, device="cuda"), 0.1, 0, reduction, stats)
        if reduction == "none":
            loss.backward(r)
        else:
            loss.backward()
        return (loss._ctx.fn.__name__, loss.numpy(), z.grad.numpy(), int(stats["n_tokens"]),
                float(stats["nll_sum"]))

    (name_f, loss_f, g_f, n_f, nll_f), (name_c, loss_c, g_c, n_c, nll_c) = run_both(monkeypatch, run)
    assert (name_f, name_c) == ("FusedCrossEntropy", "CrossEntropy")
    assert loss_f.shape == loss_c.shape and n_f == n_c == 13
    np.testing.assert_allclose(loss_f, loss_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nll_f, nll_c, rtol=1e-5)
    np.testing.assert_allclose(g_f, g_c, rtol=1e-4, atol=1e-7)


def test_dispatch_loss_can_overwrite_the_logits():
    rng = np.random.default_rng()
    (z,) = leaves(rng, (30, 700))
    t = mt.tensor(rng.integers(0, 700, 30), device="cuda")
    before = z.data.copy()
    kernels.set_loss_overwrites_logits(True)
    try:
        logits = z * 1.0  # an intermediate, as the model's output projection is
        loss = F.cross_entropy(logits, t, label_smoothing=0.1)
        loss.backward()
    finally:
        kernels.set_loss_overwrites_logits(False)
    _, grad_r = formulas.cross_entropy(cp.asnumpy(before).astype(np.float64), t.numpy(), 0.1)
    np.testing.assert_allclose(z.grad.numpy(), grad_r / 30, rtol=1e-4, atol=1e-7)
    # The logits' memory now holds the (scaled) gradient: d(z * 1.0)/dz passes it through.
    np.testing.assert_allclose(logits.numpy(), z.grad.numpy(), rtol=1e-6, atol=1e-9)
