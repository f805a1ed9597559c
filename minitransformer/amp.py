"""Mixed-precision training: 16-bit arithmetic, float32 master weights, dynamic loss scaling.

Micikevicius et al. (2018), "Mixed Precision Training", keep three things apart:

1. **Master weights in float32.** Adam's update lr * m / sqrt(v) is often below half a unit in
   the last place of a 16-bit weight (float16 has 11 significant bits, bfloat16 8), so applied
   to 16-bit weights it would round away. The model's Parameters therefore stay float32, and
   the optimiser, the checkpoints and checkpoint averaging see only them.
2. **Arithmetic in 16 bits.** Inside ``autocast(model, dtype)`` every Parameter's ``.data`` is a
   16-bit copy of its master, so the forward pass (matrix products, the fused kernels) runs in
   float16 or bfloat16. Ops that sum many terms (softmax, layer norm, reductions) accumulate in
   float32 and round once, and the loss stays float32; see ``backend.compute_dtype``. On
   leaving the block the masters are back, and ``backward()`` later casts each parameter's
   gradient to float32 as it reaches the leaf: the 16-bit gradients only ever exist inside
   the graph.
3. **Loss scaling** (float16 only). float16's smallest normal number is 6e-5, and many
   activation gradients are smaller: they would flush to zero. ``GradScaler`` multiplies the
   loss by S (2^16 to start) so the gradients backpropagate S times larger, and divides the
   float32 gradients by S before the optimiser step. If a gradient overflowed (inf or NaN), the
   step is skipped and S is halved; after ``growth_interval`` good steps in a row S doubles.
   bfloat16 has float32's exponent range and needs no scaling.

    scaler = GradScaler()                              # enabled=False for bfloat16
    with autocast(model, mt.float16):
        loss = F.cross_entropy(model(src, tgt_in), tgt_out, ...)
    scaler.scale(loss).backward()                      # float32 .grad, scaled by S
    scaler.unscale_(model.parameters())
    found_inf = not math.isfinite(grad_norm(model.parameters()))
    if not found_inf:
        optimizer.step()
    scaler.update(found_inf)

``train.accumulated_step`` does exactly this when given ``amp_dtype`` and ``scaler``.

Unlike PyTorch's op-by-op autocast, this one casts the parameters, once per forward: with the
inputs being integer token ids, every op downstream then computes in 16 bits. That is the
"O2" recipe of NVIDIA's Apex, which is how Transformers were trained in mixed precision.
"""

from __future__ import annotations

import math

from . import backend
from .schema import check_int, check_keys, check_number
from .tensor import Tensor


# Command-line names of the precisions (train_wmt.py, benchmarks) -> autocast's dtype.
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def scaler_for(dtype):
    """A ``GradScaler`` for float16; None for float32 and bfloat16, which need no loss scaling."""
    fp16 = dtype is not None and backend.resolve_dtype(dtype) == backend.resolve_dtype("float16")
    return GradScaler() if fp16 else None


class autocast:  # noqa: N801 - a context manager named like PyTorch's
    """Within the block, ``model``'s floating-point parameters hold ``dtype`` copies of their
    float32 masters; on exit (also by exception) the masters are restored.

    The copies are made on every entry, so they always reflect the latest optimiser step
    (cheap: one cast of every parameter, next to a forward pass). A nested ``autocast`` of the
    same model and dtype is a no-op; another dtype is an error. Call ``backward()`` after the
    block: only then do the gradients reach the float32 masters in float32 (one computed
    inside is cast on exit, but has been summed in 16 bits). Don't step the optimiser or save a
    checkpoint inside the block. ``dtype=None`` makes the block change nothing (float32
    training), so callers need no second code path.
    """

    def __init__(self, model, dtype) -> None:
        self.model = model
        self.dtype = None if dtype is None else backend.resolve_dtype(dtype)
        if self.dtype is not None and not backend.is_low_precision(self.dtype):
            raise TypeError(f"autocast: dtype must be float16 or bfloat16 (or None), not {self.dtype}")
        self._entries = []  # per entry: the (Parameter, master) pairs it swapped, or None if nested

    def __enter__(self):
        active = getattr(self.model, "_autocast_dtype", None)
        if self.dtype is None:
            self._entries.append(None)
            return self
        if active is not None:
            if active != self.dtype:
                raise RuntimeError(f"autocast({self.dtype}) inside autocast({active}) of the same model")
            self._entries.append(None)
            return self
        masters = []
        try:
            for p in self.model.parameters():
                if backend.is_floating(p.dtype):
                    masters.append((p, p.data))
                    p.data = p.data.astype(self.dtype)
        except BaseException:  # e.g. out of memory halfway: leave no parameter 16-bit
            self._restore(masters)
            raise
        self._entries.append(masters)
        object.__setattr__(self.model, "_autocast_dtype", self.dtype)
        return self

    def __exit__(self, *exc) -> bool:
        masters = self._entries.pop()
        if masters is not None:
            self._restore(masters)
            object.__setattr__(self.model, "_autocast_dtype", None)
        return False

    @staticmethod
    def _restore(masters) -> None:
        for p, master in masters:
            p.data = master
            if p.grad is not None and p.grad.dtype != master.dtype:  # backward() ran inside
                p.grad = Tensor(p.grad.data.astype(master.dtype))


class GradScaler:
    """Dynamic loss scaling for float16 training (see the module docstring).

    ``scale`` (S) starts at ``init_scale``; an overflow multiplies it by ``backoff_factor``, and
    ``growth_interval`` overflow-free steps in a row multiply it by ``growth_factor``. With
    ``enabled=False`` every method is the identity and S stays 1.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        _check_settings("GradScaler", "init_scale", init_scale, growth_factor, backoff_factor, growth_interval,
                        enabled)
        self.enabled = enabled
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # overflow-free steps since the scale last changed

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S``: backpropagate this instead of the loss."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, params) -> None:
        """Divide every ``.grad`` by S, in place (float32 gradients, as ``autocast`` leaves them)."""
        if not self.enabled:
            return
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is not None:
                p.grad.data *= inv
                p.grad.bump_version()

    def update(self, found_inf: bool) -> None:
        """After each step: back off on an overflow, grow after a run of good steps.

        Raises FloatingPointError once the scale $S$ falls below $2^{-24}$: gradients that overflow at such a
        scale are not finite at any scale (a NaN in the weights or the data), and skipping
        steps forever would hide that."""
        if not self.enabled:
            return
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            if self.scale_value < 2.0**-24:
                raise FloatingPointError(
                    f"loss scale fell to {self.scale_value:.3g}: the gradients are not finite at "
                    f"any scale (look for a NaN or inf in the weights, the data or the loss)")
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            grown = self.scale_value * self.growth_factor
            if math.isfinite(grown):
                self.scale_value = grown
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale_value, "good_steps": self.good_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        """Resume the scale; a disabled scaler (e.g. a run resumed in bfloat16) stays off. The
        state is checked whole first, with the constructor's checks: a refused one changes
        nothing."""
        owner = "GradScaler.load_state_dict"
        check_keys(owner, state, ("enabled", "scale", "good_steps", "growth_factor", "backoff_factor",
                                  "growth_interval"))
        _check_settings(owner, "scale", state["scale"], state["growth_factor"], state["backoff_factor"],
                        state["growth_interval"], state["enabled"])
        check_int(owner, "good_steps", state["good_steps"], low=0)
        if not (self.enabled and state["enabled"]):
            return
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = int(state["growth_interval"])


def _check_settings(owner: str, scale_name: str, scale, growth_factor, backoff_factor, growth_interval,
                    enabled) -> None:
    """What ``GradScaler`` needs, its constructor and ``load_state_dict`` alike (the scale is
    ``init_scale`` to one, ``scale`` to the other): a finite positive scale that grows on good
    steps and shrinks on overflows."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{owner}: enabled must be True or False, got {enabled!r}")
    check_number(owner, scale_name, scale, 0, open_low=True)
    check_number(owner, "growth_factor", growth_factor, 1, open_low=True)
    check_number(owner, "backoff_factor", backoff_factor, 0, 1, open_low=True, open_high=True)
    check_int(owner, "growth_interval", growth_interval)
