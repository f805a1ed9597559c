"""The learning-rate schedule of section 5.3, equation (3):

    lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for the first ``warmup`` steps, peaks at step = warmup, then decays with the
inverse square root of the step. (factor = 1 in the paper; a larger factor suits small data.)

fairseq's ``inverse_sqrt`` schedule, which much of the later literature trains with, is this
one named by its peak instead of its factor: a rate rising linearly to ``peak_lr`` at step
``warmup``, then ``peak_lr * sqrt(warmup / step)``. ``schedule_factor`` gives the factor that
makes equation (3) peak there. (fairseq starts its ramp at ``--warmup-init-lr``, 1e-7 by
default, where equation (3) starts at 0: the two differ by less than 1e-7 during warmup.)
"""

from __future__ import annotations

import math
import numbers


def noam_lr(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def schedule_factor(peak_lr: float, d_model: int, warmup: int) -> float:
    """The factor of equation (3) whose rate peaks at ``peak_lr`` (at step ``warmup``):
    peak = factor * d_model^-0.5 * warmup^-0.5."""
    return peak_lr * math.sqrt(d_model * warmup)


class WarmupInverseSqrtSchedule:
    """Sets ``optimizer.lr`` from equation (3); call ``step()`` before each optimiser step."""

    def __init__(self, optimizer, d_model: int, warmup: int = 4000, factor: float = 1.0) -> None:
        # 0 would divide by zero at the first step, a negative value make the rate complex.
        for name, value in (("d_model", d_model), ("warmup", warmup)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"WarmupInverseSqrtSchedule: {name} must be an integer >= 1, got {value!r}")
        if not (isinstance(factor, numbers.Real) and 0 < factor < math.inf):
            raise ValueError(f"WarmupInverseSqrtSchedule: factor must be a finite number > 0, got {factor!r}")
        self.optimizer, self.d_model, self.warmup, self.factor = optimizer, d_model, warmup, factor
        self.step_count = 0

    def step(self) -> float:
        self.step_count += 1
        self.optimizer.lr = noam_lr(self.step_count, self.d_model, self.warmup, self.factor)
        return self.optimizer.lr

    def next_lr(self) -> float:
        """The rate ``step()`` will set, without setting it."""
        return noam_lr(self.step_count + 1, self.d_model, self.warmup, self.factor)

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "d_model": self.d_model, "warmup": self.warmup,
                "factor": self.factor}

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.d_model = state["step_count"], state["d_model"]
        self.warmup, self.factor = state["warmup"], state["factor"]
