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

from ..schema import check_int, check_keys, check_number


def noam_lr(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def schedule_factor(peak_lr: float, d_model: int, warmup: int) -> float:
    """The factor of equation (3) whose rate peaks at ``peak_lr`` (at step ``warmup``):
    peak = factor * d_model^-0.5 * warmup^-0.5."""
    return peak_lr * math.sqrt(d_model * warmup)


def check_settings(owner: str, d_model, warmup, factor) -> None:
    """What the schedule needs, refused in one line naming the setting (the constructor and
    ``load_state_dict`` both ask it): 0 would divide by zero at the first step, a negative
    size make the rate complex."""
    check_int(owner, "d_model", d_model)
    check_int(owner, "warmup", warmup)
    check_number(owner, "factor", factor, 0, open_low=True)


class WarmupInverseSqrtSchedule:
    """Sets ``optimizer.lr`` from equation (3); call ``step()`` before each optimiser step."""

    def __init__(self, optimizer, d_model: int, warmup: int = 4000, factor: float = 1.0) -> None:
        check_settings("WarmupInverseSqrtSchedule", d_model, warmup, factor)
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
        """Resume from a ``state_dict()``, checked whole first: a refused one changes nothing."""
        owner = "WarmupInverseSqrtSchedule.load_state_dict"
        check_keys(owner, state, ("step_count", "d_model", "warmup", "factor"))
        check_settings(owner, state["d_model"], state["warmup"], state["factor"])
        check_int(owner, "step_count", state["step_count"], low=0)
        self.step_count, self.d_model = state["step_count"], state["d_model"]
        self.warmup, self.factor = state["warmup"], state["factor"]
