import numpy as np
import pytest
from hypothesis import given, strategies as st

import minitransformer as mt
from minitransformer import functional as F
from minitransformer.testing.gradcheck import gradcheck
from tests.helpers import randn, seeds, shapes


def _axis(shape):
    return st.integers(-len(shape), len(shape) - 1)


@pytest.mark.parametrize("op", [F.softmax, F.log_softmax])
@given(data=st.data(), shape=shapes, seed=seeds)
def test_softmax_gradients(device, op, data, shape, seed):
    axis = data.draw(_axis(shape))
    x = randn(device, *shape, seed=seed, scale=3.0)
    gradcheck(lambda x: op(x, axis), [x])


@given(shape=shapes, seed=seeds)
def test_softmax_matches_formula(device, shape, seed):
    x = randn(device, *shape, seed=seed)
    e = np.exp(x.numpy())
    expected = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(F.softmax(x).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(x).numpy(), np.log(expected), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_logits_stay_finite(device, dtype):
    x = mt.tensor(np.array([[1e4, -1e4, 0.0], [1e4, 1e4, -1e4]], dtype=dtype), device=device,
                  requires_grad=True)
    y = F.softmax(x)
    np.testing.assert_allclose(y.numpy(), [[1, 0, 0], [0.5, 0.5, 0]], atol=1e-7)
    ls = F.log_softmax(x)
    assert np.isfinite(ls.numpy()).all()
    np.testing.assert_allclose(ls.numpy()[0], [0, -2e4, -1e4], rtol=1e-6)
    (y.sum() + ls.sum()).backward()
    assert np.isfinite(x.grad.numpy()).all()


def test_fully_masked_row_gives_zeros_not_nan(device):
    x = randn(device, 2, 4, seed=5)
    x.data[1] = -np.inf
    y = F.softmax(x)
    np.testing.assert_array_equal(y.numpy()[1], np.zeros(4))
    np.testing.assert_allclose(y.numpy()[0].sum(), 1.0)
    (y * randn(device, 2, 4, seed=6, requires_grad=False)).sum().backward()
    assert np.isfinite(x.grad.numpy()).all()
    np.testing.assert_array_equal(x.grad.numpy()[1], np.zeros(4))
    ls = F.log_softmax(x)
    assert not np.isnan(ls.numpy()).any()
