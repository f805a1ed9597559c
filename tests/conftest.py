"""Shared fixtures: every device-aware test runs on "cpu" and, when CuPy sees a GPU, "cuda"."""

import pytest
from hypothesis import HealthCheck, settings

import minitransformer as mt
from minitransformer import backend

settings.register_profile(
    "default", max_examples=50, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")

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
