"""What each CUDA kernel of csrc/ asks of every GPU architecture setup.py builds for.

    python -m minitransformer.kernels.resources     prints the tables below (needs nvcc and g++)

A block runs only if its shared memory (static, from the kernel's code, plus dynamic, from the
launch) fits the device's cudaDevAttrMaxSharedMemoryPerBlockOptin, and each thread's registers
fit the register file. Those limits differ between GPUs that run the same build: an A100
(sm_80) lets a block use 163 KiB, an RTX 30 / A10 (sm_86) or RTX 40 / L4 / L40 (sm_89) 99 KiB,
an H100 (sm_90) 227 KiB. So csrc/ is compiled here, device code only, for each architecture
with setup.py's flags, and ptxas reports every kernel's registers, spills and static shared
memory (``nvcc --resource-usage``). The dynamic shared memory comes from the sources too: the
launchers report the variants they choose from (``_C.launch_configs``, here from the emulator's
build, which needs no GPU). ``rows`` joins the two; tests/kernels/test_resources.py
checks them against the limits. The compilation (about a minute on two cores) is cached
in the temp directory under a hash of the sources, the flags and the compiler.

The second table is the occupancy of every kernel instance the launchers launch: how many of
its blocks one SM holds at once, and whether registers, shared memory or the SM's thread or
block slots stop it holding more (the rules of the toolkit's cuda_occupancy.h). Which instances
are launched, with how many threads and how much dynamic shared memory, is recorded on the
emulated device (``launched``): every launcher is run at every dtype and width, once with
each architecture's shared memory per block.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from ..emulated import emulator
from ..emulated.emulator import CSRC, cuda_home, setup_module



@dataclass(frozen=True)
class SM:
    """What one streaming multiprocessor of an architecture holds at once (CUDA C++ Programming
    Guide, "Technical Specifications per Compute Capability"). An architecture added to
    setup.py needs its figures here."""

    threads: int    # resident threads
    blocks: int     # resident blocks
    registers: int  # 32-bit registers
    shared: int     # shared memory, bytes (the largest carveout)


SMS = {80: SM(2048, 32, 65536, 167936), 86: SM(1536, 16, 65536, 102400), 89: SM(1536, 24, 65536, 102400),
       90: SM(2048, 32, 65536, 233472)}
# How the hardware allocates them, on every architecture here (the rules of the toolkit's
# cuda_occupancy.h): registers to warps in units of 256, each warp within one of the SM's 4
# sub-partitions; shared memory to blocks in units of 128 bytes, 1 KiB of each reserved by the
# driver.
REGISTER_UNIT, SUB_PARTITIONS, SHARED_UNIT, RESERVED_SHARED = 256, 4, 128, 1024
MAX_REGISTERS = 255  # per thread

# cudaDevAttrMaxSharedMemoryPerBlockOptin: all of an SM's shared memory but the reserved KiB.
SHARED_MEMORY_PER_BLOCK = {arch: sm.shared - RESERVED_SHARED for arch, sm in SMS.items()}


@dataclass(frozen=True)
class Usage:
    """ptxas's figures for one kernel on one architecture."""

    registers: int      # per thread
    spill_stores: int   # bytes
    spill_loads: int    # bytes
    static_smem: int    # bytes of __shared__ arrays in the kernel's code


def architectures() -> list[int]:
    """The architectures the gates check: every one setup.py builds for by default, and any
    other that MINITRANSFORMER_CUDA_ARCHS asks for (a build for fewer, as CI's, checks all)."""
    setup = setup_module()
    return sorted(set(setup.DEFAULT_ARCHS) | set(setup.cuda_archs()))


def unavailable_reason() -> str | None:
    """Why the kernels cannot be compiled here (None when they can)."""
    if not CSRC.is_dir():
        return f"{CSRC} not found: the resource table compiles csrc/ of a source checkout"
    if cuda_home() is None:
        return "no CUDA toolkit (nvcc) found"
    if shutil.which("c++filt") is None:
        return "c++filt (binutils) is not installed"
    return None


# ptxas --resource-usage, per kernel:
#   ptxas info    : Compiling entry function '_ZN2mt...' for 'sm_86'
#   ptxas info    : Function properties for _ZN2mt...
#       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
#   ptxas info    : Used 40 registers, used 1 barriers, 96 bytes smem, 380 bytes cmem[0]
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\w+)")  # the entry, or a function it calls
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, Usage]:
    """Mangled kernel name -> Usage, from the log of one compilation."""
    usage, fields, entry, properties_of = {}, {}, None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, fields = m.group(1), {}
        elif m := _PROPERTIES.search(line):
            properties_of = m.group(1)
        elif entry and properties_of == entry and (m := _SPILLS.search(line)):
            fields.update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        elif entry and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            usage[entry] = Usage(registers=int(m.group(1)), static_smem=int(smem.group(1)) if smem else 0,
                                 **fields)
            entry = None
    return usage


def kernel_name(demangled: str) -> str:
    """A demangled symbol's kernel instance, as the launchers report it: 'void mt::(anonymous
    namespace)::attention_forward_f32_kernel<64, 32, 64>(mt::...)' -> 'attention_forward_f32_kernel<64, 32, 64>'."""
    m = re.search(r"(\w+(?:<[^()]*>)?)\(", demangled)
    if m is None:
        raise ValueError(f"cannot read the kernel name in {demangled!r}")
    return m.group(1)


def _compile(nvcc: str, flags: list[str], source: Path, arch: int, out: Path) -> dict[str, Usage]:
    cmd = [nvcc, "-cubin", *flags, f"-I{CSRC}", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
           "--resource-usage", str(source), "-o", str(out / f"{source.stem}.sm_{arch}.cubin")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return parse_ptxas(result.stdout + result.stderr)


def kernel_usage() -> dict[int, dict[str, Usage]]:
    """Architecture -> kernel instance name -> Usage, for every kernel in csrc/ and every
    architecture of ``architectures()``. Compiles (about a minute) or reuses the cached result."""
    setup = setup_module()
    nvcc = str(cuda_home() / "bin" / "nvcc")
    archs, flags = architectures(), setup.NVCC_FLAGS
    sources = sorted(CSRC.glob("*.cu"))
    digest = hashlib.sha256(json.dumps([archs, flags]).encode())
    digest.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    for path in [*sources, *sorted(CSRC.glob("*.cuh")), Path(__file__)]:
        digest.update(path.read_bytes())
    out = Path(tempfile.gettempdir()) / f"minitransformer_ptxas_{digest.hexdigest()[:16]}"
    cached = out / "usage.json"
    if not cached.exists():
        out.mkdir(parents=True, exist_ok=True)
        jobs = [(source, arch) for arch in archs for source in sources]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            logs = list(pool.map(lambda job: (job[1], _compile(nvcc, flags, *job, out)), jobs))
        mangled = sorted({name for _, usage in logs for name in usage})
        demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True,
                                   text=True, check=True).stdout.splitlines()
        names = {m: kernel_name(d) for m, d in zip(mangled, demangled)}
        table: dict[str, dict[str, dict]] = {str(arch): {} for arch in archs}
        for arch, usage in logs:
            table[str(arch)].update({names[m]: asdict(u) for m, u in usage.items()})
        tmp = out / f"usage.{os.getpid()}.json"
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.rename(cached)  # atomic: a concurrent run never reads half a file
    return {int(arch): {name: Usage(**u) for name, u in kernels.items()}
            for arch, kernels in json.loads(cached.read_text()).items()}


# --------------------------------------------------------------------------- the joined table


@dataclass(frozen=True)
class Launch:
    """A variant of a kernel that a launcher chooses by shared memory (launch_config.cuh)."""

    kernel: str
    smem: int       # dynamic shared memory per block, bytes
    launcher: str   # attention_forward, attention_backward or layernorm_backward
    dtype: int
    D: int          # head dim, or row width


def launches(C) -> list[Launch]:
    """Every variant that a compiled ``_C`` reports: the attention kernels for every dtype and
    head dim, layernorm_backward's for the widest rows it takes, with 16-byte vectors and without."""
    limits = C.limits()
    cases = [(f"attention_{p}", D) for p in ("forward", "backward") for D in limits["attention_head_dims"]]
    widest = limits["layernorm_max_d"]
    cases += [("layernorm_backward", D) for D in (widest, widest - 1)]
    return [Launch(config["kernel"], config["smem"], launcher, dtype, D)
            for launcher, D in cases for dtype in (0, 1, 2)
            for config in C.launch_configs(launcher, dtype, D)]


@dataclass(frozen=True)
class Row:
    """One kernel on one architecture."""

    kernel: str
    arch: int
    usage: Usage
    dynamic_smem: int      # of its launch (the widest rows for layernorm_backward); else 0
    limit: int             # the architecture's shared memory per block
    launched: bool | None  # variants: whether their launcher takes this one on arch

    @property
    def fits(self) -> bool:
        return self.usage.static_smem + self.dynamic_smem <= self.limit


def rows(C, usage: dict[int, dict[str, Usage]]) -> list[Row]:
    """Every kernel that ptxas compiled, on every architecture, with the dynamic shared memory
    of its launch if it takes any, and whether its launcher takes it there."""
    variants = {launch.kernel: launch for launch in launches(C)}
    out = []
    for arch, kernels in sorted(usage.items()):
        if arch not in SHARED_MEMORY_PER_BLOCK:
            raise ValueError(f"sm_{arch}'s shared memory per block is unknown: add it to SHARED_MEMORY_PER_BLOCK")
        limit = SHARED_MEMORY_PER_BLOCK[arch]
        for kernel, u in sorted(kernels.items()):
            launch, launched = variants.get(kernel), None
            if launch is not None:
                chosen = C.launch_config(launch.launcher, launch.dtype, launch.D, limit)
                launched = chosen is not None and chosen["kernel"] == kernel
            out.append(Row(kernel, arch, u, launch.smem if launch else 0, limit, launched))
    return out


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table, one line per kernel and a column per architecture."""
    archs = sorted({r.arch for r in rows})
    by_kernel: dict[str, dict[int, Row]] = {}
    for r in rows:
        by_kernel.setdefault(r.kernel, {})[r.arch] = r
    lines = ["kernel | dynamic smem | " + " | ".join(f"sm_{a} (limit {SHARED_MEMORY_PER_BLOCK[a]})" for a in archs),
             "--- | ---: | " + " | ".join("---" for _ in archs)]
    for kernel, per_arch in sorted(by_kernel.items()):
        smem = next(iter(per_arch.values())).dynamic_smem
        cells = []
        for arch in archs:
            r = per_arch.get(arch)
            if r is None:
                cells.append("not compiled")
                continue
            if r.launched is None:
                verdict = "fits" if r.fits else "TOO BIG"
            else:
                verdict = "launched" if r.launched else "too big" if not r.fits else "a larger one fits"
            cells.append(f"{r.usage.registers} regs, {r.usage.spill_stores + r.usage.spill_loads} B spilled, "
                         f"{r.usage.static_smem} B static: {verdict}")
        lines.append(f"`{kernel}` | {smem} | " + " | ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- occupancy


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    """How many blocks of a kernel one SM holds at once, and what stops it holding more."""

    blocks: int
    limited_by: str  # "registers", "shared memory", "threads" or "blocks" (the SM's slots), or several
    warps: int       # resident warps
    fraction: float  # of the SM's warp slots


def occupancy(arch: int, threads: int, registers: int, shared: int) -> Occupancy:
    """Resident blocks per SM of a kernel with ``threads`` per block, ``registers`` per thread
    and ``shared`` bytes of shared memory per block (static plus dynamic), by the allocation
    rules above. 0 blocks: the block cannot run there at all."""
    sm = SMS[arch]
    warps = -(-threads // 32)
    per_warp = _round_up(registers * 32, REGISTER_UNIT)
    per_block = _round_up(shared + RESERVED_SHARED, SHARED_UNIT)
    limits = {
        "registers": (sm.registers // SUB_PARTITIONS // per_warp * SUB_PARTITIONS) // warps if per_warp else sm.blocks,
        "shared memory": sm.shared // per_block,
        "threads": sm.threads // 32 // warps,
        "blocks": sm.blocks,
    }
    # A block's registers are checked as if its warps filled every sub-partition alike.
    if registers > MAX_REGISTERS or per_warp * _round_up(warps, SUB_PARTITIONS) > sm.registers:
        limits["registers"] = 0
    blocks = min(limits.values())
    limited_by = " and ".join(name for name, n in limits.items() if n == blocks)
    return Occupancy(blocks, limited_by, blocks * warps, blocks * warps / (sm.threads // 32))


def _launch_everything(launch, cupy) -> None:
    """Every launcher at every dtype and width it takes a separate kernel instance for, on small
    shapes: what matters is which instance each launches, with how many threads."""
    import numpy as np

    lim = launch.limits()
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16", "bfloat16"):
        def array(*shape):
            return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

        for D in lim["attention_head_dims"]:
            q, k, v, do = (array(1, 2, 8, D) for _ in range(4))
            o, lse = launch.attention_forward(q, k, v)
            launch.attention_backward(q, k, v, o, lse, do)
            launch.attention_naive_forward(q, k, v)
        # One instance per dtype whose shared memory grows with D: launched at its largest D.
        q, k, v = (array(1, 2, 8, lim["attention_tiled_max_d"]) for _ in range(3))
        launch.attention_tiled_forward(q, k, v)
        for D in (lim["layernorm_max_d"], lim["layernorm_max_d"] - 1):  # 16-byte vectors, and not
            x = array(2, D)
            y, mean, rstd = launch.layernorm_forward(x, array(D), array(D))
            launch.layernorm_backward(x, array(D), mean, rstd, array(2, D))
        for V in (40, 2000):  # a warp per row, and a block per row
            x = array(2, V)
            launch.softmax_backward(launch.softmax_forward(x), array(2, V))
            launch.cross_entropy_forward(x, cupy.zeros(2, dtype=cupy.int64))


def _launched_here() -> dict[str, list[int]]:
    """On the emulated device (MT_EMULATE_CUDA=1), as configured: kernel instance -> [threads,
    dynamic shared memory] of what _launch_everything launches."""
    from .. import backend
    from . import launch

    if not backend.is_emulated("cuda"):
        raise RuntimeError("_launched_here runs on the emulated device: set MT_EMULATE_CUDA=1")
    with emulator.logged_launches() as log:
        _launch_everything(launch, backend._cupy)
    kernels: dict[str, list[int]] = {}
    for record in log:
        name = kernel_name(record.kernel)
        seen = kernels.setdefault(name, [record.threads, record.smem])
        if seen != [record.threads, record.smem]:
            raise RuntimeError(f"{name} was launched with {seen} and with {[record.threads, record.smem]} "
                               f"threads and bytes")
    return kernels


def launched() -> dict[int, dict[str, tuple[int, int]]]:
    """Architecture -> kernel instance -> (threads, dynamic shared memory) of every launch the
    launchers make there: a process each, on the emulated device configured with that
    architecture's shared memory per block (about a minute in all)."""
    out = {}
    for arch, limit in sorted(SHARED_MEMORY_PER_BLOCK.items()):
        kernels = emulator.run_configured(
            "import json\nfrom minitransformer.kernels import resources\nprint(json.dumps(resources._launched_here()))",
            limit, f"recording the launches on sm_{arch}")
        out[arch] = {k: tuple(v) for k, v in kernels.items()}
    return out


@dataclass(frozen=True)
class Resident:
    """A launched kernel instance on one architecture: what it asks of an SM, and how many of
    its blocks an SM holds."""

    kernel: str
    arch: int
    threads: int
    usage: Usage
    dynamic_smem: int
    occupancy: Occupancy

    @property
    def spilled(self) -> int:
        return self.usage.spill_stores + self.usage.spill_loads


def residents(usage: dict[int, dict[str, Usage]], launches: dict[int, dict[str, tuple[int, int]]]) -> list[Resident]:
    """Every launched instance on every architecture, with ptxas's figures and its occupancy."""
    out = []
    for arch, kernels in sorted(launches.items()):
        for kernel, (threads, smem) in sorted(kernels.items()):
            u = usage[arch][kernel]
            out.append(Resident(kernel, arch, threads, u, smem,
                                occupancy(arch, threads, u.registers, u.static_smem + smem)))
    return out


def occupancy_table(residents: list[Resident]) -> str:
    """The launched instances as a Markdown table, a line each per architecture."""
    lines = ["arch | kernel | threads | registers | spilled | shared memory | blocks / SM | limited by | warps",
             "--- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---:"]
    for r in residents:
        o = r.occupancy
        lines.append(f"sm_{r.arch} | `{r.kernel}` | {r.threads} | {r.usage.registers} | {r.spilled} B | "
                     f"{r.usage.static_smem + r.dynamic_smem} B | {o.blocks} | {o.limited_by} | "
                     f"{o.warps} ({o.fraction:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    for reason in (unavailable_reason(), emulator.unavailable_reason()):
        if reason:
            raise SystemExit(f"cannot build the table: {reason}")
    usage = kernel_usage()
    print(table(rows(emulator.build(), usage)))
    print()
    print(occupancy_table(residents(usage, launched())))
