"""The oracle's own gradients: formulas.py's hand-written backward passes (the reference for the
NumPy twins, the emulated kernels and the CUDA kernels) against central finite differences, in
float64, at hypothesis-drawn shapes, with dropout factors and a non-default scale."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import checks
from minitransformer.kernels.reference import formulas
from checks import seeds
from minitransformer.gradcheck import numerical_gradient

SETTINGS = settings(max_examples=25, deadline=None)


def numeric_vjp(f, x, r):
    """d/dx of sum(r * f()) by central differences (x is perturbed in place and restored)."""
    return numerical_gradient(lambda: float((r * f()).sum()), x)


def assert_close(analytic, numeric):
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(B=st.integers(1, 2), H=st.integers(1, 2), T=st.integers(1, 4), S=st.integers(1, 4),
       D=st.integers(1, 3), causal=st.booleans(), dropout=st.booleans(),
       scale=st.none() | st.floats(0.2, 2.0), data=st.data(), seed=seeds)
def test_attention_gradients(B, H, T, S, D, causal, dropout, scale, data, seed):
    rng = np.random.default_rng(seed)
    q, k, v, r = (rng.standard_normal(s) for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D)))
    lens = data.draw(st.none() | st.lists(st.integers(0, S), min_size=B, max_size=B))
    z = (rng.random((B, H, T, S)) >= 0.3) / 0.7 if dropout else None
    _, _, dq, dk, dv = formulas.attention(q, k, v, lens, causal, scale, z, dout=r)
    out = lambda: formulas.attention(q, k, v, lens, causal, scale, z)[0]
    for analytic, x in ((dq, q), (dk, k), (dv, v)):
        assert_close(analytic, numeric_vjp(out, x, r))


@SETTINGS
@given(N=st.integers(1, 3), V=st.integers(1, 6), masked=st.booleans(), scale=st.floats(0.1, 4.0),
       seed=seeds)
def test_softmax_gradient(N, V, masked, scale, seed):
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((N, V)) * 3, rng.standard_normal((N, V))
    mask = rng.random((N, V)) < 0.7 if masked else None
    _, dx = formulas.softmax(x, mask, scale, g=r)
    assert_close(dx, numeric_vjp(lambda: formulas.softmax(x, mask, scale), x, r))


@SETTINGS
@given(N=st.integers(1, 3), D=st.integers(2, 6), affine=st.booleans(), seed=seeds)
def test_layer_norm_gradients(N, D, affine, seed):
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((N, D)) * 2 + 1, rng.standard_normal((N, D))
    w, b = (rng.standard_normal(D), rng.standard_normal(D)) if affine else (np.ones(D), np.zeros(D))
    _, dx, dw, db = formulas.layer_norm(x, w, b, 1e-5, g=r)
    out = lambda: formulas.layer_norm(x, w, b, 1e-5)
    for analytic, p in ((dx, x), (dw, w), (db, b)):
        assert_close(analytic, numeric_vjp(out, p, r))


@SETTINGS
@given(N=st.integers(1, 4), V=st.integers(2, 6), eps=st.sampled_from([0.0, 0.1, 1.0]),
       use_ignore=st.booleans(), seed=seeds)
def test_cross_entropy_gradient(N, V, eps, use_ignore, seed):
    rng = np.random.default_rng(seed)
    z, r = rng.standard_normal((N, V)) * 2, rng.standard_normal(N)
    t, ignore = checks.targets(rng, N, V, use_ignore)
    _, grad = formulas.cross_entropy(z, t, eps, ignore)
    numeric = numeric_vjp(lambda: formulas.cross_entropy(z, t, eps, ignore)[0], z, r)
    assert_close(grad * r[:, None], numeric)  # grad is per row: d loss_n / d z_n
