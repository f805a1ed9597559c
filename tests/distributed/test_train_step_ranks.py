"""benchmarks/train_step.py under ``mpiexec -n 2``: a data-parallel step, rank 0 reporting."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import records

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"


def test_two_ranks_time_one_step_and_rank_0_reports_and_records(mpiexec, tmp_path):
    argv = ["--d-model", "32", "--d-ff", "64", "--layers", "1", "--vocab", "100", "--batch", "6", "--len", "5",
            "--steps", "2", "--warmup", "1", "--ops", "--record"]
    cmd = [mpiexec, "-n", "2", sys.executable, str(SCRIPT), *argv]
    env = {**os.environ, "MT_RECORDS_DIR": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mpiexec -n 2 train_step.py hung")
    assert proc.returncode == 0, stdout + stderr[-3000:]
    assert stdout.count("2 rank(s)") == 1 and stdout.count("step / floor") == 1
    assert stdout.count("where the step's time goes") == 1 and "Linear forward" in stdout
    assert float(stdout.split("step / floor")[1].split()[0]) > 0
    (row,) = records.read_bench(tmp_path / "train_step.jsonl")  # rank 0's line alone
    assert row["command"] == "mpiexec -n 2 python benchmarks/train_step.py " + " ".join(argv)
    assert row["config"]["device"] == "cpu" and row["config"]["setup"].endswith(", two ranks")
    assert {"ours_ms", "vs_gemm_floor"} <= set(row["figures"])


def test_breakdown_is_refused_under_two_ranks(mpiexec):
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(SCRIPT), "--d-model", "32", "--d-ff", "64",
                           "--layers", "1", "--vocab", "100", "--batch", "4", "--len", "5", "--steps", "1",
                           "--warmup", "0", "--breakdown"], capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "--breakdown times the phases of a one-rank step" in proc.stderr
