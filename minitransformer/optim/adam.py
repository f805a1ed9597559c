"""Adam (Kingma and Ba, 2015) with the paper's settings (section 5.3):
beta1 = 0.9, beta2 = 0.98, eps = 1e-9.

    m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
    p <- p - lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)

All updates are in place on the parameters' arrays, so the model, its optimiser and any
data-parallel buffers keep pointing at the same memory.
"""

from __future__ import annotations

import numpy as np

from .. import backend


class Adam:
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("Adam got an empty parameter list")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.step_count = 0
        self.m = [None] * len(self.params)
        self.v = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        b1, b2 = self.betas
        self.step_count += 1
        t = self.step_count
        step_size = self.lr / (1 - b1**t)  # folds m_hat's correction into the step
        v_corr = 1.0 / (1 - b2**t)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.data
            if self.weight_decay:
                g = g + self.weight_decay * p.data
            xp = backend.array_module_of(p.data)
            if self.m[i] is None:
                self.m[i] = xp.zeros_like(p.data)
                self.v[i] = xp.zeros_like(p.data)
            m, v = self.m[i], self.v[i]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            denom = xp.sqrt(v * v_corr)
            denom += self.eps
            p.data -= step_size * (m / denom)

    def state_dict(self) -> dict:
        """Moments as NumPy arrays (None for parameters that never had a gradient)."""
        to_np = lambda a: None if a is None else backend.to_device(a, "cpu").copy()  # noqa: E731
        return {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
            "weight_decay": self.weight_decay, "step_count": self.step_count,
            "m": [to_np(a) for a in self.m], "v": [to_np(a) for a in self.v],
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["m"]) != len(self.params):
            raise ValueError(f"optimizer state holds {len(state['m'])} parameters, "
                             f"this optimizer has {len(self.params)}")
        for i, (p, a) in enumerate(zip(self.params, state["m"])):
            if a is not None and tuple(a.shape) != p.shape:
                raise ValueError(f"optimizer state for parameter {i} has shape {tuple(a.shape)}, "
                                 f"the parameter {p.shape}")
        self.lr, self.betas, self.eps = state["lr"], tuple(state["betas"]), state["eps"]
        self.weight_decay, self.step_count = state["weight_decay"], state["step_count"]
        put = lambda a, p: None if a is None else backend.to_device(np.asarray(a, p.dtype), p.device).copy()  # noqa: E731
        self.m = [put(a, p) for a, p in zip(state["m"], self.params)]
        self.v = [put(a, p) for a, p in zip(state["v"], self.params)]
