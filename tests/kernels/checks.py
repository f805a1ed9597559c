"""What the kernel tests compare with, and how: naive same-precision implementations (NumPy or
CuPy), the dtypes' conversions and the comparison rule. The plain float64 formulas themselves
are in the package, minitransformer/kernels/reference/formulas.py, where a reader finds them.

The NumPy twins (CPU), the emulated kernels (CPU) and the CUDA kernels (GPU) are all checked
against those formulas.

Tolerances. float32: the table FP32_TOL, atol + rtol * |ref|; the kernels accumulate in
float32 with hardware exp, so their error is a few float32 ulps times the reduction length.
float16 / bfloat16: the rule of flash-attention's tests: the kernel's largest error against
float64 is at most twice that of a naive implementation in the same precision (every stored
intermediate rounded to the 16-bit type, products accumulated in float32 as cuBLAS does), plus
two units in the last place of the largest reference value or of 0.01, whichever is larger (so
that a lucky exact naive result does not demand an exact fused one: with a single key, dq is 0
exactly, the naive dS = P (dP - sum dP P) gives exactly 0, while the fused kernel's
delta = rowsum(dO O) with O rounded to 16 bits leaves ~1e-7). Two units, not one: one for the
kernel's own rounding, one for the order of its float32 atomic sums (dq), which the warps'
scheduling decides, on a GPU and in the emulator alike; a sum that lands on the other side of a
rounding boundary gives the neighbouring 16-bit value (seen: 1.01e-5 and 1.14e-5 against a
bound of 0.98e-5 for one example, run beside another process).

The NumPy twins run in float64 in their tests, so TWIN_TOL, 1e-10, measures the algorithm
(tiling, online softmax, Welford/Chan merging, the recomputed backward), not float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from minitransformer import backend, kernels
from minitransformer.kernels.reference.formulas import attention_mask

# Every test draws its inputs from a hypothesis-drawn seed, so that a failing example replays.
seeds = st.integers(0, 2**32 - 1)
DTYPES = ["float32", "float16", "bfloat16"]  # the kernels' dtypes

# The twins against the formulas: float64, so the algorithm, not rounding (see above).
TWIN_TOL = dict(rtol=1e-10, atol=1e-10)
TWIN_SETTINGS = settings(max_examples=25, deadline=None)


def targets(rng, N: int, V: int, use_ignore: bool, ignore_index: int = -100):
    """N class ids in [0, V), and the ignore_index: None, or set on about 30% of the ids."""
    t = rng.integers(0, V, N)
    if not use_ignore:
        return t, None
    t[rng.random(N) < 0.3] = ignore_index
    return t, ignore_index

FP32_TOL = {  # (rtol, atol)
    "attention": (2e-4, 2e-4),
    "attention_grad": (1e-3, 1e-3),
    "layernorm": (1e-4, 1e-4),
    "softmax": (1e-5, 1e-6),
    "cross_entropy": (1e-5, 1e-5),
}
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


# --------------------------------------------------------------------------- dtypes


def to_kernel(x32, dtype: str):
    """float32 array -> the kernels' representation of dtype (bfloat16: uint16 bits)."""
    if dtype == "bfloat16":
        return kernels.to_bfloat16_bits(x32)
    return x32.astype(dtype)


def to_f32(a):
    """Kernel-dtype array -> float32 array (exact)."""
    return kernels.from_bfloat16_bits(a) if a.dtype == np.uint16 else a.astype(np.float32)


def host64(a):
    """Kernel-dtype array (NumPy or CuPy) -> float64 NumPy array (exact)."""
    return backend.to_device(to_f32(a), "cpu").astype(np.float64)


def rounder(dtype: str):
    """Rounds a float32 array to dtype's precision (returns float32)."""
    if dtype == "float16":
        return lambda a: a.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return lambda a: kernels.from_bfloat16_bits(kernels.to_bfloat16_bits(a))
    return lambda a: a


def randn(rng, shape, dtype: str, xp=np, scale: float = 1.0):
    """Fresh random input in dtype on xp; returns (kernel array, its exact float64 host copy)."""
    a = to_kernel(xp.asarray(rng.standard_normal(shape).astype(np.float32) * scale), dtype)
    return a, host64(a)


# The value ranges that find range bugs in the row kernels, as (spread, offset) of ``logits``:
# exponentials that overflow float32 unless the maximum is subtracted first (spread 1e4), large
# offsets that a difference keeps and a product by log2 e would round away, and values near
# the largest finite value of each 16-bit type (65504; 3.4e38).
LOGIT_RANGES = {"float32": [(1e4, 0.0), (3.0, 1e4), (1.0, 1e30)],
                "float16": [(1.0, 6e4), (100.0, 6e4)],
                "bfloat16": [(1e4, 0.0), (1.0, 3e38), (1e36, 3e38)]}


def logits(rng, shape, dtype: str, spread: float, offset: float = 0.0, xp=np):
    """offset + spread * N(0, 1) in dtype on xp, the offset's sign alternating row by row;
    returns (kernel array, its exact float64 host copy)."""
    x32 = rng.standard_normal(shape).astype(np.float32) * np.float32(spread)
    if offset:
        x32 += np.float32(offset) * np.where(np.arange(shape[0]) % 2, -1, 1).astype(np.float32)[:, None]
    a = to_kernel(xp.asarray(x32), dtype)
    return a, host64(a)


def attention_grad_slack(q64, k64, o, dout64, lens, causal, dtype: str):
    """(0, dq's, dk's, 0): how far the 16-bit gradients may move, beyond the naive error, with
    delta = rowsum(dO O) taken from a 16-bit O. Each row's delta is then off by about
    ulp * sum_d |dO O|, and dq_i = scale sum_j P_ij (dP_ij - delta_i) K_j (dk alike, by Q)
    carries it. Where two keys of near-equal weight make dP - delta cancel, this is the whole
    error, and the kernel's O and the naive O round differently: 2x the naive error alone
    failed one comparison in 370 at tiny shapes (T <= 17, S <= 7)."""
    B, H, T, D = q64.shape
    S = k64.shape[2]
    scale = 1 / math.sqrt(D)
    s = np.where(attention_mask(B, T, S, lens, causal), q64 @ k64.swapaxes(-1, -2) * scale, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    p = e / np.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1)
    delta_err = ULP[dtype] * (np.abs(dout64) * np.abs(host64(o))).sum(-1, keepdims=True)
    dq = scale * (p * delta_err) @ np.abs(k64)
    dk = scale * (p * delta_err).swapaxes(-1, -2) @ np.abs(q64)
    return 0.0, dq.max(initial=0.0), dk.max(initial=0.0), 0.0


def check(name: str, dtype: str, got, ref, naive=None, slack: float = 0.0):
    """float32: the tolerance table; 16-bit: at most 2x the naive error plus two ulps, plus
    2x ``slack`` (an error the naive implementation need not share: attention_grad_slack)."""
    got = got if isinstance(got, np.ndarray) and got.dtype == np.float64 else host64(got)
    if dtype == "float32":
        rtol, atol = FP32_TOL[name]
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol, err_msg=name)
        return
    naive = backend.to_device(naive, "cpu").astype(np.float64)
    err = np.abs(got - ref).max(initial=0.0)
    naive_err = np.abs(naive - ref).max(initial=0.0)
    bound = 2 * naive_err + 2 * ULP[dtype] * max(np.abs(ref).max(initial=0.0), 0.01) + 2 * slack
    assert err <= bound, (f"{name} ({dtype}): error {err:.3g} > 2 x naive {naive_err:.3g} + 2 ulp"
                          f" + 2 x slack {slack:.3g}")


# --------------------------------------------------------------------------- rounding, not error bounds
# A conversion that truncates instead of rounding to nearest even moves every 16-bit output
# towards zero by half a unit in the last place on average: inside check's bound (two ulps)
# for each element, plain in the mean over many. RNE's errors average to zero.

MANTISSA_BITS = {"float16": 10, "bfloat16": 7}
MIN_NORMAL = {"float16": 2.0**-14, "bfloat16": 2.0**-126}
BIAS_OUTPUTS = 100_000  # outputs a bias is measured over: its standard error is then ~0.001 ulp
BIAS_LIMIT = 0.05  # ulps; truncation gives about -0.5


def rounding_bias(got, ref, dtype: str) -> tuple[float, int]:
    """(mean signed error in ulps, outputs counted) of a 16-bit output against float64: each
    error (got - ref) * sign(ref) in units of the 16-bit type's ulp at |ref|, so that a shift
    towards zero is negative whatever the signs. Counted: normal references at least 1/64 of
    the largest (where the kernel's own float32 arithmetic is far below a 16-bit ulp), errors
    clipped to 8 ulps (a few cancellations must not decide the mean)."""
    got = got if isinstance(got, np.ndarray) and got.dtype == np.float64 else host64(got)
    ref = np.asarray(ref, np.float64)
    a = np.abs(ref)
    counted = np.isfinite(ref) & (a >= MIN_NORMAL[dtype]) & (a >= a.max(initial=0.0) / 64)
    ulp = np.exp2(np.floor(np.log2(a[counted])) - MANTISSA_BITS[dtype])
    err = np.clip((got[counted] - ref[counted]) * np.sign(ref[counted]) / ulp, -8, 8)
    return float(err.mean()) if err.size else 0.0, int(err.size)


def check_rounding(name: str, dtype: str, got, ref) -> None:
    """The mean signed error of a 16-bit output over at least BIAS_OUTPUTS is within BIAS_LIMIT ulps."""
    bias, n = rounding_bias(got, ref, dtype)
    assert n >= BIAS_OUTPUTS, f"{name} ({dtype}): {n} outputs counted, fewer than {BIAS_OUTPUTS}"
    assert abs(bias) <= BIAS_LIMIT, \
        f"{name} ({dtype}): mean signed error {bias:+.3f} ulp over {n} outputs (rounding towards zero?)"


# --------------------------------------------------------------------------- naive, same precision
# Inputs are float32 arrays holding 16-bit values; rnd rounds each stored intermediate.


def naive_attention(q, k, v, dout, lens, causal, rnd, z=None):
    """(o, dq, dk, dv); z the dropout factors (B, H, T, S) or None. The backward's row term
    delta = sum_j P_ij dP_ij is taken as FlashAttention-2 and the kernels take it, rowsum(dO O)
    (equal in exact arithmetic) from the stored 16-bit O: where dP - delta cancels (two keys of
    near-equal weight), the rounding of O is what both errors are made of."""
    xp = backend.array_module_of(q)
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1 / math.sqrt(D)
    mask = xp.asarray(attention_mask(B, T, S, lens, causal))
    z = 1 if z is None else xp.asarray(z, dtype=np.float32)
    s = xp.where(mask, rnd(q @ k.swapaxes(-1, -2) * scale), -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    e = xp.exp(s - xp.where(xp.isfinite(m), m, 0))
    total = e.sum(axis=-1, keepdims=True)
    p = rnd(e / xp.where(total > 0, total, 1))
    p_dropped = rnd(p * z)
    o = rnd(p_dropped @ v)
    dv = rnd(p_dropped.swapaxes(-1, -2) @ dout)
    dp = rnd(rnd(dout @ v.swapaxes(-1, -2)) * z)
    ds = rnd(p * (dp - rnd((dout * o).sum(axis=-1, keepdims=True))))
    return o, rnd(ds @ k * scale), rnd(ds.swapaxes(-1, -2) @ q * scale), dv


def naive_attention_output(q, k, v, lens, causal, dtype: str):
    """The naive same-precision implementation's O for kernel-dtype q, k, v (NumPy or CuPy);
    None for float32, which the tolerance table judges."""
    if dtype == "float32":
        return None
    xp = backend.array_module_of(q)
    zeros = xp.zeros(q.shape, dtype=xp.float32)  # no backward wanted
    return naive_attention(*(to_f32(a) for a in (q, k, v)), zeros, lens, causal, rounder(dtype))[0]


def naive_layernorm(x, w, b, g, eps, rnd):
    """(y, dx, dw, db)."""
    xp = backend.array_module_of(x)
    mean = rnd(x.mean(axis=1, keepdims=True))
    xc = rnd(x - mean)
    rstd = rnd(1 / xp.sqrt(rnd((xc * xc).mean(axis=1, keepdims=True)) + eps))
    xhat = rnd(xc * rstd)
    y = rnd(rnd(xhat * w) + b)
    gh = rnd(g * w)
    dx = rnd(rstd * rnd(gh - rnd(gh.mean(axis=1, keepdims=True))
                        - rnd(xhat * rnd((gh * xhat).mean(axis=1, keepdims=True)))))
    return y, dx, rnd((g * xhat).sum(axis=0)), rnd(g.sum(axis=0))


def naive_softmax(x, mask, scale, rnd):
    xp = backend.array_module_of(x)
    z = rnd(x * scale)
    if mask is not None:
        z = xp.where(mask, z, -xp.inf)
    m = z.max(axis=1, keepdims=True)
    e = rnd(xp.exp(z - xp.where(xp.isfinite(m), m, 0)))
    total = rnd(e.sum(axis=1, keepdims=True))
    return rnd(e / xp.where(total > 0, total, 1))


def naive_softmax_backward(y, g, scale, rnd):
    return rnd(scale * rnd(y * rnd(g - rnd((g * y).sum(axis=1, keepdims=True)))))


def naive_cross_entropy(z, t, eps, ignore_index, rnd):
    """(loss, grad); t an integer array on z's device."""
    xp = backend.array_module_of(z)
    N, V = z.shape
    ignored = t == ignore_index if ignore_index is not None else xp.zeros(N, dtype=bool)
    t = xp.where(ignored, 0, t)
    m = z.max(axis=1, keepdims=True)
    lse = rnd(m + xp.log(rnd(xp.exp(z - m).sum(axis=1, keepdims=True))))
    logp = rnd(z - lse)
    q = xp.full(z.shape, eps / V, dtype=np.float32)
    q[xp.arange(N), t] += 1 - eps
    loss = rnd(-(q * logp).sum(axis=1))
    grad = rnd(rnd(xp.exp(logp)) - q)
    return xp.where(ignored, 0, loss), xp.where(ignored[:, None], 0, grad)
