"""The CUDA kernels of csrc/, run on the CPU (minitransformer.emulated.emulator), against the
formulas: the emulator sections of test_attention.py, test_layernorm.py, test_softmax.py and
test_cross_entropy.py (their tests take the fixture C, conftest.py), which draw shapes, and
sanitized_run.py, which runs fixed ones under the sanitizers.

The very sources the GPU build compiles (bindings, launchers, kernels) are compiled with g++
against a small emulation of the CUDA runtime, warps, barriers and mma.sync, and driven with
NumPy arrays. That checks, without a GPU, their indexing, masking, tiling, synchronisation,
Philox bits (bit-exact with the NumPy twin's) and arithmetic, and each launcher's choice of
kernel variant by the device's shared memory per block (every architecture's limit is drawn).
What it cannot check: that the hardware's mma.sync / ldmatrix fragments are what the emulation
reads in the PTX ISA, tensor-core rounding, when a cp.async really lands (here: at the wait
that covers it, never sooner), races that the emulation's scheduling hides (test_sanitizers.py
has ThreadSanitizer look for those, within and between blocks), speed. The device sections, on
a GPU, remain the authority.

Shapes stay small (EMULATOR_SETTINGS draws few): every emulated CUDA thread is a fiber of its own.

Arrays handed to a kernel stand in for device allocations: exactly sized, so that an access
one element past the end falls in AddressSanitizer's redzone, and 16-byte aligned, as the
bindings require. Outputs start as 0xFF bytes (NaN), so an element a kernel never writes
shows up as NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import settings

from minitransformer.settings import env_flag
from minitransformer.kernels import reference as R
from minitransformer.emulated import emulator
from minitransformer.kernels.resources import SHARED_MEMORY_PER_BLOCK

import checks
from minitransformer.kernels.reference import formulas
from checks import check, naive_attention, rounder, to_f32

CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
# The shared memory per block of each architecture the kernels are built for: the launchers
# choose their kernels' variants by it (csrc/launch_config.cuh). The largest is the default.
LIMITS = sorted(set(SHARED_MEMORY_PER_BLOCK.values()))
EMULATOR_SETTINGS = settings(max_examples=6, deadline=None)


def require_emulator(sanitize: str | None = None) -> None:
    """Skip (the test; the module, where called at import) where this machine cannot build the
    variant; but fail if MT_REQUIRE_EMULATOR is set: CI has nvcc's headers and g++, and there a skip
    would hide the only CPU test of csrc/."""
    reason = emulator.unavailable_reason(sanitize)
    if reason is None:
        return
    if env_flag("MT_REQUIRE_EMULATOR"):
        pytest.fail(f"MT_REQUIRE_EMULATOR is set but the emulated kernels cannot be built: {reason}",
                    pytrace=False)
    pytest.skip(f"cannot build the emulated kernels: {reason}", allow_module_level=True)


def ptr(a) -> int:
    return 0 if a is None else a.ctypes.data


def device_empty(shape, dtype):
    """An exactly sized, 16-byte aligned array of 0xFF bytes (NaN in every float type)."""
    a = np.empty(shape, dtype)  # malloc'ed, and malloc aligns to 16 bytes on 64-bit Linux
    if a.ctypes.data % 16:
        raise RuntimeError(f"np.empty gave an array at {a.ctypes.data:#x}, not 16-byte aligned")
    a.view(np.uint8)[...] = 0xFF
    return a


def device_copy(a):
    """``a`` in a device_empty array."""
    out = device_empty(np.shape(a), np.asarray(a).dtype)
    out[...] = a
    return out


def randn(rng, shape, dtype, scale=1.0):
    a, a64 = checks.randn(rng, shape, dtype, np, scale)
    return device_copy(a), a64


def attention(C, q, k, v, do, lens, causal, dtype, dropout_p=0.0, seed=0, smem_limit=LIMITS[-1]):
    """Forward then backward: (o, lse, dq, dk, dv)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1 / math.sqrt(D)
    lens = None if lens is None else device_copy(np.asarray(lens, dtype=np.int32))
    o, lse = device_empty(q.shape, q.dtype), device_empty((B, H, T), np.float32)
    C.attention_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), ptr(lens), CODE[dtype], B, H, T,
                        S, D, scale, causal, dropout_p, seed, smem_limit, 0)
    dq, dk, dv = (device_empty(a.shape, a.dtype) for a in (q, k, v))
    acc, delta = device_empty((B, H, T, D), np.float32), device_empty((B, H, T), np.float32)
    C.attention_backward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(do), ptr(lse), ptr(lens), ptr(dq),
                         ptr(dk), ptr(dv), ptr(acc), ptr(delta), CODE[dtype], B, H, T, S, D,
                         scale, causal, dropout_p, seed, smem_limit, 0)
    return o, lse, dq, dk, dv


def attention_tiles(C, dtype: str, D: int, limits=LIMITS) -> dict[tuple, int]:
    """Each way the launchers tile attention for dtype and D under ``limits`` (default: every
    architecture's shared memory per block), as {(the forward's tile, the backward's tile): a
    limit that chooses them}; a tile is (BR, BC), the queries and keys one block works on
    (csrc/attention.cu)."""
    ways = {}
    for limit in limits:
        forward = C.launch_config("attention_forward", CODE[dtype], D, limit)["tile"]
        backward = C.launch_config("attention_backward", CODE[dtype], D, limit)["tile"]
        ways.setdefault((tuple(forward), tuple(backward)), limit)
    return ways


def attention_boundaries(tiles: tuple) -> list[tuple]:
    """(B, T, S, lens, causal) at every boundary of one way of tiling, (forward tile, backward
    tile). For each tile size m (of either pass):
      - causal, two sequences, S - T = 0, 1 and m - 1 modulo m, with T > S and T < S: the last
        key that a tile of queries sees (query i sees keys j <= i + S - T) is then the last of a
        key tile, the first of a new one, or the one before the last; and the first query that a
        tile of keys meets falls on the first row of a query tile, the second, or the last;
      - T and every row's kv_len at multiples of m and one either side, in batches that mix
        kv_len 0, 1 and full, causal and not."""
    (fr, fc), (br, bc) = tiles
    T = 2 * max(fr, br) + 1  # two whole query tiles of either pass, and a ragged one
    cases = []
    for m in sorted({fr, fc, br, bc}):
        for r in (0, 1, m - 1):
            cases += [(2, T, S, None, True) for S in (T + r, T + m + r, T - m + r) if S > 0]
        for n in (m - 1, m, m + 1, 2 * m - 1, 2 * m, 2 * m + 1):
            S = 2 * m + 1
            cases += [(4, n, S, [0, 1, min(n, S), S], causal) for causal in (False, True)]
    return list(dict.fromkeys((B, T, S, None if lens is None else tuple(lens), causal)
                              for B, T, S, lens, causal in cases))


# The shapes of decoding with a KV cache: one query against the cache, at lengths on and next
# to the 64-key tiles (the current token's own key is the first of a new tile at S = 65, 129).
DECODE_LENGTHS = (1, 64, 65, 128, 129, 257)


# What fills the rows of K and V past a row's kv_len (``poisoned``): NaN, and the largest finite
# value, whose square overflows a score.
POISONS = ("nan", "max")


def poisoned(k, v, lens, dtype, poison):
    """k and v with every row past its batch's kv_len set to ``poison`` (POISONS): padding
    that a kernel must never read, as a reused allocation or an overflowed activation holds
    on a GPU. (Q, dO and O have no rows past T, nor any array a column past D: they are
    exactly sized here, and a read past them falls in AddressSanitizer's redzone.)"""
    if lens is None or poison is None:
        return
    if poison == "nan":
        fill = checks.to_kernel(np.full(1, np.nan, np.float32), dtype)[0]
    elif dtype == "bfloat16":
        fill = np.uint16(0x7F7F)  # its largest finite value (float32's maximum rounds to inf)
    else:
        fill = np.finfo(dtype).max
    for b, n in enumerate(lens):
        k[b, :, n:] = v[b, :, n:] = fill


def check_attention(C, dtype, B, H, T, S, D, lens, causal, seed, dropout_p=0.0, smem_limit=LIMITS[-1],
                    magnitude=1.0, drop_seed=None, poison=None):
    """Forward and backward against the formulas; with dropout, against the NumPy twin with the
    same seed (float32: its Philox bits agree exactly; 16-bit: the naive implementation uses
    the twin's dropout factors). ``magnitude`` scales q and k, and the scores by its square;
    ``drop_seed`` is the dropout's seed (default: drawn from ``seed``); ``poison`` fills the
    padding rows of k and v (``poisoned``), which the references never see."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64) = (randn(rng, s, dtype, scale=magnitude) for s in ((B, H, T, D), (B, H, S, D)))
    (v, v64), (do, do64) = (randn(rng, s, dtype) for s in ((B, H, S, D), (B, H, T, D)))
    drop_seed = int(rng.integers(0, 2**63 - 1)) if drop_seed is None else drop_seed
    poisoned(k, v, lens, dtype, poison)
    o, lse, dq, dk, dv = attention(C, q, k, v, do, lens, causal, dtype, dropout_p, drop_seed, smem_limit)
    z = None
    if dropout_p:
        o_r, lse_r = R.attention_forward(q64, k64, v64, lens, causal, dropout_p=dropout_p, seed=drop_seed)
        refs = (o_r, *R.attention_backward(q64, k64, v64, o_r, lse_r, do64, lens, causal,
                                           dropout_p=dropout_p, seed=drop_seed))
        bh = (np.arange(B)[:, None] * H + np.arange(H))[:, :, None, None]
        z = R.dropout_factor(bh, np.arange(T)[:, None], np.arange(S)[None, :], dropout_p, drop_seed)
    else:
        o_r, lse_r, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, lens, causal, dout=do64)
        refs = (o_r, dq_r, dk_r, dv_r)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    finite = np.isfinite(lse_r)
    np.testing.assert_allclose(lse[finite], lse_r[finite], rtol=1e-4, atol=1e-4)
    naive, slack = [None] * 4, [0.0] * 4
    if dtype != "float32":
        naive = naive_attention(to_f32(q), k64.astype(np.float32), v64.astype(np.float32), to_f32(do), lens,
                                causal, rounder(dtype), z)  # k64, v64: exact and unpoisoned
        slack = checks.attention_grad_slack(q64, k64, o, do64, lens, causal, dtype)
    for name, got, ref, nv, sl in zip(["attention"] + ["attention_grad"] * 3, (o, dq, dk, dv), refs, naive, slack):
        check(name, dtype, got, ref, nv, sl)


def attention_naive(C, q, k, v, lens, causal, dtype):
    """The naive kernels' forward: o."""
    B, H, T, D = q.shape
    S = k.shape[2]
    lens = None if lens is None else device_copy(np.asarray(lens, dtype=np.int32))
    o, p = device_empty(q.shape, q.dtype), device_empty((B, H, T, S), np.float32)
    C.attention_naive_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(p), ptr(lens), CODE[dtype], B, H, T,
                              S, D, 1 / math.sqrt(D), causal, 0)
    return o


def attention_tiled(C, q, k, v, lens, causal, dtype):
    """The tiled kernel's forward: o."""
    B, H, T, D = q.shape
    lens = None if lens is None else device_copy(np.asarray(lens, dtype=np.int32))
    o = device_empty(q.shape, q.dtype)
    C.attention_tiled_forward(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lens), CODE[dtype], B, H, T, k.shape[2], D,
                              1 / math.sqrt(D), causal, 0)
    return o


def check_attention_rung(C, kernel, dtype, B, H, T, S, D, lens, causal, seed, magnitude=1.0, poison="nan"):
    """A lower rung's output (``kernel``: attention_naive or attention_tiled) against the formula
    (16-bit: against twice the error of the same-precision naive implementation); padding rows of
    k and v hold ``poison`` (``poisoned``), which must not be read. ``magnitude`` scales q and k,
    and the scores by its square."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64) = (randn(rng, s, dtype, scale=magnitude) for s in ((B, H, T, D), (B, H, S, D)))
    v, v64 = randn(rng, (B, H, S, D), dtype)
    naive = checks.naive_attention_output(q, k, v, lens, causal, dtype)  # before the padding is poisoned
    poisoned(k, v, lens, dtype, poison)
    o = kernel(C, q, k, v, lens, causal, dtype)
    check("attention", dtype, o, formulas.attention(q64, k64, v64, lens, causal)[0], naive)


def check_attention_naive(C, dtype, *case, **options):
    check_attention_rung(C, attention_naive, dtype, *case, **options)


def check_attention_tiled(C, dtype, *case, **options):
    check_attention_rung(C, attention_tiled, dtype, *case, **options)


def check_rung_cases(C, check_rung, dtype, cases, **options):
    """``check_rung`` (check_attention_naive or _tiled) on each (B, H, T, S, D, lens, causal) of
    ``cases``, the padding NaN and the largest finite value in turn; a failure names its case."""
    for n, (B, H, T, S, D, lens, causal) in enumerate(cases):
        poison = POISONS[n % 2]
        try:
            check_rung(C, dtype, B, H, T, S, D, lens, causal, seed=T * 1000 + S, poison=poison, **options)
        except AssertionError as e:
            raise AssertionError(f"B={B}, H={H}, T={T}, S={S}, D={D}, lens={lens}, causal={causal}, "
                                 f"padding {poison}: {e}") from None


def check_layernorm(C, dtype, N, D, affine, seed, smem_limit=LIMITS[-1], spread=1.0, offset=0.0):
    """Forward and backward; x is offset + spread * N(0, 1) (``logits``): spread 0 gives constant
    rows, a small spread over a large offset rows whose variance is tiny beside their mean."""
    rng = np.random.default_rng(seed)
    (x, x64), (g, g64) = logits(rng, (N, D), dtype, spread, offset), randn(rng, (N, D), dtype)
    (w, w64), (b, b64) = (randn(rng, (D,), dtype) if affine else (None, None) for _ in range(2))
    y, dx = device_empty(x.shape, x.dtype), device_empty(x.shape, x.dtype)
    mean, rstd = device_empty(N, np.float32), device_empty(N, np.float32)
    dw, db = device_empty(D, x.dtype), device_empty(D, x.dtype)
    blocks = 3
    partial = device_empty((blocks, 2, D), np.float32)
    C.layernorm_forward(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), CODE[dtype], N, D, 1e-5, 0)
    C.layernorm_backward(ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(g), ptr(dx), ptr(dw), ptr(db),
                         ptr(partial), blocks, CODE[dtype], N, D, smem_limit, 0)
    y_r, dx_r, dw_r, db_r = formulas.layer_norm(x64, w64, b64, 1e-5, g=g64)
    np.testing.assert_allclose(mean, x64.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-4)
    naive = [None] * 4
    if dtype != "float32":
        ones, zeros = np.ones(D, np.float32), np.zeros(D, np.float32)
        naive = checks.naive_layernorm(to_f32(x), ones if w is None else to_f32(w),
                                         zeros if b is None else to_f32(b), to_f32(g), 1e-5, rounder(dtype))
    for got, ref, nv in zip((y, dx, dw, db), (y_r, dx_r, dw_r, db_r), naive):
        check("layernorm", dtype, got, ref, nv)


def logits(rng, shape, dtype, spread, offset=0.0):
    """checks.logits in a device_empty array: (kernel array, its exact float64 copy)."""
    a, a64 = checks.logits(rng, shape, dtype, spread, offset)
    return device_copy(a), a64


def check_softmax(C, dtype, N, V, masked, scale, seed, spread=4.0, offset=0.0):
    """Forward and backward; row 0 fully masked (when masked), the last row all -inf. The
    logits are offset + spread * N(0, 1) (``logits``)."""
    rng = np.random.default_rng(seed)
    (x, x64), (g, g64) = logits(rng, (N, V), dtype, spread, offset), randn(rng, (N, V), dtype)
    mask = None
    if masked:
        mask = rng.random((N, V)) < 0.8
        mask[0] = False  # a fully masked row
    # A row with no finite entry: zeros, as the composite op gives (not NaN).
    x[-1], x64[-1] = checks.to_kernel(np.full(V, -np.inf, np.float32), dtype), -np.inf
    y, dx = device_empty(x.shape, x.dtype), device_empty(x.shape, x.dtype)
    mask_bytes = None if mask is None else device_copy(mask.view(np.uint8))
    C.softmax_forward(ptr(x), ptr(mask_bytes), ptr(y), CODE[dtype], N, V, scale, 0)
    C.softmax_backward(ptr(y), ptr(g), ptr(dx), CODE[dtype], N, V, scale, 0)
    y64 = checks.host64(y)
    y_r = formulas.softmax(x64, mask, scale)
    dx_r = scale * y64 * (g64 - (g64 * y64).sum(axis=1, keepdims=True))
    naive = [None, None]
    if dtype != "float32":
        rnd = rounder(dtype)
        naive = [checks.naive_softmax(to_f32(x), mask, scale, rnd),
                 checks.naive_softmax_backward(to_f32(y), to_f32(g), scale, rnd)]
    check("softmax", dtype, y, y_r, naive[0])
    check("softmax", dtype, dx, dx_r, naive[1])
    assert (y64[-1] == 0).all()
    if masked:
        assert (y64[0] == 0).all()


def check_cross_entropy(C, dtype, N, V, eps, use_ignore, inplace, nll, seed, spread=3.0, offset=0.0):
    """The loss (and nll) and its gradient; the logits are offset + spread * N(0, 1)."""
    rng = np.random.default_rng(seed)
    z, z64 = logits(rng, (N, V), dtype, spread, offset)
    t, ignore = checks.targets(rng, N, V, use_ignore)
    target = device_copy(t.astype(np.int64))
    loss = device_empty(N, np.float32)
    nll_out = device_empty(N, np.float32) if nll else None
    zf = to_f32(z)  # before the kernel may overwrite z
    grad = z if inplace else device_empty(z.shape, z.dtype)
    C.cross_entropy_forward(ptr(z), ptr(target), ptr(loss), ptr(nll_out) if nll else 0, ptr(grad),
                            CODE[dtype], N, V, eps, ignore is not None,
                            ignore if ignore is not None else 0, 0)
    loss_r, grad_r = formulas.cross_entropy(z64, t, eps, ignore)
    naive = [None, None, None]
    if dtype != "float32":  # the unsmoothed NLL is the loss at eps = 0
        naive = [*checks.naive_cross_entropy(zf, t, eps, ignore, rounder(dtype)),
                 checks.naive_cross_entropy(zf, t, 0.0, ignore, rounder(dtype))[0]]
    check("cross_entropy", dtype, loss.astype(np.float64), loss_r, naive[0])
    check("cross_entropy", dtype, grad, grad_r, naive[1])
    if nll:
        check("cross_entropy", dtype, nll_out.astype(np.float64),
              formulas.cross_entropy(z64, t, 0.0, ignore)[0], naive[2])


# --------------------------------------------------------------------------- rounding
# Shapes of at least checks.BIAS_OUTPUTS outputs, inputs of one scale (so that nearly every
# output is counted: checks.rounding_bias), each kernel's 16-bit outputs against float64.


def rounding_of_attention(C, dtype, seed=0):
    """{output: (kernel's, float64's)} of forward and backward, B=2, H=4, T=S=256, D=64."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (randn(rng, (2, 4, 256, 64), dtype) for _ in range(4))
    o, _, dq, dk, dv = attention(C, q, k, v, do, None, False, dtype)
    o_r, _, dq_r, dk_r, dv_r = formulas.attention(q64, k64, v64, None, False, dout=do64)
    return {"O": (o, o_r), "dQ": (dq, dq_r), "dK": (dk, dk_r), "dV": (dv, dv_r)}


def rounding_of_softmax(C, dtype, seed=0):
    """{output: (kernel's, float64's)}, and y's rows: N=128 rows of V=1024 logits of spread 0.5."""
    rng = np.random.default_rng(seed)
    (x, x64), (g, g64) = logits(rng, (128, 1024), dtype, 0.5), randn(rng, (128, 1024), dtype)
    y, dx = device_empty(x.shape, x.dtype), device_empty(x.shape, x.dtype)
    C.softmax_forward(ptr(x), 0, ptr(y), CODE[dtype], 128, 1024, 1.0, 0)
    C.softmax_backward(ptr(y), ptr(g), ptr(dx), CODE[dtype], 128, 1024, 1.0, 0)
    y_r = formulas.softmax(x64, None, 1.0)
    y64 = checks.host64(y)  # dx is the kernel's formula of its own 16-bit y
    return {"y": (y, y_r), "dx": (dx, y64 * (g64 - (g64 * y64).sum(axis=1, keepdims=True)))}


def rounding_of_layernorm(C, dtype, seed=0):
    """{output: (kernel's, float64's)}: y of N=128 rows of D=1024, with weight and bias."""
    rng = np.random.default_rng(seed)
    (x, x64), (w, w64), (b, b64) = randn(rng, (128, 1024), dtype), randn(rng, (1024,), dtype), randn(rng, (1024,), dtype)
    y, mean, rstd = device_empty(x.shape, x.dtype), device_empty(128, np.float32), device_empty(128, np.float32)
    C.layernorm_forward(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), CODE[dtype], 128, 1024, 1e-5, 0)
    return {"y": (y, formulas.layer_norm(x64, w64, b64, 1e-5))}


def cross_entropy(C, z, t, dtype, eps):
    """The kernel's (loss, gradient) of logits z against targets t, nothing ignored."""
    N, V = z.shape
    target, loss, grad = device_copy(t.astype(np.int64)), device_empty(N, np.float32), device_empty(z.shape, z.dtype)
    C.cross_entropy_forward(ptr(z), ptr(target), ptr(loss), 0, ptr(grad), CODE[dtype], N, V, eps, False, 0, 0)
    return loss, grad


def rounding_of_cross_entropy(C, dtype, seed=0):
    """{output: (kernel's, float64's)}: the gradient of N=128 rows of V=1024 logits, eps 0.1,
    at the entries that are not a row's target."""
    rng = np.random.default_rng(seed)
    z, z64 = logits(rng, (128, 1024), dtype, 0.5)
    t, _ = checks.targets(rng, 128, 1024, False)
    _, grad = cross_entropy(C, z, t, dtype, 0.1)
    others = np.arange(1024)[None, :] != t[:, None]  # the target's entry, near -1, would set the scale
    return {"grad": (checks.host64(grad)[others], formulas.cross_entropy(z64, t, 0.1, None)[1][others])}
