"""benchmarks/train_step.py: its GEMM floor counts the step's matrix products right, and the
script prints both ratios."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minitransformer import nn, records
from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import needs_multi30k

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floor_counts_three_times_the_forward_products_of_the_model():
    """Forward: every Linear weight of the model multiplies every token's row once (S = T here),
    the output projection is the shared embedding, and each attention is two products per head;
    backward costs twice the forward. Derived from the model's own parameters, independently
    of the script's list."""
    args = argparse.Namespace(batch=3, len=5, d_model=16, d_ff=24, heads=2, layers=2, vocab=50)
    model = nn.Transformer(nn.TransformerConfig(vocab_size=args.vocab, d_model=args.d_model, d_ff=args.d_ff,
                                                h=args.heads, num_encoder_layers=args.layers,
                                                num_decoder_layers=args.layers))
    weights = sum(m.weight.size for m in model.modules() if isinstance(m, nn.Linear))
    tokens = args.batch * args.len
    linear = 2 * tokens * (weights + args.vocab * args.d_model)
    attentions = 3 * args.layers  # one per encoder layer, two per decoder layer
    attention = attentions * 2 * (2 * args.batch * args.len * args.len * args.d_model)  # QK^T and PV, all heads
    gemms = load_script().step_gemms(args, args.batch, args.len, args.len)
    assert sum(2 * c * m * k * n for c, m, k, n in gemms) == 3 * (linear + attention)
    assert len(gemms) == 3 * (args.layers * (6 + 2) + args.layers * (10 + 4) + 1)


def test_source_and_target_lengths_count_apart():
    """Real batches have S != T: encoder products scale with S, the decoder's with T, and the
    cross-attention's K and V projections with S."""
    args = argparse.Namespace(d_model=16, d_ff=24, heads=2, layers=1, vocab=50)
    step = load_script().step_gemms
    linear_flops = lambda b, s, t: sum(2 * c * m * k * n for c, m, k, n in step(args, b, s, t) if c == 1)
    d, f, v = args.d_model, args.d_ff, args.vocab
    per_source_row = 4 * d * d + 2 * d * f + 2 * d * d  # encoder layer, and W^K, W^V on the memory
    per_target_row = 4 * d * d + 2 * d * d + 2 * d * f + d * v
    assert linear_flops(3, 7, 2) == 3 * 2 * (3 * 7 * per_source_row + 3 * 2 * per_target_row)


def test_the_script_prints_the_floor_and_the_ratio_and_records_them(tmp_path):
    argv = ["--d-model", "32", "--d-ff", "64", "--layers", "1", "--vocab", "100", "--batch", "4", "--len", "6",
            "--steps", "2", "--warmup", "1", "--record"]
    env = {**os.environ, "MT_RECORDS_DIR": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GEMM floor" in proc.stdout and "step / floor" in proc.stdout
    ratio = float(proc.stdout.split("step / floor")[1].split()[0])
    assert ratio > 0
    (row,) = records.read_bench(tmp_path / "train_step.jsonl")
    assert row["command"] == "python benchmarks/train_step.py " + " ".join(argv)
    # The sizes that differ from the defaults name the row, beside the benchmark batch and one process.
    assert row["config"] == {"device": "cpu", "setup": "benchmark batch, d_model 32, d_ff 64, layers 1, vocab 100, "
                                                       "batch 4, len 6, one process"}
    torch = importlib.util.find_spec("torch") is not None
    assert set(row["figures"]) == {"ours_ms", "vs_gemm_floor"} | ({"torch_ms", "time_vs_torch"} if torch else set())
    assert row["figures"]["vs_gemm_floor"] == pytest.approx(ratio, rel=5e-3)  # as printed, to its rounding


def test_a_torch_that_cannot_run_on_cuda_is_skipped_in_one_line(tmp_path):
    """PyTorch's CPU build is common on a machine without a GPU: on the (emulated) cuda device
    the peer is left out with one line saying why, and the rest of the benchmark runs. The
    CPU-only torch here is a stand-in package that answers what the script asks before it
    builds the peer: its version, and that CUDA is not available."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        '__version__ = "2.5.1+cpu"\n\n\nclass cuda:\n    @staticmethod\n    def is_available():\n        return False\n')
    env = {**os.environ, "MT_EMULATE_CUDA": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SCRIPT.parents[1])]),
           "MT_RECORDS_DIR": str(tmp_path / "records")}
    (tmp_path / "records").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--d-model", "32", "--d-ff", "64",
                           "--heads", "2", "--layers", "1", "--vocab", "64", "--batch", "4", "--len", "8", "--steps",
                           "1", "--warmup", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch 2.5.1+cpu cannot run on cuda here (a CPU-only build, or no GPU): no peer to compare against" \
        in proc.stdout.splitlines()
    assert "GEMM floor" in proc.stdout
    assert not list((tmp_path / "records").iterdir())  # nothing recorded without --record


@needs_multi30k
def test_real_batches_of_the_multi30k_preset(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data-dir", str(DATA), "--cache-dir", str(tmp_path),
                           "--d-model", "32", "--d-ff", "64", "--layers", "1", "--max-tokens", "300",
                           "--steps", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Multi30k batches of the multi30k preset" in proc.stdout and "vocab 8000" in proc.stdout
    assert float(proc.stdout.split("step / floor")[1].split()[0]) > 0
    assert list(tmp_path.glob("spm-*.model"))  # the preset's vocabulary, trained once into --cache-dir


def test_each_rank_takes_its_block_of_every_batch():
    rng = np.random.default_rng()
    data = [tuple(rng.integers(0, 50, (int(rng.integers(3, 12)), 4)) for _ in range(3)) for _ in range(2)]
    rows_of = load_script().rows_of
    for size in (1, 2, 3):
        shares = [rows_of(argparse.Namespace(rank=r, world_size=size), data) for r in range(size)]
        for step, batch in enumerate(data):
            for i, array in enumerate(batch):
                np.testing.assert_array_equal(np.concatenate([s[step][i] for s in shares]), array)
