"""benchmarks/bleu_minutes.py on a run folder of hand-timed checkpoints: each mark averages the
checkpoints written by then, scores their translation as the run decodes, and a mark scored
already (the same checkpoints) is not scored again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minitransformer import data, decoding, nn
from minitransformer.bleu import bleu_scores
from minitransformer.checkpoint import average_checkpoints, load_checkpoint, save_checkpoint
from tests.helpers import tiny_run, tiny_test_set

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import bleu_minutes  # noqa: E402
import translate  # noqa: E402

RUN_ARGS = {"preset": "multi30k", "average_last": 2, "beam": 2, "alpha": 0.6, "length_penalty": "gnmt",
            "preprocess": "raw"}
WRITTEN = {10: 300.0, 20: 700.0, 30: 1000.0, 40: 1900.0}  # step: seconds of training when written


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tiny_run(tmp_path_factory.mktemp("run"))
    ckpt = load_checkpoint(str(folder / "averaged.npz"))
    model = nn.Transformer(nn.TransformerConfig.from_dict(ckpt.config))
    model.load_state_dict(ckpt.model)
    for step, seconds in WRITTEN.items():
        for p in model.parameters():  # each checkpoint another model
            p.data *= 1.05
        save_checkpoint(str(folder / f"ckpt-{step}.npz"), model, extra=dict(
            ckpt.extra, step=step, train_seconds=seconds, args=RUN_ARGS))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_test_set(tmp_path_factory.mktemp("data"), n=8, split="val")


def test_each_mark_averages_the_checkpoints_written_by_then_and_none_twice(run, corpus, tmp_path):
    record, picture = tmp_path / "points.json", tmp_path / "curve.png"
    argv = ["--run", str(run), "--data-dir", str(corpus), "--every", "10", "--record", str(record),
            "--plot", str(picture), "--no-progress"]
    points = bleu_minutes.main(argv)
    # Marks at 10, 20 and 30 minutes and at the last checkpoint's 31.67; at 20 and 30 the last two
    # written are the same pair, scored once.
    assert [p["averaged"] for p in points] == [["ckpt-10.npz"], ["ckpt-20.npz", "ckpt-30.npz"],
                                               ["ckpt-30.npz", "ckpt-40.npz"]]
    assert [p["minutes"] for p in points] == [5.0, 16.67, 31.67] and [p["step"] for p in points] == [10, 30, 40]
    val = data.load_corpus("multi30k", corpus, "val")
    tok = data.Tokenizer(next(run.glob("*.model")))
    pair = [str(run / name) for name in points[1]["averaged"]]
    model = translate.model_from(average_checkpoints(pair), "pair", "cpu", tokenizer=tok)
    hyps = decoding.translate(model, tok, val.src, "cpu", 2, 0.6)
    expected = bleu_scores(hyps, val.tgt, "de")
    assert {k: points[1][k] for k in expected} == expected
    assert json.loads(record.read_text()) == points and picture.stat().st_size > 0
    assert bleu_minutes.main(argv) == points  # every mark scored already: nothing added


def test_where_a_curve_reaches_the_anchor_s_figure():
    def curve(*xy):
        return [{"minutes": x, "literature": y} for x, y in xy]

    assert bleu_minutes.crossing(curve((10, 40.02), (20, 42.02))) == pytest.approx(15.0)
    assert bleu_minutes.crossing(curve((10, 41.5), (20, 42.0))) == 10
    assert bleu_minutes.crossing(curve((10, 40.0), (20, 41.0))) is None


def test_a_run_that_kept_no_checkpoint_and_a_damaged_record_are_refused_in_one_line(run, tmp_path):
    (tmp_path / "empty").mkdir()
    empty = tiny_run(tmp_path / "empty")  # its averaged model and tokenizer, no step checkpoint
    with pytest.raises(SystemExit, match="keeps no ckpt-<step>.npz"):
        bleu_minutes.main(["--run", str(empty), "--record", str(tmp_path / "p.json"), "--plot", str(tmp_path / "c.png")])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(bleu_minutes.records.RecordError, match="bad.json: not JSON"):
        bleu_minutes.main(["--record", str(tmp_path / "bad.json"), "--plot", str(tmp_path / "c.png")])
    (tmp_path / "other.json").write_text('[{"run": "runs/x", "minutes": 15.0}]')  # not one of its points
    with pytest.raises(bleu_minutes.records.RecordError, match=r"other.json: \[0\] must contain .*'literature'"):
        bleu_minutes.main(["--record", str(tmp_path / "other.json"), "--plot", str(tmp_path / "c.png")])
