"""What each CUDA kernel of csrc/ asks of every GPU architecture setup.py builds for.

    python -m minitransformer.kernels.resources     prints the table below (needs nvcc and g++)

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

# cudaDevAttrMaxSharedMemoryPerBlockOptin of each architecture, bytes (CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability"). An architecture added to setup.py
# needs its figure here.
SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


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


def kernel_name(mangled: str, demangled: str) -> str:
    """The instance's name as the launchers report it: 'void mt::(anonymous namespace)::
    attention_forward_f32_kernel<64, 32, 64>(mt::...)' -> 'attention_forward_f32_kernel<64, 32, 64>'."""
    m = re.search(r"(\w+(?:<[^()]*>)?)\(", demangled)
    if m is None:
        raise ValueError(f"cannot read the kernel name in {demangled!r} (from {mangled})")
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
        names = {m: kernel_name(m, d) for m, d in zip(mangled, demangled)}
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


if __name__ == "__main__":
    for reason in (unavailable_reason(), emulator.unavailable_reason()):
        if reason:
            raise SystemExit(f"cannot build the table: {reason}")
    print(table(rows(emulator.build(), kernel_usage())))
