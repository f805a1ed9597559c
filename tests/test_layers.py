"""The package's layers form a chain: every import, at module level or inside a function,
goes to the same layer or a lower one, and no module imports itself through others.
Read from the source (ast), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import minitransformer

PACKAGE = pathlib.Path(minitransformer.__file__).parent
COMPILED = {"_C"}  # the CUDA extension: no Python source, imports nothing of the package

# Lowest first. A module belongs to the first entry that is it or a package above it.
LAYERS = [
    # Stand-ins for CuPy and NCCL (device "cuda" on the CPU): beneath backend, like CuPy.
    ["testing.emulator", "testing.emulated_cuda", "testing.emulated_nccl", "testing.resources"],
    ["backend", "files", "cli"],  # files (atomic writes, folder locks) and cli: the standard library only
    ["tensor"],
    ["autograd"],
    ["kernels"],
    ["functional"],
    ["nn", "optim", "amp", "data", "checkpoint", "distributed", "testing.gradcheck"],
    ["decoding", "train", "export"],
]
# Package __init__ files whose layer is not their contents': testing/ holds modules from the
# bottom and the middle, and its __init__ (run by backend's import of the stand-ins) imports
# nothing; minitransformer/__init__ imports everything.
INITS = {"testing": 0, "": len(LAYERS)}


def layer_of(module: str) -> int:
    if module in INITS:
        return INITS[module]
    for rank, names in enumerate(LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names):
            return rank
    raise AssertionError(f"{module or 'minitransformer'} is in no layer: add it to LAYERS")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int]]:
    """(package module run, line) for every import statement in the file: the module named,
    and the package __init__ files above it that the import runs first (but not the
    importer's own packages, which are running already)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    named = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "minitransformer" or (node.module or "").startswith("minitransformer."):
                target = node.module.removeprefix("minitransformer").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import nn` imports the module nn
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub not in COMPILED:
                    named.append((sub if sub in known else target, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "minitransformer" or alias.name.startswith("minitransformer."):
                    named.append((alias.name.removeprefix("minitransformer").lstrip("."), node.lineno))
    own = {".".join(module.split(".")[:i]) for i in range(len(module.split(".")))}  # "" and above
    found = []
    for target, line in named:
        parts = target.split(".") if target else []
        for parent in (".".join(parts[:i]) for i in range(1, len(parts))):
            if parent in known and parent not in own:
                found.append((parent, line))
        found.append((target, line))
    return [(t, line) for t, line in found if t in known and t != module]


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def upward(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    """The imports that run from a lower layer to a higher one."""
    return [f"{m or 'minitransformer'} (layer {layer_of(m)}) imports {t or 'minitransformer'} "
            f"(layer {layer_of(t)}) at line {line}"
            for m, edges in g.items() for t, line in edges if layer_of(t) > layer_of(m)]


def find_cycle(g: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """A loop of imports, as the list of modules around it (the first repeated at the end)."""
    children = {m: sorted({t for t, _ in edges}) for m, edges in g.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    for start in children:
        if start in state:
            continue
        path, stack = [start], [iter(children[start])]  # an iterative depth-first search
        state[start] = 1
        while stack:
            for child in stack[-1]:
                if state.get(child) == 1:
                    return path[path.index(child):] + [child]
                if child not in state:
                    state[child] = 1
                    path.append(child)
                    stack.append(iter(children.get(child, ())))
                    break
            else:
                state[path.pop()] = 2
                stack.pop()
    return None


def test_every_import_goes_down_the_layers():
    wrong = upward(graph())
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(c or "minitransformer" for c in cycle)


def test_every_module_is_in_a_layer():
    for m in modules():
        layer_of(m)


def test_the_reader_sees_every_form_of_import(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import minitransformer as mt\n"
        "import minitransformer.nn.attention\n"
        "from .. import kernels\n"
        "from ..testing import emulated_cuda\n"
        "from .attention import KeyMask\n"
        "def lazy():\n"
        "    from minitransformer.decoding import beam_search\n"
    )
    known = set(modules())
    found = {t for t, _ in imports("functional.probe", source, known)}
    assert found == {"", "nn", "nn.attention", "kernels", "testing", "testing.emulated_cuda",
                     "functional.attention", "decoding"}


def test_the_checks_find_an_upward_import_and_a_loop():
    g = {"backend": [("tensor", 3)], "tensor": [("backend", 5)], "autograd": [("tensor", 1)]}
    assert upward(g) == ["backend (layer 1) imports tensor (layer 2) at line 3"]
    assert find_cycle(g) == ["backend", "tensor", "backend"]
    assert find_cycle({"a": [("b", 1)], "b": [("c", 1)], "c": []}) is None


def test_subpackages_are_attributes_after_import_minitransformer():
    """As ``torch.nn`` after ``import torch``; in a fresh interpreter, since this one has
    imported the submodules already."""
    code = ("import minitransformer as mt; mt.nn.Linear; mt.optim.Adam; mt.functional.softmax; "
            "mt.data.Tokenizer; mt.distributed.init; mt.decoding.beam_search; mt.checkpoint.save_checkpoint")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MT_EMULATE_CUDA": "0"})


def test_the_readme_lists_the_layers_in_their_order():
    """README's layer map says each module imports only those above it: its rows (the package's
    modules; testing/, examples/, docs/ and benchmarks/ aside) must come in LAYERS' order."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("## Layer map"):].split("\n\n")[2]
    names = [re.match(r"\| `([\w/.]+)`", row).group(1) for row in table.splitlines() if row.startswith("| `")]
    modules = [n.removesuffix(".py").removesuffix("/") for n in names
               if n not in ("testing/", "examples/", "docs/", "benchmarks/")]
    assert len(modules) > 10
    ranks = [layer_of(m) for m in modules]
    assert ranks == sorted(ranks), list(zip(modules, ranks))
