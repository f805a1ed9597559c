"""tools/kernels/ncu_counts.py against a stand-in for Nsight Compute (tests/tools/kernels/fake_ncu.py,
which prints ncu's raw CSV layout): each kind's figures side by side with their ratio, a metric
ncu refuses left out and named, launches that are not the counted ones refused, and ncu's
permission error told in one line. The profiled command itself runs on the emulated device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import settings
from minitransformer.emulated import emulator
from tests.tools.kernels import fake_ncu

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "kernels"))
import ncu_counts  # noqa: E402

pytestmark = pytest.mark.skipif(
    emulator.unavailable_reason() is not None and not settings.env_flag("MT_REQUIRE_EMULATOR"),
    reason=f"the emulated kernels cannot be built: {emulator.unavailable_reason()}")

FORWARD, BACKWARD = "attention_forward_f32_kernel", "attention_backward_f32_kernel"
# A case as attn.py --counts records it: launch by launch, the emulator's figures by kind.
COUNTS = {"gpu": "an emulated GPU", "counts": [
    {"dtype": "fp32", "causal": "no", "d": 32, "kernel": FORWARD, "kinds": {
        "global load": {"requests": 40, "units": 160, "ideal": 160},
        "shared load": {"requests": 300, "units": 300, "ideal": 300},
        "barrier": {"requests": 24, "units": 24, "ideal": 24}}},
    {"dtype": "fp32", "causal": "no", "d": 32, "kernel": BACKWARD, "kinds": {
        "global atomic": {"requests": 10, "units": 40, "ideal": 40},
        "shared store": {"requests": 50, "units": 100, "ideal": 50}}},
]}


def run(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, dict | None]:
    counts, out = tmp_path / "counts.json", tmp_path / "ncu.json"
    counts.write_text(json.dumps(COUNTS))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernels" / "ncu_counts.py"),
                           "--ncu", str(fake_ncu.install(tmp_path / "bin")),
                           "--counts", str(counts), "--json", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "MT_EMULATE_CUDA": "1", **env})
    return proc, json.loads(out.read_text()) if out.exists() else None


def errors(proc) -> list[str]:
    """Its stderr's lines, less the emulated device's notice."""
    return [line for line in proc.stderr.splitlines() if "EMULATED on the CPU" not in line]


def test_each_kind_beside_nsight_computes_with_their_ratio(tmp_path):
    values = {"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 320,  # twice the emulator's 160
              "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": 40,
              "smsp__inst_executed_op_shared_ld.sum": 300, "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": 300,
              "smsp__inst_executed_op_barrier.sum": 24,
              "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum": 30,  # atom + red summed: 40
              "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum": 10,
              "smsp__inst_executed_pipe_tensor_op_hmma.sum": 1000}  # ncu saw mma the emulator did not
    proc, out = run(tmp_path, FAKE_NCU_VALUES=json.dumps(values))
    assert proc.returncode == 0, proc.stderr
    (case,) = out["cases"]
    rows = {(r["kernel"], r["kind"]): r for r in case["rows"]}
    assert rows[FORWARD, "global load"] | {} == dict(kernel=FORWARD, kind="global load", emu_requests=40,
                                                      ncu_requests=40, emu_units=160, ncu_units=320, ratio=2.0)
    assert rows[FORWARD, "shared load"]["ratio"] == 1.0
    assert rows[FORWARD, "barrier"]["ratio"] == 1.0 and rows[FORWARD, "barrier"]["emu_units"] is None
    assert rows[BACKWARD, "global atomic"]["ncu_units"] == 40 and rows[BACKWARD, "global atomic"]["ratio"] == 1.0
    assert rows[BACKWARD, "shared store"]["ncu_units"] == 0 and rows[BACKWARD, "shared store"]["ratio"] == 0.0
    # A kind only ncu saw has a row (its ratio undefined); a kind neither saw has none.
    assert rows[FORWARD, "mma"]["emu_requests"] == 0 and rows[FORWARD, "mma"]["ratio"] is None
    assert (FORWARD, "ldmatrix") not in rows
    assert out["refused"] == []
    assert f"== fp32 causal=no d=32 ==" in proc.stdout and "global load" in proc.stdout


def test_a_metric_ncu_refuses_is_left_out_and_named(tmp_path):
    refused = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum,smsp__inst_executed_op_barrier.sum"
    proc, out = run(tmp_path, FAKE_NCU_REFUSE=refused)
    assert proc.returncode == 0, proc.stderr
    assert out["refused"] == sorted(refused.split(","))
    rows = {(r["kernel"], r["kind"]): r for r in out["cases"][0]["rows"]}
    assert rows[FORWARD, "barrier"]["ncu_requests"] is None  # not collected, not zero
    assert "metrics this ncu does not know (left out): " in proc.stdout


@pytest.mark.parametrize("kernels", [f"{FORWARD}", f"{BACKWARD},{FORWARD}"])
def test_launches_that_are_not_the_counted_ones_are_refused(tmp_path, kernels):
    proc, out = run(tmp_path, FAKE_NCU_KERNELS=kernels)
    assert proc.returncode == 1
    (line,) = errors(proc)
    assert "ncu's launches are not the counted ones" in line and FORWARD in line
    assert out["cases"] == []  # the JSON is still written, with what was compared


def test_no_permission_for_the_counters_is_one_line(tmp_path):
    proc, _ = run(tmp_path, FAKE_NCU_SAY="==ERROR== ERR_NVGPUCTRPERM - The user does not have permission")
    assert proc.returncode == 1
    (line,) = errors(proc)
    assert "ERR_NVGPUCTRPERM" in line and "performance counters" in line


def test_counts_without_per_kind_figures_are_refused(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"counts": [{k: v for k, v in COUNTS["counts"][0].items() if k != "kinds"}]}))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernels" / "ncu_counts.py"), "--counts", str(old)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "old.json: its counts have no per-kind figures" in proc.stderr


def test_every_kind_the_emulator_counts_has_metrics():
    assert set(ncu_counts.METRICS) == set(emulator.KINDS)
    for kind in emulator.GLOBAL_KINDS + emulator.SHARED_KINDS:
        assert all(ncu_counts.METRICS[kind]), kind  # requests and units, both
