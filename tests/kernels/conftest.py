"""The emulator sections' fixture, and a hypothesis profile for benchmarks/gpu_check.sh."""

import pytest
from hypothesis import Phase, settings

import emulated
from device import on_device
from minitransformer.emulated import emulator

# No shrinking, so that a failing GPU test reports its (unshrunk) example at once instead of
# spending the machine's minutes shrinking.
settings.register_profile("gpu_check", phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.fixture(scope="session")
def C():
    """csrc/ compiled for the CPU emulator. Skips the test where this machine cannot build it,
    or fails it under MT_REQUIRE_EMULATOR (emulated.require_emulator)."""
    emulated.require_emulator()
    return emulator.build()


def pytest_configure(config):
    config.addinivalue_line("markers", "emulator: runs csrc/ in the CPU emulator (takes C)")
    config.addinivalue_line("markers", "device: runs the kernels on the device, a GPU or the emulated one "
                                       "(marked on_device)")


def pytest_collection_modifyitems(items):
    """Mark the tests that take C ``emulator``, so that gpu_check.sh can leave them out on a GPU
    machine (-m "not emulator"); and those marked ``on_device`` ``device``, so that a mutant's
    checks (tools/kernels/mutants.py) run only the tests that reach a kernel, not the twins'."""
    for item in items:
        if "C" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.emulator)
        if any(mark == on_device.mark for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.device)
