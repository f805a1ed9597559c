"""Per-architecture resource gates: every kernel of csrc/ runs on every GPU architecture that
setup.py builds for (sm_80, sm_86, sm_89 and sm_90 by default).

csrc/ is compiled for each architecture (device code only, setup.py's flags), and ptxas's
figures for every kernel (registers, spills, static shared memory) are joined with the dynamic
shared memory its launcher asks for (``_C.launch_configs``, from the sources through the
emulator's build): see minitransformer/kernels/resources.py. Checked per architecture:

- every kernel's static plus dynamic shared memory fits the architecture's
  cudaDevAttrMaxSharedMemoryPerBlockOptin; for a kernel built in several variants, the one its
  launcher takes there, and every launcher has one that fits;
- no spills but the known ones (KNOWN_SPILLS, reported as warnings): ptxas caps a thread at 255
  registers and spills the rest to local memory, so a spill is how register pressure shows.

The whole table is printed.

Needs nvcc (with c++filt) and the emulator (g++, pybind11). Where they are missing the module is
skipped, unless MT_REQUIRE_NVCC=1 is set (CI sets it): then it fails, so that a CI machine that
lost nvcc cannot pass the gates by skipping them. Compiling takes about a minute on two cores;
the result is cached in the temp directory.
"""

from __future__ import annotations

import os
import warnings

import pytest

from minitransformer.emulated import emulator
from minitransformer.kernels import resources

_REASON = resources.unavailable_reason() or emulator.unavailable_reason()
if _REASON:
    if os.environ.get("MT_REQUIRE_NVCC"):
        raise RuntimeError(f"MT_REQUIRE_NVCC is set but the resource gates cannot run: {_REASON}")
    pytest.skip(f"cannot compile the kernels for the resource gates: {_REASON}", allow_module_level=True)

ARCHS = resources.architectures()
# ptxas never gives a thread more than 255 registers: it spills to local memory instead, so the
# spills are the register check. These were seen with nvcc 13.0 (benchmarks/RESULTS.md) and are
# reported as warnings; any other spill fails.
KNOWN_SPILLS = {
    (80, "attention_backward_f32_kernel<64, 32, 64>"),
    (90, "attention_backward_mma_kernel<__half, 128>"),
    (90, "attention_backward_mma_kernel<__nv_bfloat16, 128>"),
}


@pytest.fixture(scope="module")
def usage():
    return resources.kernel_usage()


@pytest.fixture(scope="module")
def rows(C, usage):
    return resources.rows(C, usage)


def test_setup_builds_native_code_for_a100_rtx_l4_l40_and_h100(monkeypatch):
    monkeypatch.delenv("MINITRANSFORMER_CUDA_ARCHS", raising=False)
    assert resources.setup_module().cuda_archs() == [80, 86, 89, 90]
    assert resources.architectures() == [80, 86, 89, 90]


def test_the_gates_check_every_default_architecture_whatever_the_build(monkeypatch):
    monkeypatch.setenv("MINITRANSFORMER_CUDA_ARCHS", "90")  # as CI builds
    assert resources.setup_module().cuda_archs() == [90]
    assert resources.architectures() == [80, 86, 89, 90]
    monkeypatch.setenv("MINITRANSFORMER_CUDA_ARCHS", "86;100")
    assert resources.architectures() == [80, 86, 89, 90, 100]


def test_every_architecture_built_has_a_known_limit():
    unknown = set(ARCHS) - set(resources.SHARED_MEMORY_PER_BLOCK)
    assert not unknown, f"add the shared memory per block of sm_{unknown} to SHARED_MEMORY_PER_BLOCK"


def test_every_variant_the_launchers_report_was_compiled(C, usage):
    for launch in resources.launches(C):
        for arch in ARCHS:
            assert launch.kernel in usage[arch], f"{launch.kernel} (from _C.launch_configs) not in sm_{arch}'s ptxas log"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_fits(C, rows, arch):
    limit = resources.SHARED_MEMORY_PER_BLOCK[arch]
    problems = []
    for r in (r for r in rows if r.arch == arch):
        if r.launched is not False and not r.fits:  # a kernel without variants, or the one launched
            problems.append(f"{r.kernel} needs {r.usage.static_smem} + {r.dynamic_smem} bytes of "
                            f"shared memory per block")
        if r.usage.spill_stores or r.usage.spill_loads:
            spill = (f"{r.kernel} spills ({r.usage.registers} registers, {r.usage.spill_stores} B "
                     f"stored, {r.usage.spill_loads} B loaded)")
            if (arch, r.kernel) in KNOWN_SPILLS:
                warnings.warn(f"sm_{arch}: {spill}")
            else:
                problems.append(f"{spill}: a new spill (local memory traffic in the kernel's "
                                f"loop); if it is accepted, add it to KNOWN_SPILLS")
    for launch in resources.launches(C):
        if C.launch_config(launch.launcher, launch.dtype, launch.D, limit) is None:
            problems.append(f"{launch.launcher} has no variant that fits (dtype {launch.dtype}, "
                            f"D {launch.D}): {launch.kernel} needs {launch.smem}")
    assert not problems, f"sm_{arch} (limit {limit} bytes):\n" + "\n".join(sorted(set(problems)))


def test_print_the_table(rows, capsys):
    with capsys.disabled():
        print("\nKernel resources per architecture (minitransformer/kernels/resources.py):")
        print(resources.table(rows))
