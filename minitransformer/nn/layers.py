"""The basic layers: Linear (the paper's xW + b), LayerNorm and Dropout; and the checks of
the layers' constructor arguments."""

from __future__ import annotations

import numpy as np

from .. import functional as F
from ..schema import check_int, check_number
from ..tensor import Tensor
from . import init
from .module import Module, Parameter


def check_fraction(owner: str, name: str, value, closed: bool = False) -> None:
    """Refuse a rate outside [0, 1), or [0, 1] when ``closed``; nan is outside."""
    check_number(owner, name, value, 0, 1, open_high=not closed)


def check_positive(owner: str, name: str, value) -> None:
    """Refuse a value that is not a finite number > 0 (an epsilon: 0 divides by zero)."""
    check_number(owner, name, value, 0, open_low=True)


class Linear(Module):
    """$y = xW + b$ with $W$ of shape (in_features, out_features), Xavier-uniform initialised."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        check_int("Linear", "in_features", in_features)
        check_int("Linear", "out_features", out_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(init.xavier_uniform(in_features, out_features))
        self.bias = Parameter(np.zeros(out_features, np.float32)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        check_int("LayerNorm", "d_model", d_model)
        check_positive("LayerNorm", "eps", eps)
        self.eps = eps
        self.weight = Parameter(np.ones(d_model, np.float32))
        self.bias = Parameter(np.zeros(d_model, np.float32))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Dropout(Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        check_fraction("Dropout", "p", p, closed=True)  # F.dropout's p = 1 zeroes all, as in PyTorch
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
