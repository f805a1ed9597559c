"""benchmarks/reproduction.py: a finished run's test translations and figures, kept to rescore."""

import json
import sys
from pathlib import Path

import pytest

from minitransformer import bleu
from minitransformer import data as data_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import reproduction  # noqa: E402

PART = {"kind": "start", "step": 0, "command": "mpiexec -n 2 python examples/train_wmt.py --preset multi30k-tiny",
        "commit": "abc1234", "seed": 2, "time": "2026-12-06T00:24:30+00:00"}


def finished_run(folder: Path, **overrides) -> Path:
    """A run folder as train_wmt.py leaves a finished moses-lc run."""
    folder.mkdir()
    (folder / "test.tok.de").write_text("ein hund &quot; läuft &quot; .\n")
    (folder / "test.hyp.de").write_text('ein hund "läuft".\n')
    result = {"bleu": None, "signature": None, "bleu_lowercased": 40.1, "signature_lowercased": "case:lc",
              "literature": 41.2, "signature_literature": "tok:none", "length_ratio": 0.99, "steps": 5800,
              "epochs": 100.0, "stopped": "patience: no better validation loss in 10 validations since step 5220",
              "train_minutes": 150.0, "averaged": ["ckpt-5800.npz"], "test_sentences": 1, "beam": 5,
              "alpha": 1.0, "length_penalty": "fairseq", "preprocess": "moses-lc", "preset": "multi30k-tiny",
              "parts": [PART, {**PART, "step": 3000, "commit": "def5678"}], **overrides}
    (folder / "bleu.json").write_text(json.dumps(result))
    return folder


def test_the_run_s_files_and_summary_are_kept(tmp_path):
    run = finished_run(tmp_path / "run")
    record = reproduction.main(["--run", str(run), "--out", str(tmp_path / "kept")])
    kept = tmp_path / "kept" / "seed2"  # seed 1's files go to the folder itself
    assert (kept / "test.tok.de").read_bytes() == (run / "test.tok.de").read_bytes()
    assert (kept / "test.hyp.de").read_bytes() == (run / "test.hyp.de").read_bytes()
    summary = json.loads((kept / "summary.json").read_text())
    assert summary == record
    assert (summary["preset"], summary["seed"], summary["commits"], summary["updates"], summary["literature"]) == (
        "multi30k-tiny", 2, ["abc1234", "def5678"], 5800, 41.2)
    assert summary["stopped"].startswith("patience") and summary["epochs"] == 100.0 and summary["bleu"] is None


def test_an_unfinished_run_is_refused_in_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit, match="bleu.json does not exist: the run has not finished"):
        reproduction.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "kept")])


@pytest.mark.parametrize("text, why", [
    ("oops", "bleu.json: not JSON"), ("[]", "bleu.json: the content must be object"),
    ('{"preset": "multi30k-tiny"}', r"bleu.json: the content must contain \[.*'bleu_lowercased'"),
    ('{"bleu": NaN}', "bleu.json: not JSON .*NaN"),
    ('{"bleu": 1, "signature": "s", "bleu_lowercased": 1, "signature_lowercased": "s", "steps": "9", "beam": 4, '
     '"alpha": 1, "test_sentences": 9}', r"bleu.json: steps must be integer \(got '9'\)"),
    ('{"bleu": 1, "signature": "s", "bleu_lowercased": 1, "signature_lowercased": "s", "steps": 9, "beam": 4, '
     '"alpha": 1, "test_sentences": 9}',
     "no preset, train_minutes, averaged")])
def test_a_bleu_json_that_is_not_a_run_s_is_refused_in_one_line(tmp_path, text, why):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "bleu.json").write_text(text)
    with pytest.raises(SystemExit, match=why):
        reproduction.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "kept")])
    assert not (tmp_path / "kept").exists()


def test_with_the_references_the_figure_is_split_into_its_parts_beside_the_anchor_s(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    (run / "test.tok.de").write_text("ein hund läuft .\nzwei katzen schlafen .\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "test_2016_flickr.en").write_text("A dog runs.\nTwo cats sleep.\n")
    (data / "test_2016_flickr.de").write_text("Ein Hund läuft schnell.\nZwei Katzen schlafen.\n")
    record = reproduction.main(["--run", str(run), "--data-dir", str(data), "--out", str(tmp_path / "kept")])
    refs = ["ein hund läuft schnell .", "zwei katzen schlafen ."]
    assert record["literature_parts"] == bleu.literature_parts(["ein hund läuft .", "zwei katzen schlafen ."], refs)
    assert record["literature_parts"]["bp"] < 1 and (record["literature_parts"]["sys_len"], record["literature_parts"]["ref_len"]) == (8, 9)
    saved = json.loads((tmp_path / "kept" / "seed2" / "summary.json").read_text())
    assert saved["literature_parts"] == record["literature_parts"]
    out = capsys.readouterr().out
    parts = record["literature_parts"]
    assert (f"| seed 2, 5,800 updates | {parts['score']:.2f} | {'/'.join(f'{x:.1f}' for x in parts['precisions'])} | "
            f"{parts['bp']:.3f} | 8 / 9 | {parts['score'] / parts['bp']:.2f} |") in out
    assert "| the anchor (Wu et al. 2021) | 41.02 | 71.0/47.5/34.3/24.5 | 0.999 | 12,096 / 12,103 | 41.06 |" in out


def test_a_test_output_of_another_length_than_the_references_is_refused_in_one_line(tmp_path):
    run = finished_run(tmp_path / "run")
    data = tmp_path / "data"
    data.mkdir()
    (data / "test_2016_flickr.en").write_text("A dog runs.\nTwo cats sleep.\n")
    (data / "test_2016_flickr.de").write_text("Ein Hund läuft.\nZwei Katzen schlafen.\n")
    with pytest.raises(data_module.CorpusError, match="test output has 1 translations for 2 references"):
        reproduction.main(["--run", str(run), "--data-dir", str(data), "--out", str(tmp_path / "kept")])
