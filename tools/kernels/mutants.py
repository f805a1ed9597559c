"""Mutation testing of csrc/: how many realistic kernel bugs CI's kernel checks catch.

    python tools/kernels/mutants.py --list                 # the mutants, one line each
    python tools/kernels/mutants.py                        # the full run (resumable), then its report
    python tools/kernels/mutants.py --sample 10 --seed 7   # a seeded sample, as CI runs it

Until the kernels run on a GPU, what CI can catch is their whole proof; a bug that no check
sees is a bug CI cannot see. Each rule below is applied at every site of the kernel sources
that it matches (attention.cu, attention_naive.cu, attention_tiled.cu, layernorm.cu, softmax.cu,
common.cuh), one mutant per site and replacement, so the mutants come from the sources
themselves, not from a hand-written list:

    relational   < <-> <=, > <-> >=
    off-by-one   +-1 on a bound (the value given to an int named *_end, *_begin, *_first,
                 *_valid, kv_len, n_tiles, ...) and on every min(...) / max(...)
    min-max      min <-> max, fminf <-> fmaxf
    barrier      a __syncthreads() removed
    atomic       atomicAdd(p, v) -> *p += v
    pipeline     __pipeline_wait_prior(n) -> n +- 1; a __pipeline_commit() removed
    online-max   the online softmax's running maximum taken as 0 (a plain sum of exponentials);
                 a rescale factor (alpha, exp2f(a.m - m)) applied twice or not at all
    tile         tile sizes, leading dimensions (LDT, LDO, ...) and shared-memory carves +-1
    rounding     a 16-bit conversion's round-to-nearest-even (_rn) made _rz, _rd or _ru
    valid-length a bound by a row's valid keys (kv_len) widened to the padded length S, and
                 a bound by S narrowed to kv_len
    index-swap   / <-> % by a dimension (B, H, T, S, D, 32: batch and head, row and column,
                 warp and lane), bh / H -> bh % B, blockIdx.x <-> blockIdx.y
    constant     eps / V -> eps / (V - 1), the log2 e of exp2f dropped, a scale dropped or doubled

Each mutant is built on the emulator (emulator.compile_variant: only the changed file is
recompiled, and objects are cached) and put to CI's kernel checks, cheapest first, until one
fails. A mutant that no check kills and that nvcc compiles to the very build of the sources as
they are (PTX for every architecture, and host code) is identical (trivial compiler
equivalence) and not counted: the GPU would run the same code. The checks: the kernel tests
of tests/kernels on the mutant (MT_EMULATED_KERNELS), which run every launch with poisoned
shared memory and shuffled blocks; then the fixed cases of tests/kernels/sanitized_run.py under
AddressSanitizer/UBSan where the bug's class can reach out of bounds, under ThreadSanitizer
where it can race (SANITIZERS_FOR). A test's kill counts only if that test passes, alone, on
the sources as they are (confirm_kill). A mutant that fails to compile is stillborn and not
counted. A mutant that passes every check survives, unless tools/kernels/mutants_equivalent.toml
lists it as equivalent, with the line that masks it: the score of a kernel is
killed / (all - equivalent), where all leaves out the stillborn and the identical.

Results are kept per mutant (keyed by the mutated sources and the checks' own files) in
--results, so a run that stops resumes where it was, and a rerun after a change retests only
what the change touched.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import ast
import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from minitransformer import cli
from minitransformer.files import atomic_write
from minitransformer.emulated import emulator
from minitransformer.emulated.emulator import CSRC, ROOT, Mutation

FILES = ["attention.cu", "attention_naive.cu", "attention_tiled.cu", "layernorm.cu", "softmax.cu", "common.cuh"]
EQUIVALENT = Path(__file__).with_name("mutants_equivalent.toml")
RECORD = Path(__file__).with_name("mutants_record.json")  # the last full run, mutant by mutant
TESTS = ROOT / "tests" / "kernels"
# What a mutant's fixed sanitizer cases are, by file (sanitized_run.py's case names start so).
KERNELS = {"attention.cu": ["attention"], "attention_naive.cu": ["attention_naive"],
           "attention_tiled.cu": ["attention_tiled"],
           "layernorm.cu": ["layernorm"], "softmax.cu": ["softmax", "cross_entropy"],
           "common.cuh": ["attention", "attention_naive", "attention_tiled", "layernorm", "softmax",
                          "cross_entropy"]}
# CPU seconds for one check of one mutant, beyond which it counts as a hang (a mutant that
# never leaves a loop: on a GPU a kernel that never ends): ten times what the kernel tests take
# unmutated (attention's own, about 15), and for the sanitizers about seven times
# ThreadSanitizer on attention (about 120).
TEST_CPU_SECONDS = 180
SANITIZER_CPU_SECONDS = 900
# The sanitizers a survivor of the kernel tests meets, by class: AddressSanitizer/UBSan where a
# bug reads or writes out of bounds, ThreadSanitizer (minutes on attention) where it races. A
# mutant not given a sanitizer that would have caught it counts as a survivor: the score can
# only come out low, never high. Tile mutants change shared-memory layouts, and in every build,
# the kernel tests' too, the emulator finds a write past a carved array and turns a read past
# one into NaN (emu.h, SharedMemory): AddressSanitizer, half a minute a mutant, killed none of
# the 66 that reached it in a full run. One reading past an
# array without changing a result would survive, and be explained or fixed.
SANITIZERS_FOR = {"relational": ["address"], "off-by-one": ["address"], "min-max": ["address"],
                  "tile": [], "barrier": ["thread"], "atomic": ["thread"],
                  "pipeline": ["address", "thread"], "online-max": [], "rounding": [],
                  "valid-length": ["address"], "index-swap": ["address"], "constant": []}


# --------------------------------------------------------------------------- the mutants


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str
    line: int  # 1-based, of the site's first character
    rule: str  # the operator class
    old: str   # the site's text ...
    new: str   # ... and what it becomes
    before: str  # the whole lines of the site, and the same lines mutated
    after: str
    start: int  # the site: text[start:end] == old
    end: int
    column: int  # 1-based, of start

    def mutation(self) -> Mutation:
        """For emulator.compile_variant: the whole file, so that it matches exactly once."""
        text = (CSRC / self.file).read_text()
        if text[self.start:self.end] != self.old:
            raise RuntimeError(f"csrc/{self.file} changed since the mutants were listed")
        return Mutation(self.file, text, text[:self.start] + self.new + text[self.end:])

    @property
    def name(self) -> str:
        """file:line:column class: old -> new (one line: a multi-line site is joined)."""
        old, new = (" ".join(t.split()) for t in (self.old, self.new))
        return f"{self.file}:{self.line}:{self.column} {self.rule}: {old} -> {new or '(removed)'}"


def code_only(text: str) -> str:
    """``text`` with comments, string and character literals and preprocessor lines blanked
    (same length, newlines kept), so that the rules match code alone."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for j in range(a, b):
            if out[j] != "\n":
                out[j] = " "

    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and text[i:].lstrip(" \t").startswith("#"):
            end = text.find("\n", i)
            end = n if end < 0 else end
            while text[end - 1] == "\\" and end < n:  # a directive continued on the next line
                end = text.find("\n", end + 1)
                end = n if end < 0 else end
            blank(i, end)
            i = end
            continue
        at_line_start = c == "\n"
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.index("*/", i) + 2
            blank(i, end)
            i = end
        elif c in "\"'":
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def call_end(code: str, open_paren: int) -> int:
    """The index just past the parenthesis that closes the one at ``open_paren``."""
    depth = 0
    for i in range(open_paren, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parenthesis at {open_paren}")


def arguments(code: str, open_paren: int) -> list[tuple[int, int]]:
    """The spans of a call's top-level arguments."""
    spans, depth, start = [], 0, open_paren + 1
    for i in range(open_paren, call_end(code, open_paren)):
        c = code[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                spans.append((start, i))
        elif c == "," and depth == 1:
            spans.append((start, i))
            start = i + 1
    return spans


def statement_end(code: str, start: int) -> int:
    """The index of the ``;`` or ``,`` that ends the expression starting at ``start``."""
    depth = 0
    for i in range(start, len(code)):
        c = code[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c in ";," and depth == 0:
            return i
    raise ValueError(f"no end of the expression at {start}")


def calls(code: str, names: str):
    """The calls of the functions ``names`` (a regular expression) as matches ending at the
    opening parenthesis; not their definitions or declarations (``MaxSum maxsum_add(``)."""
    for m in re.finditer(rf"(?<![\w:.])({names})\(", code):
        if not re.search(r"[\w>]\s+$", code[code.rfind("\n", 0, m.start()) + 1:m.start()]) or \
                re.search(r"\b(return|else)\s+$", code[:m.start()]):
            yield m


# Each rule: (class, function of the code-only text -> [(start, end, replacement), ...]).
RELATIONAL = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
BOUND_NAMES = re.compile(r"\b(int|const int|size_t|const size_t)\s+(\w*(end|begin|first|last|valid|len|lens|tiles|count|rows)\w*)\s*=\s*")
BOUND_ASSIGN = re.compile(r"(?<![\w.])(\w*(end|begin|first|last|valid|len|tiles)\w*)\s*=\s*(?!=)")


def relational(code):
    for m in re.finditer(r"(?<=\s)(<=|>=|<|>)(?=\s)", code):
        yield m.start(), m.end(), RELATIONAL[m.group(1)]


def off_by_one(code):
    starts = {m.end() for m in BOUND_NAMES.finditer(code)}
    starts |= {m.end() for m in BOUND_ASSIGN.finditer(code)
               if not code[:m.start()].rstrip().endswith(("int", "float", "size_t"))}
    bounds = set()
    for start in sorted(starts):
        end = statement_end(code, start)
        value = code[start:end].strip()
        bounds.add((start, start + len(value)))
        if "?" in value:
            value = f"({value})"
        for delta in ("+ 1", "- 1"):
            yield start, end, f"{value} {delta}"
    for m in calls(code, "min|max"):
        end = call_end(code, m.end() - 1)
        if (m.start(), end) not in bounds:  # that one is a bound's whole value, just above
            for delta in ("+ 1", "- 1"):
                yield m.start(), end, f"({code[m.start():end]} {delta})"


def min_max(code):
    swap = {"min": "max", "max": "min", "fminf": "fmaxf", "fmaxf": "fminf"}
    for m in calls(code, "min|max|fminf|fmaxf"):
        yield m.start(), m.end() - 1, swap[m.group(1)]


def barrier(code):
    for m in re.finditer(r"__syncthreads\(\);", code):
        yield m.start(), m.end(), ""


def atomic(code):
    for m in calls(code, "atomicAdd"):
        (a, b), (c, d) = arguments(code, m.end() - 1)
        yield m.start(), call_end(code, m.end() - 1), f"*({code[a:b].strip()}) += {code[c:d].strip()}"


def pipeline(code):
    for m in re.finditer(r"__pipeline_wait_prior\((\d+)\)", code):
        n = int(m.group(1))
        for k in (n + 1, n - 1):
            if k >= 0:
                yield m.start(1), m.end(1), str(k)
    for m in re.finditer(r"__pipeline_commit\(\);", code):
        yield m.start(), m.end(), ""


def online_max(code):
    # The running maximum as 0: every exponential is then of the value itself, which is right
    # until a value passes about 88 (float32's exp overflows) and wrong after.
    for m in calls(code, "maxsum_add"):
        (a, b), (c, d) = arguments(code, m.end() - 1)
        yield (m.start(), call_end(code, m.end() - 1),
               f"MaxSum{{0.f, ({code[a:b].strip()}).s + exp_diff({code[c:d].strip()}, 0.f)}}")
    for m in re.finditer(r"\b(m|m_new|new_lo|new_hi)\s*=\s*(fmaxf)\(", code):
        yield m.start(2), call_end(code, m.end() - 1), "0.f"
    # A rescale factor applied twice, or not at all.
    factor = r"(alpha\w*|exp_diff\([ab]\.m, \w+\))"
    for m in re.finditer(r"(\w[\w\[\]. *+:]*?)\s*\*=\s*" + factor + ";", code):
        yield m.start(), m.end(), ""
        yield m.start(2), m.end(2), f"{m.group(2)} * {m.group(2)}"
    for m in re.finditer(r"(?<!\*=)\s\*\s" + factor, code):
        if code[m.start() - 1] != "=":
            yield m.start(), m.end(), ""
            yield m.start(1), m.end(1), f"{m.group(1)} * {m.group(1)}"


def tile(code):
    for m in re.finditer(r"static constexpr int (\w+) = ", code):
        end = statement_end(code, m.end())
        for delta in ("+ 1", "- 1"):
            yield m.end(), end, f"{code[m.end():end].strip()} {delta}"
    for m in re.finditer(r"\b(f32_forward|f32_backward)<D, (\d+), (\d+)>", code):
        for group in (2, 3):
            for delta in (1, -1):
                yield m.start(group), m.end(group), str(int(m.group(group)) + delta)
    for m in re.finditer(r"\b(carve|c)\.take<[^>]+>\(", code):
        end = call_end(code, m.end() - 1)
        (a, b), = arguments(code, m.end() - 1)
        for delta in ("+ 1", "- 1"):
            yield a, b, f"{code[a:b].strip()} {delta}"


DIRECTED = ("rz", "rd", "ru")  # toward zero, down, up: CUDA's other rounding modes
PAIRS = {"__floats2half2_rn": ("__halves2half2", "__float2half"),
         "__floats2bfloat162_rn": ("__halves2bfloat162", "__float2bfloat16")}


def rounding(code):
    # Round-to-nearest-even replaced by a directed rounding at a 16-bit conversion: each value
    # is off by less than an ulp, but every one the same way, a bias no error bound sees.
    for m in calls(code, "__float2half_rn|__float2bfloat16_rn"):
        for mode in DIRECTED:
            yield m.start(), m.end() - 1, f"{m.group(1)[:-3]}_{mode}"
    for m in calls(code, "|".join(PAIRS)):  # a packed pair has no directed form: two scalars joined
        join, one = PAIRS[m.group(1)]
        (a, b), (c, d) = arguments(code, m.end() - 1)
        for mode in DIRECTED:
            yield (m.start(), call_end(code, m.end() - 1),
                   f"{join}({one}_{mode}({code[a:b].strip()}), {one}_{mode}({code[c:d].strip()}))")


def valid_length(code):
    # A bound by a row's valid keys widened to the padded length (the padding, which may hold
    # NaN, is then read), and a bound by the padded length narrowed to the valid one.
    for m in re.finditer(r"(?<![\w.])kv_len(?!\w)", code):
        if not re.search(r"\bint\s+$", code[:m.start()]):  # a use, not its declaration
            yield m.start(), m.end(), "p.S"
    for m in re.finditer(r"(?<![\w.])(p\.)?kv_lens\[b\]", code):
        yield m.start(), m.end(), f"{m.group(1) or ''}S"
    for m in re.finditer(r"\bfor \(int (\w+) = 0; \1 < (end)\b", code):
        yield m.start(2), m.end(2), "S"
    for m in re.finditer(r"\bp\.S(?= - k0\b)", code):
        yield m.start(), m.end(), "kv_len"


def index_swap(code):
    # Index expressions exchanged: the batch for the head (bh / H <-> bh % H, or bh % B), the
    # row for the column (idx / D <-> idx % D), the warp for the lane, one grid axis for the other.
    for m in re.finditer(r"(?<=\s)(/|%)(?=\s+(p\.)?(B|H|T|S|D|32)\b)", code):
        yield m.start(), m.end(), {"/": "%", "%": "/"}[m.group(1)]
    for m in re.finditer(r"(?<=\s)/\s+(p\.)?H\b", code):
        yield m.start(), m.end(), f"% {m.group(1) or ''}B"
    for m in re.finditer(r"\bblockIdx\.([xy])\b", code):
        yield m.start(1), m.end(1), {"x": "y", "y": "x"}[m.group(1)]


def constant(code):
    # A constant of the formula wrong: eps / V as eps / (V - 1) (label smoothing's share, a
    # mean), the log2 e of exp(x) = 2^(x log2 e) dropped, the attention or softmax scale
    # dropped or doubled where it multiplies.
    for m in re.finditer(r"/ V\b", code):
        yield m.start(), m.end(), "/ (V - 1)"
    for m in re.finditer(r"\s\*\s*kLog2e\b", code):
        yield m.start(), m.end(), ""
    for m in re.finditer(r"\s\*\s((p\.)?scale)\b", code):
        yield m.start(), m.end(), ""
        yield m.start(1), m.end(1), f"(2.f * {m.group(1)})"
    for m in re.finditer(r"(?<![\w.])(scale)\s\*\s", code):
        yield m.start(), m.end(), ""
        yield m.start(1), m.end(1), "2.f * scale"


RULES = {"relational": relational, "off-by-one": off_by_one, "min-max": min_max,
         "barrier": barrier, "atomic": atomic, "pipeline": pipeline, "online-max": online_max,
         "tile": tile, "rounding": rounding, "valid-length": valid_length, "index-swap": index_swap,
         "constant": constant}


def lines(text: str, start: int, end: int) -> str:
    """The whole lines of ``text`` that the span [start, end) touches."""
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", max(end - 1, start))
    return text[a:len(text) if b < 0 else b]


def generate(files=FILES) -> list[Mutant]:
    """Every rule at every site of ``files``, in file and rule order."""
    mutants = []
    for name in files:
        text = (CSRC / name).read_text()
        code = code_only(text)
        seen = set()
        for rule, find in RULES.items():
            for start, end, new in find(code):
                if (start, end, new) in seen or text[start:end] == new:
                    continue
                seen.add((start, end, new))
                mutated = text[:start] + new + text[end:]
                mutants.append(Mutant(name, text.count("\n", 0, start) + 1, rule, text[start:end], new,
                                      lines(text, start, end), lines(mutated, start, start + len(new)),
                                      start, end, start - text.rfind("\n", 0, start)))
    return mutants


# --------------------------------------------------------------------------- the checks


def checks_paths(file: str) -> list[Path]:
    """What the result of a mutant of csrc/``file`` depends on besides csrc/: the test files its
    stages run (test_stages; sanitized_run.py), every test module they import, the conftest
    files, the emulator and the kernels' Python side. Not the other kernels' tests, nor a test
    module none of these imports: a change there tests nothing again."""
    local = {p.stem: p for d in (ROOT / "tests", TESTS) for p in d.glob("*.py")}  # as the tests import them
    todo = [Path(a) for _, cmd in test_stages([file]) for a in cmd if a.endswith(".py")]
    todo += [Path(a) for a in cost_stage([file]) or [] if a.endswith(".py")]
    todo.append(TESTS / "sanitized_run.py")
    seen = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [local[name] for name in imported_names(path) if name in local]
    seen |= {TESTS / "conftest.py", ROOT / "tests" / "conftest.py", Path(emulator.__file__), emulator.EMU_H}
    return sorted(seen) + sorted((ROOT / "minitransformer" / "kernels").rglob("*.py"))


def imported_names(path: Path) -> set[str]:
    """The modules a Python file imports (``import a.b``, ``from a import b``: a.b, a)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@functools.cache
def checks_digest(file: str) -> str:
    """The digest of checks_paths(file) as they are now (read once per process)."""
    h = hashlib.sha256()
    for path in checks_paths(file):
        h.update(path.read_bytes())
    return h.hexdigest()


def csrc_texts() -> dict[str, str]:
    """csrc/'s files by name, as they are now."""
    return {p.name: p.read_text() for p in sorted(CSRC.iterdir())}


def key(mutant: Mutant, sources: dict[str, str]) -> str:
    """The mutant's identity for the results: its mutated sources (``sources``: csrc_texts())
    and its checks (checks_digest)."""
    m = mutant.mutation()
    h = hashlib.sha256(f"{checks_digest(m.file)}\0{m.file}\0".encode())
    for name in sorted(sources):
        h.update((m.new if name == m.file else sources[name]).encode())
    return h.hexdigest()[:24]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def test_stages(files) -> list[tuple[str, list[str]]]:
    """The pytest runs a mutant of ``files`` meets, in order. First the emulator sections of
    the mutated kernels' own test files, which kill most mutants in seconds; then the tests of
    those files and of F's dispatch that reach the kernels through the emulated device (marked
    ``device``: the launchers, the dispatch). The other kernels' tests never call the mutated
    code, nor do the twins' tests against the formulas."""
    own = sorted({TESTS / f"test_{kernel}.py" for file in files for kernel in KERNELS[file]})
    return [("kernel tests", [*PYTEST, *map(str, own), "-m", "emulator"]),
            ("device tests", [*PYTEST, *map(str, own), str(TESTS / "test_dispatch.py"), "-m", "device and not emulator"])]


PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
          "--hypothesis-profile=mutants", "-o", "addopts="]


def cost_stage(files) -> list[str] | None:
    """The attention kernels' costs (test_costs.py: bank conflicts, coalescing, the tiled
    kernel's tiles and shared memory), counted in the count variant, for a mutant of the files
    they are built from: a padding, a layout or a tile visited in vain changed no result but
    what a GPU pays for it. None for the other kernels."""
    costs = TESTS / "test_costs.py"
    if {"attention.cu", "common.cuh"} & set(files):
        return [*PYTEST, str(costs)]
    return [*PYTEST, str(costs), "-k", "tiled"] if "attention_tiled.cu" in files else None


def check_environment(**variables: str) -> dict[str, str]:
    """The environment of one check: one BLAS thread, as --jobs runs the checks side by side.
    OpenBLAS's threads spin while they wait: an attention mutant's kernel tests took 30.7 CPU
    seconds on its two threads and 18.4 on one, in the same 18 s, CPU that a second job needs."""
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                PYTHONPATH=str(ROOT)) | variables


class ChecksFail(Exception):
    """The checks fail on the kernels as they are: no mutant's kill would mean anything."""


_baseline_lock = threading.Lock()
_baseline_locks: dict[Path, threading.Lock] = {}
_baseline_failed: dict[Path, str] = {}  # by _baseline_mark: the tail of its failure


@functools.cache
def _baseline_mark(file: str, cmd: tuple[str, ...]) -> Path:
    """Where a pass of ``cmd`` on the unmutated build is kept: named by the digest of the
    sources and of ``file``'s checks as they are now (read once per process, as the keys)."""
    sources = csrc_texts()
    digest = hashlib.sha256("\0".join([checks_digest(file), *(sources[n] for n in sorted(sources)), *cmd]).encode())
    return emulator.CACHE / "mutants-baselines" / digest.hexdigest()[:24]


def baseline(file: str, stage: str, cmd: list[str], variant: str | None = None) -> bool:
    """Run one check of ``file``'s mutants on the unmutated build (``variant``: the count
    variant for the cost checks): True if it passes; ChecksFail if it fails, as every mutant
    would then count killed; False if pytest could not run it (a node id it cannot find). A
    pass is kept beside the emulator's builds, so that the next run on the same sources and
    checks (CI's second mutation test, say) does not pay again; each check runs once, whichever
    job comes first, and the others wait for its verdict."""
    passed = _baseline_mark(file, tuple(cmd))
    with _baseline_lock:
        lock = _baseline_locks.setdefault(passed, threading.Lock())
    with lock:
        if passed not in _baseline_failed and not passed.exists():
            module = str(emulator.compile_variant(variant))
            env = check_environment(**({"MT_EMULATED_COUNT_KERNELS": module} if variant == "count" else
                                       {"MT_EMULATE_CUDA": "1", "MT_EMULATED_KERNELS": module}))
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            if run.returncode > 1:
                return False
            if run.returncode:
                _baseline_failed[passed] = _tail(run.stdout + run.stderr, 20)
            else:
                passed.parent.mkdir(parents=True, exist_ok=True)
                passed.touch()
        if passed in _baseline_failed:
            raise ChecksFail(f"the {stage} of {file} fail on csrc/ as it is, without a mutant: fix them first\n"
                             f"{_baseline_failed[passed]}")
    return True


FAILED_TEST = re.compile(r"^FAILED (\S+::\S+)", re.MULTILINE)  # pytest's summary: FAILED <node id> - <message>


def confirm_kill(file: str, stage: str, cmd: list[str], evidence: str, variant: str | None = None) -> None:
    """A check killed a mutant of ``file``: prove that it passes without the mutant, or the
    kill means nothing (ChecksFail). The tests that failed are run again on the unmutated
    build, alone: seconds, where the whole check takes up to minutes (every kernel's tests,
    for a mutant of common.cuh). The profile draws the same examples alone as in the whole run.
    A kill with no failed test named (a crash, a hang) runs the whole check unmutated."""
    tests = FAILED_TEST.findall(evidence)
    if tests:
        alone = [arg for arg in cmd if not arg.endswith(".py")] + tests
        if baseline(file, f"{stage} ({' '.join(tests)})", alone, variant):
            return
    if not baseline(file, stage, cmd, variant):
        raise RuntimeError(f"{' '.join(cmd[:4])}...: pytest could not run the {stage} of {file} unmutated")


def _failure(cmd: list[str], cpu_seconds: int, wall_seconds: int, env: dict, cwd: Path, pytest: bool) -> str | None:
    """Run one check of a mutant: None if it passes, else its evidence (a test that failed, a
    signal, a sanitizer's report, or no end within ``cpu_seconds``). A pytest run that ends
    with its own trouble (no tests, a usage error) is not the mutant's doing: an error; nor
    is one ended by SIGINT or SIGTERM, an interrupt that must not be recorded as a kill."""
    try:
        run = emulator.run_limited(cmd, cpu_seconds, wall_seconds=wall_seconds, env=env, capture_output=True,
                                   text=True, cwd=cwd)
    except subprocess.TimeoutExpired as e:  # a hang that spends no CPU
        return f"no end: {e}"
    output = run.stdout + run.stderr
    if run.returncode in (-signal.SIGINT, -signal.SIGTERM):  # Ctrl-C or a kill reached the check
        raise KeyboardInterrupt(f"{' '.join(cmd[:4])}... was interrupted: no result for this mutant")
    if run.returncode == -signal.SIGXCPU:
        return f"no end: over {cpu_seconds} CPU seconds\n" + output
    if pytest and run.returncode > 1:
        raise RuntimeError(f"{' '.join(cmd[:4])}...: pytest ended with {run.returncode}:\n{_tail(output)}")
    return output if run.returncode else None


def test_mutant(mutant: Mutant) -> dict:
    """Build the mutant and put it to the checks until one fails: {"status": "killed" (with
    "by", the check, and "evidence") | "survived" | "stillborn" | "identical", "seconds": ...}."""
    begin = time.time()

    def result(status, by=None, evidence=""):
        return {"status": status, "by": by, "evidence": _tail(evidence), "seconds": round(time.time() - begin, 1)}

    mutation = mutant.mutation()
    try:
        # The emulator's -O2 build unchanged: the tests would pass as on the sources as they
        # are. (Not so the sanitizers' builds, -O1: g++ -O2 may fold away undefined behaviour,
        # an index past a local array, that they report.)
        emulated_same = same_objects(mutation)
        module = None if emulated_same else emulator.compile_variant(None, [mutation])
    except RuntimeError as e:
        return result("stillborn", evidence=str(e))
    env = check_environment(MT_EMULATE_CUDA="1", MT_EMULATED_KERNELS=str(module))
    for stage, cmd in [] if emulated_same else test_stages([mutant.file]):
        evidence = _failure(cmd, TEST_CPU_SECONDS, 10 * TEST_CPU_SECONDS, env, ROOT, pytest=True)
        if evidence is not None:
            confirm_kill(mutant.file, stage, cmd, evidence)
            return result("killed", stage, evidence)
    cases = [name for name in _sanitized_cases() if name.split("-")[0] in KERNELS[mutant.file]]
    for sanitize in SANITIZERS_FOR[mutant.rule]:
        module = emulator.compile_variant(sanitize, [mutation])
        chosen = [c for c in cases if not (sanitize == "thread" and c.endswith("-bfloat16"))]
        env = check_environment(MT_EMULATE_CUDA="0", **emulator.sanitizer_environment(sanitize))
        cmd = [sys.executable, str(TESTS / "sanitized_run.py"), str(module), *chosen]
        evidence = _failure(cmd, SANITIZER_CPU_SECONDS, 3 * SANITIZER_CPU_SECONDS, env, TESTS, pytest=False)
        if evidence is not None:
            return result("killed", f"{sanitize} sanitizer", evidence)
    # Next, as nvcc too may fold undefined behaviour away: a loop one past a local array's end
    # compiles to the very PTX, and only the sanitizers see the bug.
    if same_gpu_build(mutation):
        return result("identical", "nvcc")
    # Then the cost checks, which need a build of their own: for a mutant that changed no result
    # (a padding, a layout) but compiles to other code.
    costs = None if emulated_same else cost_stage([mutant.file])
    if costs:
        try:
            counted = emulator.compile_variant("count", [mutation])
        except RuntimeError as e:  # -O1 and the count flags: what -O2 compiled still compiles
            return result("stillborn", evidence=str(e))
        env = check_environment(MT_EMULATED_COUNT_KERNELS=str(counted))
        evidence = _failure(costs, TEST_CPU_SECONDS, 10 * TEST_CPU_SECONDS, env, ROOT, pytest=True)
        if evidence is not None:
            confirm_kill(mutant.file, "cost checks", costs, evidence, "count")
            return result("killed", "cost checks", evidence)
    return result("survived")


# Trivial compiler equivalence: a mutant that compiles to the very code of the sources as they
# are is no bug at all (nvcc folded the change away, as SmemCarver's 128-byte rounding folds a
# carve one element shorter). It is not counted.

def same_objects(mutation: Mutation) -> bool:
    """Whether the emulator's build of the mutant (g++ -O2) is the unmutated one, object file
    for object file: then no check can tell it apart, and only the GPU build can."""
    plain, mutated = emulator.objects(), emulator.objects(None, [mutation])
    return all(mutated[name] == plain[name] or mutated[name].read_bytes() == plain[name].read_bytes() for name in plain)


# What differs between two compilations of one program: the anonymous namespace's mangled name
# (a hash of the file's text) and nvcc's temporary file names. Replaced by as many bytes, so
# that nothing moves in an object file.
_NAMES = re.compile(rb"_GLOBAL__N__[0-9a-f]{8}|tmpxft_[0-9a-f]{8}_[0-9a-f]{8}")


def _nvcc(sources: dict[str, str], name: str, archs: list[int], ptx_only: bool) -> bytes:
    """csrc/``name`` compiled by nvcc as ``sources`` (csrc/'s files by name) have it, with
    setup.py's flags, but with PTX for ``archs`` in place of their machine code (ptxas
    translates PTX alone, so the same PTX is the same machine code) and no line table (whose
    columns move when a mutation changes a line's length): the PTX of one architecture, or the
    whole object file, host code included."""
    flags = [f for f in emulator.setup_module().NVCC_FLAGS if f != "-lineinfo"]
    flags += ["-Xcompiler", "-fPIC", "--no-compress", "-frandom-seed=0"]  # the PTX embedded as it is
    flags += [g for arch in archs for g in ("-gencode", f"arch=compute_{arch},code=compute_{arch}")]
    with tempfile.TemporaryDirectory() as work:
        for file, text in sources.items():
            (Path(work) / file).write_text(text)
        cmd = [str(emulator.cuda_home() / "bin" / "nvcc"), "--ptx" if ptx_only else "-c", *flags, name, "-o", "out"]
        run = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed on csrc/{name}:\n{run.stderr[-4000:]}")
        return _NAMES.sub(lambda m: b"x" * len(m.group()), (Path(work) / "out").read_bytes())


@functools.cache
def _plain_nvcc(name: str, archs: tuple[int, ...], ptx_only: bool) -> bytes:
    return _nvcc(csrc_texts(), name, list(archs), ptx_only)


def same_gpu_build(mutation: Mutation) -> bool:
    """Whether nvcc compiles the mutant to the unmutated build: PTX for every architecture
    setup.py builds, and host code. First the PTX of the last architecture alone (seconds: most
    mutants differ there). False where there is no nvcc."""
    if emulator.cuda_home() is None:
        return False
    sources = csrc_texts() | {mutation.file: mutation.new}
    compiled = [mutation.file] if mutation.file.endswith(".cu") else sorted(n for n in sources if n.endswith(".cu"))
    archs = tuple(emulator.setup_module().DEFAULT_ARCHS)
    return all(_nvcc(sources, name, list(steps), ptx) == _plain_nvcc(name, steps, ptx)
               for steps, ptx in ((archs[-1:], True), (archs, False)) for name in compiled)


def _sanitized_cases() -> list[str]:
    sys.path.insert(0, str(TESTS))
    try:
        import sanitized_run
    finally:
        sys.path.remove(str(TESTS))
    return list(sanitized_run.CASES)


# --------------------------------------------------------------------------- the ledger


def equivalents(kind: str = "equivalent") -> list[dict]:
    """The checked-in entries of mutants_equivalent.toml of one kind: "equivalent" (no result
    can change) or "survivor" (a result can change, and no check sees it: why, and what
    would). Each entry: file, before and after (the site's lines), reason, and the line where
    the same text occurs at more than one site."""
    if not EQUIVALENT.exists():
        return []
    entries = tomllib.loads(EQUIVALENT.read_text()).get(kind, [])
    for e in entries:
        missing = {"file", "before", "after", "reason"} - set(e)
        if missing:
            raise ValueError(f"{EQUIVALENT.name}: an entry lacks {sorted(missing)}: {e}")
    return entries


def equivalent_reason(mutant: Mutant, entries: list[dict]) -> str | None:
    """The reason ``entries`` give for ``mutant``, or None if they do not list it."""
    for e in entries:
        if (e["file"] == mutant.file and e["before"].strip() == mutant.before.strip()
                and e["after"].strip() == mutant.after.strip() and e.get("line", mutant.line) == mutant.line):
            return e["reason"]
    return None


# --------------------------------------------------------------------------- the run


def diff(mutant: Mutant) -> str:
    """The mutant as a unified diff of csrc/, at its line."""
    before, after = mutant.before.splitlines(), mutant.after.splitlines()
    return "\n".join([f"--- a/csrc/{mutant.file}", f"+++ b/csrc/{mutant.file}",
                      f"@@ -{mutant.line},{len(before)} +{mutant.line},{len(after)} @@",
                      *(f"-{line}" for line in before), *(f"+{line}" for line in after)])


def load_results(path: Path) -> dict[str, dict]:
    results = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                results[record["key"]] = record
    return results


def run(mutants: list[Mutant], results_path: Path, jobs: int, progress, known: dict[str, dict],
        test: bool = True) -> dict[str, dict]:
    """Test every mutant not already in results_path or ``known`` (results by key, as the
    record keeps them), appending each result to results_path as it comes. Without ``test``,
    only what is known: the mutants not yet tested are left out."""
    results = known | load_results(results_path)
    sources = csrc_texts()
    keys = {m: key(m, sources) for m in mutants}
    todo = [m for m in mutants if keys[m] not in results] if test else []
    results_path.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool, results_path.open("a") as out:
        futures = {pool.submit(test_mutant, m): m for m in todo}
        try:
            for future in as_completed(futures):
                mutant = futures[future]
                record = {"key": keys[mutant], "mutant": mutant.name, **future.result()}
                out.write(json.dumps(record) + "\n")
                out.flush()
                results[keys[mutant]] = record
                progress(mutant, record)
        except BaseException:  # checks that fail unmutated, an interrupt: start no other mutant
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return {m.name: results[keys[m]] | {"mutant_obj": m} for m in mutants if keys[m] in results}


KERNEL_OF = {"attention.cu": "attention", "attention_naive.cu": "naive attention",
             "attention_tiled.cu": "tiled attention", "layernorm.cu": "layernorm",
             "softmax.cu": "softmax & cross-entropy", "common.cuh": "common (all kernels)"}


def report(outcomes: dict[str, dict], entries: list[dict], survivors: list[dict],
           seconds: float) -> tuple[str, list[Mutant]]:
    """Markdown: the score by kernel and by class, every survivor with its diff (and the reason
    mutants_equivalent.toml gives, where it gives one), the equivalents with theirs; and the
    survivors that file does not explain."""
    rows: dict[tuple[str, str], dict[str, int]] = {}
    unexplained, explained, equivalent = [], [], []
    for record in outcomes.values():
        m = record["mutant_obj"]
        status = record["status"]
        if status == "survived" and equivalent_reason(m, entries):
            status = "equivalent"
            equivalent.append(m)
        elif status == "survived":
            (explained if equivalent_reason(m, survivors) else unexplained).append(m)
        for group in ((KERNEL_OF[m.file], m.rule), (KERNEL_OF[m.file], "all")):
            counts = rows.setdefault(group, dict.fromkeys(("killed", "survived", "equivalent", "identical", "stillborn"), 0))
            counts[status] += 1
    out = [f"{len(outcomes)} mutants, {seconds / 60:.0f} min.", "",
           "| kernel | class | killed | survived | equivalent | identical | stillborn | score |",
           "|---|---|---|---|---|---|---|---|"]
    for (kernel, rule), c in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        counted = c["killed"] + c["survived"]
        score = f"{c['killed'] / counted:.3f}" if counted else "-"
        name = f"**{kernel}**" if rule == "all" else kernel
        out.append(f"| {name} | {rule} | {c['killed']} | {c['survived']} | {c['equivalent']} | {c['identical']} | {c['stillborn']} | {score} |")
    for title, group, source in (("Survivors no check kills, unexplained", unexplained, []),
                                 ("Survivors no check kills, explained", explained, survivors),
                                 ("Equivalent", equivalent, entries)):
        if group:
            out += ["", f"{title}:", ""]
            for m in group:
                reason = equivalent_reason(m, source)
                out += [f"- `{m.name}`" + (f": {reason}" if reason else ""), "", "```diff", diff(m), "```"]
    return "\n".join(out), unexplained


def load_record(path: Path) -> dict:
    """The record of the last full run: {"complete": bool, "rules": [the rule classes it holds
    every mutant of], "mutants": {name: {"status", "by", "key", "seconds"}}}. Committed, it
    carries the run's results to another machine: a mutant whose key (its sources and the
    checks) is unchanged is not tested again."""
    return json.loads(path.read_text()) if path.exists() else {"complete": False, "rules": [], "mutants": {}}


def known_results(record: dict) -> dict[str, dict]:
    """The record's results by key, as load_results gives them."""
    return {r["key"]: {"key": r["key"], "mutant": name, "status": "survived" if r["status"] == "equivalent" else r["status"],
                       "by": r.get("by"), "seconds": r.get("seconds", 0.0)}
            for name, r in record["mutants"].items() if "key" in r}


def write_record(path: Path, outcomes: dict[str, dict], every: list[Mutant], entries: list[dict]) -> None:
    """Merge this run's outcomes into the record at ``path``, dropping the results of other
    sources or checks; it is complete when it holds every mutant of the sources as they are."""
    record = load_record(path)
    for name, o in outcomes.items():
        status = "equivalent" if o["status"] == "survived" and equivalent_reason(o["mutant_obj"], entries) else o["status"]
        record["mutants"][name] = {"status": status, "by": o.get("by"), "key": o["key"], "seconds": o["seconds"]}
    # Only what holds for the sources and checks as they are: a result of other checks is gone.
    sources = csrc_texts()
    current = {m.name: key(m, sources) for m in every}
    record["mutants"] = {n: r for n, r in sorted(record["mutants"].items()) if current.get(n) == r.get("key")}
    record["complete"] = set(current) <= set(record["mutants"])
    record["rules"] = sorted({m.rule for m in every} - {m.rule for m in every if m.name not in record["mutants"]})
    with atomic_write(path) as f:
        json.dump(record, f, indent=1)
        f.write("\n")


QUICK = ("kernel tests", "device tests")  # the checks that kill a mutant in seconds


def eligible_for_sample(mutants: list[Mutant], entries: list[dict], record: dict,
                        quick: bool = False) -> list[Mutant]:
    """What a sample may draw: not listed in mutants_equivalent.toml, and killed in the last
    full run's record, or not in it when that record held every mutant of its rule class (a
    mutant the sources have gained since, or one whose line has moved: a name carries its line).
    A record vouches only for what it measured: not for a rule class added after it. With
    ``quick`` (CI's sample), only what the record shows killed by the tests, in seconds: a
    mutant it does not know may take minutes (the sanitizers, nvcc's builds) or survive."""
    recorded = record["mutants"]

    def vouched(m):
        r = recorded.get(m.name)
        if r is None:
            return not quick and (record["complete"] or m.rule in record.get("rules", []))
        return r["status"] == "killed" and (not quick or r.get("by") in QUICK)

    return [m for m in mutants if not equivalent_reason(m, entries) and vouched(m)]


class Unavailable(Exception):
    """The emulator cannot build csrc/ on this machine."""


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--sample", type=cli.integer(1), default=None,
                        help="test this many mutants drawn at random (not those listed equivalent)")
    parser.add_argument("--quick", action="store_true",
                        help="a --sample draws only mutants that the record shows killed by the tests "
                             "(seconds each), not by a sanitizer (minutes)")
    parser.add_argument("--seed", type=cli.integer(0, 2**32 - 1), default=None,
                        help="the sample's seed (default: drawn, and printed)")
    parser.add_argument("--match", type=cli.regex, default=None,
                        help="only the mutants whose line in --list this regular expression finds")
    parser.add_argument("--files", nargs="+", choices=FILES, default=FILES, metavar="FILE",
                        help=f"which of csrc/ to mutate, in this order: {', '.join(FILES)}")
    parser.add_argument("--results", type=cli.output_file, default=ROOT / "runs" / "mutants" / "results.jsonl",
                        help="where each mutant's result is kept, so that a run resumes (default: %(default)s)")
    parser.add_argument("--report", type=cli.output_file, default=None, help="also write the report (Markdown) here")
    parser.add_argument("--record", type=cli.output_file, default=str(RECORD),
                        help="the record of the full run: a run without --sample or --match updates it, "
                             "and a --sample draws from what it shows killed (default: %(default)s)")
    parser.add_argument("--report-only", action="store_true",
                        help="test nothing: report (and record) what --results and the record already hold")
    parser.add_argument("--jobs", type=cli.integer(1), default=os.cpu_count(),
                        help="mutants tested at once (default: the cores, %(default)s)")
    parser.add_debug()
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if Path(args.results).exists() and not Path(args.results).is_file():  # a FIFO would block the resume
        raise ValueError(f"--results {args.results} is not a regular file: it is read back to resume a run")
    reason = emulator.unavailable_reason() or emulator.unavailable_reason("address") or emulator.unavailable_reason("thread")
    if reason:
        raise Unavailable(f"the emulator cannot build csrc/ here: {reason}")
    every = generate()
    mutants = [m for file in args.files for m in every if m.file == file]  # in the order asked
    entries, survivors = equivalents(), equivalents("survivor")
    if args.match:
        mutants = [m for m in mutants if args.match.search(m.name)]
    if args.list:
        for m in mutants:
            print(m.name)
        return 0
    if args.sample is not None:
        seed = random.SystemRandom().randrange(2**32) if args.seed is None else args.seed
        pool = eligible_for_sample(mutants, entries + survivors, load_record(Path(args.record)), args.quick)
        mutants = random.Random(seed).sample(pool, min(args.sample, len(pool)))
        print(f"mutant sample: {len(mutants)} of {len(pool)} eligible, seed {seed} "
              f"(python tools/kernels/mutants.py --sample {args.sample} --seed {seed})", flush=True)
    begin = time.time()
    done = 0

    def progress(mutant, record):
        nonlocal done
        done += 1
        print(f"[{done}] {record['status']:>9} {record.get('by') or '':<20} {record['seconds']:6.1f}s  {mutant.name}",
              flush=True)

    # A sample or a --match tests again what it draws; a full run takes what the record knows.
    known = known_results(load_record(Path(args.record))) if args.sample is None and args.match is None else {}
    outcomes = run(mutants, Path(args.results), args.jobs, progress, known, test=not args.report_only)
    seconds = sum(o["seconds"] for o in outcomes.values()) / args.jobs if args.report_only else time.time() - begin
    text, unexplained = report(outcomes, entries, survivors, seconds)
    if len(outcomes) < len(mutants):
        text = f"{len(mutants) - len(outcomes)} of {len(mutants)} mutants not tested yet.\n\n" + text
    print(text)
    if args.report:
        with atomic_write(args.report) as f:
            f.write(text + "\n")
    if args.sample is None and args.match is None:
        write_record(Path(args.record), outcomes, every, entries)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(Unavailable, ChecksFail, ValueError)))
