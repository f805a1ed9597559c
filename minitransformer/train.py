"""One training step of the paper's recipe, and evaluation of the loss.

A step (section 5): forward the batch, label-smoothed cross-entropy over the non-padding
target tokens, backward, then Adam with the warmup schedule. ``train_step`` is that step and
nothing else, the one to read first; ``accumulated_step`` is the one training runs, the same
arithmetic in named phases with what a real run needs around it. Its three guards keep a bad
batch from damaging the model: a non-finite loss is not backpropagated, a non-finite gradient skips the
optimiser step, and so does an update that could overflow the weights (``Adam.max_update``);
each is reported in the step's result, not trained on. What no single step shows, a run whose
finite loss climbs away, ``DivergenceDetector`` tells from the losses of many.

The objective is the mean over the step's target tokens. Alone, a process backpropagates its
summed loss divided by its token count. With data parallelism (``ddp``, a
``distributed.DistributedDataParallel``) each rank backpropagates its summed loss and the
all-reduce divides by the token count of all ranks together, so batches with different
numbers of tokens are weighted correctly (see ``distributed.ddp``). A step may also be of
several micro-batches, whose gradients add up before the optimiser step (gradient
accumulation, ``accumulated_step``); the mean is then over all their tokens.

Mixed precision (``amp_dtype`` float16 or bfloat16, see ``amp``): the forward pass runs on
16-bit copies of the float32 weights, the gradients arrive in float32, and with a ``scaler``
(float16) the loss is scaled before backward and the gradients unscaled after the all-reduce;
an overflow is a "non-finite gradient" step, skipped, and lowers the scale. (With ``ddp`` the
scaled objective is the summed loss, whose weight gradients are as many times larger as there
are tokens: the scaler's first steps back off correspondingly further, then it settles.)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from . import functional as F
from .amp import autocast
from .autograd import no_grad
from .optim import clip_grad_norm_, grad_norm
from .schema import check_int, check_keys, check_number
from .tensor import Tensor


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
        return perplexity(self.nll)


PPL_CAP = 700.0  # nats: exp(700) ~ 1e304, near float64's largest


def perplexity(nll: float) -> float:
    """exp(nll per token), capped at exp(PPL_CAP) instead of overflowing."""
    return math.exp(min(nll, PPL_CAP)) if nll == nll else math.nan


def format_ppl(ppl: float) -> str:
    """A perplexity as a person reads it: 5.49, 3.7e+07, and '>1e304' at the cap."""
    if math.isinf(ppl) or ppl >= math.exp(PPL_CAP) * (1 - 1e-9):
        return f">1e{int(PPL_CAP / math.log(10))}"
    return f"{ppl:.2f}" if ppl < 1e5 else f"{ppl:.3g}"


class DivergenceDetector:
    """Tells, from a run's training losses, that it has diverged: its loss has left the range
    in which training makes progress and stays out.

    The losses are smoothed (an exponential average with a time constant of ``smoothing``
    steps, over the steps that have a loss: logs taken every 20 steps replay as well as every
    step). The run has diverged when the smoothed loss

    * stays far above its best, above best + max(1 nat, best / 2), for ``patience`` steps: a
      healthy run's spikes come back within far fewer, and a lasting rise of half the loss
      is lost training, not noise; or
    * stays above twice a uniform guess's loss, 2 ln V, for ``runaway`` steps: a model that
      predicts worse than knowing nothing, by that much, is growing without bound.

    A non-finite loss (a skipped step) extends a stretch that has begun. ``update`` returns
    why the run has diverged, or None; ``suspect`` is True while a stretch is under way, when
    a checkpoint may already hold a diverging model. ``state_dict()`` goes into checkpoints, so
    that a resumed run judges as an uninterrupted one.
    """

    def __init__(self, vocab_size: int, patience: int = 200, runaway: int = 20, smoothing: float = 50.0) -> None:
        check_int("DivergenceDetector", "vocab_size", vocab_size, low=2)  # one word: ln V = 0, every loss runs away
        check_int("DivergenceDetector", "patience", patience)
        check_int("DivergenceDetector", "runaway", runaway)
        check_number("DivergenceDetector", "smoothing", smoothing, 0, open_low=True)
        self.ceiling = 2 * math.log(vocab_size)
        self.patience, self.runaway, self.smoothing = patience, runaway, smoothing
        self.smoothed = self.best = None
        self.best_step = self.last_step = 0
        self.far_since = self.runaway_since = None  # steps at which each stretch began

    @property
    def suspect(self) -> bool:
        return self.far_since is not None or self.runaway_since is not None

    _STATE = ("smoothed", "best", "best_step", "last_step", "far_since", "runaway_since")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a ``state_dict()``, checked whole first: a refused one changes nothing."""
        owner = "DivergenceDetector.load_state_dict"
        check_keys(owner, state, self._STATE)
        if (state["smoothed"] is None) != (state["best"] is None):
            raise ValueError(f"{owner}: smoothed and best are both None (no loss yet) or both numbers, "
                             f"got {state['smoothed']!r} and {state['best']!r}")
        for k in ("smoothed", "best"):
            if state[k] is not None:
                check_number(owner, k, state[k])
        check_int(owner, "best_step", state["best_step"], low=0)
        check_int(owner, "last_step", state["last_step"], low=0)
        for k in ("far_since", "runaway_since"):  # None: no stretch under way
            if state[k] is not None:
                check_int(owner, k, state[k], low=0)
        for k in self._STATE:
            setattr(self, k, state[k])

    def update(self, step: int, loss: float) -> str | None:
        if math.isfinite(loss):
            if self.smoothed is None:
                self.smoothed = loss
            else:
                a = 1 - math.exp(-(step - self.last_step) / self.smoothing)
                self.smoothed += a * (loss - self.smoothed)
            self.last_step = step
            if self.best is None or self.smoothed < self.best:
                self.best, self.best_step = self.smoothed, step
            far = self.smoothed > self.best + max(1.0, self.best / 2)
            runaway = self.smoothed > self.ceiling
            self.far_since = (self.far_since or step) if far else None
            self.runaway_since = (self.runaway_since or step) if runaway else None
        if self.runaway_since is not None and step - self.runaway_since >= self.runaway:
            return (f"the training loss has grown without bound: {self.smoothed:.3g} nats a token (smoothed), "
                    f"above twice a uniform guess's {self.ceiling / 2:.2f} since step {self.runaway_since}")
        if self.far_since is not None and step - self.far_since >= self.patience:
            return (f"the training loss has stayed far above its best since step {self.far_since}: "
                    f"{self.smoothed:.3g} nats a token (smoothed), against {self.best:.3f} at step {self.best_step}")
        return None


class EarlyStopping:
    """Stop a run whose validation loss has not improved for ``patience`` validations in a row
    (fairseq's ``--patience``, counted in its validations, one an epoch): a run that has stopped
    learning from its data spends no more time on it. ``update`` takes each validation's loss and
    returns True when the run should stop; strictly lower is better, so a plateau counts against
    it. ``state_dict()`` goes into checkpoints, so that a resumed run counts on where it was."""

    def __init__(self, patience: int) -> None:
        check_int("EarlyStopping", "patience", patience)
        self.patience = patience
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0  # validations since the best

    def update(self, step: int, loss: float) -> bool:
        if self.best is None or loss < self.best:
            self.best, self.best_step, self.bad = loss, step, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a ``state_dict()``, checked whole first: a refused one changes nothing."""
        owner = "EarlyStopping.load_state_dict"
        check_keys(owner, state, ("best", "best_step", "bad"))
        if state["best"] is not None:  # nan would compare worse than every loss: a stop for nothing
            check_number(owner, "best", state["best"])
        check_int(owner, "best_step", state["best_step"], low=0)
        check_int(owner, "bad", state["bad"], low=0)
        self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]


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


def train_step(model, optimizer, schedule, batch, label_smoothing: float = 0.1,
               clip_norm: float | None = None) -> StepResult:
    """One training step of the paper's recipe on one batch, as a textbook writes it.

    ``batch`` is (src, tgt_in, tgt_out): source ids (B, S), the decoder's input (B, T) and the
    targets it predicts (B, T), the input shifted by one. ``schedule`` sets the learning rate
    (None keeps ``optimizer.lr``); ``clip_norm``, if given, caps the gradients' global norm.

    It has no guards: a non-finite loss or gradient is trained on. ``accumulated_step`` is the
    step training runs, the same arithmetic in the same order, with gradient accumulation, data
    parallelism, mixed precision and the guards around it; on one batch without them the two
    give the same loss and the same weights.
    """
    src, tgt_in, tgt_out = batch
    model.train()  # dropout on (section 5.4)
    # Forward pass, then label-smoothed cross-entropy (section 5.4), summed over the n target
    # tokens that are not padding; the objective is its mean per token.
    loss_sum, nll_sum, n = compute_loss(model, src, tgt_in, tgt_out, label_smoothing)
    loss = loss_sum / max(n, 1)
    loss.backward()  # every parameter's .grad = d loss / d parameter
    # The gradients' global norm, for the log; rescaled to at most clip_norm if given (the
    # paper clips nothing).
    norm = clip_grad_norm_(optimizer.params, clip_norm) if clip_norm else grad_norm(optimizer.params)
    lr = schedule.step() if schedule is not None else optimizer.lr  # equation (3), section 5.3
    optimizer.step()  # Adam with beta1 0.9, beta2 0.98, eps 1e-9 (section 5.3)
    optimizer.zero_grad()  # backward adds into .grad: the next step starts from zero
    return StepResult(loss.item(), nll_sum / max(n, 1), n, norm, lr)


def accumulated_step(model, optimizer, schedule, micro_batches, label_smoothing: float = 0.1,
                     clip_norm: float | None = None, ddp=None, amp_dtype=None, scaler=None) -> StepResult:
    """The step training runs: ``train_step``'s arithmetic, in five phases, with gradient
    accumulation, data parallelism, mixed precision and three guards around it.

    ``micro_batches``: (src, tgt_in, tgt_out) tuples, whose gradients add up before the step
    (gradient accumulation: a step on more tokens than one forward pass holds), or None for a
    rank whose share of a micro-batch is empty (a batch of fewer sentences than ranks): it adds
    nothing but takes part in the all-reduce. The objective is the mean over all the step's
    target tokens, so a step of micro-batches equals a step on their union. With ``ddp``
    every backward but the last runs in ``ddp.no_sync()``, and every rank calls
    ``ddp.reduce_gradients`` once, even when its own loss was not finite (no rank may be left
    waiting in an all-reduce); that rank reports a NaN loss, the reduced loss becomes NaN
    everywhere, and all ranks skip the step together. A non-finite loss ends the step's
    forward passes: it is skipped anyway. A skipped step moves neither the weights nor the
    schedule, and leaves no gradient behind.
    """
    model.train()
    optimizer.zero_grad()
    if ddp is None and not any(b is not None for b in micro_batches):
        raise ValueError("accumulated_step: no micro-batch with rows (an empty share of the step needs ddp)")
    # 1. Forward and backward of each micro-batch (train_step's compute_loss and backward).
    value, nll_sum, n, local_ok = _forward_backward(model, micro_batches, label_smoothing, ddp, amp_dtype, scaler)
    nll = nll_sum / max(n, 1)
    # 2. Gradient sync: with ddp, every rank's gradients become those of all ranks' tokens.
    loss, tokens, all_ok, grads_ok = _sync_gradients(ddp, value, n, local_ok)
    if not all_ok:
        why = "non-finite loss" if not local_ok else "non-finite loss on another rank"
        return _skipped(optimizer, StepResult(loss, nll, tokens, math.nan, optimizer.lr, skipped=why))
    # 3. Unscale, clip and guard (train_step's clip): a non-finite gradient skips the step.
    norm, found_inf = _unscale_and_clip(optimizer, clip_norm, scaler, grads_ok)
    if found_inf:
        return _skipped(optimizer, StepResult(loss, nll, tokens, norm, optimizer.lr, skipped="non-finite gradient"))
    # 4. Schedule (train_step's schedule.step()): the rate, looked at before it is set, so that
    # an update that could overflow the weights is skipped with the schedule unmoved.
    lr = schedule.next_lr() if schedule is not None else optimizer.lr
    if not math.isfinite(lr) or not optimizer.max_update(lr) < float(np.finfo(optimizer.params[0].dtype).max):
        return _skipped(optimizer, StepResult(loss, nll, tokens, norm, lr,
                                              skipped="an update that would overflow the weights"))
    # 5. Update (train_step's optimizer.step()).
    if schedule is not None:
        schedule.step()
    optimizer.step()
    return StepResult(loss, nll, tokens, norm, lr)


def _forward_backward(model, micro_batches, label_smoothing, ddp, amp_dtype, scaler):
    """Phase 1 of ``accumulated_step``: (summed loss, summed NLL, target tokens, whether the loss
    is finite) of this rank's micro-batches, their gradients added up in ``.grad``."""
    pad = model.config.pad_id
    # Alone, each backward is of its summed loss over the step's tokens; with ddp, of its sum.
    step_tokens = None if ddp is not None else sum(int((_array(b[2]) != pad).sum())
                                                   for b in micro_batches if b is not None)
    value, nll_sum, n, local_ok = 0.0, 0.0, 0, True
    for k, batch in enumerate(micro_batches):
        if batch is None:
            continue
        loss_sum, nll_k, n_k = compute_loss(model, *batch, label_smoothing, amp_dtype)
        value, nll_sum, n = value + loss_sum.item(), nll_sum + nll_k, n + n_k
        local_ok = math.isfinite(value)
        if not local_ok:
            break
        objective = loss_sum if ddp is not None else loss_sum / max(step_tokens, 1)
        last = k == len(micro_batches) - 1
        with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
            if scaler is None:
                objective.backward()
            else:  # overflow is expected now and then: the scaler handles it, NumPy need not warn
                with np.errstate(over="ignore", invalid="ignore"):
                    scaler.scale(objective).backward()
    return value, nll_sum, n, local_ok


def _sync_gradients(ddp, value: float, n: int, local_ok: bool):
    """Phase 2 of ``accumulated_step``: (loss per token, target tokens, whether the loss is
    finite, whether the gradients are) of the whole step. With ``ddp`` the all-reduce sums the
    ranks' gradients and divides them by all ranks' token count; alone there is nothing to do."""
    if ddp is None:
        return value / max(n, 1), n, local_ok, True
    stats = ddp.reduce_gradients(n, loss_sum=value if local_ok else math.nan)
    return stats.mean_loss, stats.num_tokens, math.isfinite(stats.loss_sum), stats.finite


def _unscale_and_clip(optimizer, clip_norm, scaler, grads_ok: bool) -> tuple[float, bool]:
    """Phase 3 of ``accumulated_step``: (the gradients' global norm before clipping, whether a
    gradient is not finite). A ``scaler``'s scale is divided out first, and the scaler told of
    an overflow (it then lowers the scale)."""
    if scaler is not None:
        scaler.unscale_(optimizer.params)
    norm = clip_grad_norm_(optimizer.params, clip_norm) if clip_norm else grad_norm(optimizer.params)
    found_inf = not (grads_ok and math.isfinite(norm))
    if scaler is not None:
        scaler.update(found_inf)
    return norm, found_inf


def _skipped(optimizer, result: StepResult) -> StepResult:
    """A step a guard stopped: its gradients are dropped, not left for the next step."""
    optimizer.zero_grad()
    return result


def _array(x):
    """A Tensor's array, or ``x`` itself (the model takes both)."""
    return x.data if isinstance(x, Tensor) else x


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
    return loss_total / tokens, perplexity(nll_total / tokens)
