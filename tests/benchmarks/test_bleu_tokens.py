"""benchmarks/bleu_tokens.py on a tiny run folder: the validation point is sacreBLEU of the
run's own decoding, the tokens are counted from its log, the test point is the run's own
figure, and a second score of the same steps replaces the first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minitransformer import data, decoding
from minitransformer.bleu import bleu, bleu_lowercased
from tests.helpers import tiny_run, tiny_test_set

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import bleu_tokens  # noqa: E402
import train_wmt  # noqa: E402
import translate  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tiny_run(tmp_path_factory.mktemp("run"), seed=0)
    (folder / "bleu.json").write_text(json.dumps(dict(
        bleu=12.5, signature="nrefs:1|case:mixed", bleu_lowercased=13.0, signature_lowercased="nrefs:1|case:lc",
        length_ratio=0.9, steps=40, test_sentences=12, beam=2, alpha=0.6, preset="multi30k",
        averaged=["ckpt-40.npz"])))
    log = [dict(kind="train", step=s, tokens=t) for s, t in ((20, 100), (40, 300))] + [
        dict(kind="val", step=s, loss=nll) for s, nll in ((20, 3.25), (40, 2.5), (60, 2.0))]
    (folder / "train.jsonl").write_text("\n".join(map(json.dumps, log)) + "\n")
    return folder


def test_a_validation_point_is_sacrebleu_of_the_runs_decoding(run, tmp_path):
    (tmp_path / "data").mkdir()
    corpus = tiny_test_set(tmp_path / "data", n=10, split="val")
    record, plot = tmp_path / "record.json", tmp_path / "curve.png"
    argv = ["--run", str(run), "--data-dir", str(corpus), "--record", str(record), "--plot", str(plot), "--no-progress"]
    assert bleu_tokens.main(argv) == 0
    (point,) = json.loads(record.read_text())["points"]
    val = data.load_corpus("multi30k", corpus, "val")
    tok = data.Tokenizer(next(run.glob("*.model")))
    model = translate.load_model(str(run / "averaged.npz"), "cpu", tokenizer=tok)
    hyps = decoding.translate(model, tok, val.src, "cpu", 2, 0.6)
    assert (point["split"], point["sentences"], point["steps"]) == ("val", 10, 40)
    assert point["bleu"] == bleu(hyps, val.tgt)[0]
    assert point["bleu_lowercased"] == bleu_lowercased(hyps, val.tgt)[0]
    assert point["target_tokens"] == 200 * 40  # the logged steps' mean, times the steps
    assert point["validation_nll"] == 2.5  # the last logged at or before the point's steps
    assert plot.stat().st_size > 0
    assert bleu_tokens.main(argv) == 0  # the same steps scored again: replaced, not added
    assert len(json.loads(record.read_text())["points"]) == 1


def test_a_test_point_is_the_runs_own_figure(run, tmp_path):
    record = tmp_path / "record.json"
    assert bleu_tokens.main(["--run", str(run), "--test", "--record", str(record), "--plot", str(tmp_path / "c.png")]) == 0
    (point,) = json.loads(record.read_text())["points"]
    assert (point["split"], point["bleu"], point["bleu_lowercased"], point["sentences"]) == ("test", 12.5, 13.0, 12)


def test_a_run_that_has_not_finished_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="has no bleu.json: let its training finish first"):
        bleu_tokens.main(["--run", str(tmp_path), "--record", str(tmp_path / "r.json")])
