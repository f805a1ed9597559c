import numpy as np
import pytest
from hypothesis import given, strategies as st

import minitransformer as mt
from minitransformer import backend
from minitransformer import functional as F
from minitransformer.kernels.reference import formulas
from minitransformer.gradcheck import gradcheck
from tests.helpers import grad_flags, randn, requiring_grad, seeds


dims = st.integers(1, 4)


@given(b=st.integers(1, 2), h=st.integers(1, 2), t=dims, s=dims, d_k=dims, d_v=dims, seed=seeds,
       causal=st.booleans(), masked=st.booleans())
def test_attention_matches_reference_and_gradients(device, b, h, t, s, d_k, d_v, seed, causal, masked):
    q = randn(device, b, h, t, d_k, seed=seed)
    k = randn(device, b, h, s, d_k, seed=seed + 1)
    v = randn(device, b, h, s, d_v, seed=seed + 2)
    lens = None
    if masked:  # key padding: each sentence keeps a prefix of its keys, possibly none
        lens = np.random.default_rng(seed).integers(0, s + 1, b)
    mask = None if lens is None else mt.tensor((np.arange(s) < lens[:, None])[:, None, None, :], device=device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    # The plain formula of equation (1) (kernels/reference/formulas.py), forward and backward.
    dout = np.random.default_rng(seed + 3).standard_normal(out.shape)
    want, _, dq, dk, dv = formulas.attention(q.numpy(), k.numpy(), v.numpy(), lens, causal, dout=dout)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-12)
    out.backward(mt.tensor(dout, device=device))
    for got, ref in zip((q.grad, k.grad, v.grad), (dq, dk, dv)):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-12)
    for t_ in (q, k, v):
        t_.grad = None
    gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask, causal), [q, k, v])


def test_float_mask_is_added_to_scores(device):
    q, k, v = (randn(device, 2, 3, 4, seed=i) for i in range(3))
    bias = randn(device, 3, 3, seed=9, requires_grad=False)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    scores = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) / 2.0 + bias.numpy()
    p = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), (p / p.sum(-1, keepdims=True)) @ v.numpy(), rtol=1e-10)


def test_fully_masked_query_gives_zeros_and_finite_gradients(device):
    q, k, v = (randn(device, 1, 2, 3, 4, seed=i) for i in range(3))
    keep = np.ones((1, 1, 3, 3), bool)
    keep[..., 1, :] = False  # query 1 may attend to nothing
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert not np.isnan(out.numpy()).any()
    np.testing.assert_array_equal(out.numpy()[..., 1, :], 0.0)
    out.sum().backward()
    for t in (q, k, v):
        assert np.isfinite(t.grad.numpy()).all()
    np.testing.assert_array_equal(q.grad.numpy()[..., 1, :], 0.0)
    gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, keep), [q, k, v])


def test_causal_single_query_sees_every_cached_key(device):
    q = randn(device, 1, 1, 1, 4, seed=1)
    k, v = randn(device, 1, 1, 5, 4, seed=2), randn(device, 1, 1, 5, 4, seed=3)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    full = F.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(causal.numpy(), full.numpy(), rtol=1e-12)


def test_attention_dropout_gradient_and_expectation(device):
    q, k, v = (randn(device, 2, 3, 4, seed=i) for i in range(3))

    def fn(q, k, v):
        mt.manual_seed(3)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    gradcheck(fn, [q, k, v])
    assert not np.allclose(fn(q, k, v).numpy(), F.scaled_dot_product_attention(q, k, v).numpy())


def test_attention_errors_name_the_argument_and_shapes(device):
    q = randn(device, 2, 3, 4)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(2, 3, 5\)"):
        F.scaled_dot_product_attention(q, randn(device, 2, 3, 5), randn(device, 2, 3, 4))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 5\)"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((2, 5), bool))
    q4, k4 = randn(device, 2, 4, 3, 8), randn(device, 2, 2, 5, 8)  # 4 heads against 2
    with pytest.raises(ValueError, match=r"batch and head axes of q \(2, 4, 3, 8\), k \(2, 2, 5, 8\)"):
        F.scaled_dot_product_attention(q4, k4, k4)
    k3 = randn(device, 3, 4, 5, 8)  # 3 sequences against 2
    with pytest.raises(ValueError, match=r"batch and head axes of q \(2, 4, 3, 8\), k \(3, 4, 5, 8\)"):
        F.scaled_dot_product_attention(q4, k3, k3)
    k = randn(device, 2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"KeyMask of shape \(3, 5\) does not broadcast to the scores .* \(2, 4, 3, 5\)"):
        F.scaled_dot_product_attention(q4, k, k, attn_mask=F.KeyMask(np.ones((3, 5), bool)))
    with pytest.raises(TypeError, match="attn_mask must be boolean .* got int64"):
        F.scaled_dot_product_attention(q4, k, k, attn_mask=np.ones((3, 5), np.int64))


def test_key_mask_is_the_boolean_mask_built_once(device):
    rng = np.random.default_rng(7)
    q = randn(device, 2, 2, 3, 4, seed=0)
    k, v = (randn(device, 2, 2, 4, 4, seed=i) for i in (1, 2))
    lengths = np.array([4, 2])
    real = np.arange(4)[None, :] < lengths[:, None]  # (B, S): True at real keys
    key_mask = F.KeyMask(mt.tensor(real, device=device))
    assert key_mask.attn_mask.shape == (2, 1, 1, 4)
    g = rng.standard_normal((2, 2, 3, 4))
    outs = []
    for mask in (key_mask, mt.tensor(real[:, None, None, :], device=device)):
        for t in (q, k, v):
            t.grad = None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        out.backward(mt.tensor(g, device=device))
        outs.append([out.numpy()] + [t.grad.numpy() for t in (q, k, v)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(F.attention_weights(q, k, key_mask).numpy()[1, :, :, 2:], 0.0)
    np.testing.assert_array_equal(backend.to_device(key_mask.select([1, 1, 0]).mask, "cpu"), real[[1, 1, 0]])
    np.testing.assert_array_equal(backend.to_device(key_mask.lengths, "cpu"), lengths)  # what the kernel takes
    np.testing.assert_array_equal(backend.to_device(key_mask.select([1, 1, 0]).lengths, "cpu"), lengths[[1, 1, 0]])
    holes = real.copy()
    holes[0, 1] = False  # padding that is not a suffix: no lengths, the composite op runs
    assert F.KeyMask(holes).lengths is None
    with pytest.raises(ValueError, match="expected \\(B, S\\) booleans .* got shape \\(2, 1, 4\\)"):
        F.KeyMask(np.zeros((2, 1, 4), bool))
    with pytest.raises(TypeError, match="expected \\(B, S\\) booleans .* got int64"):
        F.KeyMask(np.zeros((2, 4), np.int64))


@given(b=st.integers(1, 2), t=st.integers(1, 4), s=st.integers(1, 4), d=st.integers(1, 4),
       seed=seeds, flags=grad_flags(3), scale=st.floats(0.1, 2.0), float_mask=st.booleans(),
       causal=st.booleans())
def test_attention_scale_float_mask_and_some_inputs_not_requiring_grad(device, b, t, s, d, seed, flags,
                                                                        scale, float_mask, causal):
    q, k, v = (randn(device, b, 2, n, d, seed=seed + i) for i, n in enumerate((t, s, s)))
    q, k, v = requiring_grad([q, k, v], flags)
    mask = randn(device, t, s, seed=seed + 3, requires_grad=False) if float_mask else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    scores = q.numpy() @ np.swapaxes(k.numpy(), -1, -2) * scale + (0 if mask is None else mask.numpy())
    if causal:
        scores = np.where(np.tril(np.ones((t, s), bool), k=s - t), scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0))
    p /= np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(out.numpy(), p @ v.numpy(), rtol=1e-10, atol=1e-12)
    gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask, causal, scale=scale), [q, k, v])
