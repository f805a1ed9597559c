import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from minitransformer import functional as F
from minitransformer.gradcheck import gradcheck
from tests.helpers import grad_flags, randn, requiring_grad, seeds


@given(
    batch=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3),
    m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), seed=seeds,
)
def test_batched_broadcasting_matmul_gradients(device, batch, m, k, n, seed):
    sa, sb = batch.input_shapes
    a = randn(device, *sa, m, k, seed=seed)
    b = randn(device, *sb, k, n, seed=seed + 1)
    np.testing.assert_allclose((a @ b).numpy(), a.numpy() @ b.numpy(), rtol=1e-12, atol=1e-12)
    gradcheck(F.matmul, [a, b])


@given(k=st.integers(1, 4), n=st.integers(1, 4), seed=seeds)
def test_vector_operands(device, k, n, seed):
    v = randn(device, k, seed=seed)
    m = randn(device, k, n, seed=seed + 1)
    np.testing.assert_allclose((v @ m).numpy(), v.numpy() @ m.numpy(), rtol=1e-12, atol=1e-12)
    gradcheck(F.matmul, [v, m])
    w = randn(device, k, seed=seed + 2)
    assert (v @ w).shape == ()
    np.testing.assert_allclose((v @ w).item(), v.numpy() @ w.numpy(), rtol=1e-12, atol=1e-12)
    gradcheck(F.matmul, [v, w])
    gradcheck(lambda m, v: F.matmul(m.reshape(n, k), v), [m, v])


@given(lead=hnp.array_shapes(min_dims=1, max_dims=3, max_side=3), d_in=st.integers(1, 4),
       d_out=st.integers(1, 4), seed=seeds, with_bias=st.booleans())
def test_linear_gradients(device, lead, d_in, d_out, seed, with_bias):
    x = randn(device, *lead, d_in, seed=seed)
    w = randn(device, d_in, d_out, seed=seed + 1)
    b = randn(device, d_out, seed=seed + 2) if with_bias else None
    expected = x.numpy() @ w.numpy() + (b.numpy() if with_bias else 0)
    np.testing.assert_allclose(F.linear(x, w, b).numpy(), expected, rtol=1e-12, atol=1e-12)
    gradcheck(lambda *t: F.linear(*t), [x, w] + ([b] if with_bias else []))


def test_shape_mismatch_names_both_shapes(device):
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4, 5\)"):
        randn(device, 2, 3) @ randn(device, 4, 5)
    with pytest.raises(ValueError, match=r"\(2, 2, 3\) and \(3, 3, 4\)"):
        randn(device, 2, 2, 3) @ randn(device, 3, 3, 4)
    with pytest.raises(ValueError, match=r"\(5, 3\).*\(4, 2\)"):
        F.linear(randn(device, 5, 3), randn(device, 4, 2))


@given(batch=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3),
       m=st.integers(1, 3), k=st.integers(1, 3), n=st.integers(1, 3), seed=seeds, flags=grad_flags(2),
       linear_flags=grad_flags(3))
def test_matmul_and_linear_with_some_inputs_not_requiring_grad(device, batch, m, k, n, seed, flags,
                                                               linear_flags):
    sa, sb = batch.input_shapes
    a, b = randn(device, *sa, m, k, seed=seed), randn(device, *sb, k, n, seed=seed + 1)
    gradcheck(F.matmul, requiring_grad([a, b], flags))
    x, w, bias = randn(device, *sa, m, k, seed=seed), randn(device, k, n, seed=seed + 2), randn(device, n, seed=seed + 3)
    gradcheck(F.linear, requiring_grad([x, w, bias], linear_flags))
