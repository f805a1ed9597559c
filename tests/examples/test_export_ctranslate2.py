"""examples/export_ctranslate2.py: one command exports a run and prints the agreement figures."""

import json
import sys
from pathlib import Path

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
