"""benchmarks/translate_speed.py runs at a toy size, with CTranslate2 and without it."""

import json
import shlex
import statistics
import sys
from pathlib import Path

import pytest

from minitransformer import records
from tests.helpers import tiny_run, tiny_test_set

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import translate_speed  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speed")
    (folder / "run").mkdir()
    run = tiny_run(folder / "run", seed=5)
    tiny_test_set(folder)
    return ["--run", str(run), "--data-dir", str(folder), "--limit", "10", "--repeats", "2", "--max-tokens", "40"]


def test_ours_and_ctranslate2_side_by_side(toy, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ctranslate2")
    monkeypatch.setenv("MT_RECORDS_DIR", str(tmp_path))
    result = translate_speed.main(toy + ["--json", str(tmp_path / "speed.json"), "--record"])
    assert set(result["engines"]) == {"ours", "ct2 float32", "ct2 int8"}
    assert result["sentences"] == 10 and result["batches"] > 1  # several batches, the same for each engine
    for row in result["engines"].values():
        assert len(row["all_seconds"]) == 2 and row["tokens_per_s"] > 0 and 0 <= row["bleu"] <= 100
    base = result["engines"]["ct2 float32"]["all_seconds"]
    for row in result["engines"].values():  # the median of the repeats' own ratios
        assert row["vs_ct2_float32"] == statistics.median(b / s for b, s in zip(base, row["all_seconds"]))
    assert json.loads((tmp_path / "speed.json").read_text()) == result
    assert "vs ct2 fp32" in capsys.readouterr().out
    (row,) = records.read_bench(tmp_path / "translate_speed.jsonl")
    # The test set and batches differ from the defaults': they name the row too.
    assert row["config"] == {"beam": 4, "alpha": 0.6, "sentences": 10, "max_tokens": 40}
    engines = result["engines"]
    assert row["figures"] == pytest.approx({
        "ours_s": engines["ours"]["seconds"], "ct2_float32_s": engines["ct2 float32"]["seconds"],
        "ct2_int8_s": engines["ct2 int8"]["seconds"], "speed_vs_ct2": engines["ours"]["vs_ct2_float32"]}, rel=1e-3)


def test_without_ctranslate2_our_row_is_measured(toy, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed: import raises ImportError
    monkeypatch.setenv("MT_RECORDS_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = translate_speed.main(toy)
    assert set(result["engines"]) == {"ours"}
    assert "the CTranslate2 rows are skipped" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing recorded without --record
    result = translate_speed.main(toy + ["--beam", "2", "--record"])
    (row,) = records.read_bench(tmp_path / "translate_speed.jsonl")
    assert row["command"] == "python benchmarks/translate_speed.py " + shlex.join(toy + ["--beam", "2", "--record"])
    assert row["config"]["beam"] == 2
    assert row["figures"] == {"ours_s": pytest.approx(result["engines"]["ours"]["seconds"], rel=1e-3)}


def test_the_parts_add_up_and_every_patch_is_undone(toy, capsys):
    from minitransformer import decoding, nn
    from minitransformer.functional.matmul import Linear

    before = dict(vars(decoding)), Linear.__dict__["forward"], nn.KVCache.append
    result = translate_speed.main(toy + ["--engines", "ours", "--parts", "--repeats", "1"])
    assert set(result["engines"]) == {"ours"}  # CTranslate2 was neither exported nor run
    parts = result["parts"]
    top = [label for label, *_, parent in translate_speed.PARTS if parent is None]
    inner = [label for label, *_, parent in translate_speed.PARTS if parent is not None]
    assert all(parts[label] > 0 for label in top + inner)  # every part was reached, and timed
    assert sum(parts[label] for label in inner) <= parts["decoder layers"]
    assert parts["the rest (the search's bookkeeping)"] >= 0
    assert abs(sum(parts[label] for label in top) + parts["the rest (the search's bookkeeping)"]
               - parts["total"]) < 1e-9
    assert (dict(vars(decoding)), Linear.__dict__["forward"], nn.KVCache.append) == before
    assert "candidates (bound, survivors, sort)" in capsys.readouterr().out
