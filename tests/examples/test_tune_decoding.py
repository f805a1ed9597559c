"""examples/tune_decoding.py: the grid over averaging, beam and alpha, scored on validation."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from minitransformer import data
from minitransformer.bleu import bleu, bleu_lowercased
from minitransformer.checkpoint import average_checkpoints, load_checkpoint, save_checkpoint
from minitransformer.decoding import translate
from tests.helpers import tiny_run, tiny_test_set

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_wmt  # noqa: E402
import translate as translate_cli  # noqa: E402
import tune_decoding  # noqa: E402


@pytest.fixture
def run_with_checkpoints(tmp_path):
    """A tiny run folder whose three step checkpoints hold different weights, and a corpus
    folder with only a validation split (reading the test split would fail)."""
    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=3)
    base = load_checkpoint(str(run / "averaged.npz"))
    rng = np.random.default_rng(0)
    model = translate_cli.model_from(base, "averaged.npz", "cpu")
    for step in (10, 20, 30):
        for p in model.parameters():
            p.data += rng.standard_normal(p.shape).astype(p.data.dtype) * 0.3
        save_checkpoint(str(run / f"ckpt-{step}.npz"), model, extra=base.extra)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    return run, tiny_test_set(corpus, n=15, split="val")


def test_each_row_is_the_averaged_model_decoded_and_scored(run_with_checkpoints, capsys):
    run, corpus = run_with_checkpoints
    rows = tune_decoding.main(["--run", str(run), "--data-dir", str(corpus), "--average", "1,2",
                               "--beam", "1,3", "--alpha", "0.6,1.5"])
    assert [(r["average"], r["beam"], r["alpha"]) for r in rows] == [
        (n, b, a) for n in (1, 2) for b in (1, 3) for a in (0.6, 1.5)]
    assert json.loads((run / "decoding_sweep.json").read_text()) == rows

    # Row by row, the same figures computed the long way: average, load, beam-search, score.
    tok = data.Tokenizer(run / "spm-bpe60-3.model")
    val = data.load_corpus("multi30k", corpus, "val")
    paths = {1: [str(run / "ckpt-30.npz")], 2: [str(run / "ckpt-20.npz"), str(run / "ckpt-30.npz")]}
    for r in rows:
        model = translate_cli.model_from(average_checkpoints(paths[r["average"]]), "avg", "cpu")
        hyps = translate(model, tok, val.src, "cpu", r["beam"], r["alpha"])
        assert (r["bleu"], r["signature"], r["length_ratio"]) == bleu(hyps, val.tgt)
        assert r["bleu_lowercased"] == bleu_lowercased(hyps, val.tgt)[0]
        assert r["last"] == "ckpt-30.npz" and r["sentences"] == 15
        # The translations themselves, one a line, for sacreBLEU's paired bootstrap.
        assert r["hypotheses"] == f"val-avg{r['average']}-beam{r['beam']}-alpha{r['alpha']:g}.hyp"
        assert (run / r["hypotheses"]).read_text(encoding="utf-8").split("\n") == hyps + [""]
    assert len({r["first"] for r in rows}) == 2
    best = max(rows, key=lambda r: r["bleu"])
    assert f"average {best['average']}, beam {best['beam']}, alpha {best['alpha']}" in capsys.readouterr().out


def test_a_second_sweep_adds_its_rows_to_the_file(run_with_checkpoints):
    run, corpus = run_with_checkpoints
    sweep = ["--run", str(run), "--data-dir", str(corpus), "--average", "2", "--beam", "2"]
    first = tune_decoding.main(sweep + ["--alpha", "0.6,1.0"])
    second = tune_decoding.main(sweep + ["--alpha", "1.0,2.0"])  # 1.0 again: its row is replaced
    saved = json.loads((run / "decoding_sweep.json").read_text())
    assert [r["alpha"] for r in saved] == [0.6, 1.0, 2.0]
    assert saved == [first[0], second[0], second[1]]
    assert second[0]["seconds"] != first[1]["seconds"]  # the second sweep's row, not the first's


def test_a_sweep_of_part_of_the_split_names_its_translations_apart(run_with_checkpoints):
    run, corpus = run_with_checkpoints
    (row,) = tune_decoding.main(["--run", str(run), "--data-dir", str(corpus), "--limit", "4",
                                 "--average", "1", "--beam", "1"])
    assert row["hypotheses"] == "val4-avg1-beam1-alpha0.6.hyp" and row["sentences"] == 4
    assert len((run / row["hypotheses"]).read_text(encoding="utf-8").splitlines()) == 4
    assert not (run / "val-avg1-beam1-alpha0.6.hyp").exists()


def test_more_checkpoints_than_the_run_kept_is_one_line(run_with_checkpoints):
    run, corpus = run_with_checkpoints
    with pytest.raises(SystemExit, match="--average 4, but .* keeps 3 step checkpoints"):
        tune_decoding.main(["--run", str(run), "--data-dir", str(corpus), "--average", "4"])
    for flag in ("--average", "--beam"):  # 0 would average every checkpoint / keep no hypothesis
        with pytest.raises(SystemExit) as e:
            tune_decoding.main(["--run", str(run), "--data-dir", str(corpus), flag, "2,0"])
        assert e.value.code == 2
