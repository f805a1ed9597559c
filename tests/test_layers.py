"""The package's layers form a chain. Its units are its folders and top-level modules
(``nn/``, ``backend.py``, ...); ``minitransformer.LAYERS`` lists them lowest first, and every
import, at module level or inside a function, goes from a unit to one listed before it. So no
two units import each other, directly or through others, and no module imports itself through
others. Read from the source (ast), so a lazy import inside a function counts too; an import
the source does not spell out (``importlib``, ``__import__``) is refused, so the reading is whole."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import minitransformer

PACKAGE = pathlib.Path(minitransformer.__file__).parent
COMPILED = {"kernels._C"}  # the CUDA extension: no Python source, imports nothing of the package


def unit_of(module: str) -> str:
    """The folder or top-level module that holds ``module`` ("" for the package's __init__)."""
    return module.split(".")[0]


def package_layers() -> list[str]:
    """The package's units, lowest first, as the package lists them."""
    return list(minitransformer.LAYERS)


def layer_of(module: str, layers: list[str]) -> int:
    """The rank of ``module``'s unit in ``layers``; the package's __init__ imports everything
    (as ``import torch`` brings ``torch.nn``), so it stands above them all."""
    unit = unit_of(module)
    if unit == "":
        return len(layers)
    if unit not in layers:
        raise AssertionError(f"minitransformer/{unit} is not in minitransformer.LAYERS")
    return layers.index(unit)


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


def unit_graph(g: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """The imports between units, each as (unit, "module:line" of one import that makes it)."""
    units: dict[str, dict[str, str]] = {}
    for m, edges in g.items():
        for t, line in edges:
            if unit_of(t) != unit_of(m):
                units.setdefault(unit_of(m), {}).setdefault(unit_of(t), f"{m}:{line}")
    return {u: [(t, where) for t, where in sorted(targets.items())] for u, targets in units.items()}


def not_down(g: dict[str, list[tuple[str, int]]], layers: list[str]) -> list[str]:
    """The imports that do not run down ``layers``: to the importer's own unit's rank or above."""
    return [f"{m or 'minitransformer'} (layer {layer_of(m, layers)}) imports {t or 'minitransformer'} "
            f"(layer {layer_of(t, layers)}) at line {line}"
            for m, edges in g.items() for t, line in edges
            if unit_of(t) != unit_of(m) and layer_of(t, layers) >= layer_of(m, layers)]


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
    wrong = not_down(graph(), package_layers())
    assert not wrong, "imports that do not run down minitransformer.LAYERS:\n" + "\n".join(wrong)


def test_the_layers_list_every_unit_once():
    listed = package_layers()
    units = {unit_of(m) for m in modules()} - {""}
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({u for u in listed if listed.count(u) > 1})}"
    assert set(listed) == units, (f"not in the map: {sorted(units - set(listed))}; "
                                  f"in the map but not in the package: {sorted(set(listed) - units)}")


def test_no_two_units_import_each_other():
    """Directly or through others: a loop in the graph of folders and top-level modules."""
    cycle = find_cycle(unit_graph(graph()))
    assert cycle is None, "units in a loop: " + " -> ".join(c or "minitransformer" for c in cycle)


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(c or "minitransformer" for c in cycle)


def test_the_source_spells_out_every_import():
    """The checks read import statements; a module loaded by name would hide an arrow."""
    hidden = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("import_module", "__import__"):
                    hidden.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not hidden, "imports by name: " + ", ".join(hidden)


def test_the_reader_sees_every_form_of_import(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import minitransformer as mt\n"
        "import minitransformer.nn.attention\n"
        "from .. import kernels\n"
        "from ..emulated import cupy\n"
        "from .attention import KeyMask\n"
        "from ..kernels import _C\n"
        "def lazy():\n"
        "    from minitransformer.decoding import beam_search\n"
    )
    known = set(modules())
    found = {t for t, _ in imports("functional.probe", source, known)}
    assert found == {"", "nn", "nn.attention", "kernels", "emulated", "emulated.cupy",
                     "functional.attention", "decoding"}


def test_the_checks_find_an_import_that_runs_up_and_a_loop():
    g = {"backend": [("tensor", 3)], "tensor": [("backend", 5)], "autograd": [("tensor", 1)],
         "nn.module": [("nn.init", 2)], "nn.init": [("backend", 4)]}
    layers = ["backend", "tensor", "autograd", "nn"]
    assert not_down(g, layers) == ["backend (layer 0) imports tensor (layer 1) at line 3"]
    assert find_cycle(g) == ["backend", "tensor", "backend"]
    assert find_cycle({"a": [("b", 1)], "b": [("c", 1)], "c": []}) is None
    # Units: two modules of one folder importing each other is no loop of units, but two
    # folders that reach each other through their modules are.
    assert find_cycle(unit_graph({"nn.a": [("nn.b", 1)], "nn.b": [("nn.a", 1)]})) is None
    loop = unit_graph({"nn.a": [("data.x", 1)], "data.y": [("nn.b", 2)]})
    assert loop == {"nn": [("data", "nn.a:1")], "data": [("nn", "data.y:2")]}
    assert find_cycle(loop) == ["nn", "data", "nn"]
    with pytest.raises(AssertionError, match="minitransformer/optim is not in minitransformer.LAYERS"):
        not_down({"optim.adam": [("backend", 1)]}, layers)


def test_subpackages_are_attributes_after_import_minitransformer():
    """As ``torch.nn`` after ``import torch``; in a fresh interpreter, since this one has
    imported the submodules already."""
    code = ("import minitransformer as mt; mt.nn.Linear; mt.optim.Adam; mt.functional.softmax; "
            "mt.data.Tokenizer; mt.distributed.init; mt.decoding.beam_search; mt.checkpoint.save_checkpoint")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MT_EMULATE_CUDA": "0"})
