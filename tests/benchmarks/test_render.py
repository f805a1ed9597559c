"""benchmarks/render.py: the committed tables are what the records give, and a record that is
not one stops it in one line naming the file and the line."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_render(root: pathlib.Path):
    """render.py bound to a copy of the checkout's records and pages under ``root``."""
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules["render"] = render  # dataclasses look their module up
    spec.loader.exec_module(render)
    render.ROOT, render.RECORDS = root, root / "benchmarks" / "records"
    return render


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(ROOT / "benchmarks" / "records", tmp_path / "benchmarks" / "records")
    shutil.copy(ROOT / "benchmarks" / "README.md", tmp_path / "benchmarks" / "README.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for path, _ in load_render(ROOT).READING:  # the README counts their lines
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    return tmp_path


def test_the_committed_tables_are_the_records():
    assert load_render(ROOT).main(["--check"]) == 0


def test_a_new_measurement_makes_the_tables_stale_until_rendered(copy, capsys):
    render = load_render(copy)
    path = copy / "benchmarks" / "records" / "multi30k.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    seed1 = next(r for r in rows if r["config"] == {"recipe": "main job", "seed": 1})
    newer = {**seed1, "date": "2027-01-01", "figures": {**seed1["figures"], "literature": 40.50}}
    path.write_text(path.read_text() + json.dumps(newer) + "\n")
    assert render.main(["--check"]) == 1
    assert "README.md" in capsys.readouterr().err
    assert render.main([]) == 0 and render.main(["--check"]) == 0
    readme = (copy / "README.md").read_text().split("<!-- render.py: results -->")[1].split("<!-- end -->")[0]
    assert "**40.13**" in readme  # the mean of 40.50 (the seed's latest), 39.61 and 40.29
    assert "**39.87**" not in readme


def test_the_reading_order_counts_each_files_lines(copy):
    render = load_render(copy)
    path = copy / render.READING[0][0]
    path.write_text(path.read_text() + "\n" * 1000)
    assert render.main(["--check"]) == 1
    row = next(line for line in render.reading_order().splitlines() if render.READING[0][0] in line)
    assert f"| {len(path.read_text().splitlines()):,} |" in row


def test_a_configuration_without_a_record_is_not_yet_measured(copy):
    render = load_render(copy)
    (copy / "benchmarks" / "records" / "translate_speed.jsonl").unlink()
    row = next(line for line in render.results().splitlines() if line.startswith("| beam search speed"))
    assert "not yet measured" in row


@pytest.mark.parametrize("line, message", [
    ("{", "translate_speed.jsonl, line 3: not JSON"),
    ('{"date": "2026-12-01"}', "translate_speed.jsonl, line 3: the content must contain"),
    (json.dumps({"date": "yesterday", "commit": "abcdef1", "machine": "m", "command": "c", "config": {},
                 "figures": {"x": 1}}), "line 3: date must match pattern"),
    (json.dumps({"date": "2026-12-01", "commit": "abcdef1", "machine": "m", "command": "c", "config": {},
                 "figures": {}}), "line 3: figures must contain at least 1 properties"),
])
def test_a_malformed_record_stops_it_in_one_line(copy, capsys, line, message):
    path = copy / "benchmarks" / "records" / "translate_speed.jsonl"
    path.write_text(path.read_text() + line + "\n")
    before = (copy / "benchmarks" / "README.md").read_text()
    assert load_render(copy).main([]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert (copy / "benchmarks" / "README.md").read_text() == before  # nothing half-written


def test_a_record_without_a_table_or_a_page_without_its_marker_is_refused(copy, capsys):
    (copy / "benchmarks" / "records" / "unknown.jsonl").write_text("")
    assert load_render(copy).main(["--check"]) == 2
    assert "unknown.jsonl: no table" in capsys.readouterr().err
    (copy / "benchmarks" / "records" / "unknown.jsonl").unlink()
    readme = copy / "README.md"
    readme.write_text(readme.read_text().replace("<!-- render.py: results -->", ""))
    assert load_render(copy).main(["--check"]) == 2
    assert "needs the marker" in capsys.readouterr().err


def test_a_page_that_is_not_a_regular_file_is_refused_and_a_link_is_written_through(copy, capsys):
    render = load_render(copy)
    readme = copy / "README.md"
    (copy / "real.md").write_text(readme.read_text().replace("<!-- render.py: results -->\n", "<!-- render.py: results -->\nstale\n"))
    readme.unlink()
    readme.symlink_to("real.md")
    assert render.main([]) == 0 and readme.is_symlink() and render.main(["--check"]) == 0
    readme.unlink()
    os.mkfifo(readme)
    assert render.main(["--check"]) == 2
    assert "README.md: not a regular file" in capsys.readouterr().err
