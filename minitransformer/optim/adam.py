"""Adam (Kingma and Ba, 2015) with the paper's settings (section 5.3):
beta1 = 0.9, beta2 = 0.98, eps = 1e-9.

    m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
    p <- p - lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)

All updates are in place on the parameters' arrays, so the model, its optimiser and any
data-parallel buffers keep pointing at the same memory.

The update streams four arrays of every parameter's size (parameter, gradient, m, v) and
NumPy does one pass per arithmetic operation, so on the CPU each parameter is updated in
blocks of ``CPU_BLOCK`` entries: the dozen passes over a block run in the core's cache, and
only the first read and last write of each array go to memory. A GPU takes each parameter
whole, one kernel per operation.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..schema import check_int, check_keys, check_number

CPU_BLOCK = 32768  # entries: 128 KiB per float32 array, five arrays fit a 1-2 MiB L2 cache


def adam_formula(p, g, m, v, t: int, lr: float, betas=(0.9, 0.98), eps: float = 1e-9, weight_decay: float = 0.0):
    """Step ``t`` (from 1) of Algorithm 1 of Kingma and Ba, written plainly: returns the new
    (p, m, v). ``Adam.step`` computes the same, in place and in cache-sized blocks (tested equal
    in tests/optim/test_optim.py)."""
    b1, b2 = betas
    g = g + weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def check_settings(owner: str, lr, betas, eps, weight_decay) -> tuple:
    """Refuse, in one line naming the setting, what would step into NaN or the wrong way (lr 0
    is fine: a schedule sets it); returns betas as a tuple. ``Adam(...)`` and
    ``Adam.load_state_dict`` both ask it."""
    check_number(owner, "lr", lr, 0)
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        check_number(owner, f"betas[{i}]", beta, 0, 1, open_high=True)
    check_number(owner, "eps", eps, 0, open_low=True)
    check_number(owner, "weight_decay", weight_decay, 0)
    return tuple(betas)


class Adam:
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.98), eps: float = 1e-9,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("Adam got an empty parameter list")
        first = {}
        for i, param in enumerate(self.params):  # twice in the list would be two updates a step
            j = first.setdefault(id(param), i)
            if j != i:
                raise ValueError(f"Adam: parameter {i} (shape {tuple(param.shape)}) is parameter {j} again: "
                                 f"each parameter once, or it is updated twice a step")
        betas = check_settings("Adam", lr, betas, eps, weight_decay)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.m = [None] * len(self.params)
        self.v = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self._check_gradients()
        b1, b2 = self.betas
        self.step_count += 1
        t = self.step_count
        step_size = self.lr / (1 - b1**t)  # folds m_hat's correction into the step
        v_corr = 1.0 / (1 - b2**t)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            p.bump_version()  # written in place below: a graph that saved p must not backward now
            xp = backend.array_module_of(p.data)
            if self.m[i] is None:
                self.m[i] = xp.zeros_like(p.data)
                self.v[i] = xp.zeros_like(p.data)
            arrays = (p.data, p.grad.data, self.m[i], self.v[i])
            if xp is not np or not all(a.flags.c_contiguous for a in arrays):
                self._update(*arrays, xp.empty_like(p.data), step_size, v_corr)
                continue
            flat = [a.reshape(-1) for a in arrays]  # views: contiguous
            scratch = np.empty(min(CPU_BLOCK, p.size), dtype=p.dtype)
            for start in range(0, p.size, CPU_BLOCK):
                block = [a[start:start + CPU_BLOCK] for a in flat]
                self._update(*block, scratch[:block[0].size], step_size, v_corr)

    def _check_gradients(self) -> None:
        """Before anything is written: a gradient of another shape than its parameter (one that
        broadcasts too) or on another device is a bug upstream, named here rather than by NumPy."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and (g.shape != p.shape or g.device != p.device):
                raise ValueError(f"Adam.step: parameter {i} has shape {p.shape} on {p.device}, its gradient "
                                 f"shape {g.shape} on {g.device}")

    def max_update(self, lr: float | None = None) -> float:
        """The largest change the next step can make to any parameter, at ``lr`` (default: the
        current one), whatever the gradients: lr * C_t, with C_t a bound on |m_hat| / sqrt(v_hat).

        m_t = (1 - b1) sum_k b1^k g_{t-k} and v_t = (1 - b2) sum_k b2^k g_{t-k}^2, so by
        Cauchy-Schwarz |m_t| <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_k (b1^2 / b2)^k) * sqrt(v_t);
        the bias corrections multiply that by sqrt(1 - b2^t) / (1 - b1^t). At t = 1 it is 1 (the
        first update is lr * g / |g|). A step whose bound overflows the parameters' dtype would
        write infinities into them: ``train.accumulated_step`` skips it instead.
        """
        b1, b2 = self.betas
        lr = self.lr if lr is None else lr
        t = self.step_count + 1
        if b2 == 0:  # v_hat = g_t^2 bounds nothing of the earlier gradients in m
            return math.inf if b1 else lr
        r = b1 * b1 / b2
        terms = t if r == 1 else (1 - r**t) / (1 - r)  # sum_{k < t} r^k
        return lr * (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * terms)

    def _update(self, p, g, m, v, buf, step_size: float, v_corr: float) -> None:
        """One block of the update, in place on ``p``, ``m`` and ``v``; ``buf`` is scratch."""
        b1, b2 = self.betas
        xp = backend.array_module_of(p)
        if self.weight_decay:  # g + weight_decay * p, into the scratch
            xp.multiply(p, self.weight_decay, out=buf)
            g = xp.add(g, buf, out=buf)
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        xp.multiply(v, v_corr, out=buf)  # buf = sqrt(v_hat) + eps, then the step
        xp.sqrt(buf, out=buf)
        buf += self.eps
        xp.divide(m, buf, out=buf)
        buf *= step_size
        p -= buf

    def state_dict(self) -> dict:
        """Moments as NumPy arrays (None for parameters that never had a gradient)."""
        to_np = lambda a: None if a is None else backend.to_device(a, "cpu").copy()  # noqa: E731
        return {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
            "weight_decay": self.weight_decay, "step_count": self.step_count,
            "m": [to_np(a) for a in self.m], "v": [to_np(a) for a in self.v],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from a ``state_dict()``: checked whole with the constructor's checks (and the
        moments against the parameters) before anything is set, so a refused state leaves this
        optimiser as it was."""
        owner = "Adam.load_state_dict"
        check_keys(owner, state, ("lr", "betas", "eps", "weight_decay", "step_count", "m", "v"))
        betas = check_settings(owner, state["lr"], state["betas"], state["eps"], state["weight_decay"])
        check_int(owner, "step_count", state["step_count"], low=0)
        m, v = self._moments(owner, "m", state["m"]), self._moments(owner, "v", state["v"])
        for i, (mi, vi) in enumerate(zip(m, v)):
            if (mi is None) != (vi is None):  # step() would start both afresh, dropping the other
                raise ValueError(f"{owner}: parameter {i} has {'m' if vi is None else 'v'} without "
                                 f"{'v' if vi is None else 'm'}")
        self.lr, self.betas, self.eps, self.weight_decay = state["lr"], betas, state["eps"], state["weight_decay"]
        self.step_count = int(state["step_count"])
        self.m = [None if a is None else backend.to_device(a, p.device) for a, p in zip(m, self.params)]
        self.v = [None if a is None else backend.to_device(a, p.device) for a, p in zip(v, self.params)]

    def _moments(self, owner: str, name: str, arrays) -> list:
        """``arrays`` (one per parameter, None where it has none yet) as NumPy arrays of the
        parameters' dtypes, or a refusal naming the first that is not finite numbers of its
        parameter's shape (nor >= 0, for the second moments)."""
        if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__") or len(arrays) != len(self.params):
            got = len(arrays) if hasattr(arrays, "__len__") else type(arrays).__name__
            raise ValueError(f"{owner}: {name} must hold one array per parameter ({len(self.params)}), got {got}")
        out = []
        for i, (a, p) in enumerate(zip(arrays, self.params)):
            if a is None:
                out.append(None)
                continue
            try:
                a = np.asarray(backend.to_device(a, "cpu"))
            except TypeError:  # neither a NumPy nor a CuPy array
                raise ValueError(f"{owner}: {name}[{i}] must be an array, got {type(a).__name__}") from None
            if a.dtype.kind not in "fiu" or a.shape != p.shape:
                raise ValueError(f"{owner}: {name}[{i}] must be numbers of its parameter's shape {p.shape}, "
                                 f"got {a.dtype} of shape {a.shape}")
            with np.errstate(over="ignore", invalid="ignore"):  # what the cast gives is checked next
                a = a.astype(p.dtype)
            if not np.isfinite(a).all() or name == "v" and (a < 0).any():
                raise ValueError(f"{owner}: {name}[{i}] holds values that are not finite "
                                 f"{'and >= 0 ' if name == 'v' else ''}in {p.dtype}")
            out.append(a)
        return out
