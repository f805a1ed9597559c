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
    ["backend"],
    ["tensor"],
    ["autograd"],
    ["kernels"],
    ["functional"],
    ["nn", "optim", "amp", "data", "checkpoint", "distributed", "testing"],
    ["decoding", "train"],
    [""],  # the package itself: imports everything
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def layer_of(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + ".") or name == "":
                return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int]]:
    """(package module imported, line) for every import statement in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("minitransformer"):
                target = node.module.removeprefix("minitransformer").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import nn` imports the module nn
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub not in COMPILED:
                    found.append((sub if sub in known else target, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("minitransformer."):
                    found.append((alias.name.removeprefix("minitransformer."), node.lineno))
    return [(t, line) for t, line in found if t in known and t != module]


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_import_goes_down_the_layers():
    wrong = [f"{m or 'minitransformer'} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)}) at line {line}"
             for m, edges in graph().items() for t, line in edges if layer_of(t) > layer_of(m)]
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_no_import_cycle():
    g = {m: sorted({t for t, _ in edges}) for m, edges in graph().items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def cycle_from(start: str) -> list[str] | None:  # iterative depth-first search
        path, stack = [], [(start, iter(g[start]))]
        state[start] = 1
        path.append(start)
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    return path[path.index(child):] + [child]
                if child not in state:
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(g[child])))
                    break
            else:
                state[node] = 2
                path.pop()
                stack.pop()
        return None

    for m in g:
        if m not in state:
            cycle = cycle_from(m)
            assert cycle is None, "import cycle: " + " -> ".join(c or "minitransformer" for c in cycle)


def test_the_checks_can_fail():
    """The graph reader sees a loop and an upward import when there is one."""
    assert layer_of("functional.attention") > layer_of("kernels.launch") > layer_of("tensor")
    g = graph()
    assert ("tensor", 6) not in g["backend"]
    assert any(t == "kernels" for t, _ in g["functional.attention"])  # `from .. import kernels`
    assert any(t == "data" for t, _ in g["decoding"])  # a lazy import inside translate()


def test_subpackages_are_attributes_after_import_minitransformer():
    """As ``torch.nn`` after ``import torch``; in a fresh interpreter, since this one has
    imported the submodules already."""
    code = ("import minitransformer as mt; mt.nn.Linear; mt.optim.Adam; mt.functional.softmax; "
            "mt.data.Tokenizer; mt.distributed.init; mt.decoding.beam_search; mt.checkpoint.save_checkpoint")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MT_EMULATE_CUDA": "0"})
