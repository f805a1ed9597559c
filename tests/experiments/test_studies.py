"""Every study of experiments/ still runs: its script parses (``--help`` exits 0, its imports
resolved from where it lies), and its main runs end to end on toy data in a tmp folder, writing
its outputs there, never into experiments/. A study is one-off: what it found is in
experiments/README.md; this test keeps it runnable, not its figures."""

from __future__ import annotations

import gzip
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import data, nn
from minitransformer.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import pseudo_words, tiny_run, tiny_test_set

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted(p.name for p in (ROOT / "experiments").iterdir() if (p / f"{p.name}.py").is_file())


def study(name: str):
    sys.path.insert(0, str(ROOT / "experiments" / name))
    return importlib.import_module(name)


def finished_run(folder: Path, **result) -> Path:
    """tiny_run, finished: its bleu.json (a moses-lc run of seed 2, two parts) and test outputs."""
    tiny_run(folder)
    part = {"kind": "start", "step": 0, "command": "python examples/train_wmt.py", "commit": "abc1234", "seed": 2}
    (folder / "bleu.json").write_text(json.dumps({
        "bleu": 12.5, "signature": "case:mixed", "bleu_lowercased": 13.0, "signature_lowercased": "case:lc",
        "literature": 13.1, "length_ratio": 0.9, "steps": 40, "epochs": 2.0, "stopped": "max_steps",
        "train_minutes": 1.0, "averaged": ["ckpt-40.npz"], "test_sentences": 4, "beam": 2, "alpha": 0.6,
        "preset": "multi30k", "parts": [part, {**part, "step": 20, "commit": "def5678"}], **result}))
    (folder / "test.tok.de").write_text("ein hund läuft .\n" * 4)
    (folder / "test.hyp.de").write_text("Ein Hund läuft.\n" * 4)
    log = [dict(kind="train", step=s, tokens=t) for s, t in ((20, 100), (40, 300))] + [
        dict(kind="val", step=s, loss=nll) for s, nll in ((20, 3.25), (40, 2.5))]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return folder


def run_bleu_minutes(module, tmp_path, monkeypatch, capsys):
    run = tiny_run(tmp_path / "run")
    ckpt = load_checkpoint(str(run / "averaged.npz"))
    model = nn.Transformer(nn.TransformerConfig.from_dict(ckpt.config))
    model.load_state_dict(ckpt.model)
    args = {"preset": "multi30k", "average_last": 2, "beam": 2, "alpha": 0.6, "length_penalty": "gnmt",
            "preprocess": "raw"}
    for step, seconds in ((10, 300.0), (20, 700.0), (30, 1000.0)):  # marks at 10 minutes and at the last
        save_checkpoint(str(run / f"ckpt-{step}.npz"), model, extra=dict(ckpt.extra, step=step, train_seconds=seconds,
                                                                       args=args))
    record, plot = tmp_path / "points.json", tmp_path / "curve.png"
    argv = ["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path, n=4, split="val")), "--every", "10",
            "--record", str(record), "--plot", str(plot), "--no-progress"]
    points = module.main(argv)
    assert [p["averaged"] for p in points] == [["ckpt-10.npz"], ["ckpt-20.npz", "ckpt-30.npz"]]
    assert json.loads(record.read_text()) == points and plot.stat().st_size > 0
    assert module.main(argv) == points  # each mark scored already: nothing added


def run_bleu_tokens(module, tmp_path, monkeypatch, capsys):
    run = finished_run(tmp_path / "run")
    record, plot = tmp_path / "points.json", tmp_path / "curve.png"
    argv = ["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path, n=4, split="val")), "--record", str(record),
            "--plot", str(plot), "--no-progress"]
    assert module.main(argv) == 0
    (point,) = json.loads(record.read_text())["points"]
    assert (point["split"], point["sentences"], point["steps"], point["target_tokens"]) == ("val", 4, 40, 200 * 40)
    assert module.main(["--run", str(run), "--test", "--record", str(record), "--plot", str(plot)]) == 0
    assert [p["split"] for p in json.loads(record.read_text())["points"]] == ["val", "test"]
    assert plot.stat().st_size > 0


def run_recipe(module, tmp_path, monkeypatch, capsys):
    readme = "mpiexec -n 2 python examples/train_wmt.py --data-dir ../shared/data/multi30k"

    def point(bleu, command):
        return dict(split="val", steps=9000, target_tokens=21.2e6, bleu=bleu, bleu_lowercased=bleu + 0.1,
                    length_ratio=0.98, validation_nll=1.74, run="runs/x", parts=[dict(command=command, commit="abc1234")])

    changes, baseline, plot = tmp_path / "changes.json", tmp_path / "baseline.json", tmp_path / "chart.png"
    changes.write_text(json.dumps({"points": [point(39.4, f"{readme} --dropout 0.3")]}))
    baseline.write_text(json.dumps({"points": [point(40.2, readme)]}))
    assert module.main(["--record", str(changes), "--baseline", str(baseline), "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def run_subwords(module, tmp_path, monkeypatch, capsys):
    ours, anchor = tmp_path / "ours", tmp_path / "anchor"
    ours.mkdir(), anchor.mkdir()
    for split, name in module.ANCHOR_FILES.items():
        corpus = data.moses.preprocess_corpus(data.load_corpus("multi30k", tiny_test_set(ours, n=60, split=split), split),
                                              "moses-lc")
        for lang, lines in (("en", corpus.src), ("de", corpus.tgt)):
            (anchor / f"{name}.{lang}").write_text("\n".join(lines) + "\n")  # their text, no merge applied
    try:
        import subword_nmt  # noqa: F401 - the literature's tool, installed for this study alone
    except ImportError:  # its stand-in: every word a piece
        monkeypatch.setattr(module, "subword_nmt",
                            lambda sentences, merges: module._figures({k: [s.split() for s in v] for k, v in sentences.items()}))
    rows = module.main(["--data-dir", str(ours), "--anchor", str(anchor), "--merges", "50", "--vocab-size", "60"])
    assert [r["tool"] for r in rows] == ["subword-nmt, 50 merges", "the anchor's own BPE'd training files",
                                         "sentencepiece, 60 pieces"]


def run_reproduction(module, tmp_path, monkeypatch, capsys):
    run = finished_run(tmp_path / "run")
    (tmp_path / "refs").mkdir()
    refs = tiny_test_set(tmp_path / "refs", n=4)
    record = module.main(["--run", str(run), "--data-dir", str(refs), "--out", str(tmp_path / "kept")])
    kept = tmp_path / "kept" / "seed2"
    assert (kept / "test.tok.de").read_bytes() == (run / "test.tok.de").read_bytes()
    assert json.loads((kept / "summary.json").read_text()) == record and record["commits"] == ["abc1234", "def5678"]
    assert "| seed 2, 40 updates |" in capsys.readouterr().out


def run_wmt_scale(module, tmp_path, monkeypatch, capsys):
    """The pipeline's stages after "generate" (whose million word types take 13 s to draw: the
    slow tier's test_wmt_scale_runs_whole runs it), each through the script's --stage in this
    process, on 1,000 pairs of toy text."""
    tiny_test_set(tmp_path, n=1000, split="train")
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}.gz").write_bytes(gzip.compress((tmp_path / f"train.{lang}").read_bytes()))
    assert module.STAGES[0] == "generate"
    for stage in module.STAGES[1:]:
        assert module.main(["--stage", stage, "--corpus", str(tmp_path), "--pairs", "1000", "--vocab-size", "100"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])  # the last stage's, "draw"
    assert row["steps"] > 0 and row["target_tokens"] > 1000 and row["peak_mb"] > 0


def run_bpe_dropout(module, tmp_path, monkeypatch, capsys):
    model = data.train_tokenizer(pseudo_words(300, 3), tmp_path / "spm.model", data.TokenizerConfig(vocab_size=100))
    result = module.main(["--tokenizer", str(model.path), "--data-dir", str(tiny_test_set(tmp_path, n=20, split="train")),
                          "--rates", "0.1,0.6"])
    for sampler in ("paper", "sentencepiece"):
        assert 1 < result[0.1][sampler] < result[0.6][sampler]


TOY_RUNS = {"bleu_minutes": run_bleu_minutes, "bleu_tokens": run_bleu_tokens, "recipe": run_recipe,
            "subwords": run_subwords, "reproduction": run_reproduction, "wmt_scale": run_wmt_scale,
            "bpe_dropout": run_bpe_dropout}


def test_every_study_has_a_toy_run():
    assert set(STUDIES) == set(TOY_RUNS)


@pytest.mark.parametrize("name", STUDIES)
def test_the_study_parses_its_options(name):
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / name / f"{name}.py"), "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr


@pytest.mark.parametrize("name", STUDIES)
def test_the_study_runs_on_toy_data(name, tmp_path, monkeypatch, capsys):
    TOY_RUNS[name](study(name), tmp_path, monkeypatch, capsys)

