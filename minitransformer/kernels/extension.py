"""The handle on the compiled extension ``minitransformer.kernels._C``, and whether it can run.

setup.py builds ``_C`` only where nvcc is found, so importing it may fail; nothing else in
the package imports it. Without it, CuPy or a GPU, ``available()`` is False and
``unavailable_reason()`` says why.
"""

from __future__ import annotations

import functools

from .. import backend, settings

try:
    from . import _C
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # not built (no nvcc at install time), built for another Python, ...
    _C = None
    _IMPORT_ERROR = str(exc)
if _C is not None and not hasattr(_C, "limits"):  # an editable install after a pull: stale build
    _C = None
    _IMPORT_ERROR = "it was built from older csrc/ sources (no limits()): rebuild with pip install -e ."


def extension_built() -> bool:
    """True when ``minitransformer.kernels._C`` was compiled and imports."""
    return _C is not None


def available() -> bool:
    """True when the kernels can run: the extension is built and a CUDA device is usable."""
    return _C is not None and backend.has_cuda()


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if _C is None:
        return ("minitransformer.kernels._C is not built (install with nvcc on PATH or CUDA_HOME set, "
                f"and without MINITRANSFORMER_CUDA=0): {_IMPORT_ERROR}")
    if not backend.has_cupy():
        return "CuPy is not installed (pip install 'minitransformer[cuda]')"
    if not backend.has_cuda():
        return "CuPy finds no usable CUDA device"
    return None


def enabled() -> bool:
    """available(), unless MINITRANSFORMER_KERNELS=0 forces the CuPy composite ops."""
    return settings.env_flag("MINITRANSFORMER_KERNELS", default=True) and available()


@functools.cache
def limits() -> dict:
    """What the kernels can take, as csrc/limits.cuh says: attention_head_dims,
    attention_tiled_max_d, max_grid_y (attention's B * H) and layernorm_max_d. Needs the
    extension."""
    if _C is None:
        raise RuntimeError(unavailable_reason())
    return dict(_C.limits())
