"""benchmarks/allreduce.py under ``mpiexec -n 2``: rank 0 prints the table and, with --record,
appends the bus bandwidth at the record's sizes; a run whose record would say nothing is refused."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import records

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"


def test_two_ranks_record_the_bus_bandwidth_at_the_sizes_measured(mpiexec, tmp_path):
    argv = ["--min-bytes", "4K", "--max-bytes", "64K", "--iters", "2", "--warmup", "0", "--record"]
    env = {**os.environ, "MT_RECORDS_DIR": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines()]
    busbw = {int(cells[0]): float(cells[4]) for cells in table if cells and cells[0].isdigit()}
    assert sorted(busbw) == [4096, 16384, 65536]
    (row,) = records.read_bench(tmp_path / "allreduce.jsonl")  # rank 0's line alone
    assert row["command"] == "mpiexec -n 2 python benchmarks/allreduce.py " + " ".join(argv)
    assert row["config"] == {"device": "cpu", "ranks": 2}
    assert set(row["figures"]) == {"GB/s at 4 KiB", "GB/s at 64 KiB"}  # 16 KiB is not one of the record's sizes
    assert row["figures"]["GB/s at 4 KiB"] == pytest.approx(busbw[4096], abs=1e-3)  # the table's, to its rounding


@pytest.mark.parametrize("argv, why", [(["--min-bytes", "8K", "--max-bytes", "32K"], "include none of them"),
                                       (["--min-bytes", "4K", "--max-bytes", "4K"], "one rank")])
def test_a_record_that_would_say_nothing_is_refused(argv, why, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--iters", "1", "--record"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MT_RECORDS_DIR": str(tmp_path)})
    assert proc.returncode == 2 and why in proc.stderr and "--record" in proc.stderr.splitlines()[-1]
    assert not list(tmp_path.iterdir())
