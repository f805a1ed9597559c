"""Post-accumulate gradient hooks (distributed/grad_hooks.py): when they fire, and that an
in-place change in one cannot leak into another gradient."""

import gc

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.distributed.grad_hooks import _hooks, register_post_accumulate_grad_hook
from tests.helpers import randn


def test_in_place_hook_on_a_leaf_grad_cannot_corrupt_other_gradients(device):
    w, x = randn(device, 3, seed=5), randn(device, 3, seed=6)
    c = randn(device, 3, seed=7, requires_grad=False)
    register_post_accumulate_grad_hook(w, lambda t: t.grad.data.__imul__(0))
    ((w + x * 2.0) * c).sum().backward()  # Add passes one array to w and on towards x
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * c.numpy())
    np.testing.assert_array_equal(w.grad.numpy(), 0.0)


def test_post_accumulate_hook_fires_once_per_leaf_when_complete(device):
    a, b = randn(device, 3, seed=1), randn(device, 3, seed=2)
    seen = []
    for t in (a, b):
        register_post_accumulate_grad_hook(t, lambda t: seen.append((t, t.grad.numpy().copy())))
    (a * b + a * 2.0).sum().backward()  # a is used twice: its hook waits for both uses
    assert sum(t is a for t, _ in seen) == 1 and sum(t is b for t, _ in seen) == 1
    grads = {id(t): g for t, g in seen}
    np.testing.assert_allclose(grads[id(a)], b.numpy() + 2.0)


def test_hooks_fire_after_the_last_use_in_a_deep_graph(device):
    """The countdown follows the walk: w's hook runs only after the walk's last context using w
    (the first layer), when .grad already holds both layers' terms."""
    w = randn(device, 3, seed=3)
    x = randn(device, 3, seed=4, requires_grad=False)
    seen = []
    register_post_accumulate_grad_hook(w, lambda t: seen.append(t.grad.numpy().copy()))
    h = (x * w).exp()  # first use
    (h * w).sum().backward()  # second use, reached first by the walk
    hn = np.exp(x.numpy() * w.numpy())
    expected = hn + w.numpy() * hn * x.numpy()
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], expected, rtol=1e-6)


def test_hooks_only_on_leaves_and_forgotten_with_their_tensor():
    w = mt.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="only be registered on leaf tensors, not on the output of Mul"):
        register_post_accumulate_grad_hook(w * 2.0, lambda t: None)
    register_post_accumulate_grad_hook(w, lambda t: None)
    key = id(w)
    assert key in _hooks
    del w
    gc.collect()
    assert key not in _hooks
