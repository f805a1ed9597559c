"""Shared fixtures: every device-aware test runs on "cpu" and, when CuPy sees a GPU, "cuda"."""

import pytest
from hypothesis import HealthCheck, Phase, settings

import minitransformer as mt
from minitransformer import backend

settings.register_profile(
    "default", max_examples=50, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")
# benchmarks/gpu_check.sh: the suite's "cuda" cases with few examples and no shrinking, so that
# they fit the GPU machine's minutes. Registered here, not in tests/kernels/conftest.py, so that
# --hypothesis-profile=gpu_suite works for any selection under tests/.
settings.register_profile(
    "gpu_suite", settings.get_profile("default"), max_examples=10,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not backend.has_cuda(), reason="no CUDA device (CuPy with a GPU)")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    mt.manual_seed(1234)
