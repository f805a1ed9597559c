"""Shared fixtures: every device-aware test runs on "cpu" and "cuda".

"cuda" is the GPU when CuPy sees one; otherwise it is the emulated device
(minitransformer/emulated/cupy.py: a CuPy stand-in over NumPy, and csrc/ compiled for
the CPU), so that CI runs the GPU path of every op, the launch layer, mixed precision, decoding
and DDP. MT_EMULATE_CUDA=0 turns the emulation off (then the "cuda" cases skip).
"""

import importlib
import os
import pathlib
import sys


def _cupy_sees_a_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


# Before the package is imported: backend reads it once. Subprocesses (mpiexec ranks, the
# examples) inherit it.
if "MT_EMULATE_CUDA" not in os.environ and not _cupy_sees_a_gpu():
    os.environ["MT_EMULATE_CUDA"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

import minitransformer as mt  # noqa: E402
from minitransformer import backend, kernels  # noqa: E402
from minitransformer.emulated import emulator  # noqa: E402

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

# tools/kernels/mutants.py: the kernel tests against a planted bug, the same examples every time
# (a mutant's result is cached, so it must not depend on the draw), no example database (one
# mutant's failures must not be replayed on the next) and no shrinking (a failure is all it
# asks, and shrinking one took a minute).
settings.register_profile("mutants", settings.get_profile("default"), derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate])

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not backend.has_cuda(), reason="no CUDA device (CuPy with a GPU, or MT_EMULATE_CUDA=1)")),
]


def pytest_report_header(config):
    if backend.is_emulated("cuda"):
        kernels_line = "csrc/ kernels compiled for the CPU" if kernels.available() else (
            f"no kernels ({kernels.unavailable_reason()})")
        return f"device 'cuda': EMULATED on the CPU (MT_EMULATE_CUDA=1; {kernels_line})"
    return f"device 'cuda': {'a GPU' if backend.has_cuda() else 'none'}"


# pytest -n (pytest-xdist, as pyproject.toml's addopts run it) sends each worker a scope at a
# time, a module with --dist loadscope, so that a module's fixtures are made once. The
# sanitizer module is the slow tier's longest: its scopes are its three checks instead
# (each check's builds are its own), and they are collected first, so that the longest work
# starts first and ends before the rest.
SANITIZERS = "tests/kernels/test_sanitizers.py"
CHECKS = ("thread", "address", "poison")  # the slowest first


def _check_of(nodeid: str) -> str | None:
    """"thread" for "tests/kernels/test_sanitizers.py::test_kernels_are_clean[thread-attention]";
    None for a test that runs none of the checks."""
    check = nodeid.rsplit("[", 1)[-1].split("-", 1)[0] if nodeid.startswith(SANITIZERS) else None
    return check if check in CHECKS else None


def pytest_collection_modifyitems(config, items):
    def rank(item):
        check = _check_of(item.nodeid)
        return len(CHECKS) if check is None else CHECKS.index(check)
    items.sort(key=rank)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None  # the mode asked for
    from xdist.scheduler import LoadScopeScheduling

    class ChecksApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _check_of(nodeid) is not None:
                return f"{SANITIZERS}[{_check_of(nodeid)}]"
            return super()._split_scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order, not the scopes' sizes
    return ChecksApart(config, log)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    mt.manual_seed(1234)
    emulator.restart_block_order()  # each test's emulated launches replay alone as they ran here


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure where emulated kernels ran says how to replay their blocks' orders."""
    report = (yield).get_result()
    if report.failed and (seed := emulator.block_seed()) is not None:
        report.sections.append(("emulated blocks", f"the blocks ran in the orders of MT_EMU_BLOCK_SEED={seed}: "
                                                   f"set it to replay this test's"))


@pytest.fixture(scope="session")
def tour(tmp_path_factory):
    """examples/tour.py run once, into a temporary folder: (the folder, the tour's TourResult).
    Shared by the tests of the tour and of the docs that show its pictures."""
    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # the tour imports copy_task, its neighbour
    folder = tmp_path_factory.mktemp("tour")
    return folder, importlib.import_module("tour").main(["--out", str(folder)])
