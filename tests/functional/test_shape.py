import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import minitransformer as mt
from minitransformer import functional as F
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn, seeds, shapes


@given(shape=shapes, seed=seeds)
def test_reshape_gradient(device, shape, seed):
    x = randn(device, *shape, seed=seed)
    gradcheck(lambda x: F.reshape(x, (-1,)) * mt.arange(x.size, device=device), [x])
    gradcheck(lambda x: x.reshape(1, *shape[::-1]), [x])


@given(shape=shapes.filter(lambda s: len(s) >= 2), seed=seeds, data=st.data())
def test_transpose_and_permute_gradients(device, shape, seed, data):
    x = randn(device, *shape, seed=seed)
    perm = data.draw(st.permutations(range(len(shape))))
    np.testing.assert_array_equal(F.permute(x, perm).numpy(), x.numpy().transpose(perm))
    gradcheck(lambda x: F.permute(x, perm), [x])
    gradcheck(lambda x: F.transpose(x, 0, -1), [x])


@given(shape=shapes, seed=seeds, n=st.integers(1, 3), data=st.data())
def test_concat_and_stack_gradients(device, shape, seed, n, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    xs = [randn(device, *shape, seed=seed + i) for i in range(n)]
    np.testing.assert_array_equal(F.concat(xs, axis).numpy(), np.concatenate([x.numpy() for x in xs], axis))
    gradcheck(lambda *xs: F.concat(xs, axis), xs)
    gradcheck(lambda *xs: F.stack(xs, axis), xs)


@given(shape=shapes, seed=seeds, data=st.data())
def test_indexing_gradients_at_drawn_shapes_and_indices(device, shape, seed, data):
    x = randn(device, *shape, seed=seed)
    basic = data.draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))
    np.testing.assert_array_equal(x[basic].numpy(), x.numpy()[basic])
    gradcheck(lambda x: x[basic], [x])
    rows = data.draw(st.lists(st.integers(-shape[0], shape[0] - 1), min_size=1, max_size=6))
    gradcheck(lambda x: x[mt.tensor(np.array(rows), device=device)], [x])  # repeats accumulate
    mask = np.random.default_rng(seed).random(shape) > 0.5
    gradcheck(lambda x: x[mt.tensor(mask, device=device)], [x])


@given(seed=seeds)
def test_integer_array_indexing_accumulates_repeats(device, seed):
    x = randn(device, 5, 3, seed=seed)
    rows = mt.tensor([0, 2, 2, 4, 0, 0], device=device)
    gradcheck(lambda x: x[rows], [x])
    x.grad = None
    x[rows].sum().backward()
    np.testing.assert_allclose(x.grad.numpy()[:, 0], np.bincount(rows.numpy(), minlength=5))
    gradcheck(lambda x: x[[1, 1], 1:], [x])


@given(seed=seeds, vocab=st.integers(1, 6), dim=st.integers(1, 4),
       ids_shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=4))
def test_embedding_gradient_with_repeated_ids(device, seed, vocab, dim, ids_shape):
    rng = np.random.default_rng(seed)
    ids = mt.tensor(rng.integers(0, vocab, size=ids_shape), device=device)
    weight = randn(device, vocab, dim, seed=seed)
    gradcheck(lambda w: F.embedding(ids, w), [weight])
    weight.grad = None
    F.embedding(ids, weight).sum().backward()
    counts = np.bincount(ids.numpy().ravel(), minlength=vocab)
    np.testing.assert_allclose(weight.grad.numpy(), np.repeat(counts[:, None], dim, axis=1))


def test_embedding_rejects_float_ids(device):
    with pytest.raises(TypeError, match="integers"):
        F.embedding(randn(device, 2), randn(device, 3, 2))


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_embedding_names_an_id_outside_the_table(device, bad):
    """A negative id would read from the end of the table, silently; one past it, out of bounds."""
    ids = np.array([[0, 2, 1], [1, bad, 0]])
    with pytest.raises(IndexError, match=rf"token id {bad} at position \(1, 1\) of \(2, 3\) is outside \[0, 3\)"):
        F.embedding(mt.tensor(ids, device=device), randn(device, 3, 2))
