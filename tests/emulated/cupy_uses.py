"""Every CuPy name the code that runs on a GPU uses, read from its source (AST): the contract's
list (tests/emulated/test_cupy_contract.py).

A name counts when it is reached from CuPy, literally or through a variable: ``cupy.*``,
``cupyx.*`` and what ``import cupy as cp`` or ``from cupy.cuda import nccl`` bind; the array
module (``xp``, ``cupy`` as a parameter, ``backend._cupy``, ``get_array_module(...)``,
``array_module_of(...)``); names assigned from those, in a function or on ``self`` (``self.stream
= cupy.cuda.Stream(...)`` makes ``self.stream.ptr`` the name ``cupy.cuda.Stream().ptr``); and what a
function of the same file returns when all its returns are such names (``import_nccl()``). A
call records the keywords it passes. ``getattr(x, "name", default)`` and ``hasattr(x, "name")``
record an optional name: the code works without it.

Each name is a path: dotted attributes, with ``()`` for "the result of calling", as
``cupy.cuda.get_current_stream().wait_event``. Separately, ``attribute_names`` gives every
attribute name the code reads on anything, for the methods of arrays, whose variables no
reading of the source can type.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The code a GPU runs: the package but its emulated device, the benchmarks and tools that
# gpu_check.sh runs, and the examples.
SOURCES = ("minitransformer", "benchmarks", "tools", "examples")
SKIPPED = ("minitransformer/emulated/",)
ROOTS = {"cupy", "cupyx"}
# The names that stand for the array module by the package's convention (backend's docstring).
CONVENTION = {"xp": "cupy", "cupy": "cupy", "cupyx": "cupyx"}
ARRAY_MODULE_OF = {"get_array_module", "array_module_of"}


@dataclasses.dataclass
class Use:
    path: str  # "cupy.cuda.Stream().ptr"
    where: str  # "minitransformer/distributed/comm.py:276"
    keywords: tuple[str, ...] = ()
    call: bool = False
    optional: bool = False
    caught: bool = False  # named in an except clause


def source_files(root: Path = ROOT) -> list[Path]:
    files = [p for top in SOURCES for p in sorted((root / top).rglob("*.py"))]
    return [p for p in files if not any(p.relative_to(root).as_posix().startswith(s) for s in SKIPPED)]


def defined_names(path: Path) -> set[str]:
    """The functions, methods and classes a file defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


class _File(ast.NodeVisitor):
    """One file's uses, with its module-level bindings in ``module`` and its functions' return
    paths in ``returns``."""

    def __init__(self, tree: ast.Module, rel: str, tables: dict[str, dict[str, str]]) -> None:
        self.tree, self.rel, self.tables = tree, rel, tables
        self.module: dict[str, str] = {}
        self.returns: dict[str, str] = {}
        self.scopes: list[dict[str, str]] = []
        self.selves: dict[str, str] = {}  # "self.x" -> path, over the class being read
        self.uses: list[Use] = []
        self.names: set[str] = set()
        self.method_keywords: dict[str, set[str]] = {}
        # Names that imports bind (modules, functions, classes: never an array)
        self.imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                         if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}

    # ---- what an expression is, as a path from CuPy (None: not CuPy)
    def path(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return self.module.get(node.id, CONVENTION.get(node.id))
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.selves.get(f"self.{node.attr}")
            base = self.path(node.value)
            if base is not None:
                return f"{base}.{node.attr}"
            if isinstance(node.value, ast.Name):  # backend._cupy: another module's binding
                return self.tables.get(node.value.id, {}).get(node.attr)
            return None
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in ARRAY_MODULE_OF:
                return "cupy"
            if isinstance(func, ast.Name) and func.id in self.returns:
                return self.returns[func.id]
            base = self.path(func)
            return None if base is None else f"{base}()"
        return None

    # ---- bindings (a name is CuPy's if any assignment makes it so: a module's ``_cupy`` is
    # None where CuPy is missing, and CuPy's where it runs)
    def bind(self, target: ast.AST, value: str | None, table: dict[str, str]) -> None:
        if value is None:
            return
        if isinstance(target, ast.Name):
            table[target.id] = value
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            self.selves[f"self.{target.attr}"] = value

    def read_statement(self, node: ast.AST, table: dict[str, str]) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in ROOTS:
                    table[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.split(".")[0] in ROOTS:
            for alias in node.names:
                table[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            self.bind(node.targets[0], self.path(node.value), table)

    def read_module(self) -> None:
        """The module's own bindings (through its if and try blocks), and its functions'
        returns."""
        pending = list(self.tree.body)
        while pending:
            node = pending.pop(0)
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                pending[:0] = [n for field in ("body", "orelse", "finalbody") for n in getattr(node, field, [])]
                pending[:0] = [n for h in getattr(node, "handlers", []) for n in h.body]
            else:
                self.read_statement(node, self.module)
        for _ in range(2):  # a function may return what another one does
            for node in self.tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.scopes = [self.local_bindings(node)]
                    found = {self.path(r.value) for r in ast.walk(node) if isinstance(r, ast.Return) and r.value}
                    self.scopes = []
                    if len(found) == 1 and None not in found:
                        self.returns[node.name] = found.pop()

    def local_bindings(self, func: ast.FunctionDef) -> dict[str, str]:
        """What a function's statements bind, in order (nested functions' too: closures)."""
        table: dict[str, str] = {}
        self.scopes.append(table)
        for node in ast.walk(func):
            if node is not func:
                self.read_statement(node, table)
        self.scopes.pop()
        return table

    # ---- uses
    def use(self, path: str, node: ast.AST, **kw) -> None:
        self.uses.append(Use(path, f"{self.rel}:{node.lineno}", **kw))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer, self.selves = self.selves, {}
        for method in node.body:  # what every method assigns to self, first
            if isinstance(method, ast.FunctionDef):
                self.local_bindings(method)
        self.generic_visit(node)
        self.selves = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scopes.append(self.local_bindings(node))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def untyped(self, node: ast.AST) -> bool:
        """Whether ``node`` may be an array: not CuPy's (that is typed), not an import."""
        return self.path(node) is None and not (isinstance(node, ast.Name) and node.id in self.imported)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.untyped(node.value):
            self.names.add(node.attr)
        if self.path(node.value) is not None and not isinstance(node.ctx, ast.Store):
            self.use(self.path(node), node)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        for caught in node.type.elts if isinstance(node.type, ast.Tuple) else [node.type] if node.type else []:
            if self.path(caught) is not None:
                self.use(self.path(caught), caught, caught=True)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        base = self.path(func)
        keywords = tuple(k.arg for k in node.keywords if k.arg)
        if base is not None and not (isinstance(func, ast.Name) and func.id in self.returns):
            self.use(base, node, keywords=keywords, call=True)
        elif isinstance(func, ast.Attribute) and keywords and self.untyped(func.value):  # an array's method?
            self.method_keywords.setdefault(func.attr, set()).update(keywords)
        if (isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            owner = self.path(node.args[0])
            if owner is not None:
                self.use(f"{owner}.{node.args[1].value}", node,
                         optional=func.id == "hasattr" or len(node.args) == 3)
        self.generic_visit(node)


@dataclasses.dataclass
class Found:
    uses: list[Use]  # the CuPy names, each use
    names: set[str]  # every attribute name read on anything
    method_keywords: dict[str, set[str]]  # keywords passed to methods of untyped objects, by name


def collect(root: Path = ROOT) -> Found:
    """What the source uses of CuPy."""
    tables: dict[str, dict[str, str]] = {}  # a module's file stem -> its bindings
    readers = [_File(ast.parse(p.read_text(encoding="utf-8"), str(p)), p.relative_to(root).as_posix(), tables)
               for p in source_files(root)]
    for _ in range(2):  # costs.py's ``cupy = backend._cupy`` needs backend's table first
        for reader in readers:
            reader.read_module()
            tables[Path(reader.rel).stem] = reader.module
    found = Found([], set(), {})
    for reader in readers:
        reader.visit(reader.tree)
        found.uses += reader.uses
        found.names |= reader.names
        for name, keywords in reader.method_keywords.items():
            found.method_keywords.setdefault(name, set()).update(keywords)
    return found
