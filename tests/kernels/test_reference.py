"""The NumPy twins of the CUDA kernels against the plain formulas (CPU, always run).

The twins run in float64 here, so the tolerances measure the algorithm (tiling, online
softmax, Welford/Chan merging, the recomputed backward), not float32 rounding: 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer.kernels import reference as R

import formulas
from formulas import seeds

TOL = dict(rtol=1e-10, atol=1e-10)
SETTINGS = settings(max_examples=25, deadline=None)


def rng(seed=None):
    return np.random.default_rng(seed)


@st.composite
def attention_case(draw):
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
    r = rng(seed)
    return (r.standard_normal((B, H, T, D)), r.standard_normal((B, H, S, D)),
            r.standard_normal((B, H, S, D)), r.standard_normal((B, H, T, D)))


@SETTINGS
@given(attention_case(), seeds)
def test_attention_twin_matches_formula(case, seed):
    B, H, T, S, D, lens, causal, (bq, bk) = case
    q, k, v, dout = qkv(B, H, T, S, D, seed)
    o, lse = R.attention_forward(q, k, v, lens, causal, block_q=bq, block_k=bk)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = formulas.attention(q, k, v, lens, causal, dout=dout)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], **TOL)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, dout, lens, causal, block_q=bq, block_k=bk)
    np.testing.assert_allclose(dq, dq_ref, **TOL)
    np.testing.assert_allclose(dk, dk_ref, **TOL)
    np.testing.assert_allclose(dv, dv_ref, **TOL)


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
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(dq, dq_ref, **TOL)


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
    np.testing.assert_allclose(o, out.numpy(), **TOL)
    for mine, t in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(mine, t.grad.numpy(), **TOL)


# --------------------------------------------------------------------------- dropout


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
        np.testing.assert_allclose(mine, ref, **TOL)


# --------------------------------------------------------------------------- layernorm


@SETTINGS
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([1, 2, 4, 8]),
       st.booleans(), st.floats(-1e3, 1e3), seeds)
def test_layernorm_twin_matches_formula(N, D, vec, affine, offset, seed):
    r = rng(seed)
    x = r.standard_normal((N, D)) * r.uniform(0.1, 10) + offset
    w, b = (r.standard_normal(D), r.standard_normal(D)) if affine else (None, None)
    g = r.standard_normal((N, D))
    y, mean, rstd = R.layernorm_forward(x, w, b, eps=1e-5, vec=vec)
    y_ref, dx_ref, dw_ref, db_ref = formulas.layer_norm(x, w, b, 1e-5, g=g)
    np.testing.assert_allclose(y, y_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(mean, x.mean(1), rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(1) + 1e-5), rtol=1e-9)
    dx, dw, db = R.layernorm_backward(x, w, mean, rstd, g, blocks=3)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(db, db_ref, rtol=1e-9, atol=1e-9)


def test_layernorm_one_pass_statistics_survive_a_large_mean_in_float32():
    # Welford + Chan in float32 keeps the variance of data sitting at 1e4; the textbook
    # one-pass E[x^2] - E[x]^2 would lose it all to cancellation.
    r = rng(5)
    x = (r.standard_normal((64, 512)) + 1e4).astype(np.float32)
    _, mean, rstd = R.layernorm_forward(x, eps=1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-3)
    naive_var = (x * x).mean(1) - x.mean(1) ** 2
    assert np.abs(naive_var - x64.var(1)).max() > 0.1  # what the one-pass shortcut would do


def test_layernorm_twin_matches_the_engine_composite_op():
    r = rng(6)
    x, w, b, g = r.standard_normal((7, 5, 96)), r.standard_normal(96), r.standard_normal(96), r.standard_normal((7, 5, 96))
    y, mean, rstd = R.layernorm_forward(x.reshape(-1, 96), w, b)
    dx, dw, db = R.layernorm_backward(x.reshape(-1, 96), w, mean, rstd, g.reshape(-1, 96))
    tx, tw, tb = (mt.tensor(a, requires_grad=True) for a in (x, w, b))
    out = F.layer_norm(tx, tw, tb, eps=1e-5)
    out.backward(g)
    np.testing.assert_allclose(y.reshape(x.shape), out.numpy(), **TOL)
    np.testing.assert_allclose(dx.reshape(x.shape), tx.grad.numpy(), **TOL)
    np.testing.assert_allclose(dw, tw.grad.numpy(), **TOL)
    np.testing.assert_allclose(db, tb.grad.numpy(), **TOL)


# --------------------------------------------------------------------------- softmax, loss


@SETTINGS
@given(st.integers(1, 20), st.sampled_from([1, 7, 32, 100, 1024, 1025, 3000]),
       st.booleans(), st.floats(0.05, 4.0), seeds)
def test_softmax_twin_matches_formula(N, V, masked, scale, seed):
    r = rng(seed)
    x = r.standard_normal((N, V)) * 5
    mask = r.random((N, V)) < 0.7 if masked else None
    if masked:
        mask[0] = False  # a fully masked row
    g = r.standard_normal((N, V))
    y = R.softmax_forward(x, mask, scale)
    y_ref, dx_ref = formulas.softmax(x, mask, scale, g=g)
    np.testing.assert_allclose(y, y_ref, **TOL)
    np.testing.assert_allclose(R.softmax_backward(y, g, scale), dx_ref, **TOL)
    if masked:
        assert (y[0] == 0).all()


def test_online_max_sum_handles_huge_logits():
    x = np.array([[1e4, 1e4 - 1, -1e4], [-np.inf, -np.inf, -np.inf]])
    m, s = R.online_max_sum(x)
    np.testing.assert_allclose(m[0], 1e4)
    np.testing.assert_allclose(s[0], 1 + np.exp(-1.0))
    assert m[1] == -np.inf and s[1] == 0


@SETTINGS
@given(st.integers(1, 30), st.sampled_from([2, 33, 1024, 1500, 5000]),
       st.sampled_from([0.0, 0.1, 1.0]), st.booleans(), seeds)
def test_cross_entropy_twin_matches_formula(N, V, eps, use_ignore, seed):
    r = rng(seed)
    logits = r.standard_normal((N, V)) * 3
    target, ignore = formulas.targets(r, N, V, use_ignore)
    loss, grad = R.cross_entropy_forward(logits, target, eps, ignore)
    loss_ref, grad_ref = formulas.cross_entropy(logits, target, eps, ignore)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    np.testing.assert_allclose(grad, grad_ref, **TOL)


def test_cross_entropy_twin_matches_the_engine_loss():
    r = rng(7)
    logits = r.standard_normal((6, 9, 50)) * 2
    target = r.integers(0, 50, (6, 9))
    target[0, :4] = 0  # padding id, ignored
    loss, grad = R.cross_entropy_forward(logits.reshape(-1, 50), target.reshape(-1), 0.1, 0)
    tz = mt.tensor(logits, requires_grad=True)
    out = F.cross_entropy(tz, target, label_smoothing=0.1, ignore_index=0, reduction="sum")
    out.backward()
    np.testing.assert_allclose(loss.sum(), out.item(), **TOL)
    np.testing.assert_allclose(grad.reshape(logits.shape), tz.grad.numpy(), **TOL)
