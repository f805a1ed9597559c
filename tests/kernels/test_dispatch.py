"""F's dispatch to the kernels on "cuda" tensors (on a GPU, or the emulated device; device.py):
the fused Function is chosen where the kernel can take the inputs, and agrees with the
composite op that MINITRANSFORMER_KERNELS=0 forces.
"""

from __future__ import annotations

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import kernels

from minitransformer.kernels.reference import formulas
from device import cp, on_device

pytestmark = on_device


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


def test_a_refusal_is_a_reason_and_none_is_yes(monkeypatch):
    """attention_refusal / layernorm_refusal answer "why not", so None is the kernels' yes."""
    rng = np.random.default_rng()
    q = cp.asarray(rng.standard_normal((1, 2, 16, 32)).astype(np.float32))
    x, w = cp.asarray(rng.standard_normal((4, 32)).astype(np.float32)), cp.ones(32, dtype=np.float32)
    assert kernels.attention_refusal(q, q, q) is None and kernels.layernorm_refusal(x, w, w) is None
    assert "CuPy" in kernels.attention_refusal(q.get(), q.get(), q.get())
    assert "CuPy" in kernels.layernorm_refusal(x.get(), w.get(), w.get())
    monkeypatch.setenv("MINITRANSFORMER_KERNELS", "0")
    assert "switched off" in kernels.attention_refusal(q, q, q)


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


def test_empty_inputs_take_the_composite_ops_as_on_the_cpu():
    """A rank's empty share of a batch: nothing to launch (the kernels refuse zero rows), so
    the composite ops run, and give what the CPU gives: no rows, a zero loss, zero gradients."""
    for device in ("cuda", "cpu"):
        x = mt.tensor(np.zeros((0, 7, 16), np.float32), device=device, requires_grad=True)
        y = F.softmax(F.layer_norm(x))
        loss = F.cross_entropy(y, mt.tensor(np.zeros((0, 7), np.int64), device=device), 0.1, 0)
        loss.backward()
        names = (y._ctx.fn.__name__, loss._ctx.fn.__name__)
        assert names == ("Softmax", "CrossEntropy"), (device, names)
        assert y.shape == (0, 7, 16) and loss.item() == 0.0 and x.grad.shape == (0, 7, 16), device
