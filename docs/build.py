"""Build the reading: the paper, page by page in its order, beside the code that implements it.

    python docs/build.py                 # writes docs/_site/; open docs/_site/index.html
    python docs/build.py --out /tmp/site --pictures /tmp/tour   # pictures kept elsewhere

Each page is a Markdown file of docs/pages/ (the prose that joins the pieces, written for the
reading), in the order of PAGES below. The code it explains is taken from the source at build
time, so the reading cannot drift from the code:

    ```source
    minitransformer/functional/attention.py::scaled_dot_product_attention
    ```

shows that function (a class, ``Class.method``, a C++/CUDA function of csrc/, or a whole file
without ``::``): its docstring as notes beside its code, highlighted, with a link to the line it
starts on. ``... from "text" to "text"`` after the name shows a piece of it (from the first line
holding the one to the next holding the other), and lines ``: ...`` under a name are the page's
own notes on that listing, set beside it after its docstring. An inline link
``[text](src:minitransformer/nn/attention.py::MultiHeadAttention)`` points into the highlighted
copy of the file that the build writes under src/. A name that no longer exists fails the
build, with the page and line that named it. ``$...$`` and ``$$...$$`` are LaTeX, typeset to
MathML here (no script and no network when the page is read); ``![...](pictures/NAME.png)``
is a picture drawn by ``examples/tour.py`` or by ``docs/figures.py``; the build draws those
that are missing or older than the code that draws them, so a second build draws nothing.
A number the text quotes from a figure is written ``{{fused-attention.naive_over_tiled:.0f}}``
(QUOTE): the build writes in the number the figure's code returned when it drew the picture,
so that the text cannot quote another.
The libraries (markdown-it-py with mdit-py-plugins, latex2mathml,
Pygments, Jinja2) come with the ``docs`` extra, which ``dev`` includes.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import ast
import dataclasses
import hashlib
import html
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import time
import urllib.parse

import jinja2
from latex2mathml.converter import convert as latex_to_mathml
from markdown_it import MarkdownIt
from mdit_py_plugins.anchors import anchors_plugin
from mdit_py_plugins.dollarmath import dollarmath_plugin
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_for_filename

from minitransformer import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# The kernel ladder's counts, as benchmarks/attn.py writes them (```ladder shows them).
LADDER = os.path.join(DOCS, "ladder.json")
LADDER_COMMAND = "python benchmarks/attn.py --emulated --counts --json docs/ladder.json"
# A number a page quotes from a picture or table it shows: {{NAME.KEY}}, or {{NAME.KEY:SPEC}}
# with a format() spec (",.0f"). NAME is a figure of docs/figures.py, whose numbers are those
# its code returned when it drew the picture (figures.draw keeps them beside it, in NAME.json,
# with the picture's SHA-256), or "trained", docs/trained/trained.json; KEY is a dotted path
# into them. A key they lack, or numbers of another drawing than the picture's, fail the build.
QUOTE = re.compile(r"\{\{([a-z][\w-]*)\.([\w.]+)(?::([^{}]*))?\}\}")


@dataclasses.dataclass(frozen=True)
class Page:
    name: str  # docs/pages/<name>.md, written as <name>.html; or docs/<group>/<name>.md, as <group>/<name>.html
    title: str
    section: str  # the paper's section, or "" for the engine's pages and the others
    group: str = ""  # "" for the reading; "guide" or "internals" for the manual's pages

    @property
    def markdown(self) -> str:
        """Its Markdown, relative to the repository's root."""
        return f"docs/{self.group or 'pages'}/{self.name}.md"

    @property
    def html(self) -> str:
        """Its page, relative to the site's root."""
        return f"{self.group}/{self.name}.html" if self.group else f"{self.name}.html"


# The paper's order (sections 3 to 6), then the engine under it.
PAGES = [
    Page("index", "Read it", ""),
    Page("stacks", "The encoder and decoder stacks", "3.1"),
    Page("attention", "Scaled dot-product attention and its masks", "3.2.1"),
    Page("multi-head", "Multi-head attention", "3.2.2"),
    Page("uses-of-attention", "The three uses of attention", "3.2.3"),
    Page("feed-forward", "The position-wise feed-forward network", "3.3"),
    Page("embeddings", "Embeddings and the shared softmax weights", "3.4"),
    Page("positional-encoding", "Positional encoding", "3.5"),
    Page("why-self-attention", "Why self-attention: Table 1, measured", "4"),
    Page("batching", "Batches of similar length", "5.1"),
    Page("optimizer", "Adam and the learning rate of equation (3)", "5.3"),
    Page("regularization", "Dropout and label smoothing", "5.4"),
    Page("beam-search", "Beam search and checkpoint averaging", "6.1"),
    Page("variations", "Table 3: the variations, at small scale", "6.2"),
    Page("one-sentence", "One sentence, from text to BLEU", ""),
    Page("autograd", "The engine: a backward walk over the graph", ""),
    Page("online-softmax", "The online softmax: attention a tile at a time", ""),
    Page("fused-attention", "The fused attention kernels, rung by rung", ""),
    Page("mixed-precision", "Mixed precision", ""),
    Page("data-parallel", "Data parallel: the gradients' all-reduce", ""),
]

# The manual: how to run the project (docs/guide/) and how it is checked (docs/internals/).
# Their links are relative Markdown links (../pages/attention.md, ../../benchmarks/README.md),
# which a code host follows as they are and the build turns into the site's own.
GUIDE = [
    Page("training", "Training: the main job", "", "guide"),
    Page("reproducing", "Reproducing the Multi30k figures", "", "guide"),
    Page("deployment", "Deployment: export to CTranslate2", "", "guide"),
    Page("data", "Data", "", "guide"),
    Page("operations", "Operations: failures, interrupts and files", "", "guide"),
]
INTERNALS = [
    Page("layers", "Layers", "", "internals"),
    Page("kernels", "Kernels", "", "internals"),
    Page("emulated-device", "The emulated device", "", "internals"),
    Page("mutation-testing", "Mutation testing", "", "internals"),
]
GROUPS = [("The reading", PAGES), ("Guide", GUIDE), ("Internals", INTERNALS)]
SITE = PAGES + GUIDE + INTERNALS  # every page the site has
IMAGE = (".png", ".jpg", ".jpeg", ".svg", ".gif")


# Inline math and the punctuation right after it ("$x$:"): one unit, as a word and its colon
# are, so that a line never begins with the colon. The pages' math comes wrapped in
# dollarmath's <span class="math inline">, the notes' too; the span goes inside the unit whole.
_INLINE_MATH = r'<math\b[^>]*display="inline"[^>]*>(?:(?!</math>).)*</math>'
MATH_THEN_PUNCTUATION = re.compile(rf'(<span class="math inline">{_INLINE_MATH}</span>|{_INLINE_MATH})([.,:;!?)]+)',
                                   re.S)
PRIMED = re.compile(r"<msup>(<mi>[^<]*</mi>)(?:<mrow>)?<mi>&#x02032;</mi>(?:</mrow>)?</msup>")


HEADING = re.compile(r'(<h([23]) id="([^"]+)">)(.*?)(</h\2>)', re.S)


def permalinks(html: str) -> str:
    """Each ## and ### heading with a visible link to itself after its text: the address a
    reader copies to point someone at the section."""
    return HEADING.sub(r'\1\4<a class="permalink" href="#\3" aria-label="Link to this section">#</a>\5', html)


def bind_punctuation(html: str) -> str:
    """Keep each inline formula on one line with the punctuation after it."""
    return MATH_THEN_PUNCTUATION.sub(r'<span class="nowrap">\1\2</span>', html)


class ListingFormatter(HtmlFormatter):
    """Pygments' HTML with each line of code in a block of its own, its indentation in ``--i``,
    so that a line too long for the listing's column wraps under its own start (style.css)."""

    def wrap(self, source):
        for is_line, text in super().wrap(source):
            if is_line:
                code = text.rstrip("\n")
                plain = re.sub(r"<[^>]*>", "", code)
                indent = len(plain) - len(plain.lstrip(" "))
                style = f' style="--i: {indent}"' if indent else ""
                text = f'<span class="line"{style}>{code}</span>'
            yield is_line, text


class BuildError(Exception):
    """A page names something the source no longer has, or a picture that is missing."""


@dataclasses.dataclass
class SourceRef:
    path: str  # relative to the repository root
    name: str  # "" for the whole file
    first: int  # 1-based lines
    last: int
    node: ast.AST | None


DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # what may have a docstring
PIECE = re.compile(r'^(?P<ref>\S+)\s+from\s+"(?P<start>[^"]+)"(?:\s+to\s+"(?P<stop>[^"]+)")?\s*$')


def resolve(ref: str, where: str) -> SourceRef:
    """``path`` or ``path::Name`` or ``path::Class.method``, checked against the source; with
    ``from "text"`` (and ``to "text"``) after it, a piece of that: from the first of its lines
    holding the one text to the first line after it holding the other (or to its end); the
    piece that holds the docstring has it as its notes."""
    piece = PIECE.match(ref.strip())
    if piece:
        whole = resolve(piece["ref"], where)
        lines = open(os.path.join(ROOT, whole.path), encoding="utf-8").read().splitlines()
        span = range(whole.first - 1, whole.last)
        first = next((n for n in span if piece["start"] in lines[n]), None)
        if first is None:
            raise BuildError(f'{where}: {piece["ref"]} has no line with "{piece["start"]}"')
        last = whole.last - 1 if piece["stop"] is None else next(
            (n for n in span if n >= first and piece["stop"] in lines[n]), None)
        if last is None:
            raise BuildError(f'{where}: {piece["ref"]} has no line with "{piece["stop"]}" after "{piece["start"]}"')
        # The piece that holds the docstring shows it beside its code, as the whole would.
        doc = whole.node.body[0] if isinstance(whole.node, DOCUMENTED) and whole.node.body \
            and ast.get_docstring(whole.node) is not None else None
        holds_doc = doc is not None and first + 1 <= doc.lineno and doc.end_lineno <= last + 1
        return SourceRef(whole.path, whole.name, first + 1, last + 1, whole.node if holds_doc else None)
    path, _, name = ref.strip().partition("::")
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        raise BuildError(f"{where}: no file {path}")
    text = open(full, encoding="utf-8").read()
    if not name:
        return SourceRef(path, "", 1, text.count("\n") + 1, None)
    if path.endswith((".cu", ".cuh", ".cpp", ".h")):
        first, last = c_function(text, name)
        if not first:
            raise BuildError(f"{where}: {path} defines no function {name}")
        return SourceRef(path, name, first, last, None)
    if not path.endswith(".py"):
        raise BuildError(f"{where}: {path} is neither Python nor C++, so it has no {name}; name the file alone")
    node: ast.AST = ast.parse(text, filename=path)
    for part in name.split("."):
        found = [n for n in ast.iter_child_nodes(node)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part]
        found += [n for n in ast.iter_child_nodes(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                  and part in [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                               if isinstance(t, ast.Name)]]
        if not found:
            raise BuildError(f"{where}: {path} has no {name}")
        node = found[0]
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return SourceRef(path, name, first, node.end_lineno, node)


def c_function(text: str, name: str) -> tuple[int, int]:
    """The lines (1-based, inclusive) of C++/CUDA function ``name``'s definition, with the
    ``template`` line above it; (0, 0) if there is none. Braces are counted from the first one
    after the name: enough for this project's kernels, which put no brace in a string."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not re.search(rf"\b{re.escape(name)}\s*\(", line) or line.rstrip().endswith(";") \
                or line.startswith((" ", "\t", "#", "//")):
            continue
        first = i - 1 if i and lines[i - 1].startswith("template") else i
        depth, opened = 0, False
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            opened = opened or "{" in lines[j]
            if opened and depth == 0:
                return first + 1, j + 1
    return 0, 0


def rst_literals(doc: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown's (```x```)."""
    return re.sub(r"``(.+?)``", lambda m: f"`{m.group(1)}`" if "`" not in m.group(1) else f"`` {m.group(1)} ``", doc)


def src_href(ref: SourceRef) -> str:
    return f"src/{ref.path}.html#L-{ref.first}"  # Pygments' line anchors


class Site:
    """One build: the pages rendered, the source files they point into, the pictures they show."""

    def __init__(self, out: str, pictures: str, pages: str = os.path.join(DOCS, "pages"),
                 trained: str = os.path.join(DOCS, "trained")):
        self.out = out
        self.trained = trained  # the trained model's figures, from docs/trained.py
        self._trained: dict | None = None  # trained.json, once read
        self.pictures = pictures
        self.pages = pages
        self.sources: set[str] = set()  # files a page points into, written under src/
        self.images: dict[str, str] = {}  # pictures the pages show: their place in the site -> their file
        self.folders = {"": pages, "guide": os.path.join(DOCS, "guide"), "internals": os.path.join(DOCS, "internals")}
        self.formatter = HtmlFormatter(cssclass="hl")
        self.listing_formatter = ListingFormatter(cssclass="hl")
        self.md = MarkdownIt("commonmark", {"html": True}).enable("table")
        # A docstring is Markdown too, with its ``literals`` as code and its $math$ typeset as the
        # pages' is: paragraphs reflow, an indented block (a table, a command) stays as written.
        # No raw HTML: ``<T>`` is text.
        self.notes = MarkdownIt("commonmark", {"html": False}).enable("table")
        for md in (self.md, self.notes):
            dollarmath_plugin(md, renderer=self.math, allow_space=True, allow_digits=False)
        anchors_plugin(self.md, min_level=2, max_level=3)  # every section can be linked to
        for rule in ("fence", "link_open", "image"):  # markdown-it binds a rule to its renderer
            self.md.add_render_rule(rule, lambda renderer, *args, method=getattr(self, rule): method(*args))
        self.notes.add_render_rule("link_open", lambda renderer, *args: self.link_open(*args))  # a page's notes link too
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(DOCS), autoescape=True,
                                      undefined=jinja2.StrictUndefined)
        self.page: Page | None = None
        # What is being rendered: its Markdown (repository path, and the file read), its place
        # in the site; relative links and pictures are resolved from the one, written for the other.
        self.markdown = self.file = self.html = ""

    # -- what the Markdown pages may contain beyond CommonMark ----------------------------------

    @staticmethod
    def math(latex: str, options: dict) -> str:
        mathml = latex_to_mathml(latex, display="block" if options.get("display_mode") else "inline")
        # x' is x with a prime beside it: as a superscript (latex2mathml's msup) Chromium raises
        # the prime glyph, which already sits high, a second time, far above the letter.
        return PRIMED.sub(r"\1<mo>&#x02032;</mo>", mathml)

    def where(self, token) -> str:
        line = token.map[0] + 1 if token.map else token.meta.get("line", "?")
        return f"{os.path.relpath(self.file, ROOT)}:{line}"

    @property
    def root(self) -> str:
        """The site's root, relative to the page being rendered."""
        return "../" * self.html.count("/")

    def url(self, target: str) -> str:
        """The link, from the page being rendered, to the repository's file ``target``: its page
        if it is one, else its copy (a picture) or its highlighted listing under src/."""
        page = next((p for p in SITE if p.markdown == target), None)
        if page is not None:
            where = page.html
        elif target.lower().endswith(IMAGE):
            where = target[len("docs/"):] if target.startswith("docs/") else f"src/{target}"
            self.images[where] = os.path.join(ROOT, target)
        else:
            where = f"src/{target}.html"
            self.sources.add(target)
        return posixpath.relpath(where, posixpath.dirname(self.html) or ".")

    def relative(self, href: str, where: str) -> str | None:
        """A relative link of the Markdown (``../pages/attention.md#masks``) as the site's, or
        None if it names no file of the repository."""
        path, hash_, fragment = href.partition("#")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(self.markdown), urllib.parse.unquote(path)))
        if target.startswith("../") or not os.path.isfile(os.path.join(ROOT, target)):
            return None
        return self.url(target) + hash_ + fragment

    def fence(self, tokens, idx, options, env):
        token = tokens[idx]
        if token.info.split()[:1] == ["trained"]:
            return self.trained_model(token, (token.info.split() + [""])[1])
        if token.info.strip() == "ladder":
            return self.ladder(token)
        if token.info.strip() == "self-attention-costs":
            return self.self_attention_costs(token)
        if token.info.strip() != "source":  # ```python, or ```python exercise (tests/docs runs those)
            return self.code(token.content, (token.info.split() or ["text"])[0])
        listings = []  # [(ref, its notes, its line)]: a line ": text" is a note on the listing above it
        for n, line in enumerate(token.content.splitlines()):
            if line.startswith(": ") and listings:
                listings[-1][1].append(line[2:])
            elif line.startswith(": "):
                raise BuildError(f"{self.where(token)}: a note (': ...') before any listing")
            elif line.strip():
                listings.append((resolve(line, self.where(token)), [], token.map[0] + 2 + n if token.map else "?"))
        return "".join(self.listing(ref, "\n".join(notes), at) for ref, notes, at in listings)

    def link_open(self, tokens, idx, options, env):
        token = tokens[idx]
        href = token.attrGet("href") or ""
        if href.startswith("src:"):
            ref = resolve(href[4:], self.where(token))
            self.sources.add(ref.path)
            token.attrSet("href", self.root + src_href(ref))
            token.attrSet("class", "src")
        elif href and not href.startswith(("#", "mailto:")) and "://" not in href:
            url = self.relative(href, self.where(token))
            if url is not None:
                token.attrSet("href", url)
            elif href.partition("#")[0].endswith(".md") or not self.markdown.startswith("docs/pages/"):
                # The reading's pages link each other by their .html; any other page links files.
                raise BuildError(f"{self.where(token)}: the link {href} names no file of the repository")
        return self.md.renderer.renderToken(tokens, idx, options, env)

    def image(self, tokens, idx, options, env):
        token = tokens[idx]
        src = token.attrGet("src") or ""
        if src.startswith("pictures/"):
            if not os.path.isfile(os.path.join(self.pictures, src[len("pictures/"):])):
                raise BuildError(f"{self.where(tokens[idx])}: no picture {src} (does examples/tour.py or docs/figures.py draw it?)")
            src = self.root + src
        elif "://" in src:  # on the web: shown from there
            return self._figure(token, src, options, env)
        elif self.markdown.startswith("docs/pages/"):  # the reading names a picture kept in docs/ (e.g. ablations.png)
            if not os.path.isfile(os.path.join(DOCS, src)):
                raise BuildError(f"{self.where(tokens[idx])}: no picture docs/{src}")
            self.images[src] = os.path.join(DOCS, src)
        else:  # any other page names it relative to its Markdown, as a code host shows it
            url = self.relative(src, self.where(tokens[idx]))
            if url is None:
                raise BuildError(f"{self.where(tokens[idx])}: no picture {src}")
            src = url
        return self._figure(token, src, options, env)

    def _figure(self, token, src: str, options, env) -> str:
        alt = html.escape(self.md.renderer.renderInlineAsText(token.children or [], options, env))
        return f'<figure><img src="{html.escape(src)}" alt="{alt}"><figcaption>{alt}</figcaption></figure>'

    def trained_record(self, where: str) -> dict:
        """docs/trained/trained.json, read once: a page may hold several blocks."""
        path = os.path.join(self.trained, "trained.json")
        if self._trained is None:
            if not os.path.isfile(path):
                raise BuildError(f"{where}: no {os.path.relpath(path, ROOT)} (python docs/trained.py --run ...)")
            self._trained = json.load(open(path, encoding="utf-8"))
        return self._trained

    def quote(self, text: str) -> str:
        """A page's Markdown with its quotes of figures' numbers written in (QUOTE)."""
        def fill(match, line: int) -> str:
            name, key, spec = match.groups()
            where = f"{os.path.relpath(self.file, ROOT)}:{line}"
            value = self.trained_record(where) if name == "trained" else figure_numbers(self.pictures, name, where)
            for part in key.split("."):
                if not isinstance(value, dict) or part not in value:
                    held = ", ".join(value) if isinstance(value, dict) else type(value).__name__
                    raise BuildError(f"{where}: {{{{{name}.{key}}}}}: the numbers of {name} hold no {part!r} "
                                     f"(they hold {held})")
                value = value[part]
            try:
                return html.escape(format(value, spec or ""), quote=False)
            except (TypeError, ValueError) as e:
                raise BuildError(f"{where}: {{{{{name}.{key}:{spec}}}}}: {e}") from None

        return "\n".join(QUOTE.sub(lambda m, n=n: fill(m, n), line)
                         for n, line in enumerate(text.split("\n"), 1))

    def trained_model(self, token, part: str) -> str:
        """The trained model's figures (docs/trained/trained.json, from docs/trained.py).
        ```trained: its test BLEU with the signatures, validation translations beside their
        references, and the caption saying which run made them; ```trained pieces, batch,
        beams or bleu: a stage of one sentence's walk from text to BLEU."""
        t = self.trained_record(self.where(token))
        e = html.escape
        if part:
            if part not in WALK:
                raise BuildError(f"{self.where(token)}: no trained block {part!r}: {', '.join(WALK)} or none")
            return WALK[part](t["walk"], e)
        rows = "".join(f"<tr><td>{e(x['source'])}</td><td>{e(x['translation'])}</td><td>{e(x['reference'])}</td></tr>"
                       for x in t["samples"])
        return (f'<div class="trained"><p>Test BLEU <b>{t["bleu"]:.2f}</b> on {t["test_sentences"]:,} sentences '
                f'(<code>{e(t["signature"])}</code>); lowercased {t["bleu_lowercased"]:.2f} '
                f'(<code>{e(t["signature_lowercased"])}</code>).</p>'
                f'<table><tr><th>validation source</th><th>the model (beam {t["beam"]}, α {t["alpha"]})</th>'
                f'<th>reference</th></tr>{rows}</table>'
                f'<p class="caption">The model of <code>{e(t["command"])}</code>, seed {t["seed"]}, at commit '
                f'{e(t["commit"])}, after {t["steps"]:,} steps (docs/trained.py renders these from its run).</p></div>\n')

    def ladder(self, token) -> str:
        """```ladder: the kernel ladder's rungs counted on the emulated device, a row each, from
        docs/ladder.json (benchmarks/attn.py's --json output), the GPU's time column empty until
        a GPU run fills it."""
        results, rows = read_ladder(self.where(token))
        e = html.escape
        body = "".join(
            f'<tr><td>{e(r["rung"])}</td><td>{e(r["dtype"])}</td><td>{r["launches"]}</td>'
            f'<td>{r["global_KB"]:,.0f} ({r["ideal_KB"]:,.0f})</td><td>{r["sh_req"]:,}</td>'
            f'<td>{r["wavefronts"]:,} ({r["ideal_wf"]:,})</td><td>{r["barriers"]:,}</td><td>{r["mma"]:,}</td>'
            f'<td>{"–" if r["fwd_ms"] is None else format(r["fwd_ms"], ".3f")}</td></tr>' for r in rows)
        shape = ", ".join(f"{k} = {v}" for k, v in rows[0]["shape"].items())
        gpu = ("empty until a GPU run fills it" if "EMULATED" in results["device"]
               else f"measured on {results.get('gpu', 'a GPU')}")
        return (f'<div class="ladder"><table><tr><th>rung</th><th>dtype</th><th>launches</th>'
                f'<th>global memory, KiB (fewest)</th><th>shared requests</th><th>wavefronts (fewest)</th>'
                f'<th>barriers</th><th>mma</th><th>time, ms</th></tr>{body}</table>'
                f'<p class="caption">One forward of each rung, non-causal, {e(shape)}, counted on the emulated '
                f'device by <code>{e(LADDER_COMMAND)}</code>: global memory in the 32-byte sectors its '
                f'requests fetch, before any cache, beside the fewest their bytes could take; shared-memory '
                f'requests and their wavefronts, one more than the fewest for each bank conflict; the time '
                f'column {gpu}.</p></div>\n')

    def self_attention_costs(self, token) -> str:
        """```self-attention-costs: section 4's measurements against the length n, a row each,
        from docs/why-self-attention.json (docs/why_self_attention.py), with the commands,
        commits and machine that made them."""
        import why_self_attention  # docs/, beside this file

        try:
            data = why_self_attention.load()
        except (OSError, ValueError, KeyError) as e:
            raise BuildError(f"{self.where(token)}: {e} ({why_self_attention.COMMAND})") from None
        counts, times = data["counts"], data["times"]
        counted = {r["n"]: (r, b) for r, b in zip(counts["rows"]["float32"], counts["rows"]["bfloat16"])}

        def row(n, t):
            cells = ("<td>–</td>" * 3 if n not in counted else  # past the lengths counted
                     f'<td>{counted[n][0]["global_bytes"] / 1024:,.1f}</td><td>{counted[n][1]["global_bytes"] / 1024:,.1f}'
                     f'</td><td>{counted[n][1]["mma_flops"] / 1e6:,.2f}</td>')
            return f'<tr><td>{n:,}</td>{cells}<td>{t["forward_ms"]:,.3f}</td></tr>'

        body = "".join(row(n, t) for n, t in zip(data["lengths"], times["rows"]))
        e = html.escape
        return (f'<div class="ladder by-length"><table><tr><th>n</th><th>float32 kernel, KiB</th>'
                f'<th>tensor cores, KiB</th><th>tensor cores, MFLOP</th><th>NumPy path, ms</th></tr>{body}</table>'
                f'<p class="caption">One forward of one head, d = {data["d"]}, non-causal. Counted to '
                f'n = {data["counted"][-1]:,} on the emulated device by <code>{e(counts["command"])}</code> '
                f'(commit {e(counts["commit"])}, {e(counts["date"])}): the fused kernel\'s global memory, in the '
                f'32-byte sectors its requests fetch, and the tensor cores\' mma instructions at 4,096 FLOPs each. '
                f'Timed by <code>{e(times["command"])}</code> on {e(times["machine"])} (commit {e(times["commit"])}, {e(times["date"])}): the least CPU time of '
                f'{times["repeats"]} forwards of <code>F.scaled_dot_product_attention</code>, one BLAS thread.</p></div>\n')

    def code(self, text: str, language: str) -> str:
        from pygments.lexers import get_lexer_by_name
        try:
            lexer = get_lexer_by_name(language)
        except Exception:
            lexer = get_lexer_by_name("text")
        return highlight(text, lexer, self.formatter)

    def listing(self, ref: SourceRef, notes_md: str = "", line: int | str = "?") -> str:
        """A piece of the source: its docstring, then the page's own notes on it (``notes_md``,
        Markdown, from the page's ``line``), on the left; its code on the right."""
        self.sources.add(ref.path)
        lines = open(os.path.join(ROOT, ref.path), encoding="utf-8").read().splitlines()
        body = lines[ref.first - 1:ref.last]
        notes = ""
        doc = ast.get_docstring(ref.node) if isinstance(ref.node, DOCUMENTED) else None
        if doc and ref.node.body and isinstance(ref.node.body[0], ast.Expr):
            d = ref.node.body[0]  # cut the docstring out of the code: it is shown beside it
            body = lines[ref.first - 1:d.lineno - 1] + lines[d.end_lineno:ref.last]
            notes = bind_punctuation(self.notes.render(rst_literals(doc)))
        if notes_md:  # a link in them that names nothing is told at the listing's line of the page
            tokens = self.notes.parse(notes_md)
            for token in tokens:
                for child in token.children or []:
                    child.meta["line"] = line
            notes += bind_punctuation(self.notes.renderer.render(tokens, self.notes.options, {}))
        code = highlight("\n".join(body) + "\n", get_lexer_for_filename(ref.path), self.listing_formatter)
        label = f"{ref.path}" + (f" · {ref.name}" if ref.name else "")
        return (f'<div class="listing"><div class="notes"><a class="where" href="{self.root}{src_href(ref)}">'
                f'{html.escape(label).replace("/", "/<wbr>")}, line {ref.first}</a>{notes}</div><div class="code">{code}</div></div>\n')

    # -- the pages ---------------------------------------------------------------------------

    def render_page(self, page: Page, group: list[Page]) -> None:
        self.page = page
        path = os.path.join(self.folders[page.group], page.name + ".md")
        if not os.path.isfile(path):
            raise BuildError(f"docs/build.py: the site lists {page.name!r}, but there is no {page.markdown}")
        self.markdown, self.file, self.html = page.markdown, path, page.html
        text = self.quote(open(path, encoding="utf-8").read())
        tokens = self.md.parse(text)
        for token in tokens:  # inline tokens (links, pictures) know no line: give them their block's
            for child in token.children or []:
                child.meta.setdefault("line", token.map[0] + 1 if token.map else "?")
        body = permalinks(bind_punctuation(self.md.renderer.render(tokens, self.md.options, {})))
        heading = lambda inline: self.md.renderer.renderInline(inline.children or [], self.md.options, {})
        body = body.replace("</h1>", "</h1>\n" + contents(tokens, heading), 1)
        i = group.index(page)  # the previous and next pages of its own group
        out = self.env.get_template("template.html").render(
            page=page, body=body, groups=GROUPS, prev=group[i - 1] if i > 0 else None,
            next=group[i + 1] if i + 1 < len(group) else None, root=self.root)
        write(os.path.join(self.out, page.html), out)

    def render_source(self, path: str) -> None:
        """A file a page points into, under src/: highlighted with its lines numbered, or, for a
        Markdown file (benchmarks/README.md), rendered as a code host shows it, its links the site's."""
        self.markdown, self.file, self.html = path, os.path.join(ROOT, path), f"src/{path}.html"
        text = open(self.file, encoding="utf-8").read()
        if path.endswith(".md"):
            code = self.md.render(text)
        else:
            formatter = HtmlFormatter(cssclass="hl", linenos="inline", lineanchors="L", anchorlinenos=True)
            code = highlight(text, get_lexer_for_filename(path), formatter)
        out = self.env.get_template("source.html").render(path=path, code=code, root=self.root, groups=GROUPS)
        write(os.path.join(self.out, self.html), out)

    def build(self) -> None:
        for _, group in GROUPS:
            for page in group:
                self.render_page(page, group)
        done: set[str] = set()
        while self.sources - done:  # a rendered Markdown file may point into more files
            for path in sorted(self.sources - done):
                done.add(path)
                self.render_source(path)
        css = open(os.path.join(DOCS, "style.css"), encoding="utf-8").read()
        write(os.path.join(self.out, "style.css"), css + "\n" + self.formatter.get_style_defs(".hl"))
        for where, image in self.images.items():
            os.makedirs(os.path.dirname(os.path.join(self.out, where)), exist_ok=True)
            shutil.copyfile(image, os.path.join(self.out, where))
        if os.path.abspath(self.pictures) != os.path.abspath(os.path.join(self.out, "pictures")):
            shutil.copytree(self.pictures, os.path.join(self.out, "pictures"), dirs_exist_ok=True)


def read_ladder(where: str) -> tuple[dict, list[dict]]:
    """docs/ladder.json (benchmarks/attn.py's --json output) and its ladder's rows: what the
    ```ladder table and the fused-attention figure both show."""
    if not os.path.isfile(LADDER):
        raise BuildError(f"{where}: no {os.path.relpath(LADDER, ROOT)} ({LADDER_COMMAND})")
    results = json.load(open(LADDER, encoding="utf-8"))
    rows = results.get("ladder") or []
    if not rows:
        raise BuildError(f"{where}: {os.path.relpath(LADDER, ROOT)} has no ladder ({LADDER_COMMAND})")
    return results, rows


def figure_numbers(pictures: str, name: str, where: str) -> dict:
    """The numbers figure ``name`` drew, kept beside its picture in ``pictures`` (figures.draw),
    if they are that picture's: they name the SHA-256 of the picture they were drawn with."""
    path = os.path.join(pictures, f"{name}.json")
    if not os.path.isfile(path):
        raise BuildError(f"{where}: no numbers of a figure {name} (docs/figures.py draws them with "
                         f"its picture, as {name}.json)")
    kept = json.load(open(path, encoding="utf-8"))
    picture = os.path.join(pictures, f"{name}.png")
    if not os.path.isfile(picture) or sha256(picture) != kept["picture_sha256"]:
        raise BuildError(f"{where}: {os.path.relpath(path, ROOT)} holds the numbers of another drawing "
                         f"than {name}.png: draw it again (python docs/figures.py --out ... {name})")
    return kept["numbers"]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# A page of this many sections or more opens with their list.
CONTENTS_FROM = 5


def contents(tokens, render) -> str:
    """The page's sections (its ## headings, with the ids the anchors plugin gave them) as a
    list of links, for a page of CONTENTS_FROM sections or more; else nothing. ``render`` turns a
    heading's inline token into HTML, its math typeset as in the heading."""
    sections = [(token.attrGet("id"), render(tokens[i + 1]))
                for i, token in enumerate(tokens) if token.type == "heading_open" and token.tag == "h2"]
    if len(sections) < CONTENTS_FROM:
        return ""
    items = "".join(f'<li><a href="#{html.escape(i)}">{text}</a></li>' for i, text in sections)
    return f'<nav class="contents" aria-label="On this page"><p>On this page</p><ol>{items}</ol></nav>\n'


# The stages of one sentence's walk, as ```trained <stage> blocks show them.

def _pieces(w: dict, e) -> str:
    cells = "".join(f"<td><code>{e(p)}</code><br>{i}</td>" for p, i in zip(w["pieces"], w["ids"]))
    return f'<div class="trained"><p>{e(w["source"])}</p><table class="pieces"><tr>{cells}</tr></table></div>\n'


def _batch(w: dict, e) -> str:
    rows = "".join("<tr>" + "".join(f'<td class="{"pad" if i == w["pad_id"] else ""}">{i}</td>' for i in row)
                   + "</tr>" for row in w["batch"])
    norms = ", ".join(f"{n:g}" for n in w["memory_norms"])
    return (f'<div class="trained"><table class="pieces">{rows}</table><p>The encoder\'s output for the first '
            f'row: shape ({", ".join(map(str, w["memory_shape"]))}), one vector per piece; their lengths: '
            f'{e(norms)}.</p></div>\n')


def _beams(w: dict, e) -> str:
    rows = []
    for s in w["steps"]:
        live = "<br>".join(f'{b["log_prob"]:.2f} <code>{e(" ".join(b["pieces"]))}</code>' for b in s["beams"][:4])
        more = f' <span class="muted">(+{len(s["beams"]) - 4} more)</span>' if len(s["beams"]) > 4 else ""
        done = "<br>".join(f'{f["score"]:.2f} ({f["log_prob"]:.2f}) <code>{e(" ".join(f["pieces"]))}</code>'
                           for f in s["finished"])
        rows.append(f"<tr><td>{s['t']}</td><td>{live}{more}</td><td>{done}</td></tr>")
    return ('<div class="trained"><table><tr><th>t</th><th>beams kept, best first (log P)</th>'
            '<th>finished here: score = log P / lp (log P)</th></tr>' + "".join(rows) + "</table></div>\n")


def _bleu(w: dict, e) -> str:
    return (f'<div class="trained"><table><tr><th>pieces</th><td><code>{e(" ".join(w["hypothesis_pieces"]))}</code>'
            f'</td></tr><tr><th>text</th><td>{e(w["translation"])}</td></tr><tr><th>reference</th>'
            f'<td>{e(w["reference"])}</td></tr><tr><th>sentence BLEU</th><td>{w["sentence_bleu"]:.1f} '
            f'(<code>{e(w["sentence_signature"])}</code>)</td></tr></table></div>\n')


WALK = {"pieces": _pieces, "batch": _batch, "beams": _beams, "bleu": _bleu}


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def newest(*paths: str) -> float:
    """The latest modification time of the files named, and of the .py files under folders."""
    times = []
    for path in paths:
        full = os.path.join(ROOT, path)
        if os.path.isdir(full):
            times += [os.path.getmtime(os.path.join(d, f)) for d, _, names in os.walk(full) for f in names
                      if f.endswith(".py")]
        else:
            times.append(os.path.getmtime(full))
    return max(times)


def stale(folder: str, names, code: float) -> list[str]:
    """The pictures of ``names`` missing from ``folder`` or older than ``code`` (a time)."""
    return [n for n in names if not os.path.isfile(os.path.join(folder, n))
            or os.path.getmtime(os.path.join(folder, n)) < code]


def tour_pictures() -> list[str]:
    """The pictures examples/tour.py draws (its PICTURES), read without running it."""
    tree = ast.parse(open(os.path.join(ROOT, "examples", "tour.py"), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PICTURES"]:
            return ast.literal_eval(node.value)
    raise BuildError("examples/tour.py no longer lists its PICTURES")


def draw_pictures(folder: str) -> None:
    """Draw into ``folder`` the pictures that are missing there or older than the code that
    draws them: the tour's (one run of examples/tour.py, which draws them all) and those of
    figures.py, one by one, each with its numbers and again when the data it reads changes."""
    sys.modules.setdefault("build", sys.modules[__name__])  # figures imports this module, as build when run
    import figures  # docs/, beside this file

    if stale(folder, tour_pictures(), newest("examples/tour.py", "examples/copy_task.py", "minitransformer")):
        tour = os.path.join(ROOT, "examples", "tour.py")
        run = subprocess.run([sys.executable, tour, "--out", folder], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        if run.returncode:  # the tour's own one line says why
            last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
            raise BuildError(f"examples/tour.py --out {folder}: {last}")
    os.makedirs(folder, exist_ok=True)
    code = newest("docs/figures.py", "minitransformer")
    for name in figures.FIGURES:  # a picture and its numbers, drawn together
        reads = [os.path.getmtime(p) for p in figures.READS.get(name, ()) if os.path.isfile(p)]  # its data
        if stale(folder, [f"{name}.png", f"{name}.json"], max([code] + reads)):
            figures.draw(name, folder)


def build(out: str, pictures: str | None = None, pages: str = os.path.join(DOCS, "pages")) -> Site:
    """Build the site into ``out`` from the Markdown of ``pages``, with the pictures of
    ``pictures`` (default: ``out``/pictures), drawn first where missing or out of date."""
    pictures = pictures or os.path.join(out, "pictures")
    draw_pictures(pictures)
    site = Site(out, pictures, pages)
    site.build()
    return site


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=cli.output_folder, default=os.path.join(DOCS, "_site"), help="the site's folder")
    p.add_argument("--pictures", type=cli.output_folder, help="the pictures' folder (default: OUT/pictures); those missing there or "
                   "older than the code that draws them are drawn first")
    p.add_debug()
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    site = build(args.out, args.pictures)
    print(f"{len(SITE)} pages and {len(site.sources)} source files in {time.perf_counter() - start:.1f} s: "
          f"open {os.path.join(args.out, 'index.html')}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(BuildError,)))
