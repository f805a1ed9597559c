import re

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


def _one_line_error(kind, match, fn, *args, **kwargs):
    with pytest.raises(kind, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("data,dtype,described", [
    (["a", "b"], None, "<U1 (strings)"),
    ([b"ab"], None, "|S2 (bytes)"),
    (None, None, "object (Python objects: NoneType)"),
    (np.array([1, None], dtype=object), None, "object (Python objects: NoneType)"),
    (np.array(["2024-01-01"], dtype="datetime64[D]"), None, "datetime64[D] (datetimes)"),
    (np.zeros(2, dtype="V4"), None, "|V4 (raw or structured records)"),
    (["1.5"], np.float32, "<U3 (strings)"),  # NumPy would parse the strings
    ([1, 2], str, "<U0 (strings)"),
    ([1, 2], object, "object (Python objects)"),
])
def test_tensor_refuses_data_that_is_not_numbers(data, dtype, described):
    message = rf"^mt\.tensor: cannot hold data of dtype {re.escape(described)}; a Tensor holds numbers or booleans$"
    _one_line_error(TypeError, message, mt.tensor, data, dtype=dtype)


def test_tensors_hold_numbers_and_booleans_only():
    for dtype in (bool, np.int8, np.int64, np.uint8, np.uint32, np.float16, np.float32, np.float64):
        assert mt.tensor(np.zeros(2, dtype)).dtype == dtype
        assert mt.Tensor(np.zeros(2, dtype)).dtype == dtype
    if backend.bfloat16 is not None:  # NumPy files it under kind 'V', as it does raw records
        assert mt.tensor(np.zeros(2, backend.bfloat16)).dtype == backend.bfloat16
        assert mt.tensor([1.5], dtype="bfloat16").dtype == backend.bfloat16
        assert mt.zeros(2, dtype="bfloat16").dtype == backend.bfloat16
        assert mt.randn(2, dtype="bfloat16").dtype == backend.bfloat16
    # The constructor takes ops' raw arrays: the same refusal, without mt.tensor's conversion.
    _one_line_error(TypeError, r"^Tensor: cannot hold data of dtype <U1 \(strings\)", mt.Tensor, np.array(["a"]))
    _one_line_error(TypeError, r"^Tensor: data must be a NumPy or CuPy array, got list", mt.Tensor, [1.0])


@pytest.mark.parametrize("make,name", [
    (lambda: mt.zeros(2, dtype=str), "zeros"),
    (lambda: mt.ones(2, dtype=object), "ones"),
    (lambda: mt.full(2, 1.0, dtype="datetime64[s]"), "full"),
    (lambda: mt.full(2, None), "full"),  # NumPy would fill with nan
    (lambda: mt.full(2, "a"), "full"),
    (lambda: mt.randn(2, dtype=str), "randn"),
    (lambda: mt.rand(2, dtype=bytes), "rand"),
    (lambda: mt.arange(3, dtype=str), "arange"),
    (lambda: mt.zeros_like(mt.zeros(2), dtype=object), "zeros"),
])
def test_creation_functions_refuse_dtypes_that_are_not_numbers(make, name):
    _one_line_error(TypeError, rf"^mt\.{name}: cannot hold data of dtype .*; a Tensor holds numbers or booleans$",
                    make)


def test_binary_ops_promote_as_the_module_docstring_states():
    def t(dtype):
        return mt.tensor(np.ones(2, dtype))

    def result(a, b):
        return (t(a) + t(b)).dtype

    # Between tensors: NumPy's promotion of the two dtypes, for every arithmetic operator.
    for op in (lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / b,
               lambda a, b: a ** b):
        assert op(t(np.float64), t(np.float32)).dtype == np.float64
        assert op(t(np.float32), t(np.float16)).dtype == np.float32
    assert result(bool, np.float16) == np.float16
    assert result(np.int16, np.float32) == np.float32
    # Unlike PyTorch, NumPy widens an int32 or int64 meeting float32 to float64 (exact ints).
    assert result(np.int32, np.float32) == result(np.int64, np.float32) == np.float64
    assert (t(np.int64) / t(np.int64)).dtype == np.float64
    # A Python number keeps a floating tensor's dtype, 16-bit ones included.
    floats = [np.float16, np.float32, np.float64] + ([backend.bfloat16] if backend.bfloat16 is not None else [])
    for dtype in floats:
        x = t(dtype)
        for y in (x * 0.5, x + 2, 2 - x, x / 3, x ** 2, 1.5 ** x):
            assert y.dtype == dtype
    if backend.bfloat16 is not None:
        assert result(backend.bfloat16, np.float16) == np.float32
    # With an integer tensor, a Python int keeps its dtype and a Python float gives float64.
    assert (t(np.int32) + 2).dtype == np.int32
    assert (t(np.int64) * 0.5).dtype == np.float64


def test_every_operator_is_defined_where_a_reader_looks():
    """``a + b`` has its definition in tensor.py's class, one line naming the op it runs; the
    ops themselves live in functional/ (and autograd.py for backward)."""
    import inspect

    import minitransformer.tensor as tensor_module

    names = ["__add__", "__radd__", "__sub__", "__mul__", "__truediv__", "__pow__", "__neg__",
             "__matmul__", "__getitem__", "__eq__", "__lt__", "sum", "mean", "max", "softmax",
             "reshape", "permute", "to", "astype", "backward"]
    for name in names:
        method = vars(mt.Tensor).get(name)
        assert method is not None, f"Tensor.{name} is not defined in the class"
        assert inspect.getsourcefile(method) == inspect.getsourcefile(tensor_module), name
    x = mt.tensor([1.0, 2.0], requires_grad=True)
    ((x + 1) * x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 5.0])
