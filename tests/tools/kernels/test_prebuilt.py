"""tools/kernels/prebuilt.py: a build made here is used on a GPU machine only where it can run
there, and says why not where it cannot (gpu_check.sh then rebuilds)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("prebuilt", ROOT / "tools" / "kernels" / "prebuilt.py")
prebuilt = importlib.util.module_from_spec(spec)
sys.modules["prebuilt"] = prebuilt
spec.loader.exec_module(prebuilt)

MANIFEST = {"archs": [90], "cuda": 13000, "ext_suffix": ".cpython-312-x86_64-linux-gnu.so", "python": "3.12.1",
            "sources": prebuilt.sources_digest(), "extension": "minitransformer/kernels/_C.cpython-312-x86_64-linux-gnu.so"}
H100 = {"arch": 90, "driver": 13000, "ext_suffix": ".cpython-312-x86_64-linux-gnu.so", "sources": MANIFEST["sources"]}


@pytest.mark.parametrize("machine, reason", [
    ({}, None),
    ({"driver": 13020}, None),  # a later 13.x driver: minor version compatibility
    ({"arch": 80}, "sm_80"),
    ({"arch": None}, "no GPU"),
    ({"driver": 12080}, "CUDA 12.8"),
    ({"driver": None}, "no CUDA driver"),
    ({"ext_suffix": ".cpython-311-x86_64-linux-gnu.so"}, "3.12.1"),
    ({"sources": "0" * 64}, "csrc/"),
])
def test_a_build_is_used_only_where_it_runs(machine, reason):
    found = prebuilt.mismatches(MANIFEST, H100 | machine)
    assert (found == []) if reason is None else (len(found) == 1 and reason in found[0]), found


def test_install_refuses_a_build_that_does_not_fit_and_copies_one_that_does(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkout"
    (root / "minitransformer" / "kernels").mkdir(parents=True)
    build = tmp_path / "build"
    (build / "minitransformer" / "kernels").mkdir(parents=True)
    (build / MANIFEST["extension"]).write_bytes(b"the module")
    (build / "manifest.json").write_text(json.dumps(MANIFEST))
    monkeypatch.setattr(prebuilt, "ROOT", root)
    monkeypatch.setattr(prebuilt, "machine", lambda: H100 | {"arch": 80})
    assert prebuilt.install(build) == 1 and "sm_80" in capsys.readouterr().out
    assert not (root / MANIFEST["extension"]).exists()
    monkeypatch.setattr(prebuilt, "machine", lambda: H100)
    assert prebuilt.install(build) == 0
    assert (root / MANIFEST["extension"]).read_bytes() == b"the module"
    assert prebuilt.install(tmp_path / "none") == 1  # no build carried: gpu_check.sh builds instead
