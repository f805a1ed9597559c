"""The learning-rate schedule of section 5.3, equation (3):

    lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for the first ``warmup`` steps, peaks at step = warmup, then decays with the
inverse square root of the step. (factor = 1 in the paper; a larger factor suits small data.)
"""

from __future__ import annotations

import math
import numbers


def noam_lr(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


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
