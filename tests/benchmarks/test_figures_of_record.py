"""benchmarks/RESULTS.md opens with the figures of record; the README quotes them in bold. Every
bold figure of the README must be one of them, written as the table writes it, so that a figure
cannot change in one place and stay behind in the other."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOLD_FIGURE = re.compile(r"\*\*([0-9][0-9.,\-–×]*)\*\*")  # **38.81**, **0.92×**, **1.5-1.6**


def figures_of_record() -> dict[str, str]:
    """value -> what it measures, from the table under RESULTS.md's "Figures of record"."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    section = text.split("\n## Figures of record\n", 1)[1].split("\n## ", 1)[0]
    header, _, *body = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("|")]
    assert [c.strip() for c in header] == ["figure", "value", "date", "commit", "command", "machine state"]
    for row in body:
        assert len(row) == len(header) and all(c.strip() for c in row), f"a figure of record lacks a column: {row}"
    return {row[1].strip(): row[0].strip() for row in body}


def test_every_bold_figure_of_the_readme_is_a_figure_of_record():
    record = figures_of_record()
    quoted = BOLD_FIGURE.findall((ROOT / "README.md").read_text())
    assert len(quoted) >= 8  # BLEU twice, decoding twice, the step three times, parameters twice
    missing = [q for q in quoted if q not in record]
    assert not missing, f"README figures that RESULTS.md's figures of record do not hold: {missing}"
