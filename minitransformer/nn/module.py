"""Module and Parameter: containers that find their parameters by attribute, as in PyTorch.

Assigning a ``Parameter`` or a ``Module`` to an attribute registers it; ``named_parameters``
walks the tree and yields dotted names ("encoder.layers.0.self_attn.q_proj.weight"). A
parameter shared by two modules (tied embeddings) is yielded once, under its first name.
``state_dict`` maps those names to arrays (NumPy, whatever the device) and
``load_state_dict`` checks them: missing, unexpected and wrongly shaped keys are all named.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import numpy as np

from .. import backend
from ..tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module registers as trainable (``requires_grad=True``)."""

    def __init__(self, data) -> None:
        super().__init__(data.data if isinstance(data, Tensor) else data, requires_grad=True)

    def __repr__(self) -> str:
        return "Parameter(" + super().__repr__() + ")"


class Module:
    """Base class of layers. Subclasses call ``super().__init__()`` first, assign their
    parameters and submodules as attributes, and define ``forward``; calling the module
    calls ``forward``."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ----------------------------------------------------------------- registration
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        # A registered name keeps its kind (None removes it), as in PyTorch: a plain Tensor over
        # a Parameter would silently leave parameters() and state_dict(), untrained and unsaved.
        for registry, what, kind in ((self._parameters, "parameter", Parameter), (self._modules, "submodule", Module),
                                     (self._buffers, "buffer", Tensor)):
            if name in registry and value is not None and not isinstance(value, kind):
                raise TypeError(f"cannot assign {type(value).__name__} to {type(self).__name__}.{name}, a registered "
                                f"{what}: a {kind.__name__} or None expected")
        target = (self._parameters if isinstance(value, Parameter) else self._modules if isinstance(value, Module)
                  else self._buffers if name in self._buffers and value is not None else None)
        for registry in (self._parameters, self._modules, self._buffers):
            if registry is not target:
                registry.pop(name, None)
        if target is None:
            object.__setattr__(self, name, value)
        else:
            self.__dict__.pop(name, None)  # a plain attribute of that name would hide the entry
            target[name] = value  # a replaced entry keeps its place: the parameters' order is the optimiser's

    def __getattr__(self, name: str):
        # Only called when normal lookup fails: the registered names live in these dicts.
        for registry in ("_parameters", "_modules", "_buffers"):
            entries = self.__dict__.get(registry)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def register_buffer(self, name: str, value: Tensor | None) -> None:
        """A tensor that belongs to the module's state but is not trained."""
        self._buffers[name] = value

    # ----------------------------------------------------------------- traversal
    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self._modules.items()

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for mod_name, module in self.named_modules(prefix):
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        for mod_name, module in self.named_modules():
            for name, b in module._buffers.items():
                if b is not None:
                    yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self) -> Iterator[Tensor]:
        for _, b in self.named_buffers():
            yield b

    # ----------------------------------------------------------------- modes and devices
    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def to(self, device=None, dtype=None) -> Module:
        """Move parameters and buffers to ``device`` and/or cast their floating-point data to
        ``dtype``, in place: ``model.to("cuda")``, ``model.to(mt.bfloat16)``,
        ``model.to("cuda", dtype=mt.float16)``. The Parameter objects stay the same, so an
        optimiser built before the call still holds them."""
        if device is not None and not (isinstance(device, str) and device in backend.DEVICES):
            try:  # to(dtype)
                device, dtype = None, backend.resolve_dtype(device)
            except TypeError:  # neither a device nor a dtype: say which devices there are
                backend.check_device(device)
                raise
        if device is not None:
            backend.check_device(device)
        if dtype is not None:
            dtype = backend.resolve_dtype(dtype)
            if not backend.is_floating(dtype):
                raise TypeError(f"Module.to: parameters must stay floating-point, not {dtype}")

        def convert(a):
            a = backend.to_device(a, device) if device is not None else a
            if dtype is not None and backend.is_floating(a.dtype):
                a = a.astype(dtype, copy=False)
            return a

        for p in self.parameters():
            p.data = convert(p.data)
            if p.grad is not None:
                p.grad = Tensor(convert(p.grad.data))
        for _, b in self.named_buffers():
            b.data = convert(b.data)
        return self

    # ----------------------------------------------------------------- state
    def state_dict(self) -> OrderedDict:
        """Parameter and buffer arrays by dotted name, copied to NumPy."""
        state = OrderedDict()
        for name, p in self.named_parameters():
            state[name] = backend.to_device(p.data, "cpu").copy()
        for name, b in self.named_buffers():
            state[name] = backend.to_device(b.data, "cpu").copy()
        return state

    def load_state_dict(self, state: dict, strict: bool = True) -> tuple[list, list]:
        """Copy arrays from ``state`` into the parameters and buffers, keeping their device and
        dtype. Returns ``(missing, unexpected)``; with ``strict`` any of them, or a shape
        mismatch, raises a ``KeyError``/``ValueError`` that lists them; so does a value that is
        not numbers, or a finite one that the parameter's dtype cannot hold (a float64 1e39 into
        float32). Every key is checked before any is copied: a refused state changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict: expected a dict of arrays, got {type(state).__name__}")
        own = dict(self.named_parameters())
        own.update(self.named_buffers())
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        wrong = [
            f"{k}: checkpoint {tuple(np.shape(state[k]))} vs model {own[k].shape}"
            for k in own if k in state and tuple(np.shape(state[k])) != own[k].shape
        ]
        if wrong:
            raise ValueError("load_state_dict: shape mismatch for " + "; ".join(wrong))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        loaded = {k: t for k, t in own.items() if k in state}
        for k, t in loaded.items():
            _check_value(k, np.asarray(state[k]), np.dtype(t.dtype))
        for k, t in loaded.items():
            xp = backend.array_module_of(t.data)
            t.data = xp.asarray(backend.to_device(np.asarray(state[k]), t.device), dtype=t.dtype).copy()
            t.bump_version()  # a graph that saved the old values must not backward through the new
        return missing, unexpected

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ")" if not lines else head + "\n  " + "\n  ".join(lines) + "\n)"


def _check_value(key: str, value: np.ndarray, dtype: np.dtype) -> None:
    """Refuse an array that is not numbers, or holds finite values beyond ``dtype``'s range."""
    if value.dtype.kind not in "fiu" and not backend.is_floating(value.dtype):
        raise ValueError(f"load_state_dict: {key} holds {value.dtype} values, not numbers of a parameter")
    if value.dtype.kind == "f" and value.dtype.itemsize > dtype.itemsize:
        with np.errstate(over="ignore", invalid="ignore"):  # what the cast gives is counted
            beyond = int((np.isfinite(value) & ~np.isfinite(value.astype(dtype))).sum())
        if beyond:
            raise ValueError(f"load_state_dict: {key} has {beyond} values beyond the range of "
                             f"{dtype}, the parameter's dtype (they would become inf)")


class ModuleList(Module):
    """A list of modules registered as "0", "1", ..."""

    def __init__(self, modules=()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        self._modules[str(len(self._modules))] = module

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)
