"""Tensor: an array (NumPy or CuPy) plus what autograd needs to differentiate through it.

    data           the raw array; ``x.data`` is a ``numpy.ndarray`` on "cpu", ``cupy.ndarray``
                   on "cuda"
    requires_grad  whether gradients flow back to this tensor
    grad           after ``backward()``, a Tensor of the same shape (leaves only)
    _ctx           the autograd Context of the op that produced it (None for leaves)
    _version       how many times the package has written ``data`` in place (``bump_version``);
                   a backward refuses to read an array saved at an older version

A Tensor holds numbers or booleans: bool, signed and unsigned integers, float16/32/64, bfloat16
(and complex). ``tensor()``, the creation functions and the constructor refuse strings, bytes,
Python objects, datetimes and raw records with a ``TypeError``, rather than let an op fail
later inside NumPy.

Binary arithmetic (``+ - * / **``) between tensors gives NumPy's promotion of the two dtypes,
as PyTorch promotes tensors: float64 + float32 -> float64, float32 + float16 -> float32,
bfloat16 + float16 -> float32, bool + float16 -> float16, int16 + float32 -> float32. Unlike
PyTorch, an int32 or int64 tensor meeting a float32 one gives float64 (NumPy widens to hold the
integers exactly), and int / int is float64. A Python number does not promote a floating
tensor: ``x * 0.5`` and ``x + 2`` keep x's dtype, float16 and bfloat16 included. An integer
tensor keeps its dtype with a Python int, and becomes float64 with a Python float (PyTorch:
float32).

This file depends on ``backend`` only. The operators (``+ - * / ** @``, unary minus, indexing,
comparisons), the methods that are ops (``sum``, ``reshape``, ``softmax``, ``to``...) and
``backward()`` are all defined in the class below, each one line naming the op it runs: ``a + b``
is ``F.add(a, b)``, defined in functional/elementwise.py, and ``loss.backward()`` is
``autograd.backward(loss)``. Those modules import this one, so the class reaches them through
``_ops``, which they fill when they are imported (``import minitransformer`` imports both).
Creation functions (``tensor``, ``zeros``, ``randn``...) are at the bottom of this file.
Floating-point data defaults to float32, as in PyTorch.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import backend

DEFAULT_DTYPE = np.float32

_NUMERIC_KINDS = "biufc"  # NumPy's dtype kinds of bool, int, uint, float, complex
# What the other kinds hold, for the refusal; bfloat16 is kind 'V' too (ml_dtypes), so
# ``backend.is_floating`` sets it apart from raw records.
_OTHER_KINDS = {"U": "strings", "T": "strings", "S": "bytes", "O": "Python objects", "M": "datetimes",
                "m": "timedeltas", "V": "raw or structured records"}


def _holds_numbers(dtype) -> bool:
    return dtype.kind in _NUMERIC_KINDS or backend.is_floating(dtype)


def _cannot_hold(who: str, dtype, data=None) -> TypeError:
    """The one-line refusal of a dtype that is not numbers; for an object array, it names the
    type of its first element that is not a number (None, as a rule), else of its first."""
    what = _OTHER_KINDS[dtype.kind]
    if dtype.kind == "O" and data is not None and data.size:
        odd = next((v for v in data.flat if not isinstance(v, (numbers.Number, np.bool_))), data.flat[0])
        what += f": {type(odd).__name__}"
    return TypeError(f"{who}: cannot hold data of dtype {dtype} ({what}); a Tensor holds numbers or booleans")


class _Ops:
    """Where Tensor's operators find the ops: ``F`` is minitransformer.functional, ``backward``
    is autograd.backward; each sets itself here when imported."""
    F = None
    backward = None


_ops = _Ops()


class _VersionCounter:
    """The count of in-place writes into one array's memory: shared by a tensor and its views
    (what ``detach``, ``reshape``, ``transpose`` or an index give), as PyTorch's is, so that a
    write through any of them is seen by all."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class Tensor:
    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_version_counter", "__weakref__")

    # NumPy must hand ``ndarray + Tensor`` over to ``Tensor.__radd__`` instead of
    # treating the Tensor as an object array.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad: bool = False, _ctx=None) -> None:
        self.data = data
        self.grad = None
        self._ctx = _ctx
        self._version_counter = _VersionCounter()
        # Every op's output comes through here: a dtype-kind test only.
        try:
            numeric = _holds_numbers(data.dtype)
        except AttributeError:
            raise TypeError(f"Tensor: data must be a NumPy or CuPy array, got {type(data).__name__} "
                            f"(mt.tensor makes a Tensor from Python data)") from None
        if not numeric:
            raise _cannot_hold("Tensor", data.dtype, data)
        if requires_grad and not backend.is_floating(data.dtype):
            raise TypeError(f"only floating-point tensors can require grad, not {data.dtype}")
        self.requires_grad = requires_grad

    # ----------------------------------------------------------------- attributes
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def device(self) -> str:
        return backend.device_of(self.data)

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        extra = f", device='{self.device}'" if self.device != "cpu" else ""
        if self._ctx is not None:
            extra += f", grad_fn={self._ctx.fn.__name__ if self._ctx.fn else 'freed'}"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        body = np.array2string(self.numpy(), prefix="tensor(", separator=", ")
        return f"tensor({body}, dtype={self.dtype}{extra})"

    # ----------------------------------------------------------------- autograd
    def detach(self) -> Tensor:
        """The same data, cut from the graph (and sharing its version counter)."""
        out = Tensor(self.data)
        out._version_counter = self._version_counter
        return out

    @property
    def _version(self) -> int:
        """How many in-place writes ``data`` has had (PyTorch's ``x._version``)."""
        return self._version_counter.value

    def bump_version(self) -> None:
        """Count an in-place write into ``data``. The package's writers call it (the optimiser's
        update, the loss scaler, gradient clipping, ``load_state_dict``), so that a backward
        whose graph saved the old values refuses to run instead of returning a wrong gradient.
        A raw write into ``.data`` is not counted, as in PyTorch."""
        self._version_counter.value += 1

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if requires_grad and not backend.is_floating(self.dtype):
            raise TypeError(f"only floating-point tensors can require grad, not {self.dtype}")
        self.requires_grad = requires_grad
        return self

    # ----------------------------------------------------------------- conversion
    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (copied from the GPU if needed)."""
        return backend.to_device(self.data, "cpu")

    def item(self):
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element, not shape {self.shape}")
        return self.data.reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __bool__(self) -> bool:
        return bool(self.data)

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    # ----------------------------------------------------------------- the ops, by name
    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into ``leaf.grad`` for every leaf that requires grad: the
        walk of autograd.py (a scalar needs no ``grad``; anything else, one of its shape)."""
        _ops.backward(self, grad, retain_graph)

    def __add__(self, other):
        return _ops.F.add(self, other)

    def __radd__(self, other):
        return _ops.F.add(other, self)

    def __sub__(self, other):
        return _ops.F.sub(self, other)

    def __rsub__(self, other):
        return _ops.F.sub(other, self)

    def __mul__(self, other):
        return _ops.F.mul(self, other)

    def __rmul__(self, other):
        return _ops.F.mul(other, self)

    def __truediv__(self, other):
        return _ops.F.div(self, other)

    def __rtruediv__(self, other):
        return _ops.F.div(other, self)

    def __pow__(self, other):
        return _ops.F.pow(self, other)

    def __rpow__(self, other):
        return _ops.F.pow(other, self)

    def __neg__(self):
        return _ops.F.neg(self)

    def __matmul__(self, other):
        return _ops.F.matmul(self, other)

    def __rmatmul__(self, other):
        return _ops.F.matmul(other, self)

    def __getitem__(self, index):
        return _ops.F.getitem(self, index)

    # Comparisons give boolean tensors (masks); they are not differentiable.
    def __eq__(self, other):
        return _ops.F.compare(self, other, "equal")

    def __ne__(self, other):
        return _ops.F.compare(self, other, "not_equal")

    def __lt__(self, other):
        return _ops.F.compare(self, other, "less")

    def __le__(self, other):
        return _ops.F.compare(self, other, "less_equal")

    def __gt__(self, other):
        return _ops.F.compare(self, other, "greater")

    def __ge__(self, other):
        return _ops.F.compare(self, other, "greater_equal")

    # Identity, as in PyTorch: == is an elementwise comparison, and tensors are dictionary
    # keys (autograd, optimisers) by identity.
    __hash__ = object.__hash__

    def sum(self, axis=None, keepdims: bool = False):
        return _ops.F.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims: bool = False):
        return _ops.F.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims: bool = False):
        return _ops.F.max(self, axis, keepdims)

    def exp(self):
        return _ops.F.exp(self)

    def log(self):
        return _ops.F.log(self)

    def sqrt(self):
        return _ops.F.sqrt(self)

    def relu(self):
        return _ops.F.relu(self)

    def softmax(self, axis: int = -1):
        return _ops.F.softmax(self, axis)

    def log_softmax(self, axis: int = -1):
        return _ops.F.log_softmax(self, axis)

    def masked_fill(self, mask, value):
        return _ops.F.masked_fill(self, mask, value)

    def transpose(self, axis0: int, axis1: int):
        return _ops.F.transpose(self, axis0, axis1)

    def reshape(self, *shape):
        """``x.reshape(2, 3)`` or ``x.reshape((2, 3))``."""
        return _ops.F.reshape(self, as_shape(shape))

    def permute(self, *axes):
        """``x.permute(0, 2, 1)`` or ``x.permute((0, 2, 1))``."""
        return _ops.F.permute(self, as_shape(axes))

    def to(self, device: str):
        """This tensor on ``device`` (itself if already there); differentiable, so gradients
        flow back across devices."""
        return self if device == self.device else _ops.F.to_device(self, device)

    def astype(self, dtype):
        """Cast to ``dtype``; differentiable between floating-point types."""
        return _ops.F.cast(self, dtype)

    def float(self):
        return _ops.F.cast(self, np.float32)


# --------------------------------------------------------------------------- creation


def _resolve_dtype(dtype, who: str):
    if dtype is None:
        return None
    dtype = backend.resolve_dtype(dtype)
    if not _holds_numbers(dtype):
        raise _cannot_hold(who, dtype)
    return dtype


def _draw_dtype(dtype: np.dtype) -> np.dtype:
    """Generators draw float32 or float64 only: 16-bit samples are drawn in float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def as_shape(shape: tuple) -> tuple:
    """``zeros(2, 3)`` and ``zeros((2, 3))`` both mean shape (2, 3)."""
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        return tuple(shape[0])
    return tuple(int(n) for n in shape)


def _from_python(who: str, data) -> np.ndarray:
    """Python data (lists, scalars, None) as a new NumPy array of the dtype it infers, refused
    unless numbers: given a float dtype, NumPy would parse strings, and read None as nan."""
    array = np.array(data)
    if not _holds_numbers(array.dtype):
        raise _cannot_hold(who, array.dtype, array)
    return array


def tensor(data, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    """A new leaf tensor holding a copy of ``data`` (a list, scalar, or NumPy/CuPy array).

    Python floats become float32 (the default dtype); arrays keep their dtype unless
    ``dtype`` is given. Data that is not numbers or booleans raises a ``TypeError``.
    """
    if isinstance(data, Tensor):
        data = data.data
    xp = backend.get_array_module(device)
    dtype = _resolve_dtype(dtype, "mt.tensor")
    if not hasattr(data, "dtype"):
        data = _from_python("mt.tensor", data)
        if dtype is None and data.dtype.kind == "f":
            dtype = np.dtype(DEFAULT_DTYPE)
        # A new array already: cast (or move) it without a second copy.
        return Tensor(xp.asarray(data, dtype=dtype), requires_grad=requires_grad)
    source = backend.device_of(data)  # refuses what is neither a NumPy nor a CuPy array
    if not _holds_numbers(data.dtype):
        raise _cannot_hold("mt.tensor", data.dtype, data)
    if source != device:
        # The move already made a new array: cast it without a second copy.
        return Tensor(xp.asarray(backend.to_device(data, device), dtype=dtype), requires_grad=requires_grad)
    return Tensor(xp.array(data, dtype=dtype), requires_grad=requires_grad)  # a copy: the caller keeps its array


def _filled(fill, shape, dtype, device, requires_grad, who: str) -> Tensor:
    shape = as_shape(shape)
    xp = backend.get_array_module(device)
    if not hasattr(fill, "dtype"):
        _from_python(who, fill)  # np.full would fill a float tensor with nan for None
    data = xp.full(shape, fill, dtype=_resolve_dtype(dtype, who) or DEFAULT_DTYPE)
    return Tensor(data, requires_grad=requires_grad)


def zeros(*shape, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    return _filled(0, shape, dtype, device, requires_grad, "mt.zeros")


def ones(*shape, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    return _filled(1, shape, dtype, device, requires_grad, "mt.ones")


def full(shape, fill_value, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    return _filled(fill_value, (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape),
                   dtype, device, requires_grad, "mt.full")


def randn(*shape, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    """Standard normal samples from the device's seeded generator (see ``manual_seed``)."""
    dtype = _resolve_dtype(dtype, "mt.randn") or np.dtype(DEFAULT_DTYPE)
    data = backend.generator(device).standard_normal(as_shape(shape), dtype=_draw_dtype(dtype))
    return Tensor(data.astype(dtype, copy=False), requires_grad=requires_grad)


def rand(*shape, dtype=None, device: str = "cpu", requires_grad: bool = False) -> Tensor:
    """Uniform samples in [0, 1) from the device's seeded generator."""
    dtype = _resolve_dtype(dtype, "mt.rand") or np.dtype(DEFAULT_DTYPE)
    data = backend.generator(device).random(as_shape(shape), dtype=_draw_dtype(dtype))
    return Tensor(data.astype(dtype, copy=False), requires_grad=requires_grad)


def arange(start, stop=None, step=1, dtype=None, device: str = "cpu") -> Tensor:
    """Like ``numpy.arange``; integer arguments give int64, float ones float32."""
    if stop is None:
        start, stop = 0, start
    dtype = _resolve_dtype(dtype, "mt.arange")
    if dtype is None:
        is_int = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
        dtype = np.int64 if is_int else DEFAULT_DTYPE
    xp = backend.get_array_module(device)
    return Tensor(xp.arange(start, stop, step, dtype=dtype))


def zeros_like(t: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return zeros(t.shape, dtype=dtype or t.dtype, device=device or t.device,
                 requires_grad=requires_grad)


def ones_like(t: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return ones(t.shape, dtype=dtype or t.dtype, device=device or t.device,
                requires_grad=requires_grad)


def full_like(t: Tensor, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return full(t.shape, fill_value, dtype=dtype or t.dtype, device=device or t.device,
                requires_grad=requires_grad)


def randn_like(t: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return randn(t.shape, dtype=dtype or t.dtype, device=device or t.device,
                 requires_grad=requires_grad)
