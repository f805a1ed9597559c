"""One training step of the paper's recipe, and evaluation of the loss.

A step (section 5): forward the batch, label-smoothed cross-entropy over the non-padding
target tokens, backward, then Adam with the warmup schedule. Two guards keep a bad batch from
damaging the model: a non-finite loss is not backpropagated, and a non-finite gradient skips
the optimiser step; both are reported in the step's result, not trained on.

The objective is the mean over the step's target tokens. Alone, a process backpropagates its
summed loss divided by its token count. With data parallelism (``ddp``, a
``distributed.DistributedDataParallel``) each rank backpropagates its summed loss and the
all-reduce divides by the token count of all ranks together, so batches with different
numbers of tokens are weighted correctly (see ``distributed.ddp``).

Mixed precision (``amp_dtype`` float16 or bfloat16, see ``amp``): the forward pass runs on
16-bit copies of the float32 weights, the gradients arrive in float32, and with a ``scaler``
(float16) the loss is scaled before backward and the gradients unscaled after the all-reduce;
an overflow is a "non-finite gradient" step, skipped, and lowers the scale. (With ``ddp`` the
scaled objective is the summed loss, whose weight gradients are as many times larger as there
are tokens: the scaler's first steps back off correspondingly further, then it settles.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import functional as F
from .amp import autocast
from .autograd import no_grad
from .optim import clip_grad_norm_, grad_norm


@dataclass
class StepResult:
    loss: float  # label-smoothed loss per target token (what is minimised; all ranks)
    nll: float  # unsmoothed negative log-likelihood per target token (this rank)
    num_tokens: int  # target tokens in this step (all ranks)
    grad_norm: float
    lr: float
    skipped: str | None = None  # why the optimiser step was skipped, if it was

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nll, 700.0))


def compute_loss(model, src, tgt_in, tgt_out, label_smoothing: float, amp_dtype=None):
    """(summed label-smoothed loss tensor, summed NLL, non-padding target tokens); with
    ``amp_dtype`` the forward pass runs in that 16-bit dtype."""
    if not (src.shape[0] == tgt_in.shape[0] == tgt_out.shape[0]):
        raise ValueError(f"src {tuple(src.shape)}, tgt_in {tuple(tgt_in.shape)} and tgt_out {tuple(tgt_out.shape)} "
                         f"must have the same batch size")
    with autocast(model, amp_dtype):
        logits = model(src, tgt_in)  # (B, T, V)
        stats: dict = {}
        loss_sum = F.cross_entropy(logits, tgt_out, label_smoothing, model.config.pad_id, "sum", stats)
    return loss_sum, stats["nll_sum"], stats["n_tokens"]


def train_step(model, optimizer, schedule, src, tgt_in, tgt_out, label_smoothing: float = 0.1,
               clip_norm: float | None = None, ddp=None, amp_dtype=None, scaler=None) -> StepResult:
    """Forward, backward and (unless a guard trips) one optimiser step.

    With ``ddp`` every rank calls ``ddp.reduce_gradients`` even when its own loss was not
    finite (no rank may be left waiting in an all-reduce); that rank reports a NaN loss, the
    reduced loss becomes NaN everywhere, and all ranks skip the step together.
    """
    model.train()
    optimizer.zero_grad()
    loss_sum, nll_sum, n = compute_loss(model, src, tgt_in, tgt_out, label_smoothing, amp_dtype)
    value = loss_sum.item()
    local_ok = math.isfinite(value)
    if local_ok:
        objective = loss_sum if ddp is not None else loss_sum / max(n, 1)
        if scaler is None:
            objective.backward()
        else:  # overflow is expected now and then: the scaler handles it, NumPy need not warn
            with np.errstate(over="ignore", invalid="ignore"):
                scaler.scale(objective).backward()
    nll = nll_sum / max(n, 1)
    if ddp is not None:
        stats = ddp.reduce_gradients(n, loss_sum=value if local_ok else math.nan)
        loss, tokens, all_ok, grads_ok = stats.mean_loss, stats.num_tokens, math.isfinite(stats.loss_sum), stats.finite
    else:
        loss, tokens, all_ok, grads_ok = value / max(n, 1), n, local_ok, True
    if not all_ok:
        optimizer.zero_grad()
        why = "non-finite loss" if not local_ok else "non-finite loss on another rank"
        return StepResult(loss, nll, tokens, math.nan, optimizer.lr, skipped=why)
    if scaler is not None:
        scaler.unscale_(optimizer.params)
    norm = clip_grad_norm_(optimizer.params, clip_norm) if clip_norm else grad_norm(optimizer.params)
    found_inf = not (grads_ok and math.isfinite(norm))
    if scaler is not None:
        scaler.update(found_inf)
    if found_inf:
        optimizer.zero_grad()
        return StepResult(loss, nll, tokens, norm, optimizer.lr, skipped="non-finite gradient")
    lr = schedule.step() if schedule is not None else optimizer.lr
    optimizer.step()
    return StepResult(loss, nll, tokens, norm, lr)


@no_grad()
def evaluate_loss(model, batches, label_smoothing: float = 0.0, amp_dtype=None) -> tuple[float, float]:
    """(loss per token, perplexity) over ``batches`` of (src, tgt_in, tgt_out), in eval mode."""
    was_training = model.training
    model.eval()
    loss_total, nll_total, tokens = 0.0, 0.0, 0
    with autocast(model, amp_dtype):  # one cast of the weights for all batches
        for src, tgt_in, tgt_out in batches:
            loss_sum, nll_sum, n = compute_loss(model, src, tgt_in, tgt_out, label_smoothing, amp_dtype)
            loss_total += loss_sum.item()
            nll_total += nll_sum
            tokens += n
    model.train(was_training)
    tokens = max(tokens, 1)
    return loss_total / tokens, math.exp(min(nll_total / tokens, 700.0))
