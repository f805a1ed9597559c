import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from minitransformer import functional as F
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn, seeds


@given(lead=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3), d=st.integers(2, 6), seed=seeds,
       affine=st.booleans())
def test_layer_norm_matches_formula_and_gradients(device, lead, d, seed, affine):
    x = randn(device, *lead, d, seed=seed, scale=2.0, offset=1.0)
    w = randn(device, d, seed=seed + 1) if affine else None
    b = randn(device, d, seed=seed + 2) if affine else None
    xn = x.numpy()
    mean = xn.mean(-1, keepdims=True)
    var = xn.var(-1, keepdims=True)
    expected = (xn - mean) / np.sqrt(var + 1e-5)
    if affine:
        expected = expected * w.numpy() + b.numpy()
    np.testing.assert_allclose(F.layer_norm(x, w, b).numpy(), expected, rtol=1e-10, atol=1e-12)
    inputs = [x, w, b] if affine else [x]
    gradcheck(lambda x, w=None, b=None: F.layer_norm(x, w, b, eps=1e-5), inputs)


def test_layer_norm_shape_error_names_shapes(device):
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        F.layer_norm(randn(device, 2, 4), randn(device, 3), None)
