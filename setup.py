"""Build script: everything is pure Python except the optional CUDA extension
``minitransformer.kernels._C``, compiled from csrc/ with nvcc when a CUDA toolkit is found.

    pip install -e .                          builds _C if nvcc is found, pure Python otherwise
    MINITRANSFORMER_CUDA=0 pip install -e .   never builds _C
    MINITRANSFORMER_CUDA_ARCHS="80;90"        GPU architectures (default "80;86;89;90": machine
                                              code for A100, RTX 30 / A10, RTX 40 / L4 / L40 and
                                              H100, plus compute_90 PTX that newer GPUs
                                              JIT-compile)

The toolkit is found through CUDA_HOME (or CUDA_PATH), else through the nvcc on PATH, else at
/usr/local/cuda. The nvcc on PATH may be a wrapper script (/usr/local/bin/nvcc exec'ing the
real one), so the toolkit root is asked of nvcc itself (`nvcc --dryrun` prints the directory
it runs from) rather than guessed from the wrapper's location. When a toolkit is found, a compile error fails the build:
CI, which has nvcc but no GPU, thereby compiles all of csrc/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def find_cuda_home() -> Path | None:
    """Root of the CUDA toolkit (the directory holding bin/nvcc and include/), or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home)
    nvcc = shutil.which("nvcc")
    if nvcc is None:  # not on PATH: the conventional install location, if any
        default = Path("/usr/local/cuda")
        return default if (default / "bin" / "nvcc").exists() else None
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # nvcc reports its own location as `#$ _HERE_=/usr/local/cuda-13.0/bin` (on stderr).
    match = re.search(r"^#\$ _HERE_=(.+)$", dry.stderr + dry.stdout, re.MULTILINE)
    bin_dir = Path(match.group(1).strip()) if match else Path(os.path.realpath(nvcc)).parent
    home = bin_dir.parent
    return home if (home / "include" / "cuda_runtime.h").exists() else None


def cuda_wanted() -> bool:
    return os.environ.get("MINITRANSFORMER_CUDA", "1").strip().lower() not in ("0", "false", "no", "off")


# Device-code flags, shared with minitransformer/kernels/resources.py, which compiles csrc/ the
# same way to read each kernel's registers and shared memory from ptxas.
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


DEFAULT_ARCHS = [80, 86, 89, 90]


def cuda_archs() -> list[int]:
    """The GPU architectures (compute capabilities, as 80 for sm_80) to compile for."""
    archs = os.environ.get("MINITRANSFORMER_CUDA_ARCHS")
    return DEFAULT_ARCHS if archs is None else [int(a) for a in archs.split(";") if a.strip()]


def gencode_flags() -> list[str]:
    archs = cuda_archs()
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX for later GPUs
    return flags


class CudaBuildExt(build_ext):
    """build_ext that sends .cu files to nvcc and everything else to the C++ compiler."""

    cuda_home: Path

    def build_extensions(self):
        nvcc = str(self.cuda_home / "bin" / "nvcc")
        self.compiler.src_extensions.append(".cu")
        default_compile = self.compiler._compile

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(".cu"):
                self.spawn([nvcc, "-c", src, "-o", obj, *pp_opts, *extra_postargs["nvcc"]])
            else:
                default_compile(obj, src, ext, cc_args, extra_postargs["cxx"], pp_opts)

        self.compiler._compile = compile_one
        super().build_extensions()


def cuda_extension(cuda_home: Path) -> Extension:
    import pybind11

    lib = cuda_home / "lib64"
    if not (lib / "libcudart_static.a").exists():
        lib = cuda_home / "targets" / "x86_64-linux" / "lib"
    return Extension(
        "minitransformer.kernels._C",
        sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.cu"))],
        include_dirs=[pybind11.get_include(), str(cuda_home / "include"), str(CSRC)],
        library_dirs=[str(lib)],
        # The static runtime: the module then needs only the driver (libcuda) at import time,
        # not a libcudart.so of the exact version it was built against.
        libraries=["cudart_static", "rt", "dl", "pthread"],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", "-fvisibility=hidden"],
            "nvcc": [*NVCC_FLAGS, "--threads", "2", "-Xcompiler", "-fPIC",
                     "-Xcompiler", "-fvisibility=hidden", *gencode_flags()],
        },
        language="c++",
    )


if __name__ == "__main__":  # how pip's build backend runs this file; tests import it instead
    ext_modules, cmdclass = [], {}
    if cuda_wanted():
        home = find_cuda_home()
        if home is not None:
            from pybind11.setup_helpers import ParallelCompile

            # csrc/'s files compiled side by side, one per core (MAX_JOBS=N for fewer): nvcc's
            # --threads splits only one file's architectures.
            ParallelCompile("MAX_JOBS").install()
            CudaBuildExt.cuda_home = home
            ext_modules, cmdclass = [cuda_extension(home)], {"build_ext": CudaBuildExt}
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
