"""benchmarks/attn.py on the CPU. Its GPU code path runs on the emulated device as the counts
stage of benchmarks/gpu_check.sh, whose dry run (tests/benchmarks/test_gpu_check.py) checks it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from minitransformer import records

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attn.py"


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
