"""Array backends: NumPy on the CPU, CuPy on NVIDIA GPUs.

Everything above this module manipulates arrays through the module returned by
``get_array_module`` (``xp`` by convention), so one implementation of each op serves
both devices, the way chainer's functions do. A device is named by a string:

    "cpu"   NumPy arrays in host memory (always available; the reference backend)
    "cuda"  CuPy arrays on the current CUDA device (needs CuPy and a GPU)

CuPy is optional. Importing this module never fails for lack of CuPy, a driver or a GPU;
asking for "cuda" without them raises a ``RuntimeError`` that says what is missing. With
``MT_EMULATE_CUDA=1``, "cuda" is emulated on the CPU instead (minitransformer.emulated.cupy:
a CuPy stand-in over NumPy, and csrc/ compiled for the CPU): for tests and for readers.

Floating-point dtypes: float32 (the default), float64 (gradient checks), and the two 16-bit
formats of mixed-precision training, float16 and bfloat16. NumPy has no bfloat16 of its own;
``ml_dtypes.bfloat16`` supplies it (to NumPy, and to CuPy 14), so ``bfloat16`` here is None when
ml_dtypes is not installed. ``is_floating`` is the test to use: NumPy files bfloat16 under
kind 'V', not 'f'.

The module also owns the random number generators (one per device), so that
``manual_seed`` makes weight init and dropout reproducible on both backends.
"""

from __future__ import annotations

import math
import numbers
import os

import numpy as np

from . import settings

try:
    _emulate, _refused = settings.env_flag("MT_EMULATE_CUDA"), None
except settings.SettingsError as e:  # no device "cuda" then: has_cuda() refuses it, as every program's parser does
    _emulate, _refused = None, e
if _emulate:
    # "cuda" emulated on the CPU, for the tests and for reading the GPU path without a GPU
    # (minitransformer/emulated/); never imported otherwise.
    from .emulated import cupy as _emulated_cupy
    from .emulated import nccl as _emulated_nccl

    _cupy = _emulated_cupy.install(_emulated_nccl)
elif _refused is not None:
    _cupy = None
else:
    try:  # CuPy is an optional extra: pip install minitransformer[cuda]
        import cupy as _cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        _cupy = None

try:  # bfloat16 for NumPy and CuPy (installed with JAX, and by the [dev] and [cuda] extras)
    import ml_dtypes as _ml_dtypes

    bfloat16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:
    bfloat16 = None

DEVICES = ("cpu", "cuda")


def has_cupy() -> bool:
    """True when CuPy can be imported (a GPU may still be absent)."""
    return _cupy is not None


def has_cuda() -> bool:
    """True when CuPy is installed and at least one CUDA device is usable. A value of
    MT_EMULATE_CUDA that is neither on nor off is refused here (SettingsError)."""
    if _refused is not None:
        raise _refused
    if _cupy is None:
        return False
    try:
        return bool(_cupy.cuda.is_available())
    except Exception:
        return False


def is_emulated(device: str) -> bool:
    """True when ``device`` is "cuda" emulated on the CPU (MT_EMULATE_CUDA=1)."""
    return device == "cuda" and getattr(_cupy, "EMULATED", False)


class DeviceUnavailable(RuntimeError):
    """The device asked for cannot be used here (no CuPy, no GPU): an ordinary failure, which
    the programs tell in one line (cli.run)."""


def check_device(device: str) -> str:
    """Validate a device name and return it; "cuda" also checks that a GPU is usable."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device == "cuda" and not has_cuda():
        if _cupy is None:
            raise DeviceUnavailable(
                "device 'cuda' needs CuPy, which is not installed "
                "(pip install 'minitransformer[cuda]')"
            )
        raise DeviceUnavailable("device 'cuda' requested, but CuPy finds no usable CUDA device")
    return device


def get_array_module(device: str):
    """The array module for a device: numpy for "cpu", cupy for "cuda"."""
    if device == "cpu":
        return np
    check_device(device)
    return _cupy


def resolve_dtype(dtype) -> np.dtype:
    """``np.dtype(dtype)``, also for the name "bfloat16", which needs ml_dtypes."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        if bfloat16 is None:
            raise TypeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return bfloat16
    return np.dtype(dtype)


def is_floating(dtype) -> bool:
    """True for float16/32/64 and bfloat16."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (bfloat16 is not None and dtype == bfloat16)


def is_low_precision(dtype) -> bool:
    """True for the 16-bit floating formats, which composite ops compute in float32."""
    return is_floating(dtype) and np.dtype(dtype).itemsize == 2


def compute_dtype(dtype) -> np.dtype:
    """The dtype to accumulate sums of ``dtype`` in: float32 for 16-bit formats, else itself."""
    return np.dtype(np.float32) if is_low_precision(dtype) else np.dtype(dtype)


def upcast(*arrays) -> tuple:
    """The arrays in their ``compute_dtype`` (float32 copies of 16-bit ones; None passes)."""
    return tuple(None if a is None else a.astype(compute_dtype(a.dtype), copy=False) for a in arrays)


def device_of(array) -> str:
    """The device an array lives on."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return "cpu"
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return "cuda"
    raise TypeError(f"expected a NumPy or CuPy array, got {type(array).__name__}")


def array_module_of(array):
    """numpy or cupy, whichever owns ``array``."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy
    return np


def to_device(array, device: str):
    """Copy ``array`` to ``device`` (no copy when it is already there)."""
    check_device(device)
    if device_of(array) == device:
        return array
    if device == "cuda":
        return _cupy.asarray(array)
    return _cupy.asnumpy(array)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads() -> int:
    """The threads CPU work may use: ``OMP_NUM_THREADS`` when set (NumPy's BLAS reads it too),
    else ``cpu_cores()``."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return cpu_cores()


_pool = None  # (threads, ThreadPoolExecutor) of row_blocks, started on first use


def row_blocks(fn, rows: int, array, min_rows: int = 1) -> list:
    """``[fn(start, stop), ...]`` over contiguous blocks of ``range(rows)``, one block per CPU
    thread (``cpu_threads``) but none of fewer than ``min_rows`` rows, run at once; a single
    ``fn(0, rows)`` for a GPU array.

    NumPy's BLAS spreads a matrix product over the cores, but its elementwise passes and
    reductions run on one. They release Python's GIL inside their loops, so a pass over the
    rows of a large array (the vocabulary's log-softmax in beam search) split into blocks on
    threads runs on as many cores as the products do. Handing a block to a thread and back
    costs some 60 µs (measured here), which a small block does not earn back: ``min_rows``
    says how small. ``fn`` must write only its own rows."""
    global _pool
    threads = max(1, min(cpu_threads(), rows // max(1, min_rows))) if array_module_of(array) is np else 1
    if threads <= 1:
        return [fn(0, rows)]
    if _pool is None or _pool[0] < threads - 1:
        from concurrent.futures import ThreadPoolExecutor

        _pool = (threads - 1, ThreadPoolExecutor(threads - 1, thread_name_prefix="row_blocks"))
    bounds = [rows * i // threads for i in range(threads + 1)]
    futures = [_pool[1].submit(fn, start, stop) for start, stop in zip(bounds[1:-1], bounds[2:])]
    first = fn(bounds[0], bounds[1])  # this thread takes the first block
    return [first, *(f.result() for f in futures)]


def index_add(target, index, values) -> None:
    """``target[index] += values`` where repeated indices accumulate (unlike ``+=``)."""
    if array_module_of(target) is np:
        np.add.at(target, index, values)
    else:
        import cupyx  # ships with CuPy

        cupyx.scatter_add(target, index, values)


def check_ids(ids, n: int, what: str, live=None) -> None:
    """Raise an IndexError naming the first id outside ``[0, n)`` (among ``live`` ones, if given).

    NumPy would read a negative id from the end of a table, silently, and a kernel would read
    out of bounds. One reduction, so one device-to-host sync on a GPU, per call.
    """
    if not ids.size:
        return
    bad = (ids < 0) | (ids >= n)
    if live is not None:
        bad &= live
    if bool(bad.any()):
        i = int(bad.reshape(-1).argmax())
        where = tuple(int(j) for j in np.unravel_index(i, ids.shape))
        raise IndexError(f"{what} {int(ids.reshape(-1)[i])} at position {where} of {ids.shape} "
                         f"is outside [0, {n})")


# --------------------------------------------------------------------------- random state


class _RNG:
    """One ``Generator`` per device, all derived from one seed.

    NumPy's PCG64 generator and CuPy's (cuRAND Philox4x32-10) are seeded from the same integer,
    so ``manual_seed(0)`` pins both. Generators are created lazily: a CPU-only program never
    touches CuPy.
    """

    def __init__(self) -> None:
        self.seed(int(np.random.SeedSequence().entropy % (2**63)))

    def seed(self, seed: int) -> None:
        self._seed = int(seed)
        self._generators: dict[str, object] = {}

    def generator(self, device: str):
        gen = self._generators.get(device)
        if gen is None:
            if device == "cpu":
                gen = np.random.default_rng(self._seed)
            else:
                # cuRAND's counter-based Philox rather than CuPy's default XORWOW: seeding it
                # costs no skip-ahead per GPU thread, and training reseeds once a step.
                cupy_random = get_array_module(device).random
                gen = cupy_random.Generator(cupy_random.Philox4x3210(self._seed))
            self._generators[device] = gen
        return gen

    def get_state(self) -> dict:
        """The CPU generator's full state, for checkpoints."""
        return {"seed": self._seed, "cpu": self.generator("cpu").bit_generator.state}

    def set_state(self, state: dict) -> None:
        self.seed(state["seed"])
        self.generator("cpu").bit_generator.state = state["cpu"]


_rng = _RNG()


def manual_seed(seed: int) -> None:
    """Seed the generators of every device (weight init, ``randn``, dropout masks) with an
    integer in [0, 2^64), what both NumPy's and cuRAND's take: refused here, not at the first
    draw."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"manual_seed: seed must be an integer in [0, 2**64), got {seed!r}")
    _rng.seed(seed)


def generator(device: str):
    """The random ``Generator`` for ``device`` (NumPy's PCG64, or CuPy's on cuRAND Philox)."""
    return _rng.generator(device)


def dropout_mask(device: str, shape: tuple, p: float):
    """``(keep, scale)`` for inverted dropout: booleans, True with probability about 1 - p, and
    the factor that kept elements are multiplied by, the inverse of the keep probability used.

    On the CPU each element takes 16 random bits (a quarter of one 64-bit draw of the
    generator) and is dropped when they fall below round(p * 2^16): no float conversion, a
    quarter of the bits of a float32 draw. The drop probability used is that count / 2^16
    (within 2^-17 of p; at most 1 - 2^-16, and 0 for p < 2^-17), and ``scale`` is the inverse
    of its keep probability, so that ``x * keep * scale`` has expectation x (up to the rounding
    of ``scale`` to x's dtype). On CuPy, float32 draws are compared with p.
    """
    gen = generator(device)
    if device == "cpu":
        dropped = min(round(p * 2**16), 2**16 - 1)  # p near 1 still keeps some
        size = math.prod(shape)
        bits = gen.bit_generator.random_raw((size + 3) // 4).view(np.uint16)[:size]
        return (bits >= dropped).reshape(shape), 2**16 / (2**16 - dropped)
    return gen.random(shape, dtype=np.float32) >= p, 1.0 / (1.0 - p)  # float32 or float64 only


def get_rng_state() -> dict:
    return _rng.get_state()


def set_rng_state(state: dict) -> None:
    _rng.set_state(state)
