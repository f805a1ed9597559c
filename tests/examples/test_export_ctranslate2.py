"""examples/export_ctranslate2.py: one command exports a run and prints the agreement figures."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import tiny_run, tiny_test_set

pytest.importorskip("ctranslate2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import export_ctranslate2  # noqa: E402


def test_export_and_agreement(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=8)
    figures = export_ctranslate2.main(["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path, n=20)),
                                       "--threads", "1"])
    for q in ("float32", "int8"):
        assert (run / "ctranslate2" / q / "model.bin").is_file()
    assert figures["teacher_forced_max_abs_diff"] < 2e-5
    assert figures["float32"]["greedy_equal"] == 1.0 and figures["float32"]["beam_equal_rescored"] == 1.0
    assert json.loads((run / "ctranslate2" / "agreement.json").read_text()) == figures
    out = capsys.readouterr().out
    assert "greedy equal 100.0%" in out and "int8" in out


def test_the_export_is_replaced_whole_and_checked_at_the_runs_beam(tmp_path):
    """A second export replaces the first as a whole (no file of it left), after the test set
    is found; the agreement check decodes with the run's beam and alpha, as translate.py does."""
    from minitransformer.checkpoint import load_checkpoint, save_checkpoint

    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=8)
    ckpt = load_checkpoint(str(run / "averaged.npz"))
    save_checkpoint(str(run / "averaged.npz"), export_ctranslate2.model_from(ckpt, "averaged.npz", "cpu"),
                    extra={**ckpt.extra, "beam": 3, "alpha": 1.5})
    test_set = str(tiny_test_set(tmp_path, n=6))
    args = ["--run", str(run), "--data-dir", test_set, "--threads", "1"]
    assert export_ctranslate2.main(args)["beam"] == 3
    stale = run / "ctranslate2" / "float32" / "stale.bin"
    stale.write_bytes(b"from an earlier export")
    with pytest.raises(FileNotFoundError):  # a wrong --data-dir: found before the export is touched
        export_ctranslate2.main(["--run", str(run), "--data-dir", str(tmp_path / "nowhere")])
    assert stale.exists()
    figures = export_ctranslate2.main(args + ["--beam", "2", "--alpha", "0.6"])
    assert (figures["beam"], figures["alpha"]) == (2, 0.6)
    assert not stale.exists() and (run / "ctranslate2" / "int8" / "model.bin").is_file()
    assert [p.name for p in run.iterdir() if p.name.startswith(".tmp-")] == []


@pytest.mark.parametrize("what", ["file", "other files"])
def test_an_out_that_is_not_an_export_folder_is_refused_in_one_line(tmp_path, capsys, what):
    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=8)
    out = tmp_path / "out"
    if what == "file":
        out.write_text("not a folder")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        export_ctranslate2.main(["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path)), "--out", str(out)])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert f"--out {out}" in line.replace("--out: ", "--out ") and (
        "is not a folder" in line if what == "file" else "notes.txt" in line)


def exported_run(tmp_path):
    """A run with an export in place, and the arguments that make it."""
    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=8)
    args = ["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path, n=6)), "--threads", "1"]
    export_ctranslate2.main(args)
    return run, args, {p: p.read_bytes() for p in sorted((run / "ctranslate2").rglob("*")) if p.is_file()}


def test_every_folder_of_an_export_has_the_usual_permissions(tmp_path):
    run, _, _ = exported_run(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for folder in (run / "ctranslate2", run / "ctranslate2" / "float32", run / "ctranslate2" / "int8"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask, folder


@pytest.mark.parametrize("failure", ["interrupt", "disagreement"])
def test_a_failed_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch, failure):
    run, args, before = exported_run(tmp_path)
    assert run / "ctranslate2" / "agreement.json" in before
    if failure == "interrupt":  # Ctrl-C while the new export is checked
        def compare(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(export_ctranslate2, "compare", compare)
        with pytest.raises(KeyboardInterrupt):
            export_ctranslate2.main(args)
    else:  # an export that does not decode as the model does
        monkeypatch.setattr(export_ctranslate2, "teacher_forced_gap", lambda *a, **k: 0.5)
        with pytest.raises(export_ctranslate2.ExportError, match=r"up to 0.5 away .*: not written to"):
            export_ctranslate2.main(args)
    after = {p: p.read_bytes() for p in sorted((run / "ctranslate2").rglob("*")) if p.is_file()}
    assert after == before
    assert [p.name for p in run.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_checkpoint_with_non_finite_weights_is_not_exported(tmp_path):
    from minitransformer.checkpoint import CheckpointError

    (tmp_path / "run").mkdir()
    run = tiny_run(tmp_path / "run", seed=8)
    weights = dict(np.load(run / "averaged.npz"))
    name = next(k for k in sorted(weights) if k.startswith("model/"))
    weights[name] = np.full_like(weights[name], np.nan)
    with open(run / "averaged.npz", "wb") as f:
        np.savez(f, **weights)
    with pytest.raises(CheckpointError, match=f"the weight {name.removeprefix('model/')} is not finite"):
        export_ctranslate2.main(["--run", str(run), "--data-dir", str(tiny_test_set(tmp_path, n=6))])
    assert not (run / "ctranslate2").exists()


def test_threads_beyond_the_cores_are_refused(tmp_path):
    parser = export_ctranslate2.build_parser()
    cores = os.cpu_count()
    assert parser.parse_args(["--run", str(tmp_path), "--threads", str(cores)]).threads == cores
    with pytest.raises(SystemExit):
        parser.parse_args(["--run", str(tmp_path), "--threads", str(cores + 1)])
