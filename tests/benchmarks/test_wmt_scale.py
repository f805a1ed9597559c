"""benchmarks/wmt_scale.py on a toy corpus: the generated text has the stated shape, and every
stage of the pipeline runs on it and reports its time and memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import wmt_scale  # noqa: E402


def test_the_corpus_is_seeded_and_shaped_like_wmt14(tmp_path):
    stats = wmt_scale.write_corpus(tmp_path / "a", 5000, seed=3)
    again = wmt_scale.write_corpus(tmp_path / "b", 5000, seed=3)
    assert stats == again
    assert (tmp_path / "a" / "train.de.gz").read_bytes() == (tmp_path / "b" / "train.de.gz").read_bytes()
    for lang in ("en", "de"):
        s = stats[lang]
        assert 19 < s["mean_words"] < 26 and s["median_words"] < s["mean_words"] < s["p99_words"] / 2
        assert s["max_words"] <= wmt_scale.MAX_WORDS and s["word_types_seen"] > 30_000


def test_every_stage_runs_and_counts_what_it_made(tmp_path):
    rows = {stage: wmt_scale.run_stage(stage, tmp_path, 3000, 0, vocab_size=500) for stage in wmt_scale.STAGES}
    assert all(r["seconds"] >= 0 and r["peak_mb"] > 0 for r in rows.values())
    words = sum(int(rows["generate"]["corpus"][lang]["mean_words"] * 3000) for lang in ("en", "de"))
    assert rows["encode"]["pieces"] > 0.9 * words  # BPE pieces of 500 types: more pieces than words
    assert rows["plan"]["steps"] == rows["draw"]["steps"] > 0
    assert rows["draw"]["target_tokens"] > 3000


def test_the_growth_exponent_is_the_log_log_slope():
    assert wmt_scale.exponent([1e5, 2e5, 4e5], [3.0, 6.0, 12.0]) == 1.0
    assert wmt_scale.exponent([1e5, 1e6], [2.0, 2.0]) == 0.0
    assert wmt_scale.exponent([1e5], [1.0]) is None
    assert np.isclose(wmt_scale.exponent([1, 10, 100], [1, 100, 10_000]), 2.0)
