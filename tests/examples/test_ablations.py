"""examples/ablations.py at a toy size: the row list, a sweep killed in the middle of a row and
continued, and (with tests/distributed/test_ablations_ranks.py) the same table from any number
of ranks."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import needs_multi30k

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ablations.py"

sys.path.insert(0, str(ROOT / "examples"))
import ablations  # noqa: E402

# Two rows (the base row comes with A1), a 400-piece vocabulary, a 1-layer d_model=32 model.
TOY = ["--data-dir", str(DATA), "--rows", "A1", "--limit", "300", "--vocab-size", "400",
       "--d-model", "32", "--d-ff", "64", "--layers", "1", "--max-tokens", "600", "--max-steps", "8",
       "--eval-every", "2", "--bleu-sample", "2", "--warmup", "10", "--no-progress"]
# One BLAS thread everywhere, as each of two ranks has: the tables are compared to the last digit.
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def sweep(out_dir, *launcher, timeout=300) -> subprocess.CompletedProcess:
    """The toy sweep, to the end, in one process or under ``launcher`` (mpiexec -n 2)."""
    proc = subprocess.run([*launcher, sys.executable, str(SCRIPT), *TOY, "--out-dir", str(out_dir)], env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_rows_named_by_group_or_name_and_refused_with_one_line(capsys):
    rows = ablations.table_rows(ablations.BASE)
    assert [r.name for r in ablations.select("base,A1,E", rows)] == ["base", "A1", "E1"]
    assert [r.name for r in ablations.select("D", rows)] == ["base", "D1", "D2", "D3", "D4"]  # base comes along
    a = {r.name: r.changes for r in rows if r.group == "A"}
    assert a == {"A1": {"h": 1}, "A2": {"h": 2}, "A3": {"h": 8}, "A4": {"h": 16}}  # d_k = d_v = d_model / h
    a1 = ablations.settings(ablations.row_config(ablations.BASE, rows[1], 100))
    assert (a1["h"], a1["d_k"], a1["d_v"]) == (1, 256, 256)
    assert {r.name: r.changes for r in rows if r.group == "B"}["B1"] == {"d_k": 32, "d_v": 64}

    with pytest.raises(SystemExit) as unknown:
        ablations.parse_args(["--rows", "A1,Z9", "--max-steps", "3"])
    with pytest.raises(SystemExit) as impossible:  # h=16 does not divide 24 (h=4, the base's, does)
        ablations.parse_args(["--rows", "A", "--d-model", "24", "--max-steps", "3"])
    for exit_, expected in ((unknown, "unknown row 'Z9'"), (impossible, "row A4 (h=16): d_model=24 must be "
                                                                     "divisible by h=16")):
        assert expected in str(exit_.value.code) and "\n" not in str(exit_.value.code)

    # Every row decodes with the paper's beam search, whatever train_wmt.py's preset chose for its own.
    run_args = ablations.row_run_args(ablations.parse_args(["--rows", "A1", "--max-steps", "3"]), rows[1], False)
    assert (run_args.beam, run_args.alpha) == (4, 0.6) != (ablations.PRESET.beam, ablations.PRESET.alpha)

    ablations.main(["--list"])
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == 19 and listing[0].startswith("base") and "d_k=16 d_v=64" in listing[6]


@needs_multi30k
def test_a_killed_sweep_resumes_its_row_and_skips_finished_ones(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    sweep(straight)
    table = (straight / "table.md").read_text()
    assert table.splitlines()[2].startswith("| base | 1 | 32 | 64 | 4 | 8 | 8 | 0.1 | 0.1 | sinusoid | 8 |")
    assert table.splitlines()[3].startswith("| (A) A1 |  |  |  | 1 | 32 | 32 |  |  |  |  |")
    assert (straight / "ablations.png").stat().st_size > 10_000

    # Kill the sweep once row A1 (second in one process) can be resumed.
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *TOY, "--out-dir", str(killed)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (killed / "A1" / "last.npz").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / "base" / "result.json").exists() and not (killed / "A1" / "result.json").exists(), \
        "the kill was meant to land inside row A1"
    base_result = (killed / "base" / "result.json").stat().st_mtime_ns

    resumed = sweep(killed)
    assert (killed / "base" / "result.json").stat().st_mtime_ns == base_result  # not trained again
    assert "row base" not in resumed.stderr and "row A1 (h=1): resuming" in resumed.stderr
    assert (killed / "table.md").read_text() == table  # resumed exactly
    rows = json.loads((killed / "table.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["base", "A1"] and all(r["steps"] == 8 for r in rows)
