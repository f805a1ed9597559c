"""The reading (docs/build.py), tested as a reader reads it: every section of the paper it
promises has its page, every code reference and link on every page resolves, every picture
is there; then a real browser (headless Chromium) opens the main pages from the file system.

The browser tests skip without Chromium, except where MT_REQUIRE_BROWSER=1 (CI installs it and
sets that), where they fail instead.
"""

from __future__ import annotations

import html.parser
import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest

from minitransformer import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import build  # noqa: E402

pytestmark = pytest.mark.slow  # the reading built whole, and rendered in a browser

# The paper's sections the reading walks through (issue 27; section 4, issue 77): each must have its page.
SECTIONS = ["3.1", "3.2.1", "3.2.2", "3.2.3", "3.3", "3.4", "3.5", "4", "5.1", "5.3", "5.4", "6.1", "6.2"]
MAIN_PAGES = ["index", "attention", "positional-encoding", "optimizer", "online-softmax", "fused-attention"]


@pytest.fixture(scope="module")
def site(tour, tmp_path_factory):
    """The site, built once from the tour's pictures."""
    pictures, _ = tour
    out = tmp_path_factory.mktemp("site")
    built = build.build(str(out), str(pictures))
    return out, built


class _Refs(html.parser.HTMLParser):
    """Every href and src of a page."""

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("href", "src") and v]


def test_every_section_of_the_paper_has_its_page(site):
    out, _ = site
    sections = {p.section for p in build.PAGES}
    assert set(SECTIONS) <= sections, f"no page for sections {sorted(set(SECTIONS) - sections)}"
    for page in build.PAGES:
        text = (out / f"{page.name}.html").read_text()
        assert "TO BE WRITTEN" not in text, f"{page.name}: still a placeholder"
        assert len(re.sub(r"<[^>]+>", " ", text).split()) > 300, f"{page.name}: hardly any prose"


def test_every_link_and_picture_on_every_page_resolves(site):
    out, built = site
    pages = sorted(out.glob("*.html")) + sorted(out.glob("guide/*.html")) + sorted(out.glob("internals/*.html")) \
        + sorted((out / "src").rglob("*.html"))
    assert len(pages) == len(build.SITE) + len(built.sources)
    for page in pages:
        refs = _Refs()
        refs.feed(page.read_text())
        for ref in refs.refs:
            url = urllib.parse.urlparse(ref)
            assert url.scheme in ("", "file"), f"{page.name}: {ref} would need the network"
            if not url.path:
                continue  # #anchor on the same page
            target = (page.parent / urllib.parse.unquote(url.path)).resolve()
            assert target.is_file(), f"{page.relative_to(out)}: broken link {ref}"
            if url.fragment and target.suffix == ".html":  # a line of a listing, or a section
                assert f'id="{url.fragment}"' in target.read_text(), f"{page.name}: no anchor {ref}"


def test_the_manuals_markdown_links_become_the_sites_own(tmp_path):
    """A guide page links files as a code host resolves them, relative to its Markdown; the
    build points each at the site's page, its copy of a picture, or its listing under src/, and
    stops at a link to no file, naming the page and line."""
    site = build.Site(str(tmp_path / "out"), str(tmp_path))
    site.folders["guide"] = str(tmp_path)
    page = build.GUIDE[0]
    (tmp_path / f"{page.name}.md").write_text(
        "# A\n\n[a](../pages/attention.md#masks), [b](../../benchmarks/README.md#multi30k), "
        "[c](reproducing.md), [d](../../examples/train_wmt.py)\n\n![e](../ablations.png)\n")
    site.render_page(page, build.GUIDE)
    text = (tmp_path / "out" / "guide" / f"{page.name}.html").read_text()
    for href in ('href="../attention.html#masks"', 'href="../src/benchmarks/README.md.html#multi30k"',
                 'href="reproducing.html"', 'href="../src/examples/train_wmt.py.html"', 'src="../ablations.png"'):
        assert href in text, href
    assert {"benchmarks/README.md", "examples/train_wmt.py"} <= site.sources
    (tmp_path / f"{page.name}.md").write_text("# A\n\nSee [it](../pages/no-such-page.md).\n")
    with pytest.raises(build.BuildError, match=rf"{page.name}\.md:3: the link \.\./pages/no-such-page\.md names no file"):
        site.render_page(page, build.GUIDE)


def test_every_heading_can_be_linked_to_and_a_long_page_lists_its_sections(site):
    """Every ## and ### heading has an id and a visible link to it; a page of build.CONTENTS_FROM
    sections or more opens with their list, each entry a link to its section on the page."""
    out, _ = site
    listed = 0
    for page in build.SITE:
        text = (out / page.html).read_text()
        headings = re.findall(r"<h([23])( id=\"[^\"]+\")?>(.*?)</h\1>", text, re.S)
        assert headings and all(ident for _, ident, _ in headings), f"{page.name}: a heading without an id"
        for _, ident, inner in headings:  # and a visible link to itself, to copy
            assert f'href="#{ident[5:-1]}"' in inner and re.sub(r"<[^>]+>", "", inner).strip(), (page.name, inner)
        sections = re.findall(r'<h2 id="([^"]+)">', text)
        links = re.findall(r'<nav class="contents".*?</nav>', text, re.S)
        if len(sections) >= build.CONTENTS_FROM:
            listed += 1
            assert len(links) == 1 and re.findall(r'href="#([^"]+)"', links[0]) == sections, page.name
        else:
            assert not links, page.name
    assert listed >= 1  # fused-attention, at least


def test_a_prime_sits_beside_its_letter_not_above_it():
    """x' as the letter and a prime (latex2mathml makes it a superscript, which Chromium raises
    far above the letter)."""
    mathml = build.Site.math("(pos, pos')", {})
    assert "<msup>" not in mathml and "<mi>s</mi><mo>&#x02032;</mo>" in mathml


def test_an_inline_formula_keeps_the_punctuation_after_it_on_its_line(site):
    a, b, c = (build.Site.math(x, {}) for x in "abc")
    html = build.bind_punctuation(f"<p>{a} and {b}: then {c}.</p>")
    assert html == f'<p>{a} and <span class="nowrap">{b}:</span> then <span class="nowrap">{c}.</span></p>'
    # As the pages render it, in dollarmath's span: the colon after $k$ on positional-encoding.
    out, _ = site
    k = build.Site.math("k", {})
    assert f'<span class="nowrap"><span class="math inline">{k}</span>:</span> the dot product' in \
        (out / "positional-encoding.html").read_text()


def test_docstrings_render_as_markdown_with_their_literals_as_code(site, tmp_path):
    """Notes are Markdown: a docstring's ``literals`` are code, its lists lists, its indented
    blocks kept as written."""
    out, _ = site
    text = (out / "attention.html").read_text()
    notes = re.search(r'KeyMask, line \d+</a>(.*?)</div>', text, re.S).group(1)
    assert "``" not in notes and "<code>model.src_key_mask(src)</code>" in notes
    assert notes.count("<li>") == 3  # the forms it holds
    rendered = build.Site(str(tmp_path), str(tmp_path)).notes.render("Shapes:\n\n    q   (B, h, T, d_k)\n")
    assert "<pre><code>q   (B, h, T, d_k)" in rendered


# A listing of more lines than this is cut into pieces, a note beside each (labml's annotated
# implementations set a note beside each section of a file, not one beside the whole).
LONGEST_LISTING = 40


def test_every_listing_has_its_note_and_a_long_one_is_cut_into_pieces(site):
    """Each listing's notes column says something beside its path (its docstring, or the page's
    notes on it), and none runs past LONGEST_LISTING lines of code."""
    out, _ = site
    listings = unnoted = 0
    for page in build.SITE:
        text = (out / page.html).read_text()
        for notes, code in re.findall(r'<div class="notes">(.*?)</div><div class="code">(.*?)</div>\n', text, re.S):
            listings += 1
            where = re.sub(r"<[^>]+>", "", re.search(r'class="where"[^>]*>(.*?)</a>', notes, re.S).group(1))
            said = re.sub(r"<[^>]+>", " ", re.sub(r'<a class="where".*?</a>', "", notes, flags=re.S)).split()
            assert len(said) >= 5, f"{page.name}: {where} has no note"
            assert code.count('class="line"') <= LONGEST_LISTING, f"{page.name}: {where} is one listing"
    assert listings > 90


# A formula written in ASCII: what a note (a docstring shown beside its code) may not contain
# outside its code and its typeset math.
ASCII_MATH = re.compile(r"\^|\bsqrt\(|\*\*|<=|>=|\bexp\(|\bsum_|\bsoftmax\(")


def test_notes_typeset_their_math(site):
    out, _ = site
    typeset = 0
    for page in build.PAGES:
        text = (out / f"{page.name}.html").read_text()
        for notes in re.findall(r'<div class="notes">(.*?)</div><div class="code">', text, re.S):
            typeset += notes.count("<math")
            prose = re.sub(r"<(code|pre|math)\b.*?</\1>", " ", notes, flags=re.S)
            prose = html.unescape(re.sub(r"<[^>]+>", " ", prose))
            assert not ASCII_MATH.search(prose), f"{page.name}: {' '.join(prose.split())[:300]}"
    assert typeset >= 20  # the notes do carry formulas, typeset


def test_every_page_has_a_picture_and_every_picture_a_page(site, tour):
    out, _ = site
    import figures

    pictures, _ = tour
    shown = {}
    for page in build.PAGES:
        shown[page.name] = re.findall(r'<img src="([^"]+)"', (out / f"{page.name}.html").read_text())
        assert shown[page.name], f"{page.name}.html has no picture"
    drawn = ["pictures/" + name for name in build.tour_pictures()] + [f"pictures/{n}.png" for n in figures.FIGURES]
    every = {src for srcs in shown.values() for src in srcs}
    assert set(drawn) <= every, f"drawn but on no page: {sorted(set(drawn) - every)}"
    assert all((pictures / src.removeprefix("pictures/")).is_file() for src in drawn)


def test_a_second_build_draws_nothing_and_a_changed_drawing_is_drawn_again(site, tour, tmp_path):
    """The build draws a picture only when it is missing or older than the code that draws it."""
    pictures, _ = tour
    before = {p.name: p.stat().st_mtime_ns for p in pictures.glob("*.png")}
    build.draw_pictures(str(pictures))
    assert {p.name: p.stat().st_mtime_ns for p in pictures.glob("*.png")} == before
    old = pictures / "autograd.png"
    os.utime(old, ns=(0, 0))  # older than docs/figures.py
    build.draw_pictures(str(pictures))
    assert old.stat().st_mtime_ns > 0
    assert {n: t for n, t in before.items() if n != "autograd.png"} == \
        {p.name: p.stat().st_mtime_ns for p in pictures.glob("*.png") if p.name != "autograd.png"}


def test_the_listings_are_the_source_itself(site):
    """A listing is the function as it is in the file, not a copy that can drift."""
    out, _ = site
    text = (out / "optimizer.html").read_text()
    source = open(os.path.join(ROOT, "minitransformer", "optim", "adam.py")).read()
    body = re.search(r"def adam_formula.*?\n\n\n", source, re.S).group(0)
    last_line = [line for line in body.splitlines() if line.strip()][-1].strip()
    assert last_line in html.unescape(re.sub(r"<[^>]+>", "", text))


def test_a_piece_of_a_function_is_its_lines_from_one_text_to_the_next(tmp_path):
    """``from "a" to "b"`` after a name: the function's lines from the first holding a to the
    next holding b (to its end without ``to``); a text the function lacks fails the build."""
    name = "csrc/attention.cu::attention_forward_f32_kernel"
    whole = build.resolve(name, "p.md:1")
    lines = open(os.path.join(ROOT, "csrc", "attention.cu")).read().splitlines()
    piece = build.resolve(f'{name} from "const float m_new" to "*= alpha;"', "p.md:1")
    assert whole.first < piece.first < piece.last < whole.last
    assert "const float m_new" in lines[piece.first - 1] and "*= alpha;" in lines[piece.last - 1]
    assert not any("*= alpha;" in line for line in lines[piece.first - 1:piece.last - 1])
    assert build.resolve(f'{name} from "const float m_new"', "p.md:1").last == whole.last
    with pytest.raises(build.BuildError, match=r'p\.md:7: .* has no line with "m_newest"'):
        build.resolve(f'{name} from "m_newest"', "p.md:7")
    with pytest.raises(build.BuildError, match=r'p\.md:7: .* has no line with "no such text" after'):
        build.resolve(f'{name} from "const float m_new" to "no such text"', "p.md:7")


def test_a_pages_notes_on_a_listing_are_set_beside_it_with_their_math(tmp_path):
    site = build.Site(str(tmp_path / "out"), str(tmp_path))
    site.file = os.path.join(ROOT, "p.md")  # the page being built, which a note's broken link names
    listing = site.listing(build.resolve("minitransformer/nn/layers.py::Linear", "p.md:1"),
                           "**The map.** It computes $xW + b$, [tested](src:tests/nn/test_transformer.py).")
    notes = re.search(r'<div class="notes">(.*?)</div><div class="code">', listing, re.S).group(1)
    assert notes.index("Xavier-uniform") < notes.index("<strong>The map.</strong>")  # docstring first
    assert notes.count("<math") == 3  # the docstring's $y = xW + b$ and $W$, and the note's
    assert 'href="src/tests/nn/test_transformer.py.html#L-1"' in notes  # into the source, as the page's links
    with pytest.raises(build.BuildError, match=r"p\.md:7: no file tests/gone\.py"):
        site.listing(build.resolve("minitransformer/nn/layers.py::Linear", "p.md:1"), "[it](src:tests/gone.py)", 7)


def test_the_piece_that_holds_a_docstring_has_it_as_its_notes():
    """A function cut into pieces shows its docstring beside the piece whose lines hold it, as
    the whole function would, and beside no other."""
    name = "minitransformer/kernels/reference/attention.py::attention_forward"
    first = build.resolve(f'{name} from "def attention_forward" to "lse = np.full("', "p.md:1")
    later = build.resolve(f'{name} from "for q0 in range"', "p.md:1")
    site = build.Site("/nonexistent", "/nonexistent")
    notes = [re.search(r'<div class="notes">(.*?)</div><div class="code">', site.listing(ref), re.S).group(1)
             for ref in (first, later)]
    assert "Tiled attention with online softmax" in notes[0] and "Tiled attention" not in notes[1]
    assert "Tiled attention with online softmax" not in site.listing(first).split('<div class="code">')[1]


def test_a_name_that_no_longer_exists_fails_the_build(tour, tmp_path):
    pages = tmp_path / "pages"
    shutil.copytree(os.path.join(ROOT, "docs", "pages"), pages)
    with open(pages / "attention.md", "a") as f:
        f.write("\n\n```source\nminitransformer/functional/attention.py::scaled_dot_product_attention_v2\n```\n")
    line = (pages / "attention.md").read_text().splitlines().index("```source", -4) + 1  # the fence's
    pictures, _ = tour
    with pytest.raises(build.BuildError, match=rf"attention\.md:{line}: .*has no scaled_dot_product_attention_v2"):
        build.build(str(tmp_path / "out"), str(pictures), str(pages))
    (pages / "attention.md").write_text("# A\n\nSee [it](src:minitransformer/gone.py).\n")
    with pytest.raises(build.BuildError, match=r"attention\.md:3: no file minitransformer/gone\.py"):
        build.build(str(tmp_path / "out"), str(pictures), str(pages))


def test_a_picture_nothing_draws_fails_the_build(tour, tmp_path):
    pages = tmp_path / "pages"
    shutil.copytree(os.path.join(ROOT, "docs", "pages"), pages)
    (pages / "index.md").write_text("# A\n\nText.\n\n![A picture](pictures/undrawn.png)\n")
    pictures, _ = tour
    with pytest.raises(build.BuildError, match=r"index\.md:5: no picture pictures/undrawn\.png"):
        build.build(str(tmp_path / "out"), str(pictures), str(pages))


def test_the_ladders_table_is_attn_pys_counts_and_without_them_the_build_fails(site, tour, tmp_path, monkeypatch):
    out, _ = site
    page = (out / "fused-attention.html").read_text()
    table = page[page.index('<div class="ladder">'):]
    table = table[:table.index("</div>")]
    rows = json.load(open(build.LADDER))["ladder"]
    assert [r["rung"] for r in rows] == ["naive", "tiled", "fused", "tensor cores"]
    for r in rows:  # each rung's row, as attn.py counted it
        assert f'<tr><td>{r["rung"]}</td><td>{r["dtype"]}</td><td>{r["launches"]}</td><td>{r["global_KB"]:,.0f} ' in table
    monkeypatch.setattr(build, "LADDER", str(tmp_path / "none.json"))
    pages = tmp_path / "pages"  # the first page holds the block, so that the build stops at once
    shutil.copytree(os.path.join(ROOT, "docs", "pages"), pages)
    (pages / "index.md").write_text("# A\n\nThe ladder:\n\n```ladder\n```\n")
    pictures, _ = tour
    with pytest.raises(build.BuildError, match=r"index\.md:5: no .*none\.json \(python benchmarks/attn\.py"):
        build.build(str(tmp_path / "out"), str(pictures), str(pages))


def test_section_4s_table_is_the_kept_measurements_and_without_them_the_build_fails(site, tour, tmp_path,
                                                                                    monkeypatch):
    import why_self_attention

    out, _ = site
    page = (out / "why-self-attention.html").read_text()
    data = why_self_attention.load()
    counted = dict(zip(data["counted"], zip(data["counts"]["rows"]["float32"], data["counts"]["rows"]["bfloat16"])))
    assert set(counted) < set(data["lengths"])
    for n, t in zip(data["lengths"], data["times"]["rows"]):  # each length's row, as measured
        f32, bf16 = counted.get(n, (None, None))
        cells = "<td>–</td>" * 3 if f32 is None else (
            f'<td>{f32["global_bytes"] / 1024:,.1f}</td><td>{bf16["global_bytes"] / 1024:,.1f}</td>'
            f'<td>{bf16["mma_flops"] / 1e6:,.2f}</td>')
        assert f'<tr><td>{n:,}</td>{cells}<td>{t["forward_ms"]:,.3f}</td></tr>' in page, n
    monkeypatch.setattr(why_self_attention, "DATA", str(tmp_path / "none.json"))
    pages = tmp_path / "pages"
    shutil.copytree(os.path.join(ROOT, "docs", "pages"), pages)
    (pages / "index.md").write_text("# A\n\n```self-attention-costs\n```\n")
    pictures, _ = tour
    with pytest.raises(build.BuildError, match=r"index\.md:3: .*none\.json.*python docs/why_self_attention\.py"):
        build.build(str(tmp_path / "out"), str(pictures), str(pages))


def test_table_1s_path_lengths_come_out_of_the_masks():
    """Walked over each layer type's mask (the model's own for self-attention), the longest path
    between two positions is Table 1's: 1 for self-attention, n/r restricted to a window of r,
    log_k(n) for a dilated convolution, n for a recurrent layer; the causal layers never reach
    back."""
    import figures

    for n in (16, 64):
        masks = figures.layer_masks(n, r=8, k=3)
        hops = {kind: figures.path_lengths(layers, n, np.arange(n)) for kind, layers in masks.items()}
        longest = [int(h[np.isfinite(h)].max()) for h in hops.values()]
        assert longest == [1, 1, math.ceil((n - 1) / 4), math.ceil(math.log(n, 3)), n - 1], (n, longest)
        reach_back = [bool(np.isfinite(h[0, n - 1])) for h in hops.values()]  # from the last position to the first
        assert reach_back == [True, False, True, False, False], (n, reach_back)


# --------------------------------------------------------------------------- in a real browser


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def chromium():
    path = _chromium()
    if path is None:
        if settings.env_flag("MT_REQUIRE_BROWSER"):
            pytest.fail("MT_REQUIRE_BROWSER=1 but no Chromium: apt-get install chromium")
        pytest.skip("no Chromium (apt-get install chromium); CI sets MT_REQUIRE_BROWSER=1")
    return path


def _run_chromium(chromium: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--allow-file-access-from-files", *args], capture_output=True, text=True, timeout=120)


# Runs in the page once it has loaded: what a reader would see broken.
_PROBE = """<script>
window.addEventListener("load", () => {
  const maths = [...document.querySelectorAll("math")];
  const report = {
    mathml: typeof MathMLElement !== "undefined" && maths.every(m => m instanceof MathMLElement),
    maths: maths.length,
    flat_maths: maths.filter(m => { const r = m.getBoundingClientRect(); return !(r.width > 0 && r.height > 0); }).length,
    images: document.images.length,
    broken_images: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
    text: document.body.innerText.length,
  };
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>"""


# Loads every page in turn in a frame of the given width and reports how its listings lie: those
# wider than their column, those whose notes are not beside their code, and the lines of code
# that wrap (a line box taller than one line of text).
_FRAMES = """<!doctype html><html><body><pre id="probe"></pre><script>
const pages = %s, width = %d, found = {};
let i = 0;
function next() {
  if (i === pages.length) { document.getElementById("probe").textContent = JSON.stringify(found); return; }
  const frame = document.createElement("iframe");
  frame.style.width = width + "px"; frame.style.height = "800px";
  frame.onload = () => {
    const doc = frame.contentDocument, where = e => e.querySelector(".where").textContent;
    const listings = [...doc.querySelectorAll(".listing")];
    const lines = [...doc.querySelectorAll(".listing .hl .line")];
    found[pages[i]] = {
      listings: listings.length,
      overflowing: listings.filter(e => { const c = e.querySelector(".hl"); return c.scrollWidth > c.clientWidth; }).map(where),
      beside: listings.filter(e => { const n = e.querySelector(".notes").getBoundingClientRect(),
                                          c = e.querySelector(".code").getBoundingClientRect();
                                     return n.right <= c.left && Math.abs(n.top - c.top) < 2; }).length,
      lines: lines.length,
      wrapped: lines.filter(e => e.getBoundingClientRect().height > 1.5 * parseFloat(getComputedStyle(e).lineHeight)).length,
      formulas: doc.querySelectorAll("math").length,
      // A formula wider than its column (a listing's notes, else the page) runs under the code
      // beside it or off the page: its box must lie inside the column's content box.
      cut: [...doc.querySelectorAll("math")].filter(m => {
        const column = m.closest(".notes, main"), c = column.getBoundingClientRect(), r = m.getBoundingClientRect(),
              style = getComputedStyle(column);
        return r.right > c.right - parseFloat(style.paddingRight) + 0.5 || r.left < c.left + parseFloat(style.paddingLeft) - 0.5;
      }).map(m => m.textContent.slice(0, 60)),
    };
    frame.remove(); i += 1; next();
  };
  frame.src = pages[i] + ".html";
  document.body.appendChild(frame);
}
next();
</script></body></html>"""


def _listings_at(site, chromium, width: int) -> dict:
    out, _ = site
    probe = out / f"frames{width}.probe.html"
    probe.write_text(_FRAMES % (json.dumps([page.name for page in build.PAGES]), width))
    try:
        dom = _run_chromium(chromium, "--window-size=1900,1000", "--virtual-time-budget=30000", "--dump-dom",
                            probe.as_uri()).stdout
    finally:
        probe.unlink()
    found = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))
    assert sorted(found) == sorted(page.name for page in build.PAGES), "not every page loaded"
    assert sum(page["lines"] for page in found.values()) > 1000, "the probe found almost no listed code"
    return found


def test_notes_sit_beside_their_code_from_1100_pixels(site, chromium):
    """At 1280 pixels (most laptops) every listing has its notes beside its code and the code's
    lines (to 120 columns) fit whole; at 1100 the notes are still beside, and a line too long
    for the column wraps under itself (at most 1 in 12) instead of scrolling. At both, every
    formula of every page fits its column."""
    for width, wrapped in ((1280, 0), (1100, 1 / 12)):
        found = _listings_at(site, chromium, width)
        assert sum(p["formulas"] for p in found.values()) > 500, "the probe found almost no formulas"
        assert {name: p["cut"] for name, p in found.items() if p["cut"]} == {}, width
        assert {name: p["overflowing"] for name, p in found.items() if p["overflowing"]} == {}, width
        assert {name: p["listings"] - p["beside"] for name, p in found.items() if p["beside"] != p["listings"]} == {}, width
        lines = sum(p["lines"] for p in found.values())
        assert sum(p["wrapped"] for p in found.values()) <= wrapped * lines, (width, {
            name: p["wrapped"] for name, p in found.items() if p["wrapped"]})


def test_notes_go_above_their_code_on_a_narrow_screen(site, chromium):
    found = _listings_at(site, chromium, 900)
    assert sum(p["beside"] for p in found.values()) == 0
    assert {name: p["overflowing"] for name, p in found.items() if p["overflowing"]} == {}


@pytest.mark.parametrize("name", MAIN_PAGES)
def test_the_main_pages_render_in_a_browser(site, chromium, tmp_path, name):
    out, _ = site
    probed = out / f"{name}.probe.html"
    probed.write_text((out / f"{name}.html").read_text().replace("</body>", _PROBE + "</body>"))
    try:
        dom = _run_chromium(chromium, "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()).stdout
    finally:
        probed.unlink()
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"{name}: the page did not load in Chromium"
    report = json.loads(html.unescape(found.group(1)))
    assert report["text"] > 1000, f"{name}: almost no text rendered"
    assert report["broken_images"] == [], f"{name}: broken images {report['broken_images']}"
    if name != "index":
        assert report["maths"] > 0, f"{name}: no equations"
    assert report["mathml"], f"{name}: the browser did not take the equations as MathML"
    assert report["flat_maths"] == 0, f"{name}: {report['flat_maths']} of {report['maths']} equations laid out empty"

    shot = tmp_path / f"{name}.png"
    _run_chromium(chromium, "--window-size=1400,1000", f"--screenshot={shot}", (out / f"{name}.html").as_uri())
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.std() > 0.05, f"{name}: the screenshot is blank"
    if os.environ.get("MT_SCREENSHOTS"):  # keep them to look at: MT_SCREENSHOTS=/some/folder
        shutil.copy(shot, os.path.join(os.environ["MT_SCREENSHOTS"], shot.name))
