"""benchmarks/gpu_check.sh, the one script a lent GPU runs first, runs every stage here on the
emulated device at toy sizes (GPU_CHECK_EMULATED=1): a typo in it, a renamed option or test,
a stage that crashes, fails CI instead of costing the GPU's minutes. And the script's exit
status says when a stage failed."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from minitransformer import records, settings
from minitransformer.emulated import emulator
from tests.tools.kernels import fake_ncu
from tests.helpers import MULTI30K_DIR, needs_multi30k

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["tests", "benchmarks", "counts", "ncu", "nccl tests", "suite (cuda cases)", "train_wmt (bf16, 2 steps)"]

pytestmark = [
    pytest.mark.slow,  # every stage of the GPU machine's script, emulated
    needs_multi30k,
    pytest.mark.skipif(emulator.unavailable_reason() is not None and not settings.env_flag("MT_REQUIRE_EMULATOR"),
                       reason=f"the emulated kernels cannot be built: {emulator.unavailable_reason()}"),
]


def gpu_check(out_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "GPU_CHECK_EMULATED": "1", "OUT": str(out_dir),
                               "GPU_CHECK_DATA": str(MULTI30K_DIR), **env})


def test_every_stage_runs_on_the_emulated_device(tmp_path):
    proc = gpu_check(tmp_path, NCU=str(fake_ncu.install(tmp_path / "bin")))  # Nsight Compute's stand-in
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "skipped" not in log.replace("build: skipped", ""), log  # every stage ran
    for stage in STAGES:
        assert re.search(rf"^{re.escape(stage)}: \d+ s, exit 0", proc.stdout, re.M), (stage, log)
    for name in ("allreduce.log", "train_step_fp32.log", "train_step_bf16.log", "reseed.log", "bench.json",
                 "counts.json", "ncu.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "gpu_check summary" in proc.stdout and "FAILED" not in proc.stdout
    attention_counted_emulated(tmp_path)


def attention_counted_emulated(out: Path) -> None:
    """benchmarks/attn.py's GPU path as the counts stage ran it (bf16 and fp32, causal, d 32, 40
    tokens): timed rows, bandwidths, each fused kernel's traffic and the ladder, counted, and
    a record line per dtype, beside the logs."""
    results = json.loads((out / "counts.json").read_text())
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
    # The record, beside the logs: a line per dtype (one mask) over the one case; no torch on the
    # emulated device.
    lines = [r for r in records.read_bench(out / "records" / "attn.jsonl") if "--counts" in r["command"]]
    assert [r["config"] for r in lines] == [{"device": "emulated", "dtype": d, "causal": "yes"}
                                            for d in ("bf16", "fp32")]
    for line in lines:
        assert set(line["figures"]) == {"tflops_max", "global_sectors_vs_fewest", "shared_wavefronts_vs_fewest",
                                        "cases"}
        assert line["figures"]["cases"] == 1 and line["figures"]["global_sectors_vs_fewest"] >= 1


def test_a_failed_stage_fails_the_script_and_is_named(tmp_path):
    (tmp_path / "wmt").mkdir()
    (tmp_path / "wmt" / "ckpt-1.npz").write_bytes(b"")  # train_wmt refuses to overwrite a run
    proc = gpu_check(tmp_path, GPU_CHECK_STAGES="wmt")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: wmt (exit 1)" in proc.stdout
