"""Optimisation: Adam, the warmup schedule of section 5.3, and gradient clipping."""

from .adam import Adam
from .schedule import WarmupInverseSqrtSchedule, noam_lr, schedule_factor
from .utils import clip_grad_norm_, grad_norm

__all__ = ["Adam", "WarmupInverseSqrtSchedule", "clip_grad_norm_", "grad_norm", "noam_lr", "schedule_factor"]
