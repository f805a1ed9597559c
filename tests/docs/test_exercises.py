"""The reading's exercises: every page sets at least one, and each folded answer's
``python exercise`` block runs, in a namespace of its own, with its assertions holding: an answer
stated on a page is an answer the code gives."""

from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import build  # noqa: E402

ANSWER = re.compile(r"^```python exercise\n(.*?)^```", re.S | re.M)


def page_text(name: str) -> str:
    return open(os.path.join(ROOT, "docs", "pages", f"{name}.md"), encoding="utf-8").read()


ANSWERS = [(page.name, i, code) for page in build.PAGES for i, code in enumerate(ANSWER.findall(page_text(page.name)), 1)]


def test_every_page_sets_exercises_with_answers():
    for page in build.PAGES:
        text = page_text(page.name)
        asked = len(re.findall(r"^\*\*Exercise \d+\.\*\*", text, re.M))
        answered = len(ANSWER.findall(text))
        assert asked >= 1, f"{page.name}.md sets no exercise"
        assert answered == asked == text.count("<details><summary>Answer</summary>"), \
            f"{page.name}.md: {asked} exercises, {answered} tested answers"


@pytest.mark.parametrize("page,i,code", ANSWERS, ids=[f"{p}-{i}" for p, i, _ in ANSWERS])
def test_the_answer_runs_and_holds(page, i, code):
    assert "assert " in code, f"{page}.md exercise {i}: an answer that asserts nothing proves nothing"
    exec(compile(code, f"docs/pages/{page}.md, exercise {i}", "exec"), {"__name__": f"exercise_{i}"})
