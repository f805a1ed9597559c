"""What every twin shares: the precision its arithmetic is done in."""

from __future__ import annotations

import numpy as np


def acc_dtype(*arrays):
    """float32, or float64 when an input is float64 (the tests use that to compare the
    algorithm, not the rounding, with the formula)."""
    return np.result_type(np.float32, *[a.dtype for a in arrays])
