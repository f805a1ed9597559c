"""Device "cuda" on the CPU: a CuPy stand-in over NumPy, for tests and for readers without a GPU.

    MT_EMULATE_CUDA=1 python examples/copy_task.py --device cuda

With ``MT_EMULATE_CUDA=1`` in the environment, ``backend`` calls ``install()`` instead of
importing CuPy. ``install`` registers this stand-in as ``cupy`` (with ``cupy.cuda``,
``cupy.random``, ``cupy.testing``, ``cupyx`` and ``cupy.cuda.nccl``, the last from
nccl.py) and, as ``minitransformer.kernels._C``, the emulator's build of csrc/
(emulator.py): so every kernel launch goes through the real launchers, bindings and
kernels, with host addresses where a GPU has device pointers. It covers the CuPy API the
package uses, with CuPy's behaviour where the package relies on it:

- ``ndarray`` keeps a NumPy array behind CuPy's interface: ``.data.ptr`` (the host address the
  emulated kernels take), ``.device``, ``.get()``; reductions and scalar indexing give 0-d
  arrays. As on a GPU, a NumPy array is refused as an operand (``TypeError: Unsupported type``)
  and never converted implicitly (``__array__`` raises): host/device mix-ups fail here as they
  would on the first GPU run.
- Streams and events. The work runs at once, in program order, but the order that streams and
  events promise is checked: each allocation remembers the stream and the point of its last
  write, and using it on another stream that has not waited for that point (through an event,
  or a host synchronisation) raises ``StreamOrderError``. On a GPU such a race gives wrong
  numbers only sometimes. Writes after reads are checked too: writing memory that another
  stream has read, before waiting for that read, raises the same error (the reader, still
  running on a GPU, could see the new data).
- The memory pool's figures: bytes of live arrays, and the peak since ``free_all_blocks``.
- ``random.Generator(Philox4x3210(seed))`` draws NumPy's Philox stream, not cuRAND's bits.
- ``cupyx.scatter_add``; ``cuda.runtime``'s device count and properties; ``Device.attributes``
  (``MaxSharedMemoryPerBlockOptin``, ``MultiProcessorCount``), which ``configure`` changes so
  that a test can play another GPU.

What it cannot show: speed, memory limits, what the hardware's mma.sync, ldmatrix and cuRAND
really do, and races inside a kernel (the emulator's sanitizers look for those).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import sys
import time
import types
import weakref

import numpy as np

from .. import settings

BANNER = ("minitransformer: device 'cuda' is EMULATED on the CPU (MT_EMULATE_CUDA=1): NumPy "
          "behind CuPy's interface, csrc/ compiled with g++; nothing here measures a GPU")
DEVICE_NAME = "Emulated CUDA device (CPU, minitransformer.emulated)"

# What Device().attributes reports. The defaults are an H100/H200's (sm_90): 227 KB of opt-in
# shared memory per block, 132 multiprocessors. Only keys CuPy's Device.attributes has (one per
# cudaDevAttr* constant of its runtime module, which leaves the compute capability out: CuPy
# gives it as Device.compute_capability and getDeviceProperties' major and minor).
_ATTRIBUTES = {"MaxSharedMemoryPerBlockOptin": 232448, "MultiProcessorCount": 132,
               "MaxSharedMemoryPerBlock": 49152}
_COMPUTE_CAPABILITY = (9, 0)


_attributes_read = False  # whether anyone has asked for Device().attributes yet


def configure(*, max_shared_memory_per_block_optin: int | None = None,
              multiprocessor_count: int | None = None) -> dict:
    """Change what the emulated device reports (to test choices made from it); returns the
    previous values, which ``configure(**previous)`` restores.

    Only before anything has read the attributes: the launch layer reads them once per process
    (as it must on a GPU, where reading them is slow), so a later change would be silently
    ignored. A change after that raises RuntimeError; configure in a fresh process instead."""
    keys = {"max_shared_memory_per_block_optin": "MaxSharedMemoryPerBlockOptin",
            "multiprocessor_count": "MultiProcessorCount"}
    given = {"max_shared_memory_per_block_optin": max_shared_memory_per_block_optin,
             "multiprocessor_count": multiprocessor_count}
    previous = {arg: _ATTRIBUTES[key] for arg, key in keys.items()}
    changed = {arg: int(value) for arg, value in given.items()
               if value is not None and int(value) != previous[arg]}
    if changed and _attributes_read:
        settings = ", ".join(f"{arg}={value}" for arg, value in changed.items())
        raise RuntimeError(f"minitransformer.emulated.cupy.configure({settings}): the device's attributes were "
                           f"already read in this process, and minitransformer.kernels keeps what "
                           f"it read; configure the emulated device before its first use")
    for arg, value in changed.items():
        _ATTRIBUTES[keys[arg]] = value
    return previous


class StreamOrderError(RuntimeError):
    """An array was used on a stream that had not waited for its last write on another."""


# --------------------------------------------------------------------------- streams, events


class Stream:
    """A CUDA stream as an ordering promise. ``_clock`` counts the writes issued on it;
    ``_seen`` holds, per other stream, the clock up to which this one has waited for it (a
    vector clock: waiting on an event also inherits what the recording stream had seen). Its
    public names are CuPy's (tests/emulated/test_cupy_contract.py holds them to it)."""

    _ids = itertools.count(1)
    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        self.ptr = 0 if null else 0x5000 + 16 * next(Stream._ids)
        self.is_non_blocking = non_blocking and not null
        self._clock = 0
        self._seen: dict[Stream, int] = {}
        _streams[self.ptr] = self

    def __repr__(self) -> str:
        return "<emulated null stream>" if self.ptr == 0 else f"<emulated stream {self.ptr:#x}>"

    def __enter__(self):
        _current_stream.append(self)
        return self

    def __exit__(self, *exc):
        _current_stream.pop()
        return False

    def use(self) -> "Stream":
        _current_stream[-1] = self
        return self

    def synchronize(self) -> None:
        _host_seen[self] = self._clock

    def wait_event(self, event: "Event") -> None:
        if event._stream is None:
            return  # never recorded: nothing to wait for, as in CUDA
        for stream, clock in event._vector.items():
            if clock > self._seen.get(stream, 0):
                self._seen[stream] = clock

    def record(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    @property
    def done(self) -> bool:
        return True

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _ordered_after(self, writer: "Stream", clock: int) -> bool:
        """True when work issued on this stream now is ordered after ``writer``'s op ``clock``."""
        if writer is self or _host_seen.get(writer, 0) >= clock or self._seen.get(writer, 0) >= clock:
            return True
        # The legacy null stream and the blocking streams wait for each other.
        return (self.ptr == 0 and not writer.is_non_blocking) or (writer.ptr == 0 and not self.is_non_blocking)


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._stream: Stream | None = None
        self._vector: dict[Stream, int] = {}
        self._time = None
        self._disable_timing = disable_timing

    def record(self, stream: Stream | None = None) -> None:
        self._stream = get_current_stream() if stream is None else stream
        self._vector = {**self._stream._seen, self._stream: self._stream._clock}
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        for stream, clock in self._vector.items():
            _host_seen[stream] = max(_host_seen.get(stream, 0), clock)

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events (host time: the work ran when it was issued)."""
    if start._disable_timing or end._disable_timing:
        raise RuntimeError("get_elapsed_time: an event was created with disable_timing=True")
    return (end._time - start._time) * 1e3


_streams: dict[int, Stream] = {}
_host_seen: dict[Stream, int] = {}
Stream.null = Stream(null=True)
_current_stream: list[Stream] = [Stream.null]


def get_current_stream(device_id: int | None = None) -> Stream:
    return _current_stream[-1]


def stream_from_ptr(ptr: int) -> Stream:
    """The stream a raw handle (``Stream.ptr``, as a kernel or NCCL call receives it) names."""
    try:
        return _streams[ptr]
    except KeyError:
        raise ValueError(f"{ptr:#x} is not a stream of the emulated device") from None


# --------------------------------------------------------------------------- memory


class _Allocation:
    """One NumPy buffer standing for device memory: its size, its last writes and the reads
    since, as byte ranges (start, stop, stream, clock): streams may use disjoint parts of one
    buffer at once, as DDP's all-reduces of one bucket and backward's writes into the next do."""

    __slots__ = ("ref", "address", "nbytes", "writes", "reads")

    def __init__(self, root: np.ndarray) -> None:
        self.ref = weakref.ref(root)
        self.address, self.nbytes = root.ctypes.data, root.nbytes
        self.writes: list[tuple[int, int, Stream, int]] = []
        self.reads: list[tuple[int, int, Stream, int]] = []


_allocations: dict[int, _Allocation] = {}  # id(root array) -> its record
# Told (address, bytes) of each new buffer and (address, 0) of each freed one: the emulator's
# counters, which count accesses to these as global memory (emulator.logged_launches).
_observers: list = []
_starts: list[tuple[int, int]] = []  # (address, id(root)) of every record, sorted
_pool = {"used": 0, "peak": 0}


def _release(key: int) -> None:
    record = _allocations.pop(key)
    del _starts[bisect.bisect_left(_starts, (record.address, key))]
    _pool["used"] -= record.nbytes
    for observe in _observers:
        observe(record.address, 0)


def _allocation(a: np.ndarray) -> tuple[_Allocation, bool]:
    """The record of the buffer that ``a`` views, and whether it is new."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    record = _allocations.get(id(root))
    if record is not None:
        return record, False
    record = _allocations[id(root)] = _Allocation(root)
    bisect.insort(_starts, (record.address, id(root)))
    weakref.finalize(root, _release, id(root))
    _pool["used"] += record.nbytes
    _pool["peak"] = max(_pool["peak"], _pool["used"])
    for observe in _observers:
        observe(record.address, record.nbytes)
    return record, True


def _use(a: np.ndarray, write: bool = False, stream: Stream | None = None) -> None:
    """Check that ``stream`` (the current one by default) may use ``a``'s bytes now: every
    earlier write to them on another stream must be ordered before it, and before a write,
    every earlier read on another stream too (the reader could still be reading). Record it."""
    record, _ = _allocation(a)
    stream = get_current_stream() if stream is None else stream
    low, high = _extent(a, record)
    checks = [(record.writes, "last written", "used", "write")]
    if write:
        checks.append((record.reads, "read", "written", "read"))
    for uses, done, doing, kind in checks:
        for start, stop, other, clock in uses:
            if start < high and low < stop and not stream._ordered_after(other, clock):
                raise StreamOrderError(
                    f"an array of shape {a.shape} {done} on {other} is {doing} on {stream}, which "
                    f"has not waited for that {kind} (record an Event on {other} after it and call "
                    f"{stream}.wait_event, or synchronize)")
    if high <= low:
        return

    def inside(use: tuple[int, int, Stream, int]) -> bool:
        return low <= use[0] and use[1] <= high

    use = (low, high, stream, stream._tick())
    if write:  # what it covers is ordered before it, and later uses are checked against it
        record.writes = [w for w in record.writes if not inside(w)] + [use]
        record.reads = [r for r in record.reads if not inside(r)]
    else:  # a stream's later read of the same bytes stands for its earlier one
        record.reads = [r for r in record.reads if not (r[2] is stream and inside(r))] + [use]


def _extent(a: np.ndarray, record: _Allocation) -> tuple[int, int]:
    """The bytes ``a`` spans, as offsets into its allocation (NumPy's byte_bounds, without its
    cost for the common case, an array that is its allocation)."""
    if a.base is None:
        return 0, a.nbytes
    low = high = a.ctypes.data - record.address
    if a.flags.c_contiguous:
        return low, low + a.nbytes
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + a.itemsize


def _bytes_at(address: int) -> tuple[np.ndarray, int]:
    """The live allocation holding a raw device address, as flat bytes, and the address's
    offset in it (kernels and NCCL, as on a GPU, receive raw addresses)."""
    # The allocation starting last at or before the address, as a rule; else (an array made
    # over another's memory, starting inside it) any that holds it.
    nearest = bisect.bisect_right(_starts, (address, float("inf"))) - 1
    candidates = [_allocations[_starts[nearest][1]]] if nearest >= 0 else []
    for record in [*candidates, *_allocations.values()]:
        root = record.ref()
        if (root is not None and root.flags.c_contiguous
                and record.address <= address < record.address + max(record.nbytes, 1)):
            return root.reshape(-1).view(np.uint8), address - record.address
    raise ValueError(f"{address:#x} is in no array of the emulated device")


def device_buffer(address: int, count: int, dtype, stream: Stream, write: bool) -> np.ndarray:
    """``count`` elements of ``dtype`` at a raw device address, as a NumPy view, used on
    ``stream`` (for the NCCL stand-in)."""
    data, start = _bytes_at(address)
    nbytes = count * np.dtype(dtype).itemsize
    view = data[start:start + nbytes]
    if view.nbytes != nbytes:
        raise ValueError(f"{nbytes} bytes at {address:#x} run past the end of their array")
    _use(view, write, stream)
    return view.view(dtype)


class MemoryPool:
    """CuPy's pool as the package reads it: ``used_bytes`` (live arrays), ``total_bytes``
    (what the pool would hold: the peak since the last ``free_all_blocks``)."""

    def used_bytes(self) -> int:
        return _pool["used"]

    def total_bytes(self) -> int:
        return _pool["peak"]

    def free_bytes(self) -> int:
        return _pool["peak"] - _pool["used"]

    def free_all_blocks(self, stream=None) -> None:
        _pool["peak"] = _pool["used"]


_default_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _default_pool


class OutOfMemoryError(MemoryError):
    """Never raised (the emulation has no memory limit); here so that code catching CuPy's
    ``cupy.cuda.memory.OutOfMemoryError``, as benchmarks/attn.py does, runs unchanged."""


# --------------------------------------------------------------------------- arrays


class MemoryPointer:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int) -> None:
        self.ptr, self.device_id = ptr, 0


def _unwrap(x, allow_host: bool = False, reads: bool = True):
    """Raw NumPy arrays for an op, each a use of its data (unless not ``reads``: an op such as
    empty_like takes only the shape). A NumPy array among the operands is CuPy's TypeError
    (unless ``allow_host``: indices, which CuPy copies to the device itself)."""
    if isinstance(x, ndarray):
        if reads:
            _use(x._a)
        return x._a
    if isinstance(x, np.ndarray):
        if not allow_host:
            raise TypeError(f"Unsupported type {type(x)}")
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i, allow_host, reads) for i in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, allow_host, reads) for k, v in x.items()}
    return x


def _wrap(r):
    """An op's result as device arrays: new buffers are written on the current stream, and
    NumPy scalars become 0-d arrays, as CuPy's reductions return."""
    if isinstance(r, np.ndarray):
        record, new = _allocation(r)
        if new:
            _use(r, write=True)
        return ndarray._of(r)
    if isinstance(r, np.generic):
        return _wrap(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(i) for i in r)
    if isinstance(r, list):
        return [_wrap(i) for i in r]
    return r


def _device_op(f, writes_first: bool = False, reads: bool = True):
    """``f`` on device arrays: operands unwrapped and checked, results wrapped. ``out=`` and,
    with ``writes_first``, the first argument are written. (Made at every call of a method or
    of a NumPy function on device arrays, so without functools.wraps, which cost more than
    the op's checks.)"""
    def op(*args, **kwargs):
        out = kwargs.get("out")
        raw_args, raw_kwargs = _unwrap(args, reads=reads), _unwrap(kwargs, reads=reads)
        for target in ([args[0]] if writes_first and args else []) + list(out if isinstance(out, tuple) else [out]):
            if isinstance(target, ndarray):
                _use(target._a, write=True)
        return _wrap(f(*raw_args, **raw_kwargs))
    return op


def _host_sync() -> None:
    get_current_stream().synchronize()


_IN_PLACE_METHODS = {"fill", "sort", "put", "partition"}
# What NumPy's arrays have and CuPy's do not (tests/emulated/test_cupy_contract.py compares the
# two): refused, as CuPy refuses them, rather than lent from the NumPy array behind.
NUMPY_ONLY = frozenset({"ctypes", "getfield", "resize", "setfield", "setflags", "to_device"})


# The one live device array over each NumPy array that owns its memory, by id: an op that
# gives its input back (``astype`` to the same dtype, ``asarray``) gives the same object, and
# a view's ``base`` is that very object, as in CuPy (autograd tells a tensor's views by it).
_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class ndarray:
    """A CuPy array, emulated: NumPy storage in host memory behind CuPy's interface."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float) -> None:  # cupy.ndarray(shape, dtype): uninitialised
        self._a = np.empty(shape, dtype)
        _owners[id(self._a)] = self

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        """The device array whose storage is ``a`` (no copy)."""
        owns = isinstance(a, np.ndarray) and a.base is None
        if owns:
            obj = _owners.get(id(a))
            if obj is not None and obj._a is a:
                return obj
        obj = cls.__new__(cls)
        obj._a = a
        if owns:
            _owners[id(a)] = obj
        return obj

    @property
    def base(self) -> "ndarray | None":
        """The array that owns this view's memory (None for an owner): NumPy points a view's
        base at the owning array, never at an intermediate view, and so does CuPy."""
        root = self._a.base
        if root is None:
            return None
        return ndarray._of(root)

    # ---- what CuPy adds
    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._a.ctypes.data)

    @property
    def device(self) -> "Device":
        return Device(0)

    def get(self, stream=None, out=None):
        _use(self._a)
        _host_sync()
        if out is not None:
            out[...] = self._a
            return out
        return self._a.copy()

    def set(self, arr, stream=None) -> None:
        _use(self._a, write=True)
        self._a[...] = arr

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    # ---- NumPy's protocols, as CuPy implements them (np.exp(cupy_array) is a cupy array)
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _device_op(getattr(ufunc, method), writes_first=method == "at")(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return _device_op(func)(*args, **kwargs)

    # ---- plain attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: _wrap(self._a.T))

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    def __getattr__(self, name):  # the methods: astype, reshape, sum, max, view, copy, ...
        if name.startswith("__") or name in NUMPY_ONLY:  # __array_interface__ would let NumPy convert us
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        method = getattr(self._a, name)
        if not callable(method):
            return _wrap(method)
        op = _device_op(method)

        def call(*args, **kwargs):
            _use(self._a, write=name in _IN_PLACE_METHODS)
            return op(*args, **kwargs)
        return call

    # ---- values on the host (each one a synchronisation, as on a GPU)
    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())

    def __bool__(self):
        return bool(self.get())

    def __complex__(self):
        return complex(self.get())

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._a)))

    def __repr__(self):
        return repr(self._a)[:-1] + ", device='cuda (emulated)')"

    def __str__(self):
        return str(self._a)

    def __hash__(self):
        raise TypeError("unhashable type: 'cupy.ndarray'")

    def __reduce__(self):
        return (_array_from_host, (self.get(),))

    # ---- indexing: indices may be host arrays or lists (CuPy copies them to the device)
    def __getitem__(self, key):
        r = self._a[_unwrap(key, allow_host=True)]
        if not np.may_share_memory(r, self._a):  # a gather reads; a view reads nothing yet
            _use(self._a)
        return _wrap(r)

    def __setitem__(self, key, value):
        if not isinstance(value, ndarray) and np.ndim(value) != 0:  # CuPy's own refusal
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        raw_key, raw_value = _unwrap(key, allow_host=True), _unwrap(value)
        region = self._a[raw_key]  # a slice writes only its bytes; a scatter, say, anywhere
        _use(region if isinstance(region, np.ndarray) and np.may_share_memory(region, self._a)
             else self._a, write=True)
        self._a[raw_key] = raw_value


def _array_from_host(a):
    return _wrap(np.array(a))


def _binary(op):
    def method(self, other):
        return _device_op(op)(self, other)
    return method


def _reflected(op):
    def method(self, other):
        return _device_op(lambda a, b: op(b, a))(self, other)
    return method


def _in_place(op):
    def method(self, other):
        raw = _unwrap(other)
        _use(self._a, write=True)
        op(self._a, raw)
        return self
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lshift", "rshift"):
    _op = getattr(operator, _name + "_" if _name in ("and", "or") else _name)
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _reflected(_op))
    if _name != "matmul":  # CuPy has no in-place @=: Python then makes a new array, as here
        setattr(ndarray, f"__i{_name}__", _in_place(getattr(operator, f"i{_name}")))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", _binary(getattr(operator, _name)))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", (lambda op: lambda self: _device_op(op)(self))(getattr(operator, _name)))


# --------------------------------------------------------------------------- devices


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else int(device)
        if not 0 <= self.id < runtime.getDeviceCount():
            raise RuntimeError(f"cudaErrorInvalidDevice: emulated device {self.id} does not exist "
                               f"(there is {runtime.getDeviceCount()})")

    def use(self) -> None:
        """Make this the current device: there is only one (``runtime.getDeviceCount()``)."""

    def synchronize(self) -> None:
        for stream in list(_streams.values()):
            stream.synchronize()

    @property
    def attributes(self) -> dict:
        global _attributes_read
        _attributes_read = True
        return dict(_ATTRIBUTES)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id} (emulated)>"


class _Runtime(types.ModuleType):
    def getDeviceCount(self) -> int:
        return 1

    def getDeviceProperties(self, device: int) -> dict:
        Device(device)
        return {"name": DEVICE_NAME.encode(), "totalGlobalMem": 0,
                "multiProcessorCount": _ATTRIBUTES["MultiProcessorCount"],
                "sharedMemPerBlockOptin": _ATTRIBUTES["MaxSharedMemoryPerBlockOptin"],
                "major": _COMPUTE_CAPABILITY[0], "minor": _COMPUTE_CAPABILITY[1]}


runtime = _Runtime("cupy.cuda.runtime")


# --------------------------------------------------------------------------- random


class Philox4x3210:
    """Stands for cuRAND's Philox4x32-10 generator; draws NumPy's Philox stream."""

    def __init__(self, seed: int = 0) -> None:
        self._numpy = np.random.Philox(seed)


# The methods of CuPy's random.Generator, which the stand-in's lends from NumPy's (CuPy's lacks
# normal, choice, bit_generator and others that NumPy's has; the contract test compares the two).
GENERATOR_METHODS = frozenset({"beta", "binomial", "chisquare", "dirichlet", "exponential", "f", "gamma",
                               "geometric", "hypergeometric", "integers", "logseries", "poisson", "power", "random",
                               "standard_exponential", "standard_gamma", "standard_normal", "uniform"})


class Generator:
    def __init__(self, bit_generator) -> None:
        self._numpy = np.random.Generator(bit_generator._numpy)

    def __getattr__(self, name):
        if name not in GENERATOR_METHODS:
            raise AttributeError(f"'cupy.random.Generator' object has no attribute {name!r}")
        return _device_op(getattr(self._numpy, name))


# --------------------------------------------------------------------------- modules


def _creation(f):
    """asarray/array/ascontiguousarray: a host array is copied to the device."""
    @functools.wraps(f)
    def create(a, *args, **kwargs):
        if isinstance(a, ndarray):
            return _device_op(f)(a, *args, **kwargs)
        return _wrap(np.array(f(_unwrap(a, allow_host=True), *args, **kwargs), copy=True))
    return create


def asnumpy(a, stream=None, out=None):
    return a.get(out=out) if isinstance(a, ndarray) else np.asarray(a)


_WRITES_FIRST = {"copyto", "put", "place", "putmask", "fill_diagonal"}


class _ArrayModule(types.ModuleType):
    """A module whose missing names are NumPy's, taking and giving device arrays."""

    def __init__(self, name: str, numpy_module) -> None:
        super().__init__(name)
        self._numpy = numpy_module

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self._numpy, name)
        if isinstance(value, types.ModuleType):
            value = _ArrayModule(f"{self.__name__}.{name}", value)
        elif callable(value) and not isinstance(value, type):
            value = _device_op(value, writes_first=name in _WRITES_FIRST, reads=not name.endswith("_like"))
        setattr(self, name, value)  # resolved once
        return value


def _module(name: str, numpy_module=None, **attributes) -> types.ModuleType:
    module = _ArrayModule(name, numpy_module) if numpy_module is not None else types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__doc__ = f"{name}, emulated on the CPU (minitransformer.emulated.cupy)"
    return module


def _testing_function(f):
    return lambda *args, **kwargs: f(*(asnumpy(a) if isinstance(a, ndarray) else a for a in args), **kwargs)


def _scatter_add(a, slices, value) -> None:
    _device_op(np.add.at, writes_first=True)(a, slices, value)


def _build_modules(nccl_module) -> dict[str, types.ModuleType]:
    cuda = _module("cupy.cuda", Device=Device, Stream=Stream, Event=Event,
                   get_current_stream=get_current_stream, get_elapsed_time=get_elapsed_time,
                   is_available=lambda: True, runtime=runtime, nccl=nccl_module,
                   memory=_module("cupy.cuda.memory", OutOfMemoryError=OutOfMemoryError,
                                  MemoryPointer=MemoryPointer))
    random = _module("cupy.random", np.random.default_rng(), Generator=Generator,
                     Philox4x3210=Philox4x3210)
    random.randint = _device_op(lambda low, high=None, size=None, dtype=int:
                                random._numpy.integers(low, high, size, dtype))
    testing = _module("cupy.testing", **{name: _testing_function(getattr(np.testing, name))
                                         for name in ("assert_array_equal", "assert_allclose",
                                                      "assert_array_almost_equal")})
    cupy = _module("cupy", np, ndarray=ndarray, cuda=cuda, random=random, testing=testing,
                   asnumpy=asnumpy, asarray=_creation(np.asarray), array=_creation(np.array),
                   ascontiguousarray=_creation(np.ascontiguousarray),
                   get_default_memory_pool=get_default_memory_pool,
                   EMULATED=True, __version__="14.0.0+emulated")
    cupyx = _module("cupyx", scatter_add=_scatter_add)
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime,
            "cupy.cuda.memory": cuda.memory, "cupy.cuda.nccl": nccl_module,
            "cupy.random": random, "cupy.testing": testing, "cupyx": cupyx}


# The bindings of csrc/bindings.cpp take their arrays as raw addresses, first in their argument
# lists, and the stream last: how many addresses lead each, and which of them it writes.
_KERNEL_ARRAYS = {
    "attention_forward": (6, {3, 4}),  # q k v | o lse | kv_lens
    "attention_backward": (12, {7, 8, 9, 10, 11}),  # q k v o dout lse kv_lens | dq dk dv dq_accum delta
    "layernorm_forward": (6, {3, 4, 5}),  # x w b | y mean rstd
    "layernorm_backward": (9, {5, 6, 7, 8}),  # x w mean rstd grad | dx dw db partial
    "softmax_forward": (3, {2}),  # x mask | y
    "softmax_backward": (3, {2}),  # y grad | dx
    "cross_entropy_forward": (5, {2, 3, 4}),  # logits target | loss nll grad (may be the logits)
}


def _use_address(address: int, stream: Stream, write: bool) -> None:
    """A kernel's use of the array at ``address``: the rest of its allocation from there."""
    data, start = _bytes_at(address)
    _use(data[start:], write, stream)


class _OrderedKernels(types.ModuleType):
    """The emulated ``_C``, whose launches are uses of their arrays on the launch's stream:
    each array must be ordered after its last write on another stream, and the outputs are
    written on this one."""

    def __init__(self, kernels) -> None:
        super().__init__("minitransformer.kernels._C")
        self._kernels = kernels

    def __getattr__(self, name):
        value = getattr(self._kernels, name)
        if name not in _KERNEL_ARRAYS:
            return value
        count, outputs = _KERNEL_ARRAYS[name]

        @functools.wraps(value)
        def launch(*args, **kwargs):
            result = value(*args, **kwargs)  # first: a call the binding refuses uses nothing
            stream = stream_from_ptr(args[-1])
            for address in args[:count]:
                if address:
                    _use_address(address, stream, write=False)
            for i in outputs:
                if args[i]:
                    _use_address(args[i], stream, write=True)
            return result
        return launch


_installed: types.ModuleType | None = None


def install(nccl_module: types.ModuleType) -> types.ModuleType:
    """Register the stand-in as ``cupy`` (with ``nccl_module``, emulated/nccl.py, as
    ``cupy.cuda.nccl``: it builds on this module, so it is handed in rather than imported) and
    the emulated kernels as ``minitransformer.kernels._C``; returns the ``cupy`` module. Idempotent. Builds csrc/ for the CPU the first time (about a
    minute on two cores; cached in the temp directory). Where it cannot be built (no g++, CUDA
    headers or pybind11), "cuda" runs on the composite ops, as CuPy without the extension
    does, unless MT_REQUIRE_EMULATOR=1 makes that an error."""
    global _installed
    if _installed is not None:
        return _installed
    from . import emulator

    reason = emulator.unavailable_reason()
    if reason is None:
        sys.modules["minitransformer.kernels._C"] = _OrderedKernels(emulator.build())
        print(BANNER, file=sys.stderr)
    elif settings.env_flag("MT_REQUIRE_EMULATOR"):
        raise RuntimeError(f"MT_EMULATE_CUDA=1 and MT_REQUIRE_EMULATOR=1, but the emulated "
                           f"kernels cannot be built: {reason}")
    else:
        sys.modules["minitransformer.kernels._C"] = None  # never the real build, which needs a GPU
        print(f"{BANNER}; without kernels: {reason}", file=sys.stderr)
    modules = _build_modules(nccl_module)
    sys.modules.update(modules)
    _installed = modules["cupy"]
    return _installed
