"""benchmarks/recipe.py: a change is named by the options its command adds to the README's,
it is compared with the preset's point nearest in target tokens, and the chart is drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe  # noqa: E402


def point(steps, tokens, bleu_lc, command=None, split="val"):
    p = dict(split=split, steps=steps, target_tokens=tokens, bleu=bleu_lc - 0.1, bleu_lowercased=bleu_lc,
             length_ratio=0.99, validation_nll=1.75, run=f"runs/r{steps}")
    if command:
        p["parts"] = [dict(command=command, commit="abc1234")]
    return p


README = "mpiexec -n 2 python examples/train_wmt.py --data-dir ../shared/data/multi30k"


def test_a_change_is_what_its_command_adds_to_the_readme_run():
    assert recipe.change(point(1, 1, 1, f"{README} --out-dir runs/x --dropout 0.3 --no-progress")) == "--dropout 0.3"
    assert recipe.change(point(1, 1, 1, f"{README} --max-tokens 8192 --max-steps 2700 --resume")) == \
        "--max-tokens 8192 --max-steps 2700"
    assert recipe.change(point(1, 1, 1, f"{README} --out-dir 'a folder'")) == "the preset"
    elsewhere = "mpiexec -n 2 python /work/other/examples/train_wmt.py --data-dir d --dropout 0.3"
    assert recipe.change(point(1, 1, 1, elsewhere)) == "--dropout 0.3"


def test_changes_are_compared_with_the_preset_nearest_in_tokens(tmp_path):
    baseline = {"points": [point(9000, 21.2e6, 40.3), point(9000, 21.2e6, 39.6, split="test"),
                           point(18500, 43.7e6, 40.5)]}
    changes = {"points": [point(9000, 21.3e6, 39.5, f"{README} --dropout 0.3"),
                          point(2700, 22.0e6, 41.0, f"{README} --max-tokens 8192 --max-steps 2700")]}
    rows = recipe.rows(changes, baseline)
    assert [(r["change"], r["steps"]) for r in rows] == [
        ("the preset", 9000), ("--dropout 0.3", 9000), ("--max-tokens 8192 --max-steps 2700", 2700)]
    assert [round(r["delta_lowercased"], 2) for r in rows] == [0.0, -0.8, 0.7]
    table = recipe.table(rows)
    assert "| --dropout 0.3 | 9,000 | 21.3M | 39.40 | 39.50 | -0.80 |" in table
    paths = [tmp_path / name for name in ("changes.json", "baseline.json")]
    for path, record in zip(paths, (changes, baseline)):
        path.write_text(json.dumps(record))
    plot = tmp_path / "chart.png"
    assert recipe.main(["--record", str(paths[0]), "--baseline", str(paths[1]), "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
