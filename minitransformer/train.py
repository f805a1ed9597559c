"""One training step of the paper's recipe, and evaluation of the loss.

A step (section 5): forward the batch, label-smoothed cross-entropy over the non-padding
target tokens, backward, then Adam with the warmup schedule. Two guards keep a bad batch from
damaging the model: a non-finite loss is not backpropagated, and a non-finite gradient norm
skips the optimiser step; both are reported in the step's result, not trained on.

The loss is averaged over the step's target tokens (``num_tokens``): pass the total over all
data-parallel ranks there and every rank's gradient is already scaled for a plain sum
all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import functional as F
from .autograd import no_grad
from .optim import clip_grad_norm_, grad_norm


@dataclass
class StepResult:
    loss: float  # label-smoothed loss per target token (what is minimised)
    nll: float  # unsmoothed negative log-likelihood per target token
    num_tokens: int
    grad_norm: float
    lr: float
    skipped: str | None = None  # why the optimiser step was skipped, if it was

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nll, 700.0))


def compute_loss(model, src, tgt_in, tgt_out, label_smoothing: float, num_tokens: int | None = None):
    """(loss tensor per token, nll per token, tokens in this batch)."""
    logits = model(src, tgt_in)  # (B, T, V)
    stats: dict = {}
    loss_sum = F.cross_entropy(logits, tgt_out, label_smoothing, model.config.pad_id, "sum", stats)
    n = stats["n_tokens"]
    denom = max(num_tokens if num_tokens is not None else n, 1)
    return loss_sum / denom, stats["nll_sum"] / max(n, 1), n


def train_step(model, optimizer, schedule, src, tgt_in, tgt_out, label_smoothing: float = 0.1,
               clip_norm: float | None = None, num_tokens: int | None = None,
               reduce_gradients=None) -> StepResult:
    """Forward, backward and (unless a guard trips) one optimiser step.

    ``reduce_gradients(local_ok) -> bool``: data parallelism's hook, called after backward on
    every rank (also on a rank whose loss was not finite, so no rank is left waiting in an
    all-reduce); it reduces the gradients and returns whether every rank's loss was finite.
    After it, all ranks hold the same gradients, so the norm check below agrees everywhere.
    """
    model.train()
    optimizer.zero_grad()
    loss, nll, n = compute_loss(model, src, tgt_in, tgt_out, label_smoothing, num_tokens)
    value = loss.item()
    local_ok = math.isfinite(value)
    if local_ok:
        loss.backward()
    all_ok = reduce_gradients(local_ok) if reduce_gradients is not None else local_ok
    if not all_ok:
        optimizer.zero_grad()
        why = "non-finite loss" if not local_ok else "non-finite loss on another rank"
        return StepResult(value, nll, n, float("nan"), optimizer.lr, skipped=why)
    norm = clip_grad_norm_(optimizer.params, clip_norm) if clip_norm else grad_norm(optimizer.params)
    if not math.isfinite(norm):
        optimizer.zero_grad()
        return StepResult(value, nll, n, norm, optimizer.lr, skipped="non-finite gradient")
    lr = schedule.step() if schedule is not None else optimizer.lr
    optimizer.step()
    return StepResult(value, nll, n, norm, lr)


@no_grad()
def evaluate_loss(model, batches, label_smoothing: float = 0.0) -> tuple[float, float]:
    """(loss per token, perplexity) over ``batches`` of (src, tgt_in, tgt_out), in eval mode."""
    was_training = model.training
    model.eval()
    loss_total, nll_total, tokens = 0.0, 0.0, 0
    for src, tgt_in, tgt_out in batches:
        loss, nll, n = compute_loss(model, src, tgt_in, tgt_out, label_smoothing)
        loss_total += loss.item() * n
        nll_total += nll * n
        tokens += n
    model.train(was_training)
    tokens = max(tokens, 1)
    return loss_total / tokens, math.exp(min(nll_total / tokens, 700.0))
