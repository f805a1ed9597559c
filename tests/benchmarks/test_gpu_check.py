"""benchmarks/gpu_check.sh, the one script a lent GPU runs first, runs every stage here on the
emulated device at toy sizes (GPU_CHECK_EMULATED=1): a typo in it, a renamed option or test,
a stage that crashes, fails CI instead of costing the GPU's minutes. And the script's exit
status says when a stage failed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from minitransformer.emulated import emulator
from tests.tools.kernels import fake_ncu
from tests.helpers import MULTI30K_DIR, needs_multi30k

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["tests", "benchmarks", "counts", "ncu", "nccl tests", "suite (cuda cases)", "train_wmt (bf16, 2 steps)"]

pytestmark = [
    pytest.mark.slow,  # every stage of the GPU machine's script, emulated
    needs_multi30k,
    pytest.mark.skipif(emulator.unavailable_reason() is not None and not os.environ.get("MT_REQUIRE_EMULATOR"),
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


def test_a_failed_stage_fails_the_script_and_is_named(tmp_path):
    (tmp_path / "wmt").mkdir()
    (tmp_path / "wmt" / "ckpt-1.npz").write_bytes(b"")  # train_wmt refuses to overwrite a run
    proc = gpu_check(tmp_path, GPU_CHECK_STAGES="wmt")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: wmt (exit 1)" in proc.stdout
