"""The Markdown a code host shows first (README.md, benchmarks/README.md, experiments/README.md):
every relative link reaches a file of the checkout, and every #anchor a heading of it, as a code
host makes anchors of headings."""

from __future__ import annotations

import pathlib
import re

import pytest
from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRONT = ["README.md", "benchmarks/README.md", "experiments/README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercased, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
    return {slug(tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"}


def links(path: pathlib.Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    md = [t for t in MarkdownIt("commonmark").enable("table").parse(text) if t.type == "inline"]
    found = [c.attrs["href"] for t in md for c in t.children or [] if c.type == "link_open"]
    return found + re.findall(r'<img src="([^"]+)"', text)


@pytest.mark.parametrize("page", FRONT)
def test_every_link_of_a_front_page_resolves(page):
    path = ROOT / page
    broken = []
    for href in links(path):
        if "://" in href or href.startswith("mailto:"):
            continue
        target, _, anchor = href.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{href}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{href}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# Top\n\n## Two commands\n\n[a](missing.md) [b](#two-commands) [c](#three) "
                    '<img src="nothing.png">\n')
    assert links(page) == ["missing.md", "#two-commands", "#three", "nothing.png"]
    assert anchors(page) == {"top", "two-commands"}
