"""benchmarks/wmt_scale.py on a toy corpus: the generated text has the stated shape, and every
stage of the pipeline runs on it and reports its time and memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_a_run_given_its_json_goes_on_from_the_first_size_it_lacks(tmp_path, monkeypatch, capsys):
    ran = []

    def stage(*args, address_space=None):  # every stage's own work is tested above; here the bookkeeping
        name = args[args.index("--stage") + 1]
        ran.append((name, args[args.index("--pairs") + 1] if "--pairs" in args else None))
        return {"seconds": 1.0 + len(ran), "peak_mb": 100 + len(ran)}

    monkeypatch.setattr(wmt_scale, "in_subprocess", stage)
    out = tmp_path / "result.json"
    common = ["--no-step", "--json", str(out), "--work-dir", str(tmp_path / "work")]
    assert wmt_scale.main(["--pairs", "2000", *common]) == 0
    first = json.loads(out.read_text())
    assert ran == [*((s, "2000") for s in wmt_scale.STAGES), ("checkpoint", None)]
    assert list(first["sizes"]) == ["2000"] and first["exponents"]["read"]["seconds"] is None
    ran.clear()
    capsys.readouterr()
    assert wmt_scale.main(["--pairs", "2000", "3000", *common]) == 0
    assert "2,000 pairs  measured already" in capsys.readouterr().out
    assert ran == [(s, "3000") for s in wmt_scale.STAGES]  # neither 2,000 pairs nor the checkpoints again
    second = json.loads(out.read_text())
    assert second["sizes"]["2000"] == first["sizes"]["2000"] and second["checkpoint"] == first["checkpoint"]
    assert list(second["sizes"]) == ["2000", "3000"] and second["exponents"]["read"]["seconds"] is not None


def test_a_run_refuses_a_json_of_another_seed(tmp_path, capsys):
    out = tmp_path / "result.json"
    out.write_text(json.dumps({"sizes": {}, "vocab_size": 300, "seed": 1}))
    with pytest.raises(SystemExit) as e:
        wmt_scale.main(["--pairs", "2000", "--vocab-size", "300", "--json", str(out)])
    assert e.value.code == 2 and "--seed 1: give another file" in capsys.readouterr().err


def test_the_training_step_halves_its_budget_until_it_fits(monkeypatch):
    asked = []

    def step(*args, address_space):
        tokens = int(args[args.index("--step-tokens") + 1])
        asked.append(tokens)
        if tokens > 7000:
            raise MemoryError("too large")
        return {"tokens": tokens}

    monkeypatch.setattr(wmt_scale, "in_subprocess", step)
    row = wmt_scale.largest_step_that_fits("base", 22.0, steps=1)
    assert asked == [25_000, 12_500, 6_250] and row == {"tokens": 6_250, "too_large": [25_000, 12_500]}


def test_a_step_over_its_address_space_is_told_apart_from_a_failure():
    with pytest.raises(MemoryError):  # the base model's parameters and Adam's moments alone take more
        wmt_scale.in_subprocess("--stage", "step", "--preset", "base", "--step-tokens", "64", "--steps", "1",
                                address_space=700 * 2**20)
    with pytest.raises(RuntimeError, match="failed"):  # no such model: an error, not a budget too large
        wmt_scale.in_subprocess("--stage", "step", "--preset", "small", "--step-tokens", "64", "--steps", "1",
                                address_space=700 * 2**20)


def test_the_training_step_reports_its_time_and_memory():
    row = wmt_scale.training_step("base", 2 * wmt_scale.STEP_LEN, steps=1)
    assert row["sentences"] == 2 and row["tokens"] == 64 and row["seconds"] > 0
    assert row["peak_mb"] > 4 * 4 * 60e6 / 2**20  # over 60M parameters, their gradients and Adam's two moments


def test_the_table_gives_each_stage_its_sizes_and_exponents():
    row = {"seconds": 1.5, "peak_mb": 1200}
    results = {"sizes": {"2000000": {s: dict(row, seconds=3.0) for s in wmt_scale.STAGES},
                         "500000": {s: row for s in wmt_scale.STAGES}},
               "exponents": {s: {"seconds": 0.5, "peak_mb": 0.0} for s in wmt_scale.STAGES}}
    lines = wmt_scale.table(results).splitlines()
    assert lines[0].startswith("| stage | seconds at 0.5M / 2M pairs |")
    assert "| plan | 1.5 / 3 | 0.5 | 1,200 / 1,200 | 0.0 |" in lines
    assert len(lines) == 2 + len(wmt_scale.STAGES)
