import numpy as np
import pytest
from hypothesis import given, strategies as st

import minitransformer as mt
from minitransformer import functional as F
from minitransformer.functional import loss as loss_module
from minitransformer.kernels.reference import formulas
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn, seeds


@given(n=st.integers(1, 5), v=st.integers(2, 6), seed=seeds,
       eps=st.sampled_from([0.0, 0.1, 0.5]), reduction=st.sampled_from(["mean", "sum", "none"]),
       with_ignore=st.booleans())
def test_cross_entropy_matches_formula_and_gradients(device, n, v, seed, eps, reduction, with_ignore):
    rng = np.random.default_rng(seed)
    logits = randn(device, 2, n, v, seed=seed, scale=2.0)
    target_np = rng.integers(0, v, size=(2, n))
    ignore = 0 if with_ignore else None
    target = mt.tensor(target_np, device=device)
    loss = F.cross_entropy(logits, target, label_smoothing=eps, ignore_index=ignore, reduction=reduction)
    # The plain formula beside the cache-blocked op: per position loss and softmax - q.
    ref, ref_grad = formulas.cross_entropy(logits.numpy().reshape(-1, v), target_np.reshape(-1), eps, ignore)
    keep = (target_np != ignore if with_ignore else np.ones_like(target_np, bool)).reshape(-1)
    weight = {"none": 1.0, "sum": 1.0, "mean": 1.0 / max(keep.sum(), 1)}[reduction]
    if reduction == "none":
        assert loss.shape == (2, n)
        np.testing.assert_allclose(loss.numpy().reshape(-1), ref, rtol=1e-10)
        loss.sum().backward()
    else:
        expected = ref.sum() * weight
        np.testing.assert_allclose(loss.item(), expected, rtol=1e-10, atol=1e-12)
        loss.backward()
    np.testing.assert_allclose(logits.grad.numpy().reshape(-1, v), ref_grad * weight, rtol=1e-10, atol=1e-12)
    logits.grad = None
    gradcheck(lambda z: F.cross_entropy(z, target, eps, ignore, reduction), [logits])


def test_ignored_positions_get_no_gradient(device):
    logits = randn(device, 4, 5, seed=1)
    target = mt.tensor([1, 0, 3, 0], device=device)
    F.cross_entropy(logits, target, label_smoothing=0.1, ignore_index=0).backward()
    np.testing.assert_array_equal(logits.grad.numpy()[[1, 3]], 0.0)
    assert np.abs(logits.grad.numpy()[[0, 2]]).min() > 0


def test_huge_logits_stay_finite(device):
    logits = mt.tensor([[1e4, -1e4, 0.0]], device=device, requires_grad=True)
    loss = F.cross_entropy(logits, mt.tensor([1], device=device), label_smoothing=0.1)
    assert np.isfinite(loss.item())
    loss.backward()
    assert np.isfinite(logits.grad.numpy()).all()


def test_bad_targets_are_reported(device):
    logits = randn(device, 3, 4)
    with pytest.raises(IndexError, match=r"target id 4 at position \(1,\) of \(3,\) is outside \[0, 4\)"):
        F.cross_entropy(logits, mt.tensor([0, 4, 1], device=device))
    # an ignored id need not be a class (PyTorch's -100, say); the others are still checked
    assert np.isfinite(F.cross_entropy(logits, mt.tensor([0, -100, 1], device=device), ignore_index=-100).item())
    with pytest.raises(IndexError, match=r"target id -1 at position \(2,\)"):
        F.cross_entropy(logits, mt.tensor([0, -100, -1], device=device), ignore_index=-100)
    with pytest.raises(ValueError, match=r"\(2,\).*\(3, 4\)"):
        F.cross_entropy(logits, mt.tensor([0, 1], device=device))


@given(n=st.integers(1, 12), v=st.integers(2, 9), block_bytes=st.integers(1, 300), seed=seeds,
       eps=st.sampled_from([0.0, 0.1]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_blocks_of_any_size_give_the_same_loss_and_gradient(monkeypatch, n, v, block_bytes, seed, eps,
                                                            reduction):
    """The NumPy path works through blocks of rows: blocks of one row, of several with a
    shorter last one, and one block for all must agree (float64, so bit for bit up to the
    order of a row's own sums, which blocks do not change)."""
    target = mt.tensor(np.random.default_rng(seed).integers(0, v, size=n))

    def loss_and_grad():
        logits = randn("cpu", n, v, seed=seed, scale=3.0)
        loss = F.cross_entropy(logits, target, label_smoothing=eps, ignore_index=0, reduction=reduction)
        loss.sum().backward() if reduction == "none" else loss.backward()
        return loss.numpy(), logits.grad.numpy()

    whole = loss_and_grad()
    monkeypatch.setattr(loss_module, "BLOCK_BYTES", block_bytes)  # rows of v * 8 bytes
    blocked = loss_and_grad()
    for a, b in zip(whole, blocked):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_an_empty_batch(device, reduction):
    logits = randn(device, 2, 0, 5)
    loss = F.cross_entropy(logits, mt.tensor(np.zeros((2, 0), int), device=device), 0.1, 0, reduction)
    assert loss.shape == ((2, 0) if reduction == "none" else ())
    np.testing.assert_array_equal(loss.numpy(), 0.0)
    loss.sum().backward()
    assert logits.grad.shape == (2, 0, 5)


def test_an_ignored_row_of_infinite_logits_costs_nothing(device):
    """Its target is ignored, so whatever its logits, it adds neither loss nor NaN."""
    data = np.random.default_rng(4).standard_normal((3, 6))
    data[1] = -np.inf
    data[1, 2] = 0.0
    target = np.array([3, 0, 5])
    logits = mt.tensor(data, device=device, requires_grad=True)
    for eps in (0.0, 0.1):
        loss = F.cross_entropy(logits, mt.tensor(target, device=device), eps, ignore_index=0, reduction="none")
        expected, _ = formulas.cross_entropy(data[[0, 2]], target[[0, 2]], eps)
        np.testing.assert_allclose(loss.numpy()[[0, 2]], expected, rtol=1e-10)
        assert loss.numpy()[1] == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_retained_graph_backwards_twice_through_the_loss(reduction):
    """The NumPy path scales its saved gradient in place, remembering the factor: a second
    backward with another upstream gradient still gives the right sum. (The fused kernel's
    path refuses a second backward instead; see FusedCrossEntropy.)"""
    logits = randn("cpu", 6, 9, seed=2)
    target = mt.tensor([1, 0, 3, 8, 2, 0])
    loss = F.cross_entropy(logits, target, label_smoothing=0.1, ignore_index=0, reduction=reduction)
    (loss * 3.0).backward(retain_graph=True)
    (loss * -0.5).backward(retain_graph=True)
    fresh = randn("cpu", 6, 9, seed=2)
    F.cross_entropy(fresh, target, label_smoothing=0.1, ignore_index=0, reduction=reduction).backward()
    np.testing.assert_allclose(logits.grad.numpy(), 2.5 * fresh.grad.numpy(), rtol=1e-12)
    # An upstream gradient of exactly 1 (a summed loss under data parallelism) skips the scaling
    # pass; the bookkeeping must still hold for a backward after it.
    again = randn("cpu", 6, 9, seed=2)
    loss2 = F.cross_entropy(again, target, label_smoothing=0.1, ignore_index=0, reduction=reduction)
    loss2.backward(retain_graph=True)
    np.testing.assert_allclose(again.grad.numpy(), fresh.grad.numpy(), rtol=1e-12)
    (loss2 * 3.0).backward(retain_graph=True)
    np.testing.assert_allclose(again.grad.numpy(), 4.0 * fresh.grad.numpy(), rtol=1e-12)
    (loss * 0.0).backward(retain_graph=True)  # zeroes the saved gradient: no later backward can undo it
    with pytest.raises(RuntimeError, match="cannot undo"):
        loss.backward()
