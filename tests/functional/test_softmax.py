import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minitransformer as mt
from minitransformer import functional as F
from minitransformer.gradcheck import gradcheck
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


@given(rows=st.integers(0, 40), width=st.integers(1, 300), threads=st.integers(1, 3),
       block_bytes=st.sampled_from([1, 64, 4096, 1 << 18]), split=st.sampled_from([1, 1 << 19]),
       dtype=st.sampled_from([np.float32, np.float64]), seed=seeds)
def test_in_place_log_softmax_parts_are_the_plain_ones(rows, width, threads, block_bytes, split, dtype, seed):
    softmax = importlib.import_module("minitransformer.functional.softmax")  # F.softmax is the op

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, width)) * 10).astype(dtype)
    x[rng.random(x.shape) < 0.2] = -np.inf  # masked words
    if rows:
        x[rng.integers(rows)] = -np.inf  # a fully masked row
    shifted, log_sum = softmax.log_softmax_parts(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", str(threads))  # blocks on 1-3 threads
        mp.setattr(softmax, "_BLOCK_BYTES", block_bytes)  # from one row per block to all rows in one
        mp.setattr(softmax, "_SPLIT_ELEMENTS", split)  # 1: every thread takes rows, however few
        y = x.copy()
        shifted_, log_sum_ = softmax.log_softmax_parts_(y)
    assert shifted_ is y and shifted_.dtype == dtype and log_sum_.dtype == dtype
    np.testing.assert_array_equal(shifted_, shifted)  # bit for bit
    # Summed in another order: each sum of at most `width` terms (the largest 1) within
    # width * eps of the pairwise one, and so its log.
    np.testing.assert_allclose(log_sum_, log_sum, rtol=0, atol=width * np.finfo(dtype).eps)


@settings(deadline=None, max_examples=40)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), width=st.integers(1, 80),
       axis=st.sampled_from([-1, 0]), dtype=st.sampled_from([np.float32, np.float64, np.float16]), seed=seeds)
def test_row_max_is_numpy_s_max(shape, width, axis, dtype, seed):
    softmax = importlib.import_module("minitransformer.functional.softmax")

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*shape, width)) * 10).astype(dtype)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x.flat[rng.integers(x.size)] = rng.choice([np.nan, np.inf, -np.inf])
    got = softmax.row_max(x, axis)
    np.testing.assert_array_equal(got, x.max(axis=axis, keepdims=True))
    assert got.dtype == dtype
