"""A number a page quotes from a figure is the number the figure's code drew: the page writes
{{NAME.KEY}}, the build fills it from the numbers kept with the picture, and fails where the
numbers are not the picture's or lack the key (docs/build.py's QUOTE)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import build  # noqa: E402

pytestmark = pytest.mark.slow  # the reading's build


def drawn(pictures, name: str, picture: bytes, numbers: dict) -> None:
    """A picture and its numbers, as figures.draw keeps them."""
    (pictures / f"{name}.png").write_bytes(picture)
    (pictures / f"{name}.json").write_text(json.dumps(
        {"picture_sha256": build.sha256(str(pictures / f"{name}.png")), "numbers": numbers}))


def render(tmp_path, text: str, trained: str | None = None) -> str:
    """The first page of the reading, written as ``text``, as the build renders it."""
    pages = tmp_path / "pages"
    pages.mkdir(exist_ok=True)
    (pages / "index.md").write_text(text)
    site = build.Site(str(tmp_path / "site"), str(tmp_path / "pictures"), str(pages),
                      **({"trained": trained} if trained else {}))
    site.render_page(build.PAGES[0], build.PAGES)
    return (tmp_path / "site" / "index.html").read_text()


def test_the_page_quotes_what_the_figure_drew_and_fails_on_any_other_number(tmp_path):
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    page = "# A\n\nThe tiled kernel fetches {{ladder.naive_over_tiled:.0f}} times less.\n"
    drawn(pictures, "ladder", b"one drawing", {"naive_over_tiled": 48.73})
    assert "fetches 49 times less" in render(tmp_path, page)
    drawn(pictures, "ladder", b"another drawing", {"naive_over_tiled": 12.2})  # drawn again from other counts
    assert "fetches 12 times less" in render(tmp_path, page)
    (pictures / "ladder.png").write_bytes(b"a third drawing, its numbers not kept")
    with pytest.raises(build.BuildError, match=r"index\.md:3: .*ladder\.json holds the numbers of another drawing"):
        render(tmp_path, page)
    drawn(pictures, "ladder", b"a fourth drawing", {"naive_over_fused": 140.5})  # the figure no longer draws it
    with pytest.raises(build.BuildError, match=r"index\.md:3: .*no 'naive_over_tiled' \(they hold naive_over_fused\)"):
        render(tmp_path, page)
    with pytest.raises(build.BuildError, match=r"index\.md:1: no numbers of a figure masks"):
        render(tmp_path, "{{masks.rows}}\n")


def test_the_page_quotes_the_trained_run(tmp_path):
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "trained.json").write_text(json.dumps({"alpha": 2.0, "walk": {"winner": {"score": -0.7891}}}))
    text = render(tmp_path, "# A\n\nα = {{trained.alpha}} ranks it first ({{trained.walk.winner.score:.2f}}).\n",
                  str(trained))
    assert "α = 2.0 ranks it first (-0.79)" in text


def test_each_figure_keeps_the_numbers_it_drew_with_its_picture(tmp_path, monkeypatch):
    """figures.draw keeps what a figure's code returns beside the picture it drew; the
    fused-attention figure's are the ladder's, the table's own rows (one record for both)."""
    import figures

    ladder = json.load(open(build.LADDER, encoding="utf-8"))
    for row in ladder["ladder"]:  # counts of another ladder
        row["global_KB"] *= 3 if row["rung"] == "naive" else 2
    monkeypatch.setattr(build, "LADDER", str(tmp_path / "ladder.json"))
    (tmp_path / "ladder.json").write_text(json.dumps(ladder))
    numbers = figures.draw("fused-attention", str(tmp_path))
    rows = {r["rung"]: r for r in ladder["ladder"]}
    assert numbers["naive_over_tiled"] == rows["naive"]["global_KB"] / rows["tiled"]["global_KB"]
    assert numbers["tensor_cores"]["global_KB"] == rows["tensor cores"]["global_KB"]
    assert build.figure_numbers(str(tmp_path), "fused-attention", "p.md:1") == numbers
