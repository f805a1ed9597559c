"""The main job under ``mpiexec -n 2``: two CPU ranks train together through
DistributedDataParallel, rank 0 alone validates, checkpoints and scores."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import needs_multi30k

REPO = Path(__file__).resolve().parents[2]


@needs_multi30k
def test_two_ranks_train_and_only_rank_0_writes(mpiexec, tmp_path):
    out = tmp_path / "run"
    cmd = [mpiexec, "-n", "2", sys.executable, str(REPO / "examples" / "train_wmt.py"),
           "--data-dir", str(DATA), "--out-dir", str(out), "--limit-train", "300", "--vocab-size", "400",
           "--d-model", "32", "--layers", "1", "--max-tokens", "400", "--max-steps", "4", "--eval-every", "2",
           "--bleu-sample", "3", "--limit-test", "6", "--log-every", "1", "--no-progress", "--warmup", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mpiexec -n 2 train_wmt.py hung")
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("BLEU = ") == 1  # printed by rank 0 only
    result = json.loads((out / "bleu.json").read_text())
    assert result["steps"] == 4 and result["test_sentences"] == 6
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]  # one writer, one line per step
    assert sorted(p.name for p in out.glob("ckpt-*.npz")) == ["ckpt-2.npz", "ckpt-4.npz"]
