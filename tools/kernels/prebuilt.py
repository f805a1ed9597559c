"""minitransformer.kernels._C built here, on the CPU, for a GPU machine lent for minutes: nvcc's
minutes are spent before the loan, not during it.

    python tools/kernels/prebuilt.py build --python PY  # here: .gpu_build/ (git-ignored)
    python tools/kernels/prebuilt.py install            # there: benchmarks/gpu_check.sh's first stage

``build`` compiles csrc/ with nvcc for sm_90 (an H100 or H200; ``--arch 80`` for an A100) with
the Python the GPU machine runs (``--python``: the lent machines' is 3.12, which needs pybind11
and setuptools here, as in ``python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install
pybind11 setuptools``), into .gpu_build/ (about 14 MB) with manifest.json, what the binary
needs, and the wheels of the package's pure-Python dependencies (the GPU machines' image lacks
fastjsonschema, sacremoses and subword-nmt, and nothing can be fetched there), which
gpu_check.sh puts on the path. Name .gpu_build in the device call's ``carry`` so that it travels.

``install`` checks the manifest against the machine before anything uses the build: the GPU's
compute capability among the architectures compiled (its machine code: no PTX compiled at
load), a driver whose CUDA version runs the CUDA runtime linked in (the same major version or
a later one: CUDA's minor version compatibility), the Python ABI the module was compiled for
(EXT_SUFFIX), and csrc/ as compiled (a checkout changed since would run stale kernels). If
all hold, it copies _C into minitransformer/kernels/; if one fails it says which and exits 1,
and gpu_check.sh builds on the GPU machine instead.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from minitransformer import cli, files

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / ".gpu_build"


def sources_digest(root: Path = ROOT) -> str:
    """What the build read: csrc/ and setup.py (its flags)."""
    digest = hashlib.sha256()
    for path in sorted((root / "csrc").rglob("*")) + [root / "setup.py"]:
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def nvcc_version(nvcc: str) -> int:
    """The CUDA version of ``nvcc`` as the driver API writes it: 13000 for 13.0."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", out).groups()
    return int(major) * 1000 + int(minor) * 10


def pure_dependencies() -> list[str]:
    """``name==version`` of each runtime dependency of the package (pyproject.toml's, not an
    install's metadata, which an editable install leaves stale) that is pure Python here."""
    found = []
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group()
        dist = metadata.distribution(name)
        if "Root-Is-Purelib: true" in (dist.read_text("WHEEL") or ""):
            found.append(f"{name}=={dist.version}")
    return found


def build(arch: int, python: str, out: Path) -> dict:
    """Compile _C for ``arch`` with ``python`` into ``out``, with the pure-Python dependencies'
    wheels; returns the manifest."""
    sys.path.insert(0, str(ROOT))
    import setup  # noqa: E402 - the build's own toolkit lookup

    home = setup.find_cuda_home()
    if home is None:
        raise SystemExit("prebuilt.py build: no CUDA toolkit (nvcc) found: set CUDA_HOME")
    facts = json.loads(subprocess.run(
        [python, "-c", "import json, sys, sysconfig; print(json.dumps([sysconfig.get_config_var('EXT_SUFFIX'), "
                       "'%d.%d.%d' % sys.version_info[:3]]))"], capture_output=True, text=True, check=True).stdout)
    staging = out.with_name(out.name + f".partial.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run([python, "setup.py", "-q", "build_ext", "--build-lib", str(staging), "--build-temp", str(staging / "objects")],
                   cwd=ROOT, env={**os.environ, "MINITRANSFORMER_CUDA_ARCHS": str(arch)}, check=True)
    shutil.rmtree(staging / "objects")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", facts[1].rsplit(".", 1)[0], "-d", str(staging / "wheels"), *pure_dependencies()],
                   check=True)
    manifest = {"archs": [arch], "cuda": nvcc_version(str(home / "bin" / "nvcc")), "ext_suffix": facts[0],
                "python": facts[1], "sources": sources_digest(), "extension": f"minitransformer/kernels/_C{facts[0]}"}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return manifest


# --------------------------------------------------------------------------- on the GPU


def driver_version() -> int | None:
    """The CUDA version the driver supports (13000 for 13.0), None without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    return version.value if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def compute_capability() -> int | None:
    """The first GPU's compute capability as 90 for 9.0, None without nvidia-smi or a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out[0].replace(".", "")) if out and re.fullmatch(r"\d+\.\d", out[0]) else None


def machine() -> dict:
    return {"arch": compute_capability(), "driver": driver_version(),
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"), "sources": sources_digest()}


def mismatches(manifest: dict, here: dict) -> list[str]:
    """Why the build described by ``manifest`` cannot run on the machine ``here`` describes
    (empty when it can)."""
    found = []
    if here["arch"] is None:
        found.append("no GPU found (nvidia-smi gave no compute capability)")
    elif here["arch"] not in manifest["archs"]:
        found.append(f"the GPU is sm_{here['arch']}, the build has machine code for "
                     f"{', '.join(f'sm_{a}' for a in manifest['archs'])} only")
    if here["driver"] is None:
        found.append("no CUDA driver (libcuda.so.1 does not load)")
    elif here["driver"] // 1000 < manifest["cuda"] // 1000:
        found.append(f"the driver supports CUDA {here['driver'] // 1000}.{here['driver'] % 1000 // 10}, the build "
                     f"links CUDA {manifest['cuda'] // 1000}.{manifest['cuda'] % 1000 // 10}'s runtime")
    if here["ext_suffix"] != manifest["ext_suffix"]:
        found.append(f"this Python's extension modules end in {here['ext_suffix']}, the build's in "
                     f"{manifest['ext_suffix']} (Python {manifest['python']})")
    if here["sources"] != manifest["sources"]:
        found.append("csrc/ or setup.py changed since the build")
    return found


def install(folder: Path) -> int:
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        print(f"prebuilt: none at {folder} (python tools/kernels/prebuilt.py build, and carry .gpu_build)")
        return 1
    manifest = json.loads(manifest_path.read_text())
    problems = mismatches(manifest, machine())
    if problems:
        print("prebuilt: not usable here: " + "; ".join(problems))
        return 1
    with files.atomic_write(ROOT / manifest["extension"], "wb") as f:
        f.write((folder / manifest["extension"]).read_bytes())
    print(f"prebuilt: installed {manifest['extension']} (sm_{', sm_'.join(map(str, manifest['archs']))}, "
          f"CUDA {manifest['cuda'] // 1000}.{manifest['cuda'] % 1000 // 10}, Python {manifest['python']})")
    return 0


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["build", "install"])
    p.add_argument("--arch", type=cli.integer(50, 200), default=90, help="compute capability to compile for (default 90)")
    p.add_argument("--python", default=sys.executable,
                   help="build: the Python the GPU machine runs, a path or a command (default: this one)")
    p.add_argument("--folder", type=cli.output_folder, default=str(FOLDER),
                   help=f"where the build goes or comes from (default {FOLDER.name})")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.folder = Path(args.folder)
    if args.command == "build":
        manifest = build(args.arch, args.python, args.folder)
        print(f"built {args.folder}: sm_{args.arch}, CUDA {manifest['cuda'] // 1000}.{manifest['cuda'] % 1000 // 10}, "
              f"Python {manifest['python']}")
        return 0
    return install(args.folder)


if __name__ == "__main__":
    sys.exit(cli.run(main))
