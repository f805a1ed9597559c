"""gradcheck itself: every gradient test in the suite relies on it failing for a wrong backward."""

import numpy as np
import pytest
from hypothesis import given

from minitransformer.functional.elementwise import Mul
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn, seeds, shapes


def _mul(bug=None):
    """The library's a * b, with its backward kept right or made wrong in one stated way."""

    class WrongMul(Mul):
        @staticmethod
        def backward(ctx, g):
            ga, gb = Mul.backward(ctx, g)
            b = ctx.saved[1]
            if bug == "grad_a":
                ga = ga * 1.01  # 1% off: far above gradcheck's tolerance
            elif bug == "grad_b":
                gb = g  # the second input's gradient is wrong, the first's right
            elif bug == "positions":
                ga = (g * b)[::-1]  # right values, wrong output positions
            return ga, gb

    return WrongMul


@given(shape=shapes, seed=seeds)
def test_gradcheck_passes_a_correct_backward(device, shape, seed):
    a, b = randn(device, *shape, seed=seed), randn(device, *shape, seed=seed + 1)
    gradcheck(_mul().apply, [a, b])


@pytest.mark.parametrize("bug", ["grad_a", "grad_b", "positions"])
def test_gradcheck_fails_a_wrong_backward(device, bug):
    a, b = randn(device, 4, 3, seed=1), randn(device, 4, 3, seed=2)
    with pytest.raises(AssertionError, match="gradcheck: gradient of input"):
        gradcheck(_mul(bug).apply, [a, b])


def test_gradcheck_refuses_inputs_it_cannot_check(device):
    with pytest.raises(ValueError, match="no input requires grad"):
        gradcheck(lambda x: x * 2.0, [randn(device, 3, requires_grad=False)])
    with pytest.raises(ValueError, match="float64"):
        gradcheck(lambda x: x * 2.0, [randn(device, 3, dtype=np.float32)])
