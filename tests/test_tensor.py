import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend
from tests.helpers import randn


def test_python_data_defaults_to_float32_and_int64(device):
    assert mt.tensor([1.0, 2.0], device=device).dtype == np.float32
    assert mt.tensor(3.5, device=device).dtype == np.float32
    assert mt.tensor([1, 2], device=device).dtype == np.int64
    assert mt.tensor([True], device=device).dtype == bool
    assert mt.tensor(np.zeros(2), device=device).dtype == np.float64  # arrays keep their dtype
    assert mt.tensor([1, 2], dtype=mt.float64, device=device).dtype == np.float64


def test_tensor_copies_its_data(device):
    data = np.array([1.0, 2.0], dtype=np.float32)
    t = mt.tensor(data, device=device)
    data[0] = 100.0
    assert t.numpy()[0] == 1.0


def test_creation_functions(device):
    assert mt.zeros(2, 3, device=device).numpy().tolist() == [[0, 0, 0], [0, 0, 0]]
    assert mt.ones((2,), device=device).dtype == np.float32
    assert mt.full((2, 2), 7.0, device=device).numpy().sum() == 28.0
    assert mt.arange(5, device=device).dtype == np.int64
    np.testing.assert_allclose(mt.arange(0.0, 1.0, 0.25, device=device).numpy(), [0, 0.25, 0.5, 0.75])
    r = mt.randn(1000, device=device)
    assert r.dtype == np.float32 and abs(r.numpy().mean()) < 0.15 and 0.85 < r.numpy().std() < 1.15
    u = mt.rand(1000, device=device)
    assert 0 <= u.numpy().min() and u.numpy().max() < 1
    x = randn(device, 2, 3, dtype=np.float64)
    for like in (mt.zeros_like(x), mt.ones_like(x), mt.randn_like(x), mt.full_like(x, 2.0)):
        assert like.shape == (2, 3) and like.dtype == np.float64 and like.device == device
        assert not like.requires_grad


def test_manual_seed_makes_randn_reproducible(device):
    mt.manual_seed(42)
    a = mt.randn(5, device=device).numpy()
    mt.manual_seed(42)
    b = mt.randn(5, device=device).numpy()
    assert (a == b).all() and (a != mt.randn(5, device=device).numpy()).any()


def test_attributes_and_conversions(device):
    x = mt.tensor([[1.5, 2.0]], device=device, requires_grad=True)
    assert x.shape == (1, 2) and x.ndim == 2 and x.size == 2 and len(x) == 1
    assert x.device == device and x.is_leaf and x.grad is None
    assert isinstance(x.numpy(), np.ndarray)
    assert x[0, 0].item() == 1.5 and float(x[0, 1]) == 2.0
    assert x.tolist() == [[1.5, 2.0]]
    d = x.detach()
    assert not d.requires_grad and d.data is x.data
    assert "requires_grad=True" in repr(x)
    with pytest.raises(ValueError, match="one element"):
        x.item()


def test_only_floats_require_grad():
    with pytest.raises(TypeError, match="floating-point"):
        mt.tensor([1, 2], requires_grad=True)


def test_ndarray_on_the_left_defers_to_tensor():
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    y = np.array([3.0, 4.0], dtype=np.float32) * x
    assert isinstance(y, mt.Tensor)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 4.0])


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        mt.zeros(2, device="tpu")


@pytest.mark.skipif(backend.has_cuda(), reason="checks the error raised without a GPU")
def test_cuda_without_gpu_raises_a_clear_error():
    with pytest.raises(RuntimeError, match="device 'cuda'"):
        mt.zeros(2, device="cuda")
    assert mt.has_cuda() is False


@pytest.mark.skipif(not backend.has_cuda(), reason="no CUDA device (CuPy with a GPU)")
def test_to_moves_between_devices():
    x = mt.tensor([1.0, 2.0])
    y = x.to("cuda")
    assert y.device == "cuda" and y.to("cpu").numpy().tolist() == [1.0, 2.0]
    assert x.to("cpu") is x
