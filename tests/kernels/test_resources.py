"""Per-architecture resource gates: every kernel of csrc/ runs on every GPU architecture that
setup.py builds for (sm_80, sm_86, sm_89 and sm_90 by default).

csrc/ is compiled for each architecture (device code only, setup.py's flags), and ptxas's
figures for every kernel (registers, spills, static shared memory) are joined with the dynamic
shared memory its launcher asks for (``_C.launch_configs``, from the sources through the
emulator's build): see minitransformer/kernels/resources.py. Checked per architecture:

- every kernel's static plus dynamic shared memory fits the architecture's
  cudaDevAttrMaxSharedMemoryPerBlockOptin; for a kernel built in several variants, the one its
  launcher takes there, and every launcher has one that fits;
- no spills: ptxas caps a thread at 255 registers (or fewer, for its occupancy target) and
  spills the rest to local memory, so a spill is how register pressure shows;
- the occupancy of every instance the launchers launch (recorded on the emulated device), by
  the CUDA occupancy rules, checked on hand-worked cases: each runs, at least one block an SM.

Both tables are printed.

Needs nvcc (with c++filt) and the emulator (g++, pybind11). Where they are missing the module is
skipped, unless MT_REQUIRE_NVCC=1 is set (CI sets it): then it fails, so that a CI machine that
lost nvcc cannot pass the gates by skipping them. Compiling takes about a minute on two cores;
the result is cached in the temp directory.
"""

from __future__ import annotations

import pytest

from minitransformer import settings
from minitransformer.emulated import emulator
from minitransformer.kernels import resources

pytestmark = pytest.mark.slow  # the ptxas gates: csrc/ compiled for every GPU architecture

_REASON = resources.unavailable_reason() or emulator.unavailable_reason()
if _REASON:
    if settings.env_flag("MT_REQUIRE_NVCC"):
        raise RuntimeError(f"MT_REQUIRE_NVCC is set but the resource gates cannot run: {_REASON}")
    pytest.skip(f"cannot compile the kernels for the resource gates: {_REASON}", allow_module_level=True)

ARCHS = resources.architectures()


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
            problems.append(f"{r.kernel} spills ({r.usage.registers} registers, {r.usage.spill_stores} B "
                            f"stored, {r.usage.spill_loads} B loaded): local memory traffic in its loop")
    for launch in resources.launches(C):
        if C.launch_config(launch.launcher, launch.dtype, launch.D, limit) is None:
            problems.append(f"{launch.launcher} has no variant that fits (dtype {launch.dtype}, "
                            f"D {launch.D}): {launch.kernel} needs {launch.smem}")
    assert not problems, f"sm_{arch} (limit {limit} bytes):\n" + "\n".join(sorted(set(problems)))


# Worked by hand from the rules (registers to warps in units of 256 within 4 sub-partitions of
# 16,384; shared memory in units of 128 bytes plus 1 KiB reserved; the SM's thread and block
# slots): (arch, threads, registers, shared) -> (blocks, limited by).
OCCUPANCY = {
    # 8,160 registers a warp round to 8,192: 2 warps a sub-partition, 8 an SM, 2 blocks of 4
    (90, 128, 255, 0): (2, "registers"),
    # 1,024 a warp: 16 a sub-partition, 64 an SM = the 2,048 threads' 64 warp slots
    (90, 128, 32, 0): (16, "registers and threads"),
    # 48 KiB + 1 KiB reserved = 50,176 bytes: 2 in sm_86's 100 KiB (registers would allow 12)
    (86, 128, 40, 49152): (2, "shared memory"),
    # 2,048 a warp: 8 warps a sub-partition, 32 an SM, 4 blocks of 8 warps
    (80, 256, 64, 0): (4, "registers"),
    # small blocks of a light kernel run out of the SM's 16 block slots first
    (86, 32, 16, 0): (16, "blocks"),
    # one byte more than sm_86 lets a block have: it cannot run there
    (86, 128, 32, 101377): (0, "shared memory"),
    # 32 warps of 2,304 registers need 73,728 of the 65,536: "too many resources requested"
    (80, 1024, 72, 0): (0, "registers"),
}


@pytest.mark.parametrize("case", sorted(OCCUPANCY))
def test_occupancy_by_the_rules(case):
    arch, threads, registers, shared = case
    got = resources.occupancy(arch, threads, registers, shared)
    assert (got.blocks, got.limited_by) == OCCUPANCY[case]
    assert got.warps == got.blocks * -(-threads // 32)
    assert got.fraction == got.warps / (resources.SMS[arch].threads // 32)


def test_the_launch_log_names_the_instance_each_launcher_chose(C):
    import numpy as np

    import emulated

    rng = np.random.default_rng(0)
    q, k, v, do = (emulated.randn(rng, (2, 3, 8, 64), "float16")[0] for _ in range(4))
    limit = resources.SHARED_MEMORY_PER_BLOCK[86]
    with emulator.logged_launches() as log:
        emulated.attention(C, q, k, v, do, None, False, "float16", smem_limit=limit)
    assert [resources.kernel_name(r.kernel).split("<")[0] for r in log] == [
        "attention_forward_mma_kernel", "attention_backward_delta_kernel", "attention_backward_mma_kernel",
        "cast_from_float_kernel"]
    forward = C.launch_config("attention_forward", 1, 64, limit)
    assert (resources.kernel_name(log[0].kernel), log[0].threads, log[0].smem) == (forward["kernel"], 128, forward["smem"])
    assert log[0].grid == (1, 6, 1)  # a block per 64 queries, for each of the 2 x 3 heads
    with emulator.logged_launches() as empty:
        pass
    assert empty == []


@pytest.fixture(scope="module")
def resident(usage):
    return resources.residents(usage, resources.launched())


def test_every_launched_instance_runs_without_spilling(resident):
    assert {r.arch for r in resident} == set(resources.SMS)
    kernels = {r.kernel.split("<")[0] for r in resident}
    assert {"attention_forward_f32_kernel", "attention_backward_mma_kernel", "layernorm_backward_kernel",
            "softmax_forward_kernel", "cross_entropy_kernel", "scores_kernel"} <= kernels
    problems = [f"sm_{r.arch} {r.kernel}: {r.spilled} B spilled, {r.occupancy.blocks} blocks an SM"
                for r in resident if r.spilled or r.occupancy.blocks < 1]
    assert not problems, "\n".join(problems)


def test_print_the_tables(rows, resident, capsys):
    with capsys.disabled():
        print("\nKernel resources per architecture (minitransformer/kernels/resources.py):")
        print(resources.table(rows))
        print("\nOccupancy of every launched instance:")
        print(resources.occupancy_table(resident))
