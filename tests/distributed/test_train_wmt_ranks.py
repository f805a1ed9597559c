"""The main job under ``mpiexec -n 2``: two CPU ranks train together through
DistributedDataParallel, rank 0 alone validates, checkpoints and scores."""

import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest

from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import needs_multi30k

pytestmark = pytest.mark.slow  # whole runs of train_wmt.py under mpiexec

REPO = Path(__file__).resolve().parents[2]


@needs_multi30k
def test_two_ranks_train_and_only_rank_0_writes(mpiexec, tmp_path):
    out = tmp_path / "run"
    cmd = [mpiexec, "-n", "2", sys.executable, str(REPO / "examples" / "train_wmt.py"),
           "--data-dir", str(DATA), "--out-dir", str(out), "--limit", "300", "--vocab-size", "400",
           "--d-model", "32", "--layers", "1", "--max-tokens", "400", "--max-steps", "4", "--eval-every", "2",
           "--bleu-sample", "3", "--log-every", "1", "--no-progress", "--warmup", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mpiexec -n 2 train_wmt.py hung")
    assert proc.returncode == 0, stderr[-3000:]
    assert [line.startswith("BLEU = ") for line in stdout.splitlines()].count(True) == 1  # by rank 0 only
    result = json.loads((out / "bleu.json").read_text())
    assert result["steps"] == 4 and result["test_sentences"] == 15  # --limit 300: 300 // 20
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]  # one writer, one line per step
    assert sorted(p.name for p in out.glob("ckpt-*.npz")) == ["ckpt-2.npz", "ckpt-4.npz"]


@needs_multi30k
def test_one_two_and_three_ranks_train_on_the_same_batches(mpiexec, tmp_path):
    """The ranks split each step's batch (data.TokenBatcher): at any number of ranks a step has
    the same target tokens and, with dropout off, the same loss to float32 rounding, a step
    with fewer sentences than ranks included (one rank's share is empty there)."""
    from minitransformer import data

    args = ["--data-dir", str(DATA), "--limit", "100", "--vocab-size", "200", "--d-model", "32",
            "--layers", "1", "--max-tokens", "400", "--dropout", "0", "--max-steps", "11", "--eval-every", "11",
            "--bleu-sample", "2", "--log-every", "1", "--no-progress",
            "--warmup", "10"]
    logs = {}
    for n in (1, 2, 3):
        out = tmp_path / f"ranks{n}"
        cmd = [mpiexec, "-n", str(n), sys.executable, str(REPO / "examples" / "train_wmt.py"), *args,
               "--out-dir", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, start_new_session=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
        logs[n] = [r for r in rows if r["kind"] == "train"]
    steps = [r["step"] for r in logs[1]]
    assert steps == list(range(1, 12))
    for n in (2, 3):
        assert [r["step"] for r in logs[n]] == steps
        assert [r["tokens"] for r in logs[n]] == [r["tokens"] for r in logs[1]]
        for one, many in zip(logs[1], logs[n]):
            assert many["loss"] == pytest.approx(one["loss"], rel=2e-5), (n, one["step"])

    tok = data.Tokenizer(next((tmp_path / "ranks3").glob("spm-*.model")))
    train = data.load_corpus("multi30k", DATA, "train").subset(range(100))
    last = data.TokenBatcher(tok.encode(train.src), tok.encode(train.tgt), max_tokens=400, max_len=100, seed=1,
                             rank=2, world_size=3)
    assert any(len(share) == 0 for share in last.epoch_batches(0)), "no step left a rank without a sentence"


@needs_multi30k
def test_sigterm_to_mpiexec_ends_every_rank_as_ctrl_c_does(mpiexec, tmp_path):
    """A scheduler ends a job with SIGTERM to mpiexec, which MPICH's Hydra passes to every rank:
    each rank cleans up as on Ctrl-C, rank 0 alone says how to continue, status 143, and the run
    resumes from its last checkpoint."""
    out = tmp_path / "run"
    cmd = [mpiexec, "-n", "2", sys.executable, str(REPO / "examples" / "train_wmt.py"),
           "--data-dir", str(DATA), "--out-dir", str(out), "--limit", "300", "--vocab-size", "400",
           "--d-model", "32", "--layers", "1", "--max-tokens", "400", "--max-steps", "100000", "--eval-every", "2",
           "--bleu-sample", "0", "--log-every", "1", "--no-progress", "--warmup", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "ckpt-2.npz").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mpiexec -n 2 train_wmt.py did not end on SIGTERM")
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    ends = [line for line in stderr.splitlines() if line.startswith("terminated (SIGTERM)")]
    assert len(ends) == 1 and ends[0].startswith("terminated (SIGTERM): continue with: mpiexec -n 2 ")
    assert ends[0].endswith(" --resume") and not list(out.glob(".tmp-*"))
    assert (out / ".lock").read_text() == ""
