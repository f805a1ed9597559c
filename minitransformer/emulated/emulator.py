"""Build csrc/ (kernels and bindings) with g++ against emu.h into a CPU-only ``_C`` module.

The result has the same functions as ``minitransformer.kernels._C``, taking host pointers (NumPy's
``a.ctypes.data``) where the real one takes device pointers, so a test can drive the very
binding checks, launchers and kernels that run on the GPU. emu.h says how CUDA is emulated.

Variants, chosen by ``compile_variant(sanitize, mutations)``:

    sanitize=None       plain, -O2; ``build()`` compiles and imports it
    sanitize="address"  AddressSanitizer with UndefinedBehaviorSanitizer: out-of-bounds and
                        misaligned accesses of global buffers and shared memory, indices past
                        fixed-size arrays, other undefined behaviour
    sanitize="thread"   ThreadSanitizer: races between the threads of a block
    sanitize="count"    no sanitizer: every load and store calls emu.h's counters, and
                        ``logged_launches`` gives each launch's memory traffic (Count); loads
                        as the plain one does (MT_EMULATED_KERNELS)
    mutations           planted bugs, textual edits of csrc/ before the build: a test that a
                        check flags them shows that it sees bugs in the real kernels

Every variant poisons shared memory at every block start (emu.h), so a read of shared memory
before the block wrote it turns results into NaN, and runs the blocks of a launch in a shuffled
order, never in index order; ``block_seed`` gives the seed that replays the orders. A sanitized module loads only in a process
whose sanitizer runtime was loaded first (Python is not built with it): run it in a fresh
process with ``sanitizer_environment(sanitize)``.

Builds are cached in the temp directory one object file at a time, under a hash of what its
compilation reads (source, headers, emu.h, flags, compiler): a planted bug recompiles only the
files it changes, and bindings.cpp, host code, is compiled once, plain, for every variant.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
EMU_H = Path(__file__).with_name("emu.h")
CACHE = Path(tempfile.gettempdir()) / "minitransformer_emu_cache"

SANITIZERS = ("address", "thread")
# Sanitized builds: -O1 as the sanitizers' manuals advise, line tables for the reports, and
# memcpy/memset left as calls that the runtime intercepts (g++ inlines small ones, and TSan
# does not check inlined copies: it missed every cp.async tile write).
_FLAGS = {
    None: ["-O2"],
    "address": ["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                "-fno-sanitize-recover=all", "-fno-builtin-memcpy", "-fno-builtin-memset"],
    "thread": ["-O1", "-g1", "-fsanitize=thread", "-fno-builtin-memcpy", "-fno-builtin-memset"],
    # Not a sanitizer: its instrumentation calls emu.h's counters before every load and store
    # (no runtime, no shadow memory). -O1 keeps the accesses the source states (no vectorising),
    # and without SRA a 16-byte vector (uint4) stays one access, not four of its members;
    # DWARF 4, whose line tables addr2line reads with the #line file names (5's, as kernels.cpp).
    "count": ["-O1", "-fno-tree-sra", "-g1", "-gdwarf-4", "-DMT_EMU_COUNT", "-fsanitize=kernel-address",
              "--param=asan-instrumentation-with-call-threshold=0", "--param=asan-stack=0",
              "--param=asan-globals=0", "--param=asan-memintrin=0"],
}
_RUNTIME = {"address": "libasan.so", "thread": "libtsan.so"}

# kernel<<<grid, block, smem, stream>>>(  ->  mt_emu::launch(kernel, grid, block, smem, stream)(
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;{}]*?>)?)\s*<<<(.*?)>>>\s*\(", re.S)
# extern __shared__ T name[];  ->  T* name = the launch's dynamic shared memory
_DYNAMIC_SMEM = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w[\w ]*?) (\w+)\[\];")
# __shared__ T name[N];  ->  struct name_site; auto& name = mt_emu::StaticShared<name_site, T[N]>::array();
_STATIC_SMEM = re.compile(r"(?<!extern )__shared__ (\w[\w:<>, ]*?) (\w+)((?:\[[^\]]+\])+);")


@dataclass(frozen=True)
class Mutation:
    """A planted bug: ``old``, which must occur exactly once in csrc/``file``, becomes ``new``."""

    file: str
    old: str
    new: str


@functools.cache
def setup_module():
    """setup.py as a module, for its helpers (it calls setup() only as __main__)."""
    spec = importlib.util.spec_from_file_location("minitransformer_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cuda_home() -> Path | None:
    """setup.py's CUDA toolkit root, asked once (finding it may run ``nvcc --dryrun``)."""
    return setup_module().find_cuda_home()


def _cuda_include() -> Path | None:
    return None if cuda_home() is None else cuda_home() / "include"


@functools.cache
def _compiler_version() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout


@functools.cache
def _runtime(sanitize: str) -> Path:
    """The g++ sanitizer runtime library (a bare file name when g++ has none)."""
    name = _RUNTIME[sanitize]
    found = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True)
    return Path(found.stdout.strip() or name)


def unavailable_reason(sanitize: str | None = None) -> str | None:
    if not CSRC.is_dir():
        return f"{CSRC} not found: the emulator compiles csrc/ of a source checkout"
    if shutil.which("g++") is None:
        return "g++ is not installed"
    if _cuda_include() is None:
        return "no CUDA toolkit headers (cuda_fp16.h) found"
    if importlib.util.find_spec("pybind11") is None:
        return "pybind11 is not installed"
    if sanitize in _RUNTIME:  # the sanitizers' (the count variant has none)
        if not _runtime(sanitize).is_absolute():
            return f"g++ has no {_RUNTIME[sanitize]} (the {sanitize} sanitizer's runtime)"
        return _runtime_failure(sanitize)
    return None


@functools.cache
def _runtime_failure(sanitize: str) -> str | None:
    """Why Python does not start with the runtime preloaded, if it does not (TSan, for one, can
    fail to map its shadow memory under some kernels' address randomisation)."""
    probe = subprocess.run([sys.executable, "-c", ""], capture_output=True, text=True,
                           env=dict(os.environ, **sanitizer_environment(sanitize)))
    if probe.returncode:
        return f"Python does not start under {_RUNTIME[sanitize]}: {probe.stderr.strip()[-500:]}"
    return None


def translate(source: str) -> str:
    source = source.replace("#include <cuda_pipeline.h>", "")  # emu.h provides the primitives
    source = _LAUNCH.sub(r"mt_emu::launch(\1, \2)(", source)
    source = _DYNAMIC_SMEM.sub(r"\1* \2 = reinterpret_cast<\1*>(mt_emu::dynamic_smem());", source)
    return _STATIC_SMEM.sub(r"struct \2_site; auto& \2 = mt_emu::StaticShared<\2_site, \1\3>::array();",
                            source)


def _sources(mutations) -> dict[str, str]:
    """What the build compiles, by file name: csrc/'s files with the mutations applied, the CUDA
    ones translated (x.cu becoming x_cu.cpp, on which emu.h is force-included)."""
    sources = {p.name: p.read_text() for p in sorted(CSRC.iterdir()) if p.suffix in (".cu", ".cuh", ".cpp")}
    for m in mutations:
        count = sources[m.file].count(m.old)
        if count != 1:
            raise ValueError(f"{m} matches {count} places in csrc/{m.file}, not one")
        sources[m.file] = sources[m.file].replace(m.old, m.new)
    translated = {}
    for name, text in sources.items():
        if name.endswith((".cu", ".cuh")):  # line for line: reports name csrc/'s lines
            text = f'#line 1 "{CSRC / name}"\n{translate(text)}'
        translated[name.removesuffix(".cu") + "_cu.cpp" if name.endswith(".cu") else name] = text
    return translated


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if result.returncode:
        raise RuntimeError(f"emulated build failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")


def objects(sanitize: str | None = None, mutations=()) -> dict[str, Path]:
    """Compile (or reuse) the object files of a variant: {translated source name: object}."""
    import pybind11

    sources = _sources(mutations)
    common = ["g++", "-std=c++20", "-fPIC", "-pthread", "-w", f"-I{_cuda_include()}",
              f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    headers = [text for name, text in sources.items() if name.endswith(".cuh")]
    emu = EMU_H.read_text()
    commands, objects = {}, {}
    for name, text in sources.items():
        if name.endswith("_cu.cpp"):  # kernels: the variant's flags, and emu.h ahead of the source
            flags = [*common, *_FLAGS[sanitize], "-include", str(EMU_H)]
            key = _digest(_compiler_version(), *flags, emu, *headers, text)
        elif name.endswith(".cpp"):  # bindings.cpp, host code: plain in every variant, built once
            flags = [*common, *_FLAGS[None]]
            key = _digest(_compiler_version(), *flags, *headers, text)  # it includes launch_config.cuh
        else:
            continue
        objects[name] = CACHE / "objects" / f"{key}.o"
        commands[name] = [*flags, "-c", name, "-o", f"{name}.o"]
    missing = [name for name, obj in objects.items() if not obj.exists()]
    if missing:
        (CACHE / "objects").mkdir(parents=True, exist_ok=True)
        # The translated headers sit beside the sources, where `#include "common.cuh"` looks first.
        work = Path(tempfile.mkdtemp(dir=CACHE))
        try:
            for name, text in sources.items():
                (work / name).write_text(text)

            def build(name: str) -> None:
                # One process compiles an object while another that needs it waits (pytest's
                # workers build the same variant at once), then finds it built.
                with open(objects[name].with_suffix(".lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if not objects[name].exists():
                        _run(commands[name], work)
                        (work / f"{name}.o").rename(objects[name])  # atomic: never half a file

            with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
                list(pool.map(build, missing))
        finally:
            shutil.rmtree(work)
    return objects


def compile_variant(sanitize: str | None = None, mutations=()) -> Path:
    """Compile (or reuse) a variant of the emulated extension; returns its module's path."""
    linked = sorted(str(obj) for obj in objects(sanitize, mutations).values())
    module = CACHE / _digest(*linked, *_FLAGS[sanitize]) / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not module.exists():
        module.parent.mkdir(parents=True, exist_ok=True)
        partial = module.with_name(f"{module.name}.{os.getpid()}")
        _run(["g++", "-shared", "-pthread", *_FLAGS[sanitize], *linked, "-o", str(partial)])
        partial.rename(module)
    return module


def compile_kernels(source: str, sanitize: str | None = None, name: str = "kernels.cu") -> Path:
    """Compile (or reuse) CUDA source of one's own (a test's kernels, and extern "C" functions
    that launch them) as csrc/'s kernels are compiled: translated, emu.h ahead of it, csrc/'s
    headers beside it, its lines reported as ``name``'s. Returns the shared library's path,
    for ctypes.CDLL."""
    headers = {name: text for name, text in _sources(()).items() if name.endswith(".cuh")}
    cmd = ["g++", "-std=c++20", "-fPIC", "-pthread", "-w", "-shared", f"-I{_cuda_include()}",
           *_FLAGS[sanitize], "-include", str(EMU_H), "kernels.cpp", "-o", "kernels.so"]
    text = f'#line 1 "{name}"\n{translate(source)}'
    library = CACHE / "kernels" / _digest(_compiler_version(), *cmd, EMU_H.read_text(), *headers.values(), text) / "kernels.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=library.parent))
        try:
            for name, header in headers.items():
                (work / name).write_text(header)
            (work / "kernels.cpp").write_text(text)
            _run(cmd, work)
            (work / "kernels.so").rename(library)  # atomic, as in objects()
        finally:
            shutil.rmtree(work)
    return library


def load(path: Path):
    """Import the module at ``path`` (a sanitized one only where its runtime is loaded)."""
    spec = importlib.util.spec_from_file_location("minitransformer_emulated._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault("minitransformer_emulated._C", module)
    return module


_built: Path | None = None  # the module build() imported


@functools.cache
def build():
    """Compile (or reuse) the plain emulated extension and return the imported module: once a
    process (the emulated device and the kernel tests share it). ``MT_EMULATED_KERNELS=PATH``
    takes the unsanitized variant at PATH instead (from ``compile_variant``: a planted bug,
    which the mutation tester, tools/kernels/mutants.py, puts to the kernel tests so)."""
    global _built
    path = Path(os.environ["MT_EMULATED_KERNELS"]) if os.environ.get("MT_EMULATED_KERNELS") else compile_variant()
    module = load(path)
    _built = path
    return module


def _library(path: Path | None):
    path = path or _built
    return None if path is None else ctypes.CDLL(str(path))  # the loaded module, not a second copy


def block_seed(path: Path | None = None) -> int | None:
    """The seed of the block orders (emu.h) of the module at ``path`` (default: build()'s), loaded
    in this process; None if build() has not run. ``MT_EMU_BLOCK_SEED=<seed>`` replays them."""
    library = _library(path)
    if library is None:
        return None
    library.mt_emu_block_seed.restype = ctypes.c_ulonglong
    return int(library.mt_emu_block_seed())


def restart_block_order(path: Path | None = None) -> None:
    """Start the sequence of block orders again (if the module is loaded): the next launch gets
    the first order of the seed, as if the process had just begun."""
    library = _library(path)
    if library is not None:
        library.mt_emu_restart_block_order()


# What emu.h's Counting counts, by its CountKind.
KINDS = ("global load", "global store", "global atomic", "cp.async read", "shared load", "shared store",
         "ldmatrix", "cp.async write", "barrier", "mma")
GLOBAL_KINDS, SHARED_KINDS = KINDS[:4], KINDS[4:8]  # costed in sectors, in wavefronts


@dataclass(frozen=True)
class Count:
    """What one program point of a launch cost, counted by the count variant (emu.h's Counting)."""

    kind: str      # one of KINDS
    line: str      # where in the source, "attention.cu:412"
    requests: int  # warp instructions
    accesses: int  # their lanes' accesses
    bytes: int     # the bytes those accessed
    units: int     # 32-byte sectors (global memory), wavefronts (shared memory), one a barrier or mma
    ideal: int     # the fewest sectors or wavefronts the requests' bytes could take


@dataclass(frozen=True)
class LoggedLaunch:
    """One kernel launch of the emulated module, as logged_launches records it."""

    kernel: str                    # the kernel's symbol, demangled: "void mt::...::name<args>(params)"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int                      # dynamic shared memory, bytes
    counts: tuple[Count, ...] = ()  # the count variant's, by program point

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def total(self, *kinds: str) -> Count:
        """The counts of these kinds (default: all) summed over the launch's program points."""
        mine = [c for c in self.counts if not kinds or c.kind in kinds]
        return Count("+".join(kinds) or "all", "", *(sum(getattr(c, f) for c in mine)
                                                     for f in ("requests", "accesses", "bytes", "units", "ideal")))


@functools.cache
def _load_base(path: Path) -> tuple[int, dict[int, str]]:
    """Where the module at ``path``, loaded here, begins, and its functions by offset in the file
    (demangled; local ones too: the kernels live in an anonymous namespace). nm gives offsets;
    one known symbol's address gives where the loader put them."""
    listing = subprocess.run(["nm", "--defined-only", "--demangle", str(path)], capture_output=True, text=True,
                             check=True).stdout
    names = {}
    for line in listing.splitlines():
        value, kind, name = line.split(" ", 2)
        if kind in "tTwW":
            names[int(value, 16)] = name
    anchor = ctypes.cast(_library(path).mt_emu_launch_count, ctypes.c_void_p).value
    return anchor - next(offset for offset, name in names.items() if name == "mt_emu_launch_count"), names


def _source_lines(path: Path, offsets: list[int]) -> dict[int, str]:
    """"file:line" of each offset in the module at ``path`` (a return address: its call's line)."""
    if not offsets:
        return {}
    found = subprocess.run(["addr2line", "-e", str(path), *(hex(o - 1) for o in offsets)], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    return {o: f"{Path(where.rsplit(':', 1)[0]).name}:{where.rsplit(':', 1)[1].split()[0]}"
            for o, where in zip(offsets, found)}


def _by_line(rows: list[list[int]], line) -> tuple[Count, ...]:
    """Counts of (kind, return address, figures...) summed by kind and source line (an unrolled
    loop has a program point per copy), in the order of the source."""
    summed: dict[tuple[str, str], list[int]] = {}
    for kind, pc, *figures in rows:
        into = summed.setdefault((KINDS[kind], line(pc)), [0] * len(figures))
        into[:] = [a + b for a, b in zip(into, figures)]

    def place(key):
        file, number = key[1].rsplit(":", 1)
        return file, int(number) if number.isdigit() else 0, KINDS.index(key[0])

    return tuple(Count(kind, where, *figures) for (kind, where), figures in sorted(summed.items(), key=lambda i: place(i[0])))


@contextlib.contextmanager
def logged_launches(path: Path | None = None, memory=()):
    """``with logged_launches() as log:`` fills ``log`` (a list) with the LoggedLaunch of every
    kernel launched inside the block, in order, when the block ends: the kernel instance each
    launcher chose and its threads. For the module at ``path`` (default: build()'s), loaded here.

    A module of the count variant counts each launch too (LoggedLaunch.counts), in the global
    memory of the emulated CuPy's arrays and of ``memory`` (NumPy arrays that a test's own
    kernels take)."""
    path = path or _built
    if path is None:
        raise RuntimeError("logged_launches: the emulated kernels are not loaded (emulator.build())")
    library = _library(path)
    library.mt_emu_launch_count.restype = ctypes.c_size_t
    base, names = _load_base(path)
    counts = hasattr(library, "mt_emu_counts")
    emulated = sys.modules.get("minitransformer.emulated.cupy")
    if counts:
        library.mt_emu_count_records.restype = ctypes.c_size_t

        def observe(address: int, nbytes: int) -> None:
            library.mt_emu_count_global(ctypes.c_size_t(address), ctypes.c_size_t(nbytes))

        arrays = [(a.ctypes.data, a.nbytes) for a in memory]
        if emulated is not None:
            arrays += [(r.address, r.nbytes) for r in emulated._allocations.values()]
            emulated._observers.append(observe)
        for address, nbytes in arrays:
            observe(address, nbytes)
    log: list[LoggedLaunch] = []
    library.mt_emu_log_launches(1)
    try:
        yield log
    finally:
        library.mt_emu_log_launches(0)
        by_launch: dict[int, list[list[int]]] = {}
        if counts:
            if emulated is not None:
                emulated._observers.remove(observe)
            for address, _ in arrays:
                observe(address, 0)
            record = (ctypes.c_ulonglong * 8)()
            for i in range(library.mt_emu_count_records()):
                library.mt_emu_count_record(ctypes.c_size_t(i), record)
                by_launch.setdefault(record[0], []).append(list(record)[1:])
        lines = _source_lines(path, sorted({pc - base for rows in by_launch.values() for _, pc, *_ in rows}))
        record = (ctypes.c_ulonglong * 8)()
        for i in range(library.mt_emu_launch_count()):
            library.mt_emu_launch_record(ctypes.c_size_t(i), record)
            kernel, *dims, smem = list(record)
            log.append(LoggedLaunch(names[kernel - base], tuple(dims[:3]), tuple(dims[3:]), smem,
                                    _by_line(by_launch.get(i, []), lambda pc: lines[pc - base])))


def run_configured(code: str, shared_memory_per_block: int, what: str, env: dict[str, str] | None = None):
    """The JSON value that Python ``code`` prints on its last line, run in a process of its own on
    the emulated device configured with an architecture's shared memory per block (by which the
    launchers choose their tiles), with ``env`` added to the environment; ``what`` names the
    work in the error raised if the process fails."""
    program = "\n".join(["from minitransformer.emulated import cupy as emulated_cupy",
                         f"emulated_cupy.configure(max_shared_memory_per_block_optin={shared_memory_per_block})",
                         code])
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "MT_EMULATE_CUDA": "1", **(env or {})})
    if result.returncode:
        raise RuntimeError(f"{what} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def run_limited(cmd: list[str], cpu_seconds: int, wall_seconds: int = 3600,
                **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with its CPU time limited to ``cpu_seconds`` (RLIMIT_CPU: the
    kernel ends it with SIGXCPU), where a wall-clock timeout would trip on a busy machine: a
    sanitized run takes the same CPU seconds beside a training job as alone, and twice the
    time. A run that waits without computing is stopped by ``wall_seconds`` of wall clock
    besides (the emulator reports the hangs it knows, barrier deadlocks, by itself)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))

    return subprocess.run(cmd, preexec_fn=limit, timeout=wall_seconds, **kwargs)


def sanitizer_environment(sanitize: str) -> dict[str, str]:
    """Variables to add to the environment of a process that loads a ``sanitize`` variant."""
    options = {
        # The runtime must initialise before anything it instruments: Python is not built with it.
        "LD_PRELOAD": str(_runtime(sanitize)),
        # OpenBLAS's worker threads synchronise out of TSan's sight: it reports races in dgemm.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    if sanitize == "address":  # every report ends the run; Python's own leaks are no concern
        options["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1"
        options["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    else:
        options["TSAN_OPTIONS"] = "halt_on_error=1"
    return options
