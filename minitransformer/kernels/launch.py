"""Launch wrappers: CuPy arrays in, CuPy arrays out, one call into ``minitransformer.kernels._C`` each.

Each wrapper checks its arrays (CuPy, on the current device, dtypes, shapes), makes them
contiguous and 16-byte aligned (copying a strided view, e.g. a transposed q, when it has to),
allocates the outputs, and passes raw device pointers (``a.data.ptr``) and CuPy's current stream
(``cupy.cuda.get_current_stream().ptr``) to the binding, which checks sizes again and turns CUDA
errors into RuntimeErrors. All launches are asynchronous on that stream, like CuPy's own.

Shared memory. A block may use at most the device's cudaDevAttrMaxSharedMemoryPerBlockOptin
bytes of shared memory, and GPUs that run the same build differ: 163 KiB on an A100 (sm_80),
99 KiB on RTX 30/40, A10, L4 and L40 (sm_86, sm_89), 227 KiB on an H100 (sm_90). The attention
and layernorm_backward wrappers pass that limit to the binding, whose launcher takes the largest
variant of its kernel that fits (csrc/launch_config.cuh) or raises ``_C.SharedMemoryLimitError``
before launching anything. ``attention_refusal`` tells ``functional`` beforehand, so that it
can use the composite op instead.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np

from .. import backend
from .extension import _C, enabled, limits, unavailable_reason

_FLOAT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
_loss_inplace = False


# --------------------------------------------------------------------------- dtypes


def dtype_code(dtype) -> int | None:
    """The kernels' dtype code (0 float32, 1 float16, 2 bfloat16) or None if unsupported.
    uint16 means raw bfloat16 bits (see the package docstring)."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return 2
    return _FLOAT_CODES.get(dtype.name)


def to_bfloat16_bits(x):
    """float32 array (NumPy or CuPy) -> uint16 array of bfloat16 bits, rounded to nearest even."""
    xp = backend.array_module_of(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + ((u >> 16) & 1) + 0x7FFF) >> 16
    return xp.where(xp.isnan(x), 0x7FC0, rounded).astype(xp.uint16)


def from_bfloat16_bits(bits):
    """uint16 array of bfloat16 bits -> float32 array (exact)."""
    xp = backend.array_module_of(bits)
    return (xp.ascontiguousarray(bits).astype(xp.uint32) << 16).view(xp.float32)


def enabled_for(*arrays) -> bool:
    """True when the kernels are enabled and every given array (None is skipped) is a CuPy
    array, all of one dtype among float32, float16 and bfloat16."""
    if not enabled():
        return False
    cupy = backend._cupy
    dtype = None
    for a in arrays:
        if a is None:
            continue
        if not isinstance(a, cupy.ndarray) or _FLOAT_CODES.get(a.dtype.name) is None:
            return False
        if dtype is not None and a.dtype != dtype:
            return False
        dtype = a.dtype
    return True


def set_loss_overwrites_logits(flag: bool) -> None:
    """Let the fused cross-entropy write its gradient over the logits array (saving one
    logits-sized buffer, the largest of a step at a 37k vocabulary). Only safe when nothing
    reads the logits after the loss (e.g. no accuracy computed from them); off by default."""
    global _loss_inplace
    _loss_inplace = bool(flag)


def loss_overwrites_logits() -> bool:
    return _loss_inplace


def new_seed() -> int:
    """A 63-bit seed for in-kernel dropout. Drawn on the host, from the "cpu" generator
    (``manual_seed`` makes it reproducible): a draw from CuPy's would wait for the GPU."""
    return int(backend.generator("cpu").integers(0, 2**63))


# --------------------------------------------------------------------------- checks


def _ready(fn: str):
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"{fn}: the CUDA kernels are unavailable: {reason}")
    return backend._cupy


def _device_array(cupy, a, fn: str, name: str):
    """``a`` as a C-contiguous, 16-byte aligned CuPy array on the current device."""
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{fn}: {name} must be a CuPy array, got {type(a).__name__}")
    if a.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{fn}: {name} is on GPU {a.device.id}, the current device is "
                         f"{cupy.cuda.Device().id}")
    if not a.flags.c_contiguous or a.data.ptr % 16:
        a = a.copy()  # a fresh C-contiguous allocation, 256-byte aligned
    return a


def _float_code(fn: str, **arrays) -> int:
    codes = {name: dtype_code(a.dtype) for name, a in arrays.items() if a is not None}
    for name, code in codes.items():
        if code is None:
            raise TypeError(f"{fn}: {name} has dtype {arrays[name].dtype}; the kernels take "
                            f"float32, float16 or bfloat16 (as bfloat16 or uint16 bits)")
    dtypes = {name: str(a.dtype) for name, a in arrays.items() if a is not None}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{fn}: arrays must share one dtype, got {dtypes}")
    return next(iter(codes.values()))


def _stream(cupy) -> int:
    return cupy.cuda.get_current_stream().ptr


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


@functools.cache
def _device_attribute(device_id: int, name: str) -> int:
    return int(backend._cupy.cuda.Device(device_id).attributes[name])


def device_attribute(name: str) -> int:
    """An attribute of the current device, read once per device: CuPy's ``Device.attributes``
    asks the driver for every attribute."""
    return _device_attribute(backend._cupy.cuda.Device().id, name)


def shared_memory_limit() -> int:
    """Bytes of shared memory one block may use on the current device (see the module doc)."""
    return device_attribute("MaxSharedMemoryPerBlockOptin")


# --------------------------------------------------------------------------- attention


def _attention_shape_problem(q, k, v, kernels: str = "fused") -> str | None:
    """What the attention ``kernels`` ("fused", "tiled" or "naive") cannot take about these
    shapes (csrc/limits.cuh; the naive kernels take any head dim and batch), or None."""
    if q.ndim != 4:
        return f"q must have shape (B, H, T, D), got {q.shape}"
    B, H, T, D = q.shape
    if k.ndim != 4 or k.shape[:2] != (B, H) or k.shape[3] != D or v.shape != k.shape:
        return f"k {k.shape} and v {v.shape} must both be (B, H, S, D) = ({B}, {H}, S, {D}) for q {q.shape}"
    if 0 in q.shape or 0 in k.shape:
        return f"q {q.shape} or k {k.shape} is empty"
    if kernels == "naive":
        return None
    lim = limits()
    if kernels == "fused" and D not in lim["attention_head_dims"]:
        return f"head dim {D} is not one the kernels are compiled for {lim['attention_head_dims']}"
    if kernels == "tiled" and D > lim["attention_tiled_max_d"]:
        return f"head dim {D} is past the tiled kernel's {lim['attention_tiled_max_d']}"
    if B * H > lim["max_grid_y"]:
        return f"B * H = {B * H} exceeds {lim['max_grid_y']} (the blocks along the grid's y axis)"
    return None


@functools.cache
def _shared_memory_refusal(code: int, D: int, smem_limit: int) -> str | None:
    """Why no tile configuration of the forward or backward kernel for (dtype code, D) fits
    smem_limit bytes of shared memory per block, or None. Warns the first time (per dtype, D and
    limit, since the answer is cached): the composite op then runs, slower and in T x S memory."""
    for launcher in ("attention_forward", "attention_backward"):
        if _C.launch_config(launcher, code, D, smem_limit) is None:
            smallest = _C.launch_configs(launcher, code, D)[-1]
            reason = (f"{smallest['kernel']} needs {smallest['smem']} bytes of shared memory per "
                      f"block, the device allows {smem_limit}")
            warnings.warn(f"fused attention: {reason}; scaled_dot_product_attention uses the "
                          f"composite op instead", stacklevel=3)
            return reason
    return None


def attention_refusal(q, k, v) -> str | None:
    """Why the fused attention kernels, forward and backward, cannot take the arrays q
    (B, H, T, D) and k, v (B, H, S, D) on the current device; None when they can. This is
    the dispatch decision of ``functional.scaled_dot_product_attention`` (which also needs a mask
    the kernels can express). A refusal for lack of shared memory warns once (see
    ``_shared_memory_refusal``); the others are the ordinary cases of the composite op."""
    if not enabled():
        return unavailable_reason() or "the kernels are switched off (MINITRANSFORMER_KERNELS=0)"
    if not enabled_for(q, k, v):
        return "q, k and v must be CuPy arrays of one dtype: float32, float16 or bfloat16"
    problem = _attention_shape_problem(q, k, v)
    if problem is not None:
        return problem
    return _shared_memory_refusal(dtype_code(q.dtype), q.shape[3], shared_memory_limit())


def _smem_limit(asked: int | None) -> int:
    """The shared memory per block a launch plans for: the device's, or less where asked."""
    limit = shared_memory_limit()
    if asked is None:
        return limit
    if not 0 < asked <= limit:
        raise ValueError(f"smem_limit {asked} is not in (0, {limit}], the device's shared memory per block")
    return int(asked)


def _attention_inputs(cupy, fn, q, k, v, kv_lens, kernels: str = "fused"):
    q, k, v = (_device_array(cupy, a, fn, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    code = _float_code(fn, q=q, k=k, v=v)
    problem = _attention_shape_problem(q, k, v, kernels)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    B, H, T, D = q.shape
    S = k.shape[2]
    lens = None
    if kv_lens is not None:
        lens = cupy.ascontiguousarray(cupy.asarray(kv_lens), dtype=cupy.int32)
        if lens.shape != (B,):
            raise ValueError(f"{fn}: kv_lens must have shape ({B},), got {lens.shape}")
    return q, k, v, lens, code, (B, H, T, S, D)


def attention_forward(q, k, v, kv_lens=None, causal: bool = False, scale: float | None = None,
                      dropout_p: float = 0.0, seed: int = 0, smem_limit: int | None = None):
    """Fused attention. q (B, H, T, D), k and v (B, H, S, D), kv_lens (B,) ints or None.
    Raises ``_C.SharedMemoryLimitError`` where ``attention_refusal`` gives a shared-memory reason.
    ``smem_limit``: the shared memory per block to choose the tiles for (default: the device's);
    a smaller one takes the tiles a smaller GPU runs, so that one GPU can test every tiling.

    Returns ``(o, lse)``: o like q, lse (B, H, T) float32 (-inf for a query that sees no key).
    See csrc/attention.cu and reference.attention_forward for the algorithm.
    """
    fn = "attention_forward"
    cupy = _ready(fn)
    q, k, v, lens, code, (B, H, T, S, D) = _attention_inputs(cupy, fn, q, k, v, kv_lens)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = cupy.empty_like(q)
    lse = cupy.empty((B, H, T), dtype=cupy.float32)
    _C.attention_forward(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, _ptr(lens),
                         code, B, H, T, S, D, scale, bool(causal), float(dropout_p),
                         int(seed) % 2**64, _smem_limit(smem_limit), _stream(cupy))
    return o, lse


def attention_backward(q, k, v, o, lse, dout, kv_lens=None, causal: bool = False,
                       scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                       smem_limit: int | None = None):
    """Gradients (dq, dk, dv) of the fused attention, recomputing P from lse; the same
    kv_lens, causal, scale, dropout_p and seed as the forward call (``smem_limit`` as there)."""
    fn = "attention_backward"
    cupy = _ready(fn)
    q, k, v, lens, code, (B, H, T, S, D) = _attention_inputs(cupy, fn, q, k, v, kv_lens)
    o, dout = _device_array(cupy, o, fn, "o"), _device_array(cupy, dout, fn, "dout")
    lse = _device_array(cupy, lse, fn, "lse")
    _float_code(fn, q=q, o=o, dout=dout)
    if o.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"{fn}: o {o.shape} and dout {dout.shape} must match q {q.shape}")
    if lse.shape != (B, H, T) or lse.dtype != cupy.float32:
        raise ValueError(f"{fn}: lse must be float32 of shape {(B, H, T)}, got {lse.dtype} {lse.shape}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    dq_accum = cupy.empty((B, H, T, D), dtype=cupy.float32)
    delta = cupy.empty((B, H, T), dtype=cupy.float32)
    _C.attention_backward(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, dout.data.ptr,
                          lse.data.ptr, _ptr(lens), dq.data.ptr, dk.data.ptr, dv.data.ptr,
                          dq_accum.data.ptr, delta.data.ptr, code, B, H, T, S, D, scale,
                          bool(causal), float(dropout_p), int(seed) % 2**64,
                          _smem_limit(smem_limit), _stream(cupy))
    return dq, dk, dv


def attention_naive_forward(q, k, v, kv_lens=None, causal: bool = False, scale: float | None = None):
    """The naive attention kernels (csrc/attention_naive.cu): scores, softmax and P V as three
    launches through the (B, H, T, S) float32 matrix P in device memory, which this allocates.
    Arguments as ``attention_forward``'s, any head dim; forward only, no dropout. Returns o
    like q. The ladder's rung below the fused kernel, for benchmarks/attn.py and the reading;
    ``functional`` dispatches to the fused kernel only."""
    fn = "attention_naive_forward"
    cupy = _ready(fn)
    q, k, v, lens, code, (B, H, T, S, D) = _attention_inputs(cupy, fn, q, k, v, kv_lens, "naive")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = cupy.empty_like(q)
    p = cupy.empty((B, H, T, S), dtype=cupy.float32)
    _C.attention_naive_forward(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, p.data.ptr, _ptr(lens),
                               code, B, H, T, S, D, scale, bool(causal), _stream(cupy))
    return o


def attention_tiled_forward(q, k, v, kv_lens=None, causal: bool = False, scale: float | None = None):
    """The tiled attention kernel (csrc/attention_tiled.cu): scores a tile at a time in shared
    memory, a pass for each row's maximum and a second for the softmax and P V, so no (T, S)
    array in device memory but the scores computed twice. Arguments as ``attention_forward``'s,
    head dims up to ``limits()["attention_tiled_max_d"]``; forward only, no dropout. Returns o
    like q. The ladder's rung between the naive and the fused kernels, for benchmarks/attn.py
    and the reading; ``functional`` dispatches to the fused kernel only."""
    fn = "attention_tiled_forward"
    cupy = _ready(fn)
    q, k, v, lens, code, (B, H, T, S, D) = _attention_inputs(cupy, fn, q, k, v, kv_lens, "tiled")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = cupy.empty_like(q)
    _C.attention_tiled_forward(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, _ptr(lens), code, B, H, T, S, D,
                               scale, bool(causal), _stream(cupy))
    return o


def key_lengths_from_mask(mask, batch: int, keys: int):
    """Per-sequence key lengths (B,) int32 if ``mask`` (a NumPy or CuPy array) is a boolean
    key-padding mask of shape (B or 1, 1, 1, S) whose True entries are a prefix of every row;
    None otherwise (then the fused kernel cannot express it). The lengths are on the mask's
    device; the prefix check costs one device-to-host sync for a CuPy mask."""
    if (getattr(mask, "dtype", None) != bool or mask.ndim != 4 or mask.shape[1:3] != (1, 1)
            or mask.shape[0] not in (1, batch) or mask.shape[3] != keys):
        return None
    xp = backend.array_module_of(mask)
    rows = mask.reshape(mask.shape[0], keys)
    lens = rows.sum(axis=1, dtype=xp.int32)
    if not bool((rows == (xp.arange(keys)[None, :] < lens[:, None])).all()):
        return None
    return xp.ascontiguousarray(xp.broadcast_to(lens, (batch,)))


# --------------------------------------------------------------------------- layernorm


def layernorm_refusal(x, weight=None, bias=None) -> str | None:
    """Why the layernorm kernels, forward and backward, cannot take x (..., D) with weight and
    bias (D,) or None on the current device (the composite op then runs); None when they can."""
    if not enabled():
        return unavailable_reason() or "the kernels are switched off (MINITRANSFORMER_KERNELS=0)"
    if not enabled_for(x, weight, bias):
        return "x, weight and bias must be CuPy arrays of one dtype: float32, float16 or bfloat16"
    if x.size == 0:
        return f"x {x.shape} is empty"
    if x.shape[-1] > limits()["layernorm_max_d"]:
        return f"rows of {x.shape[-1]} exceed {limits()['layernorm_max_d']}, the widest layernorm_backward takes"
    return None


def layernorm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last axis. Returns (y like x, mean (N,), rstd (N,)), N = x.size / D."""
    fn = "layernorm_forward"
    cupy = _ready(fn)
    x = _device_array(cupy, x, fn, "x")
    weight = None if weight is None else _device_array(cupy, weight, fn, "weight")
    bias = None if bias is None else _device_array(cupy, bias, fn, "bias")
    code = _float_code(fn, x=x, weight=weight, bias=bias)
    D = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (D,):
            raise ValueError(f"{fn}: {name} of shape {p.shape} does not match the last axis of x {x.shape}")
    N = x.size // D
    y = cupy.empty_like(x)
    mean = cupy.empty(N, dtype=cupy.float32)
    rstd = cupy.empty(N, dtype=cupy.float32)
    _C.layernorm_forward(x.data.ptr, _ptr(weight), _ptr(bias), y.data.ptr, mean.data.ptr,
                         rstd.data.ptr, code, N, D, float(eps), _stream(cupy))
    return y, mean, rstd


def layernorm_backward(x, weight, mean, rstd, grad, weight_grad: bool = True, bias_grad: bool = True):
    """Returns (dx, dweight or None, dbias or None) from the saved mean and rstd."""
    fn = "layernorm_backward"
    cupy = _ready(fn)
    x, grad = _device_array(cupy, x, fn, "x"), _device_array(cupy, grad, fn, "grad")
    weight = None if weight is None else _device_array(cupy, weight, fn, "weight")
    code = _float_code(fn, x=x, grad=grad, weight=weight)
    D = x.shape[-1]
    N = x.size // D
    if grad.shape != x.shape or mean.shape != (N,) or rstd.shape != (N,):
        raise ValueError(f"{fn}: grad {grad.shape}, mean {mean.shape}, rstd {rstd.shape} do not "
                         f"match x {x.shape} (expected grad {x.shape}, mean and rstd ({N},))")
    mean = _device_array(cupy, mean, fn, "mean")
    rstd = _device_array(cupy, rstd, fn, "rstd")
    # Enough blocks to fill the GPU a few times over; each writes one partial row of dw, db.
    sms = device_attribute("MultiProcessorCount")
    blocks = max(1, min(-(-N // 4), 4 * sms))
    partial = cupy.empty((blocks, 2, D), dtype=cupy.float32)
    dx = cupy.empty_like(x)
    dw = cupy.empty(D, dtype=x.dtype) if weight_grad else None
    db = cupy.empty(D, dtype=x.dtype) if bias_grad else None
    _C.layernorm_backward(x.data.ptr, _ptr(weight), mean.data.ptr, rstd.data.ptr, grad.data.ptr,
                          dx.data.ptr, _ptr(dw), _ptr(db), partial.data.ptr, blocks, code, N, D,
                          shared_memory_limit(), _stream(cupy))
    return dx, dw, db


# --------------------------------------------------------------------------- softmax, loss


def softmax_forward(x, mask=None, scale: float = 1.0):
    """softmax(scale * x) over the last axis, only over entries where ``mask`` (bool, shape
    broadcastable to x) is True; a fully masked row gives zeros."""
    fn = "softmax_forward"
    cupy = _ready(fn)
    x = _device_array(cupy, x, fn, "x")
    code = _float_code(fn, x=x)
    if mask is not None:
        if mask.dtype != bool:
            raise TypeError(f"{fn}: mask must be boolean, got {mask.dtype}")
        try:
            mask = cupy.ascontiguousarray(cupy.broadcast_to(mask, x.shape)).view(cupy.uint8)
        except ValueError:
            raise ValueError(f"{fn}: mask of shape {mask.shape} does not broadcast to x {x.shape}") from None
    V = x.shape[-1]
    y = cupy.empty_like(x)
    _C.softmax_forward(x.data.ptr, _ptr(mask), y.data.ptr, code, x.size // V, V, float(scale),
                       _stream(cupy))
    return y


def softmax_backward(y, grad, scale: float = 1.0):
    """dx = scale * y * (grad - sum(grad * y)) over the last axis."""
    fn = "softmax_backward"
    cupy = _ready(fn)
    y, grad = _device_array(cupy, y, fn, "y"), _device_array(cupy, grad, fn, "grad")
    code = _float_code(fn, y=y, grad=grad)
    if grad.shape != y.shape:
        raise ValueError(f"{fn}: grad {grad.shape} does not match y {y.shape}")
    V = y.shape[-1]
    dx = cupy.empty_like(y)
    _C.softmax_backward(y.data.ptr, grad.data.ptr, dx.data.ptr, code, y.size // V, V,
                        float(scale), _stream(cupy))
    return dx


def cross_entropy_forward(logits, target, label_smoothing: float = 0.0, ignore_index=None,
                          grad: str = "new", nll: bool = False):
    """Per-position label-smoothed cross-entropy of (..., V) logits, fused with its gradient.

    ``grad``: "new" writes d loss_row / d logits into a new array, "inplace" over ``logits``
    itself (then ``logits`` is destroyed), "none" computes only the loss.
    Returns (loss float32 of shape logits.shape[:-1], gradient like logits or None), and with
    ``nll`` a third array like the loss: the unsmoothed NLL, from the same read of the logits.
    """
    fn = "cross_entropy_forward"
    cupy = _ready(fn)
    if grad not in ("new", "inplace", "none"):
        raise ValueError(f"{fn}: grad must be 'new', 'inplace' or 'none', got {grad!r}")
    if grad == "inplace" and not (isinstance(logits, cupy.ndarray) and logits.flags.c_contiguous
                                  and logits.data.ptr % 16 == 0):
        raise ValueError(f"{fn}: grad='inplace' needs C-contiguous, aligned logits")
    logits = _device_array(cupy, logits, fn, "logits")
    code = _float_code(fn, logits=logits)
    target = _device_array(cupy, target, fn, "target")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"{fn}: target of shape {target.shape} does not match logits {logits.shape}")
    if target.dtype.kind not in "iu":
        raise TypeError(f"{fn}: target must hold integer class ids, got {target.dtype}")
    V = logits.shape[-1]
    N = logits.size // V
    t = cupy.ascontiguousarray(target.reshape(N), dtype=cupy.int64)
    live = target != ignore_index if ignore_index is not None else None
    backend.check_ids(target, V, f"{fn}: target id", live=live)
    loss = cupy.empty(N, dtype=cupy.float32)
    nll_out = cupy.empty(N, dtype=cupy.float32) if nll else None
    out = {"new": lambda: cupy.empty_like(logits), "inplace": lambda: logits, "none": lambda: None}[grad]()
    _C.cross_entropy_forward(logits.data.ptr, t.data.ptr, loss.data.ptr, _ptr(nll_out), _ptr(out), code,
                             N, V, float(label_smoothing), ignore_index is not None,
                             int(ignore_index) if ignore_index is not None else 0, _stream(cupy))
    shape = logits.shape[:-1]
    return (loss.reshape(shape), out) + ((nll_out.reshape(shape),) if nll else ())
