"""Build csrc/ (kernels and bindings) with g++ against emu.h into a CPU-only ``_C`` module.

The result has the same functions as ``minitransformer._C``, taking host pointers (NumPy's
``a.ctypes.data``) where the real one takes device pointers, so a test can drive the very
binding checks, launchers and kernels that run on the GPU. The build (about a minute on two
cores) is cached in the temp directory under a hash of the sources.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
EMU_H = Path(__file__).with_name("emu.h")

# kernel<<<grid, block, smem, stream>>>(  ->  mt_emu::launch(kernel, grid, block, smem, stream)(
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;{}]*?>)?)\s*<<<(.*?)>>>\s*\(", re.S)
_DYNAMIC_SMEM = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w[\w ]*?) (\w+)\[\];")


def _cuda_include() -> Path | None:
    spec = importlib.util.spec_from_file_location("minitransformer_setup", ROOT / "setup.py")
    setup_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_module)  # defines helpers only; setup() runs as __main__
    home = setup_module.find_cuda_home()
    return None if home is None else home / "include"


def unavailable_reason() -> str | None:
    if not CSRC.is_dir():
        return f"{CSRC} not found: the emulator compiles csrc/ of a source checkout"
    if shutil.which("g++") is None:
        return "g++ is not installed"
    if _cuda_include() is None:
        return "no CUDA toolkit headers (cuda_fp16.h) found"
    if importlib.util.find_spec("pybind11") is None:
        return "pybind11 is not installed"
    return None


def translate(source: str) -> str:
    source = source.replace("#include <cuda_pipeline.h>", "")  # emu.h provides the primitives
    source = _LAUNCH.sub(r"mt_emu::launch(\1, \2)(", source)
    return _DYNAMIC_SMEM.sub(r"\1* \2 = reinterpret_cast<\1*>(mt_emu::dynamic_smem());", source)


def build():
    """Compile (or reuse) the emulated extension and return the imported module."""
    import pybind11

    sources = sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.cuh"))
    digest = hashlib.sha256()
    for path in [*sources, EMU_H, Path(__file__)]:
        digest.update(path.read_bytes())
    out = Path(tempfile.gettempdir()) / f"minitransformer_emu_{digest.hexdigest()[:16]}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    module_path = out / f"_C{suffix}"
    if not module_path.exists():
        work = out / f"build-{os.getpid()}"  # concurrent test runs never share object files
        work.mkdir(parents=True, exist_ok=True)
        flags = ["g++", "-std=c++20", "-O2", "-fPIC", "-pthread", "-w",
                 f"-I{_cuda_include()}", f"-I{CSRC}", f"-I{pybind11.get_include()}",
                 f"-I{sysconfig.get_paths()['include']}"]
        jobs = []
        for path in sources:
            if path.suffix == ".cuh":
                continue
            cpp = work / (path.stem + ("_cu.cpp" if path.suffix == ".cu" else ".cpp"))
            cpp.write_text(translate(path.read_text()) if path.suffix == ".cu" else path.read_text())
            extra = ["-include", str(EMU_H)] if path.suffix == ".cu" else []
            jobs.append([*flags, *extra, "-c", str(cpp), "-o", str(cpp.with_suffix(".o"))])
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
        for cmd, result in zip(jobs, results):
            if result.returncode:
                raise RuntimeError(f"emulated build failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
        objects = [str(Path(cmd[-1])) for cmd in jobs]
        tmp = work / module_path.name
        subprocess.run(["g++", "-shared", "-pthread", *objects, "-o", str(tmp)], check=True)
        tmp.rename(module_path)  # atomic: a concurrent run never loads half a file
        shutil.rmtree(work)
    spec = importlib.util.spec_from_file_location("minitransformer_emulated._C", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault("minitransformer_emulated._C", module)
    return module
