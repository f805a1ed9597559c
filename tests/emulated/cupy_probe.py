"""The real CuPy's side of the contract (tests/emulated/test_cupy_contract.py), run in a process
of its own with CuPy on its path, so that no other test process imports it:

    PYTHONPATH=.venv-cupy python tests/emulated/cupy_probe.py request.json

The request lists the names to look up (tests/emulated/cupy_uses.py), the reply (JSON on stdout)
says of each whether CuPy has it, and compares what the stand-in (minitransformer.emulated.cupy)
and CuPy answer where CuPy needs no device. No GPU is here, so CuPy is read as its own
documentation describes it where an object would need one: a class's attributes from its
docstring's "Attributes" section, a function's result from its "Returns" section, a signature
from ``inspect.signature`` or the one Cython writes atop each docstring. cupy.cuda.nccl loads
only with NCCL's library; without it, its names and signatures are read from the compiled
module's text, which holds each name and each embedded signature.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import textwrap
import types

import numpy as np

import cupy
import cupy.cuda.nccl
from cupy_backends.cuda.api import runtime as cuda_runtime


class Instance:
    """An object of ``cls`` that cannot be made here (it needs a device)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


UNKNOWN = object()  # what a step led to when CuPy's documentation does not say


def _section(doc: str | None, title: str) -> list[str]:
    """The lines of a Google-style docstring section ("Attributes", "Returns")."""
    lines = inspect.cleandoc(doc or "").splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"{title}:":
            indent = len(line) - len(line.lstrip())
            body = []
            for rest in lines[i + 1:]:
                if rest.strip() and len(rest) - len(rest.lstrip()) <= indent:
                    break
                body.append(rest)
            return body
    return []


def documented_attributes(cls: type) -> dict[str, str]:
    """name -> type, as the "Attributes" sections of ``cls`` and its bases say."""
    found = {}
    for klass in inspect.getmro(cls):
        for line in _section(klass.__doc__, "Attributes"):
            m = re.match(r"\s*(?:~?\w+\.)?(\w+)\s*\(([^)]*)\)\s*:", line)
            if m:
                found.setdefault(m.group(1), m.group(2))
    return found


def _type(text: str, context) -> object:
    """The class a docstring's type names, as an Instance (UNKNOWN if it names none)."""
    text = text.strip().lstrip("~")
    if text.startswith(("None or ", "int or ")):
        text = text.split(" or ")[-1]
    owner = getattr(context, "__objclass__", None)
    for namespace in (sys.modules.get(getattr(owner, "__module__", ""), None), cupy):
        obj = namespace
        for part in text.split(".")[1:] if text.startswith("cupy.") else text.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type):
            return Instance(obj)
    return UNKNOWN


def returned(func) -> object:
    """What calling ``func`` gives, as CuPy documents it."""
    if isinstance(func, type):
        return Instance(func)
    if isinstance(func, cupy.ufunc):
        return Instance(cupy.ndarray)
    said = [m.group(1) for line in _section(func.__doc__, "Returns")[:1] if (m := re.match(r"\s*([\w.~]+)\s*:", line))]
    said += re.findall(r"\)\s*->\s*([\w.]+)", (func.__doc__ or "").split("\n")[0])
    for text in said:
        if (found := _type(text, func)) is not UNKNOWN:
            return found
    return UNKNOWN


def step(obj, name: str):
    """``obj.name`` in CuPy (KeyError if CuPy has no such name)."""
    if obj is UNKNOWN:
        return UNKNOWN
    if isinstance(obj, Instance):
        for klass in inspect.getmro(obj.cls):
            if name in vars(klass):
                value = getattr(obj.cls, name)
                kind = type(vars(klass)[name]).__name__
                if "getset" in kind or "member" in kind or isinstance(vars(klass)[name], property):
                    return _type(documented_attributes(obj.cls)[name], value) if name in documented_attributes(obj.cls) else UNKNOWN
                return value
        if name in documented_attributes(obj.cls):
            return _type(documented_attributes(obj.cls)[name], None)
        raise KeyError(name)
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, types.ModuleType):
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            pass
    raise KeyError(name)


def _split(params: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in params:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def keywords_of(params: str) -> set[str] | None:
    """The keyword names a written signature's parameter list takes (None: any, ``**kw``)."""
    names = set()
    for part in _split(params.replace("\\*", "*")):
        if part.startswith("**"):
            return None
        if part in ("*", "/", "self") or part.startswith("*"):
            continue
        names.add(re.split(r"[=:]", part)[0].split()[-1])
    return names


def signature(obj) -> tuple[set[str] | None, str] | None:
    """(the keywords ``obj`` takes, where that was read), None where CuPy shows no signature."""
    target = obj.cls if isinstance(obj, Instance) else obj
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        pass
    else:
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None, "inspect.signature"
        return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}, "inspect.signature"
    for line in inspect.cleandoc(target.__doc__ or "").splitlines()[:1]:
        m = re.match(r"\s*[\w.]+\((.*)\)", line)
        if m:
            return keywords_of(m.group(1)), "the signature atop its docstring"
    return None


def compiled_text(module: str) -> tuple[set[str], dict[str, str]]:
    """The identifiers and the embedded signatures (``Class.method(params)``) in the text of
    a compiled module's file, for a module that cannot be imported here."""
    data = open(importlib.util.find_spec(module).origin, "rb").read()
    strings = [s.decode() for s in re.findall(rb"[\x20-\x7e]{2,}", data)]
    names = {part for s in strings for part in s.split(".") if part.isidentifier()}
    signatures = {m.group(1): m.group(2) for s in strings if (m := re.match(r"([\w.]+)\((.*)\)", s))}
    return names, signatures


NCCL_MODULE = "cupy_backends.cuda.libs.nccl"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_nccl(path: str, keywords: list[str]) -> dict:
    """A name under cupy.cuda.nccl, without NCCL's library: read from the compiled module."""
    names, signatures = compiled_text(NCCL_MODULE)
    parts = [p for p in re.split(r"\.|\(\)", path.removeprefix("cupy.cuda.nccl.")) if p]
    how = f"read from {NCCL_MODULE}'s compiled text (no NCCL library here)"
    if path == "cupy.cuda.nccl.available":
        return {"status": "found"}
    if not all(p in names for p in parts):
        return {"status": "missing", "detail": how}
    qualified = ".".join(parts)
    if keywords and qualified in signatures:
        taken = keywords_of(signatures[qualified])
        bad = sorted(set(keywords) - taken) if taken is not None else []
        if bad:
            return {"status": "keyword", "rejected": bad, "detail": f"{qualified}({signatures[qualified]})"}
    return {"status": "found", "detail": how}


def check(path: str, keywords: list[str]) -> dict:
    """Whether CuPy has ``path`` ("cupy.cuda.Stream().ptr"), and takes the keywords a call
    passes it."""
    if path.startswith("cupy.cuda.nccl.") and not cupy.cuda.nccl.available:
        return check_nccl(path, keywords)
    tokens = list(re.finditer(r"\(\)|[A-Za-z_]\w*", path))
    obj = importlib.import_module(tokens[0].group())
    for previous, token in zip(tokens, tokens[1:]):
        if obj is UNKNOWN:
            return {"status": "unchecked", "detail": f"CuPy does not document what {path[:previous.end()]} is"}
        token = token.group()
        try:
            obj = returned(obj) if token == "()" else step(obj, token)
        except KeyError:
            return {"status": "missing"}
    if keywords and obj is not UNKNOWN:
        taken = signature(obj)
        if taken is None:
            return {"status": "found", "detail": "CuPy shows no signature: keywords unchecked"}
        if taken[0] is not None and set(keywords) - taken[0]:
            return {"status": "keyword", "rejected": sorted(set(keywords) - taken[0]), "detail": taken[1]}
    return {"status": "found"}


# --------------------------------------------------------------------------- the stand-in


def standin():
    """The stand-in's modules, built as ``install`` builds them, without registering them."""
    from minitransformer.emulated import cupy as emulated
    from minitransformer.emulated import nccl as emulated_nccl

    return emulated, emulated._build_modules(emulated_nccl)


def _where(obj, line: int | None = None) -> str:
    """file:line of ``obj``'s source (of its ``line``-th line, counted from 1)."""
    try:
        file, start = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return "?"
    return f"{os.path.relpath(file, ROOT)}:{start + (line or 1) - 1}"


def _instance_attributes(cls: type) -> dict[str, str]:
    """The attributes ``cls``'s methods set on ``self``, with where."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {node.attr: _where(cls, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


# Python's plumbing of a class, not an interface the stand-in offers.
PLUMBING = {"__module__", "__doc__", "__slots__", "__weakref__", "__dict__", "__init__", "__getattr__",
            "__qualname__", "__annotations__", "__firstlineno__", "__static_attributes__"}


def surface(emulated, modules) -> list[tuple[str, str]]:
    """(path, where) of each name the stand-in offers as CuPy's: its modules' own names, the
    public members of its classes and of what its functions return (by their annotations),
    instance attributes included, and the operators of its ndarray."""
    names = []

    def members(path: str, cls: type) -> None:
        for name, value in vars(cls).items():
            if not name.startswith("_") or (cls is emulated.ndarray and name.startswith("__") and name not in PLUMBING):
                names.append((f"{path}.{name}", _where(value) if callable(value) else _where(cls)))
        for name, where in _instance_attributes(cls).items():
            if not name.startswith("_"):
                names.append((f"{path}.{name}", where))

    for mname, module in modules.items():
        own = dict(vars(module))
        if isinstance(module, emulated._Runtime):
            own |= {k: v for k, v in vars(type(module)).items() if not k.startswith("_")}
        for name, value in own.items():
            if name.startswith("_") or isinstance(value, types.ModuleType) or name == "annotations":
                continue
            path = f"{mname}.{name}"
            names.append((path, _where(value) if callable(value) else _where(emulated._build_modules)))
            if isinstance(value, type) and value.__module__.startswith("minitransformer.emulated"):
                members(f"{path}()", value)
            result = getattr(value, "__annotations__", {}).get("return") if callable(value) else None
            if isinstance(result, str) and isinstance(getattr(emulated, result, None), type):
                members(f"{path}()", getattr(emulated, result))
    return names


# --------------------------------------------------------------------------- behaviour


def promotions(emulated_cupy) -> dict:
    """The result dtype of mixed operands, by the stand-in (NumPy's rules) and by CuPy's own
    choice of a ufunc's loop (its ``guess_routine``, which needs no device): each operand an
    array of a dtype, or a Python scalar (a weak one, NEP 50's rule, in both)."""
    from cupy._core._scalar import CScalar

    import ml_dtypes

    dtypes = [np.dtype(t) for t in (np.bool_, np.uint8, np.uint16, np.int32, np.uint32, np.int64, np.float16,
                                    ml_dtypes.bfloat16, np.float32, np.float64)]
    scalars = [True, 3, 2.5]
    cases, differ = 0, []
    for ufunc in ("add", "subtract", "multiply", "true_divide", "maximum"):
        real = getattr(cupy, ufunc)
        for a in dtypes:
            for b in [*dtypes, *scalars]:
                other = b if not isinstance(b, np.dtype) else emulated_cupy.asarray(np.ones(2, b))
                try:
                    ours = str(getattr(emulated_cupy, ufunc)(emulated_cupy.asarray(np.ones(2, a)), other).dtype)
                except TypeError:
                    ours = "TypeError"
                args = [CScalar(0, a), CScalar(1, b) if isinstance(b, np.dtype) else CScalar(b)]
                try:
                    theirs = str(real._ops.guess_routine(real.name, {}, args, None, real._out_ops).out_types[0])
                except TypeError:
                    theirs = "TypeError"
                cases += 1
                if ours != theirs:
                    differ.append(f"{ufunc}({a}, {b if not isinstance(b, np.dtype) else b.name}): "
                                  f"stand-in {ours}, CuPy {theirs}")
    return {"cases": cases, "differ": differ}


def _builtin_bases(cls: type) -> list[str]:
    return [k.__name__ for k in inspect.getmro(cls) if k.__module__ == "builtins"]


def behaviour(emulated, modules, caught: list[str]) -> dict:
    emulated_cupy = modules["cupy"]
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = {"promotions": promotions(emulated_cupy)}
    # asnumpy of host data gives it back on both; asarray needs a device on CuPy.
    out["asnumpy"] = all(type(m.asnumpy(host)) is np.ndarray and np.array_equal(m.asnumpy(host), host)
                         and np.array_equal(m.asnumpy([1, 2]), [1, 2]) for m in (cupy, emulated_cupy))
    try:
        cupy.asarray(host)
        out["asarray"] = "ran without a device"
    except cupy.cuda.runtime.CUDARuntimeError:
        out["asarray"] = "needs a GPU"
    # What the package catches, and what CuPy raises for a failed CUDA call: the same built-in
    # classes on both, so that one except clause serves both.
    exceptions = {}
    for path in caught:
        theirs = modules["cupy"]
        for part in path.split(".")[1:]:
            theirs = getattr(theirs, part)
        real = cupy
        for part in path.split(".")[1:]:
            real = getattr(real, part)
        exceptions[path] = {"CuPy": _builtin_bases(real), "stand-in": _builtin_bases(theirs)}
    exceptions["a failed CUDA call (CUDARuntimeError)"] = {"CuPy": _builtin_bases(cuda_runtime.CUDARuntimeError),
                                                          "stand-in": _builtin_bases(RuntimeError)}
    out["exceptions"] = exceptions
    # Without a device: is_available() answers False rather than raising, and the package
    # then says "cuda" is unavailable in one line (DeviceUnavailable).
    out["is_available"] = repr(cupy.cuda.is_available())
    from minitransformer import backend, kernels

    try:
        backend.check_device("cuda")
        out["check_device"] = "accepted"
    except backend.DeviceUnavailable as e:
        out["check_device"] = f"DeviceUnavailable: {e}"
    out["package"] = {"has_cupy": backend.has_cupy(), "has_cuda": backend.has_cuda(),
                      "kernels_available": kernels.available()}
    # The device attributes the stand-in reports by CuPy's names: Device.attributes has a key
    # for each cudaDevAttr* constant of CuPy's runtime module.
    attributes = {name.removeprefix("cudaDevAttr") for name in dir(cuda_runtime) if name.startswith("cudaDevAttr")}
    out["attributes_missing"] = sorted(set(emulated._ATTRIBUTES) - attributes)
    properties = open(importlib.util.find_spec("cupy_backends.cuda.api.runtime").origin, "rb").read()
    keys = emulated.runtime.getDeviceProperties(0)
    out["properties_missing"] = sorted(k for k in keys if f"'{k}'".encode() not in properties and k.encode() not in properties)
    return out


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    emulated, modules = standin()
    reply = {"cupy": cupy.__version__, "nccl_available": bool(cupy.cuda.nccl.available)}
    reply["uses"] = {path: check(path, keywords) for path, keywords in request["uses"].items()}
    reply["standin"] = [(path, where, check(path, [])) for path, where in surface(emulated, modules)]
    ndarray_names = {n for n in dir(np.ndarray) if not n.startswith("_")}
    reply["ndarray"] = {name: check(f"cupy.ndarray().{name}", sorted(request["method_keywords"].get(name, [])))
                        for name in sorted(set(request["names"]) & ndarray_names)}
    # What the stand-in's arrays refuse of NumPy's: what CuPy's lack.
    reply["numpy_only"] = sorted(n for n in ndarray_names if check(f"cupy.ndarray().{n}", [])["status"] == "missing")
    reply["refused"] = sorted(emulated.NUMPY_ONLY)
    # The methods the stand-in's generator lends of NumPy's: CuPy's.
    reply["generator"] = sorted(n for n in dir(cupy.random.Generator) if not n.startswith("_"))
    reply["generator_lent"] = sorted(emulated.GENERATOR_METHODS)
    reply["behaviour"] = behaviour(emulated, modules, request["caught"])
    json.dump(reply, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
