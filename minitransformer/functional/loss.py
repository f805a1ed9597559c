"""Cross-entropy with label smoothing, the Transformer's training loss (paper section 5.4).

For logits z over V classes and target y, the smoothed target distribution is (Szegedy et
al., 2016, the paper's reference [36])

    q_k = (1 - eps) * [k == y] + eps / V

and the loss per position is the cross-entropy  -sum_k q_k log softmax(z)_k
    = (1 - eps) * nll + eps * mean_k(-log softmax(z)_k),    nll = -log softmax(z)_y.

Positions whose target equals ``ignore_index`` (padding) contribute neither loss nor gradient.
"mean" averages over the other positions, "sum" adds them up, "none" returns one value per
position (0 where ignored). The gradient with respect to the logits is  softmax(z) - q  per
position, times that position's weight.

16-bit logits are handled in float32 (the softmax, and the loss, which is returned in
float32); the gradient comes back in the logits' dtype.

The (N, V) logits are the largest array of a training step (N target tokens times a vocabulary
of thousands), so forward reads them once per block of rows that fits the cache, computing
each row's loss and already its gradient from the same exponentials, as csrc/softmax.cu's
fused kernel does:

    m = max_k z_k     e_k = exp(z_k - m)     s = sum_k e_k     lse = m + log s
    nll = lse - z_y   smoothing term = lse - mean_k z_k      grad_k = (e_k / s - q_k) * w

where w is the position's weight in the reduction (0 for padding, 1/n_valid for "mean").
Backward only multiplies it by the upstream gradient.
"""

from __future__ import annotations

from .. import backend, kernels
from ..autograd import Function
from ..tensor import Tensor

BLOCK_BYTES = 1 << 19  # 512 KiB of (float32) logits a block: they and their exponentials fit an L2 cache


class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction, stats):
        xp = backend.array_module_of(logits)
        eps, v = label_smoothing, logits.shape[-1]
        z = logits.reshape(-1, v)  # (N, V)
        t = target.reshape(-1)  # (N,)
        live = target != ignore_index if ignore_index is not None else None
        backend.check_ids(target, v, "cross_entropy: target id", live=live)
        valid = live.reshape(-1) if live is not None else xp.ones(t.shape, dtype=bool)
        t = xp.where(valid, t, 0)
        dtype = backend.compute_dtype(z.dtype)  # float32 for 16-bit logits
        n_valid = int(valid.sum())
        weight = valid.astype(dtype)
        if reduction == "mean":
            weight /= max(n_valid, 1)  # an all-padding batch gives 0, not 0/0
        grad = xp.empty(z.shape, dtype) if ctx.needs_input_grad[0] else None
        lse, z_mean = xp.empty(len(t), dtype), xp.empty(len(t), dtype)

        def rows_of(rows):  # in cache: z[rows] is read from memory once
            zr = z[rows].astype(dtype, copy=False)
            m = zr.max(axis=1, keepdims=True)
            m = xp.where(xp.isfinite(m), m, 0)  # a row of -inf logits: e = 0, s = 1 below
            e = xp.empty_like(zr) if grad is None else grad[rows]
            xp.exp(xp.subtract(zr, m, out=e), out=e)
            s = e.sum(axis=1, keepdims=True)
            s = xp.where(s == 0, 1, s)
            lse[rows] = (m + xp.log(s))[:, 0]
            if eps:
                z_mean[rows] = zr.mean(axis=1)
            if grad is not None:  # (softmax - q) * w, the -(1 - eps) at the target added below
                w = weight[rows, None]
                e *= w / s
                e -= (eps / v) * w

        # NumPy: blocks of rows; CuPy: all rows at once (its kernels run asynchronously anyway).
        on_cpu = backend.device_of(z) == "cpu"
        per_block = max(1, BLOCK_BYTES // (v * dtype.itemsize) if on_cpu else len(t))
        for start in range(0, len(t), per_block):
            rows_of(slice(start, start + per_block))
        rows = xp.arange(len(t))
        nll = xp.where(valid, lse - z[rows, t].astype(dtype, copy=False), 0)  # 0, not inf * 0, if ignored
        loss = nll if eps == 0.0 else xp.where(valid, (1.0 - eps) * nll + eps * (lse - z_mean), 0)
        if grad is not None:
            grad[rows, t] -= (1.0 - eps) * weight
        if stats is not None:  # the unsmoothed NLL, for perplexity
            stats["nll_sum"] = float(nll.sum())
            stats["n_tokens"] = n_valid
        if reduction == "none":
            out = loss.reshape(target.shape)
        else:
            out = (loss * weight).sum()
        ctx.save_for_backward(grad)
        ctx.shape, ctx.reduction, ctx.applied = logits.shape, reduction, None
        return xp.asarray(out)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved
        if ctx.reduction == "none":
            return (grad * g.reshape(-1, 1)).reshape(ctx.shape), None, None, None, None, None
        # Scaled in place, as a new (N, V) array would cost more than the product itself; the
        # factor applied is kept, so that a retained graph's second backward rescales it.
        # (No backward in the package changes the gradient it is handed, which this relies on.)
        # A summed loss backpropagated as it is (data parallelism) hands down exactly 1: no pass
        # (on the CPU; on a GPU reading g would wait for the device, and the pass is cheap).
        if ctx.applied is None:
            if not (g.size == 1 and backend.device_of(g) == "cpu" and float(g) == 1.0):
                grad *= g
        elif ctx.applied == 0 or not backend.array_module_of(grad).isfinite(ctx.applied):
            raise RuntimeError(f"cross_entropy: the first backward scaled the saved gradient by "
                               f"{float(ctx.applied)}; a second backward cannot undo that")
        else:
            grad *= g / ctx.applied
        ctx.applied = g.copy()
        return grad.reshape(ctx.shape), None, None, None, None, None


class FusedCrossEntropy(Function):
    """csrc/softmax.cu (see minitransformer.kernels): one kernel reads the logits once for the
    loss and writes each position's gradient softmax - q, into a new array or, with
    ``kernels.set_loss_overwrites_logits(True)``, over the logits themselves. Backward only
    scales it, in place, by the reduction's weights."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction, stats):
        xp = backend.array_module_of(logits)
        valid = target != ignore_index if ignore_index is not None else xp.ones(target.shape, dtype=bool)
        mode = "none"
        if ctx.needs_input_grad[0]:
            aligned = logits.flags.c_contiguous and logits.data.ptr % 16 == 0
            mode = "inplace" if kernels.loss_overwrites_logits() and aligned else "new"
        loss, grad, *nll = kernels.cross_entropy_forward(logits, target, label_smoothing, ignore_index, mode,
                                                         nll=stats is not None)
        n_valid = valid.sum(dtype=xp.float32)
        if stats is not None:  # the unsmoothed NLL (0 where ignored), for perplexity: one copy to the host
            nll_sum, n_tokens = xp.stack([nll[0].sum(), n_valid]).tolist()
            stats["nll_sum"], stats["n_tokens"] = nll_sum, int(n_tokens)
        weight = valid.astype(xp.float32)
        if reduction == "mean":
            weight /= xp.maximum(n_valid, 1)  # an all-padding batch gives 0, not 0/0
        out = loss if reduction == "none" else (loss * weight).sum()
        ctx.save_for_backward(grad, weight)
        ctx.reduction, ctx.used = reduction, False
        return xp.asarray(out, dtype=backend.compute_dtype(logits.dtype))  # a float16 sum could overflow

    @staticmethod
    def backward(ctx, g):
        grad, weight = ctx.saved
        if ctx.used:
            raise RuntimeError("the fused cross-entropy scales its saved gradient in place, so its "
                               "backward runs once; use MINITRANSFORMER_KERNELS=0 to backward twice")
        ctx.used = True
        grad *= (weight * g)[..., None]  # in float32: with loss scaling, weight * g may exceed float16
        return grad, None, None, None, None, None


def cross_entropy(logits: Tensor, target, label_smoothing: float = 0.0,
                  ignore_index: int | None = None, reduction: str = "mean",
                  stats: dict | None = None) -> Tensor:
    """Label-smoothed cross-entropy of (..., V) logits against (...) integer targets.

    Pass a dict as ``stats`` to also receive ``nll_sum`` (the unsmoothed negative
    log-likelihood summed over counted positions, for perplexity) and ``n_tokens``.
    """
    t = target.data if isinstance(target, Tensor) else target
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: target of shape {t.shape} does not match logits {logits.shape}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target must hold integer class ids, got {t.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    # An empty batch (a rank's empty share of a step) has nothing to launch.
    fn = FusedCrossEntropy if logits.data.size and kernels.enabled_for(logits.data) else CrossEntropy
    return fn.apply(logits, t, label_smoothing, ignore_index, reduction, stats)
