"""benchmarks/gpu_check.sh, the one script a lent GPU runs first, runs every stage here on the
emulated device at toy sizes (GPU_CHECK_EMULATED=1): a typo in it, a renamed option or test,
a stage that crashes, fails CI instead of costing the GPU's minutes. Each stage prints its time
against its budget, writes its figures as records that benchmarks/render.py renders, and is
stopped at its budget or skipped when it does not fit; the exit status says when one failed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import records, settings
from minitransformer.emulated import emulator
from tests.tools.kernels import fake_ncu
from tests.helpers import MULTI30K_DIR, needs_multi30k

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["build", "kernels", "parity", "ddp", "attn", "step", "nccl", "suite", "ncu", "wmt"]

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
    assert "skipped" not in log and "not run" not in log, log  # every stage ran
    # Each stage's time against its budget (the emulated run's: ten times the GPU's), in order.
    timed = re.findall(r"^(\w+): (\d+) s of (\d+) s, exit 0$", proc.stdout, re.M)
    assert [name for name, _, _ in timed] == STAGES, log
    assert all(int(took) <= int(budget) for _, took, budget in timed), timed
    for name in ("allreduce.log", "train_step_fp32.log", "train_step_bf16.log", "ddp.log", "counts.json", "ncu.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "gpu_check summary" in proc.stdout and "FAILED" not in proc.stdout
    attention_counted_emulated(tmp_path)
    # Two emulated GPUs: one data-parallel step over NCCL (carried over MPI), recorded as such.
    steps = records.read_bench(tmp_path / "records" / "train_step.jsonl")
    assert [r["config"]["setup"].endswith("two ranks") for r in steps] == [True, False, False], steps
    assert [r["config"].get("precision") for r in steps[1:]] == ["bf16", None]
    # The stages' seconds, a record of their own.
    (run,) = records.read_bench(tmp_path / "records" / "gpu_check.jsonl")
    assert run["config"] == {"device": "emulated", "gpus": 2} and run["command"] == "bash benchmarks/gpu_check.sh"
    assert run["figures"] == {**{f"{name}_s": int(took) for name, took, _ in timed}, "total_s": run["figures"]["total_s"]}
    rendered(tmp_path / "records")


def rendered(folder: Path) -> None:
    """What the run recorded, rendered by benchmarks/render.py; and the README's GPU rows read
    the very configurations the run writes (an emulated run's never fill them: its device is
    "emulated", not "cuda")."""
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules["render"] = render  # dataclasses look their module up
    spec.loader.exec_module(render)
    for name in ("gpu_check", "attn", "train_step"):
        table = render.table(name, records.read_bench(folder / f"{name}.jsonl"))
        assert "emulated" in table.split("Run as:")[0], table
    assert "| emulated | 2 |" in render.table("gpu_check", records.read_bench(folder / "gpu_check.jsonl"))
    for row in (r for r in render.RESULTS if r.config.get("device") == "cuda"):
        written = [line["config"] | {"device": "cuda"} for line in records.read_bench(folder / f"{row.record}.jsonl")]
        assert any(all(config.get(k) == v for k, v in row.config.items()) for config in written), (row.what, written)


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


def test_a_stage_is_stopped_at_its_budget_and_one_that_does_not_fit_is_skipped(tmp_path):
    # At 4 % of the GPU's budgets attn's 120 s are 4 s, which its emulated run far exceeds.
    proc = gpu_check(tmp_path / "stopped", GPU_CHECK_STAGES="attn", GPU_CHECK_SCALE="4", GPU_CHECK_SECONDS="100000")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^attn: \d+ s of 4 s, stopped at its budget$", proc.stdout, re.M), proc.stdout
    assert "FAILED: attn (stopped at its 4 s budget)" in proc.stdout
    # No time left: the stage does not start, and that is no failure.
    proc = gpu_check(tmp_path / "skipped", GPU_CHECK_STAGES="kernels", GPU_CHECK_SECONDS="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^kernels: skipped, its 750 s budget does not fit", proc.stdout, re.M), proc.stdout
    assert not (tmp_path / "skipped" / "tests.log").exists()
