"""The CuPy stand-in held to the real CuPy. Every "cuda" path runs here on
minitransformer.emulated.cupy, which says it covers the CuPy API the package uses: a name it has
and CuPy lacks, a keyword CuPy spells otherwise, a dtype rule CuPy applies otherwise would pass
every other test and fail in a GPU's first minute. So, against CuPy itself (imported without a
GPU, in a process of its own: tests/emulated/cupy_probe.py):

- every CuPy name the code a GPU runs uses (read from its source: tests/emulated/cupy_uses.py),
  and every keyword it passes, is CuPy's; the list is printed with its count, and a name
  CuPy lacks fails with the file and line that uses it;
- every name the stand-in offers as CuPy's is CuPy's (the few it adds on purpose are those the
  package asks for with a default, as ``getattr(cupy, "EMULATED", False)``);
- where CuPy needs no device, both answer alike: dtype promotion of mixed operands, asnumpy of
  host data, the exception classes the package catches, is_available() without a device.

CuPy is installed for this test alone, in .venv-cupy (.ci/run: ``pip install --target``), which
only the probe's process has on its path: ``backend`` imports CuPy wherever it can, and the
other tests must keep the emulated device.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import settings
from tests.emulated import cupy_uses

ROOT = Path(__file__).resolve().parents[2]
CUPY = ROOT / ".venv-cupy"
INSTALL = 'pip install --no-deps --target .venv-cupy "cupy-cuda13x>=14,<15" "cuda-pathfinder>=1.3.4,<2"'

pytestmark = pytest.mark.slow

# A planted misuse, to prove that the contract fails: a name CuPy lacks, reached through the
# array module, and a keyword CuPy's Stream does not take.
PLANTED = '''
from minitransformer import backend


def planted(x):
    xp = backend.array_module_of(x)
    stream = xp.cuda.Stream(nonblocking=True)
    return xp.scatter_add(x, 0, 1), stream.ptr
'''


def request(found: cupy_uses.Found) -> dict:
    keywords = collections.defaultdict(set)
    for use in found.uses:
        keywords[use.path].update(use.keywords)
    return {"uses": {path: sorted(k) for path, k in keywords.items()}, "names": sorted(found.names),
            "method_keywords": {name: sorted(k) for name, k in found.method_keywords.items()},
            "caught": sorted({use.path for use in found.uses if use.caught})}


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    """(what the source uses, what the planted file uses, the probe's reply)."""
    if not (CUPY / "cupy" / "__init__.py").is_file():
        message = f"no CuPy in {CUPY} (install it there with: {INSTALL})"
        if settings.env_flag("MT_REQUIRE_CUPY"):
            pytest.fail(f"MT_REQUIRE_CUPY=1: {message}")
        pytest.skip(message)
    tmp = tmp_path_factory.mktemp("contract")
    (tmp / "minitransformer").mkdir()
    (tmp / "minitransformer" / "planted.py").write_text(PLANTED)
    found, planted = cupy_uses.collect(), cupy_uses.collect(tmp)
    (tmp / "request.json").write_text(json.dumps(request(cupy_uses.Found(found.uses + planted.uses, found.names,
                                                                            found.method_keywords))))
    env = {**os.environ, "PYTHONPATH": str(CUPY), "MT_EMULATE_CUDA": "0",
           "PYTHONWARNINGS": "ignore"}  # CuPy warns that NCCL's library is missing: the probe says so itself
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "emulated" / "cupy_probe.py"), str(tmp / "request.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return found, planted, json.loads(proc.stdout)


def failures(uses: list[cupy_uses.Use], reply: dict) -> list[str]:
    """Each use of a name CuPy lacks, or of a keyword it does not take, with its file and line."""
    bad = []
    for use in uses:
        result = reply["uses"][use.path]
        if result["status"] == "missing" and not use.optional:
            bad.append(f"{use.where}: {use.path} is not in CuPy {reply['cupy']}")
        elif set(result.get("rejected", ())) & set(use.keywords):
            rejected = sorted(set(result["rejected"]) & set(use.keywords))
            bad.append(f"{use.where}: {use.path}({', '.join(f'{k}=' for k in rejected)}): CuPy's takes no such "
                       f"keyword ({result['detail']})")
    return bad


def test_every_cupy_name_the_code_uses_is_in_cupy(contract):
    found, _, reply = contract
    by_path = collections.defaultdict(list)
    for use in found.uses:
        by_path[use.path].append(use)
    print(f"\nThe contract: {len(by_path)} CuPy names used (CuPy {reply['cupy']}), and "
          f"{len(reply['ndarray'])} names of arrays:")
    for path, uses in sorted(by_path.items()):
        result = reply["uses"][path]
        note = f"  ({result['detail']})" if "detail" in result else ""
        print(f"  {path:60} {result['status']:9} {uses[0].where}{f' and {len(uses) - 1} more' if len(uses) > 1 else ''}{note}")
    print("  arrays' names: " + ", ".join(f"{n} ({r['status']})" for n, r in reply["ndarray"].items()))
    assert not failures(found.uses, reply), "\n".join(failures(found.uses, reply))
    # The names an untyped receiver may have read as an array's: where CuPy's ndarray lacks one,
    # the package must define it itself (Tensor.to_device), else an array was asked for it.
    own = {name for p in cupy_uses.source_files() for name in cupy_uses.defined_names(p)}
    lacking = {name for name, r in reply["ndarray"].items() if r["status"] == "missing"}
    assert lacking <= own, f"names read on arrays that CuPy's ndarray lacks: {sorted(lacking - own)}"
    keyword = {name: r["rejected"] for name, r in reply["ndarray"].items() if r["status"] == "keyword"}
    assert not keyword, keyword
    # The reading reaches through variables, self, imports of cupy.cuda and functions' returns.
    assert {"cupy.cuda.Stream().ptr", "cupy.cuda.nccl.NcclCommunicator().allReduce", "cupyx.scatter_add",
            "cupy.cuda.get_current_stream().wait_event", "cupy.random.Philox4x3210",
            "cupy.cuda.memory.OutOfMemoryError"} <= set(by_path)


def test_a_name_cupy_lacks_fails_with_its_file_and_line(contract):
    _, planted, reply = contract
    bad = failures(planted.uses, reply)
    assert any(line.startswith("minitransformer/planted.py:8: cupy.scatter_add is not in CuPy") for line in bad), bad
    assert any(line.startswith("minitransformer/planted.py:7: cupy.cuda.Stream(nonblocking=)") for line in bad), bad
    assert not any("Stream().ptr" in line for line in bad), bad  # a name CuPy has passes


def test_the_stand_in_offers_only_cupys_names(contract):
    found, _, reply = contract
    asked_with_a_default = {use.path for use in found.uses if use.optional}
    offered = [f"{where}: {path}" for path, where, result in reply["standin"]
               if result["status"] == "missing" and path not in asked_with_a_default]
    print(f"\nThe stand-in offers {len(reply['standin'])} names as CuPy's")
    assert not offered, "the stand-in offers names CuPy lacks:\n" + "\n".join(offered)
    # What it lends from NumPy: what CuPy has of it. Its arrays refuse the rest of NumPy's names,
    # its generators lend only CuPy's methods.
    assert reply["refused"] == reply["numpy_only"]
    assert reply["generator_lent"] == reply["generator"]


def test_the_stand_in_answers_as_cupy_does_where_cupy_needs_no_device(contract):
    behaviour = contract[2]["behaviour"]
    promotions = behaviour["promotions"]
    print(f"\ndtype promotion: {promotions['cases']} mixed operands compared")
    assert promotions["cases"] > 500 and not promotions["differ"], promotions["differ"]
    assert behaviour["asnumpy"]
    for caught, bases in behaviour["exceptions"].items():
        assert bases["CuPy"] == bases["stand-in"], (caught, bases)
    # Device attributes and properties the stand-in reports are keys a real device has.
    assert behaviour["attributes_missing"] == [] and behaviour["properties_missing"] == []
    # Without a device, CuPy says so without raising, and the package refuses "cuda" in one line.
    assert behaviour["is_available"] == "False"
    assert behaviour["check_device"].startswith("DeviceUnavailable")
    assert behaviour["package"] == {"has_cupy": True, "has_cuda": False, "kernels_available": False}
    # What only a GPU can show (the GPU check runs these paths: benchmarks/gpu_check.sh).
    print("needs a GPU: cupy.asarray of host data (here: %s); the values of Device.attributes and "
          "getDeviceProperties; NCCL's calls (cupy.cuda.nccl read from its compiled module)" % behaviour["asarray"])
