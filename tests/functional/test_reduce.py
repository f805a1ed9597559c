import numpy as np
import pytest
from hypothesis import given, strategies as st

from minitransformer import functional as F
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn, seeds, shapes


def _axes(shape):
    """None, a single axis (possibly negative) or a tuple of axes of ``shape``."""
    n = len(shape)
    return st.one_of(
        st.none(),
        st.integers(-n, n - 1),
        st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(tuple),
    )


@pytest.mark.parametrize("op,ref", [(F.sum, np.sum), (F.mean, np.mean), (F.max, np.max)])
@given(data=st.data(), shape=shapes, seed=seeds, keepdims=st.booleans())
def test_reductions_match_numpy_and_gradients(device, op, ref, data, shape, seed, keepdims):
    axis = data.draw(_axes(shape))
    x = randn(device, *shape, seed=seed)  # continuous samples: no ties for max
    out = op(x, axis=axis, keepdims=keepdims)
    np.testing.assert_allclose(out.numpy(), ref(x.numpy(), axis=axis, keepdims=keepdims), rtol=1e-12, atol=1e-12)
    gradcheck(lambda x: op(x, axis=axis, keepdims=keepdims), [x])


def test_max_splits_gradient_between_ties(device):
    x = randn(device, 2, 3)
    x.data[0] = 5.0
    x.data[0, 0] = 1.0  # row 0 is [1, 5, 5]: two maxima
    F.max(x, axis=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy()[0], [0.0, 0.5, 0.5])
    assert x.grad.numpy()[1].sum() == 1.0


def test_sum_of_broadcast_product_reduces_to_input_shapes(device):
    a = randn(device, 3, 1, seed=1)
    b = randn(device, 1, 4, seed=2)
    (a * b).sum().backward()
    assert a.grad.shape == (3, 1) and b.grad.shape == (1, 4)
    np.testing.assert_allclose(a.grad.numpy(), np.broadcast_to(b.numpy().sum(), (3, 1)))
    np.testing.assert_allclose(b.grad.numpy(), np.broadcast_to(a.numpy().sum(), (1, 4)))


def test_bad_axis_is_reported(device):
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        F.sum(randn(device, 2, 2), axis=3)
