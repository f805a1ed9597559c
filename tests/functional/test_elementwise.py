import numpy as np
import pytest
from hypothesis import given, strategies as st

import minitransformer as mt
from minitransformer import functional as F
from minitransformer.functional.elementwise import Cast
from minitransformer.gradcheck import gradcheck
from tests.helpers import broadcastable_pair, grad_flags, positive, randn, requiring_grad, seeds, shapes


@pytest.mark.parametrize("op", [F.add, F.sub, F.mul])
@given(pair=broadcastable_pair(), seed=seeds)
def test_binary_ops_gradients_with_broadcasting(device, op, pair, seed):
    a = randn(device, *pair[0], seed=seed)
    b = randn(device, *pair[1], seed=seed + 1)
    gradcheck(op, [a, b])


@given(pair=broadcastable_pair(), seed=seeds)
def test_div_gradients(device, pair, seed):
    a = randn(device, *pair[0], seed=seed)
    b = positive(device, *pair[1], seed=seed + 1)
    gradcheck(F.div, [a, b])


@given(shape=shapes, seed=seeds, exponent=st.sampled_from([2, 3, 0.5, -1.5]))
def test_pow_scalar_exponent_gradients(device, shape, seed, exponent):
    gradcheck(lambda x: x**exponent, [positive(device, *shape, seed=seed)])


@given(pair=broadcastable_pair(), seed=seeds)
def test_pow_tensor_exponent_and_base_gradients(device, pair, seed):
    base = positive(device, *pair[0], seed=seed)
    exponent = randn(device, *pair[1], seed=seed + 1)
    gradcheck(F.pow, [base, exponent])
    gradcheck(lambda e: 2.0**e, [exponent])


@pytest.mark.parametrize("op,domain", [(F.exp, randn), (F.log, positive), (F.sqrt, positive), (F.neg, randn)])
@given(shape=shapes, seed=seeds)
def test_unary_ops_gradients(device, op, domain, shape, seed):
    gradcheck(op, [domain(device, *shape, seed=seed)])


@given(shape=shapes, seed=seeds)
def test_relu_gradient_away_from_the_kink(device, shape, seed):
    x = randn(device, *shape, seed=seed)
    x.data[abs(x.data) < 1e-3] = 0.5  # finite differences are meaningless at 0
    gradcheck(F.relu, [x])
    assert (F.relu(x).numpy() >= 0).all()


@given(pair=broadcastable_pair(), seed=seeds)
def test_where_and_masked_fill_gradients(device, pair, seed):
    a = randn(device, *pair[0], seed=seed)
    b = randn(device, *pair[1], seed=seed + 1)
    cond = mt.tensor(np.random.default_rng(seed).random(pair[0]) > 0.5, device=device)
    gradcheck(lambda a, b: F.where(cond, a, b), [a, b])
    gradcheck(lambda a: F.masked_fill(a, cond, -3.0), [a])
    filled = F.masked_fill(a, cond, -3.0).numpy()
    np.testing.assert_array_equal(filled, np.where(cond.numpy(), -3.0, a.numpy()))


def test_operators_match_numpy(device):
    a = randn(device, 3, 4, seed=1)
    b = positive(device, 4, seed=2)
    an, bn = a.numpy(), b.numpy()
    np.testing.assert_allclose((a + b).numpy(), an + bn)
    np.testing.assert_allclose((a - b).numpy(), an - bn)
    np.testing.assert_allclose((2.0 - a).numpy(), 2.0 - an)
    np.testing.assert_allclose((a * b).numpy(), an * bn)
    np.testing.assert_allclose((a / b).numpy(), an / bn)
    np.testing.assert_allclose((1.0 / b).numpy(), 1.0 / bn)
    np.testing.assert_allclose((b**2).numpy(), bn**2)
    np.testing.assert_allclose((-a).numpy(), -an)
    np.testing.assert_array_equal((a > 0).numpy(), an > 0)
    np.testing.assert_array_equal((a == a).numpy(), np.ones((3, 4), bool))


def test_python_scalar_keeps_float32(device):
    x = mt.ones(3, device=device)
    assert (x * 2.5 + 1).dtype == np.float32
    assert (1.0 / x).dtype == np.float32


def test_dropout_scale_and_mask_reuse(device):
    x = randn(device, 200, 100, seed=3, dtype=np.float32)
    p = 0.3
    y = F.dropout(x, p, training=True)
    y.backward(mt.ones_like(y))
    kept = y.numpy() != 0
    assert abs(kept.mean() - (1 - p)) < 0.01  # 20,000 draws: std of the mean is 0.003
    # The CPU drops an element when 16 random bits fall below round(p 2^16): the scale is the
    # inverse of that keep probability (at p = 0.3, 4.4e-6 away from 1 / (1 - p)).
    keep_p = 1 - round(p * 2**16) / 2**16 if device == "cpu" else 1 - p
    np.testing.assert_allclose(y.numpy()[kept], x.numpy()[kept] / keep_p, rtol=1e-6)
    # backward uses exactly the forward mask, scaled the same way
    np.testing.assert_allclose(x.grad.numpy(), kept / keep_p, rtol=1e-6)


@given(shape=shapes, seed=seeds, p=st.floats(0.1, 0.9))
def test_dropout_gradient_and_identity_when_not_training(device, shape, seed, p):
    x = randn(device, *shape, seed=seed)

    def fn(x):
        mt.manual_seed(seed)  # the same mask on every evaluation
        return F.dropout(x, p, training=True)

    gradcheck(fn, [x])
    assert F.dropout(x, p, training=False) is x
    np.testing.assert_array_equal(F.dropout(x, 1.0).numpy(), np.zeros(shape))
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout(x, 1.5)


def test_dropout_reproducible_from_seed(device):
    x = mt.ones(50, 50, device=device)
    mt.manual_seed(11)
    a = F.dropout(x, 0.5).numpy()
    mt.manual_seed(11)
    b = F.dropout(x, 0.5).numpy()
    mt.manual_seed(12)
    c = F.dropout(x, 0.5).numpy()
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


@given(shape=shapes, seed=seeds)
def test_cast_and_to_device_gradients(device, shape, seed):
    x = randn(device, *shape, seed=seed)
    gradcheck(lambda x: Cast.apply(x, np.float64), [x])  # backward's reshaping, at any shape
    gradcheck(lambda x: F.to_device(x, device), [x])
    # float64 -> float32: the gradient comes back in float64, entry for entry (a random
    # upstream gradient, so a backward that moved entries around could not pass)
    x.grad = None
    g = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    F.cast(x, np.float32).backward(mt.tensor(g, device=device))
    assert x.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad.numpy(), g.astype(np.float64))
def test_broadcast_mismatch_names_both_shapes(device):
    a = randn(device, 2, 3)
    b = randn(device, 4)
    # NumPy writes the shapes as (2,3) (4,), CuPy as (2, 3) (4,)
    with pytest.raises(ValueError, match=r"\(2, ?3\).*\(4,\)"):
        a + b


@given(pair=broadcastable_pair(), seed=seeds, flags=grad_flags(2),
       op=st.sampled_from(["add", "sub", "mul", "div", "pow", "where"]))
def test_binary_ops_with_some_inputs_not_requiring_grad(device, pair, seed, flags, op):
    if op in ("div", "pow"):  # b is the divisor / a is the base: keep them positive
        a = (positive if op == "pow" else randn)(device, *pair[0], seed=seed)
        b = (positive if op == "div" else randn)(device, *pair[1], seed=seed + 1)
    else:
        a, b = randn(device, *pair[0], seed=seed), randn(device, *pair[1], seed=seed + 1)
    a, b = requiring_grad([a, b], flags)
    cond = mt.tensor(np.random.default_rng(seed).random(pair[0]) > 0.5, device=device)
    fn = (lambda a, b: F.where(cond, a, b)) if op == "where" else getattr(F, op)
    gradcheck(fn, [a, b])
