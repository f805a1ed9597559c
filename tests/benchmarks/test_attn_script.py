"""benchmarks/attn.py's GPU code path runs (on the emulated device, without a GPU), so that the
script is known to work before a GPU sees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import records
from minitransformer.emulated import emulator

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attn.py"


@pytest.mark.skipif(emulator.unavailable_reason() is not None and not os.environ.get("MT_REQUIRE_EMULATOR"),
                    reason=f"the emulated kernels cannot be built: {emulator.unavailable_reason()}")
@pytest.mark.slow  # the GPU path emulated
def test_attn_benchmark_runs_its_gpu_path_emulated(tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--emulated", "--dtypes", "bf16", "fp32", "--causal", "yes",
         "--head-dims", "32", "--seqs", "40", "--counts", "--json", str(out), "--record"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "MT_EMULATE_CUDA": "1", "MT_RECORDS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EMULATED" in proc.stdout
    results = json.loads(out.read_text())
    assert "EMULATED" in results["device"] and "mulated" in results["gpu"]
    rows = results["attention"]
    assert {(r["dtype"], r["pass"]) for r in rows} == {(d, p) for d in ("bf16", "fp32") for p in ("fwd", "fwd+bwd")}
    assert {(r["d"], r["seq"]) for r in rows} == {(32, 40)}  # the sizes given, not --emulated's defaults
    assert all(r["fused_ms"] > 0 and r["naive_ms"] > 0 for r in rows)
    for rung in ("naive_cuda", "tiled_cuda"):  # forward only
        assert all((r[f"{rung}_ms"] > 0) if r["pass"] == "fwd" else (f"{rung}_ms" not in r) for r in rows)
    kernels = {r["kernel"] for r in results["bandwidth"]}
    assert kernels == {"layernorm_fwd", "layernorm_bwd", "softmax_fwd", "softmax_bwd", "xent_fwd+grad"}
    # Each fused kernel's memory traffic, counted (the count variant), its GPU time left empty.
    counts = {(r["dtype"], r["kernel"]): r for r in results["counts"]}
    assert {("bf16", "attention_forward_mma_kernel"), ("bf16", "attention_backward_mma_kernel"),
            ("fp32", "attention_forward_f32_kernel"), ("fp32", "attention_backward_f32_kernel")} <= set(counts)
    for r in counts.values():
        assert r["sectors"] >= r["ideal"] > 0 and r["wavefronts"] >= r["ideal_wf"] and r["pass_ms"] is None, r
    assert counts[("bf16", "attention_forward_mma_kernel")]["mma"] > 0
    assert counts[("fp32", "attention_forward_f32_kernel")]["sh_req"] > 0
    # The ladder: each rung's forward, counted; the naive kernels fetch the most global memory,
    # the tiled kernel no T x T array but K twice, the fused float32 kernel less, and only the
    # tensor cores' rung runs mma.
    ladder = {r["rung"]: r for r in results["ladder"]}
    assert list(ladder) == ["naive", "tiled", "fused", "tensor cores"]
    assert [r["launches"] for r in ladder.values()] == [3, 1, 1, 1]
    assert ladder["naive"]["global_KB"] > ladder["tiled"]["global_KB"] > ladder["fused"]["global_KB"]
    assert [r["mma"] > 0 for r in ladder.values()] == [False, False, False, True]
    assert ladder["naive"]["sh_req"] == ladder["naive"]["barriers"] == 0 < ladder["tiled"]["barriers"]
    assert all(r["fwd_ms"] is None and r["global_KB"] >= r["ideal_KB"] for r in ladder.values())
    # The record: a line per dtype (one mask), over the one case; no torch on the emulated device.
    lines = records.read_bench(tmp_path / "attn.jsonl")
    assert [r["config"] for r in lines] == [{"device": "emulated", "dtype": d, "causal": "yes"}
                                            for d in ("bf16", "fp32")]
    for line in lines:
        assert set(line["figures"]) == {"tflops_max", "global_sectors_vs_fewest", "shared_wavefronts_vs_fewest",
                                        "cases"}
        assert line["figures"]["cases"] == 1 and line["figures"]["global_sectors_vs_fewest"] >= 1


def test_the_cpu_run_records_a_line_per_mask(tmp_path):
    argv = ["--cpu", "--head-dims", "8", "--causal", "no", "yes"]
    env = {**os.environ, "MT_RECORDS_DIR": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--record"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = records.read_bench(tmp_path / "attn.jsonl")
    assert [r["config"] for r in lines] == [{"device": "cpu", "dtype": "fp32", "causal": c} for c in ("no", "yes")]
    assert {r["command"] for r in lines} == {"python benchmarks/attn.py " + " ".join(argv + ["--record"])}
    for line in lines:  # two sequence lengths at one head dim; the NumPy twin against the composite
        assert set(line["figures"]) == {"twin_speed_vs_composite", "cases"} and line["figures"]["cases"] == 2
        assert line["figures"]["twin_speed_vs_composite"] > 0
