"""Reverse-mode automatic differentiation.

A differentiable op is a ``Function`` subclass with two static methods that work on raw
arrays (NumPy or CuPy), never on Tensors:

    forward(ctx, *args)       -> array        args: arrays where the caller passed Tensors,
                                               plain values (axis, p, eps...) elsewhere
    backward(ctx, grad_out)   -> one gradient per forward argument (None where there is none)

``Function.apply(*args)`` unwraps Tensors, runs ``forward`` and, when gradients are being
recorded, returns a Tensor that remembers its ``Context``: the function, its input Tensors and
whatever ``forward`` saved with ``ctx.save_for_backward``. The contexts form the graph.

``backward`` below walks that graph once, from the output to the leaves:

1. An iterative search finds the contexts the output depends on, each once (a recursive one
   would overflow Python's stack on a 10,000-op chain), and orders them newest first. An op is
   created after the ops that made its inputs, so in that order every context comes after all
   the contexts that feed gradient into it; and it is the forward pass run backwards, so a
   layer's gradients are complete before the layer below starts (data parallelism all-reduces
   them meanwhile).
2. In reverse order, each context's gradient, summed over all its uses, goes through its
   ``backward``. A gradient whose shape differs from its input's was broadcast in the forward
   pass, so it is summed back to the input's shape here, once for every op.
3. Leaves (tensors created by the user with ``requires_grad=True``) accumulate into ``.grad``.
   Each leaf's ``.grad`` owns its memory, so an optimiser may update it in place.
4. Unless ``retain_graph=True``, each context drops its inputs and saved arrays as soon as it
   has been used, so the graph of one training step is freed before the next one starts.
5. Whoever registered with ``add_walk_observer`` hears of each context as the walk finishes it:
   data-parallel training learns there that a parameter's gradient is complete, and starts
   all-reducing it while the walk goes on (distributed/grad_hooks.py). The walk knows no more.

Two safeguards stand outside the walk. Whether ops record (``no_grad``, ``enable_grad``) is
kept per thread. And a saved array that is (or views) a tensor's array is saved with that
tensor's version, the count of its in-place writes (``Tensor.bump_version``: an optimiser
step, ``load_state_dict``): when ``backward`` reads it back through ``ctx.saved``, a newer
version is an error naming the op, where the arithmetic would have run on values the forward
pass never saw and returned a wrong gradient without a word.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading

import numpy as np

from .backend import array_module_of, device_of
from .tensor import Tensor
from .tensor import _ops as _tensor_ops


class _GradState(threading.local):
    """Whether ops record a graph, per thread as in PyTorch: a ``no_grad`` block in one thread
    (a data loader, an evaluation) must not switch recording off in another. ``previous``
    holds the modes that the open blocks of this thread replaced, innermost last."""

    def __init__(self) -> None:  # runs once in every thread that reads the state
        self.enabled = True
        self.previous: list[bool] = []


_grad = _GradState()


def is_grad_enabled() -> bool:
    return _grad.enabled


class _GradMode:
    """A block (or decorated function) that runs with graph recording on or off."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self):
        _grad.previous.append(_grad.enabled)
        _grad.enabled = self.enabled

    def __exit__(self, *exc):
        _grad.enabled = _grad.previous.pop()
        return False

    def __call__(self, fn):
        if inspect.isgeneratorfunction(fn):
            return _generator_in_mode(fn, self.enabled)

        @functools.wraps(fn)
        def in_mode(*args, **kwargs):
            with _GradMode(self.enabled):
                return fn(*args, **kwargs)

        return in_mode


def _generator_in_mode(fn, enabled: bool):
    """A decorated generator function: its body runs in the mode each time it resumes, and the
    caller's code between two items does not (a ``with`` around the whole generator would hold
    the mode while it is suspended, and leak it into the caller); as PyTorch does."""

    @functools.wraps(fn)
    def in_mode(*args, **kwargs):
        gen = fn(*args, **kwargs)
        try:
            with _GradMode(enabled):
                item = next(gen)
            while True:
                try:
                    sent = yield item
                except GeneratorExit:
                    with _GradMode(enabled):
                        gen.close()
                    raise
                except BaseException as e:  # thrown in by the caller: into the body, in the mode
                    with _GradMode(enabled):
                        item = gen.throw(e)
                else:
                    with _GradMode(enabled):
                        item = gen.send(sent)
        except StopIteration as stop:  # the body returned: so does this generator, with its value
            return stop.value

    return in_mode


def no_grad():
    """Context manager (and decorator, of a generator function too) inside which ops record
    no graph; per thread."""
    return _GradMode(False)


def enable_grad():
    """Re-enable graph recording inside a ``no_grad`` block."""
    return _GradMode(True)


_created = itertools.count()


class Context:
    """What one op remembers between forward and backward; also the graph's node.

    Arrays go through ``save_for_backward``; small non-array values (an axis, a shape) may
    simply be set as attributes, ``ctx.axes = axes``. A saved array that is (or views) a
    tensor's array is checked when ``backward`` reads it back: it must not have been written
    in place since (``Tensor.bump_version``), or the gradient would be computed from values
    the forward pass never saw.
    """

    def __init__(self) -> None:
        self.sequence = next(_created)  # the order of creation: the walk's order, reversed
        self.fn = None
        self.inputs = ()
        self._saved = ()
        self._versions = ()  # (index in saved, version counter, its value when saved)
        self.needs_input_grad = ()
        self.freed = False

    def save_for_backward(self, *arrays) -> None:
        self._saved = arrays

    @property
    def saved(self) -> tuple:
        for i, counter, version in self._versions:
            if counter.value != version:
                raise RuntimeError(
                    f"{self.fn.__name__}.backward: one of the arrays needed for gradient computation (saved "
                    f"array {i}, shape {self._saved[i].shape}) has been modified by an inplace operation since "
                    f"the forward pass (version {version}, now {counter.value}): run backward() before "
                    f"optimizer.step() or load_state_dict(), or run the forward pass again")
        return self._saved

    def free(self) -> None:
        self.inputs = ()
        self._saved = ()
        self._versions = ()
        self.freed = True


class Function:
    """Base class of differentiable ops. A subclass defines two static methods on raw arrays
    (NumPy or CuPy), never Tensors: ``forward(ctx, *args)`` returns the output array, and
    ``backward(ctx, grad_out)`` one gradient per forward argument (None where there is none).
    ``apply`` unwraps Tensors, runs ``forward``, and records the context when gradients are on."""

    @classmethod
    def apply(cls, *args) -> Tensor:
        arrays = []
        needs = []
        tensors = []
        first = None  # (array type, index) of the first Tensor argument, for device checks
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                if first is None:
                    first = (type(a.data), i)
                elif type(a.data) is not first[0]:
                    _raise_device_mismatch(cls, args, first[1], i)
                arrays.append(a.data)
                needs.append(a.requires_grad)
                tensors.append(a)
            else:
                arrays.append(a)
                needs.append(False)
        record = _grad.enabled and any(needs)
        ctx = Context()
        ctx.needs_input_grad = tuple(needs) if record else (False,) * len(args)
        out = cls.forward(ctx, *arrays)
        if isinstance(out, np.generic):  # NumPy reductions to 0-d return scalars, not arrays
            out = np.asarray(out)
        if not record:
            return _share_version(Tensor(out), tensors)
        ctx.fn = cls
        ctx.inputs = tuple(a if n else None for a, n in zip(args, needs))
        result = _share_version(Tensor(out, requires_grad=True, _ctx=ctx), tensors)
        if ctx._saved:
            tensors.append(result)
            ctx._versions = _saved_versions(ctx._saved, tensors)
        return result


# NumPy and CuPy both point a view's ``base`` at the array that owns the memory, never at an
# intermediate view: an array is a tensor's, or views it, when it is that tensor's array, or
# its base is that array or that array's base.


def _share_version(result: Tensor, inputs: list) -> Tensor:
    """A view of an input (reshape, transpose, an index, a cast to the same dtype) counts its
    writes with that input: writing one writes the other."""
    out = result.data
    owner = out.base
    for t in inputs:
        data = t.data
        if data is out or owner is not None and (data is owner or data.base is owner):
            result._version_counter = t._version_counter
            break
    return result


def _saved_versions(saved: tuple, tensors: list) -> list:
    """For each saved array that is (or views) one of ``tensors``' arrays: its index, that
    tensor's version counter and the counter's value now, for ``Context.saved`` to check."""
    versions = []
    for i, array in enumerate(saved):
        owner = getattr(array, "base", None)  # saved values may be None or numbers
        for t in tensors:
            data = t.data
            if data is array or owner is not None and (data is owner or data.base is owner):
                versions.append((i, t._version_counter, t._version_counter.value))
                break
    return versions


def _raise_device_mismatch(fn, args, i, j):
    a, b = args[i], args[j]
    raise RuntimeError(
        f"{fn.__name__}: expected all tensors on one device, but argument {i} is on "
        f"{device_of(a.data)} (shape {a.shape}) and argument {j} is on "
        f"{device_of(b.data)} (shape {b.shape})"
    )


# --------------------------------------------------------------------------- the walk


def _topological_order(root: Context) -> list[Context]:
    """Contexts reachable from ``root``, newest first: every context after all the contexts
    it feeds, since an op's inputs are made before it is."""
    found, stack = {id(root): root}, [root]
    while stack:
        for t in stack.pop().inputs:
            if t is not None and t._ctx is not None and id(t._ctx) not in found:
                found[id(t._ctx)] = t._ctx
                stack.append(t._ctx)
    return sorted(found.values(), key=lambda ctx: ctx.sequence, reverse=True)


def sum_to_shape(grad, shape: tuple):
    """Undo broadcasting: sum ``grad`` over the axes that broadcasting added or stretched."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    if lead < 0:
        raise RuntimeError(f"gradient of shape {grad.shape} cannot be reduced to {shape}")
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    return array_module_of(grad).asarray(grad.sum(axis=axes)).reshape(shape)


def backward(root: Tensor, grad=None, retain_graph: bool = False) -> None:
    r"""Accumulate $\partial\,\mathrm{root} / \partial\,\mathrm{leaf}$ into ``leaf.grad`` for every
    leaf that requires grad. ``root.backward()`` calls it."""
    grad = _seed_gradient(root, grad)
    if root._ctx is None:
        _accumulate(root, grad)
        return
    order = _topological_order(root._ctx)  # iterative, each context once (step 1 above)
    listeners = [cb for cb in (observer(order) for observer in _observers) if cb is not None]
    for node in _chain_rule(order, grad, retain_graph):  # steps 2 to 4
        for listen in listeners:  # step 5: empty unless something listens (DDP's gradient hooks)
            listen(node)


def _chain_rule(order: list[Context], grad, retain_graph: bool):
    """The walk proper: for each context in ``order`` (root first), its output's gradient,
    summed over its uses, goes through its ``backward`` to its inputs. Yields each context once
    it is done, then frees it unless ``retain_graph``."""
    grads = {id(order[0]): grad}  # context -> gradient of its output, summed over its uses
    for node in order:
        g = grads.pop(id(node), None)  # None: every path to this node carried no gradient
        if g is not None:
            if node.freed:
                raise RuntimeError(_FREED)
            for t, gi in zip(node.inputs, _input_gradients(node, g)):  # the chain rule
                if t is None or gi is None:
                    continue
                gi = sum_to_shape(gi, t.shape).astype(t.dtype, copy=False)
                if t._ctx is None:
                    _accumulate(t, gi)
                else:
                    key = id(t._ctx)
                    grads[key] = grads[key] + gi if key in grads else gi
        yield node
        if not retain_graph:
            node.free()


_tensor_ops.backward = backward  # Tensor.backward (tensor.py imports nothing above backend)


def _seed_gradient(root: Tensor, grad):
    """The gradient the walk starts from: ones for a scalar root, else the caller's (copied)."""
    if not root.requires_grad:
        raise RuntimeError(
            "backward() called on a tensor that does not require grad "
            "(no input had requires_grad=True, or it was computed under no_grad())"
        )
    xp = array_module_of(root.data)
    if grad is None:
        if root.data.size != 1:
            raise RuntimeError(
                f"backward() on a non-scalar tensor of shape {root.shape} needs an explicit "
                f"gradient of that shape: call backward(grad)"
            )
        return xp.ones_like(root.data)
    grad = grad.data if isinstance(grad, Tensor) else grad
    if device_of(grad) != root.device:
        raise RuntimeError(f"backward(): gradient is on {device_of(grad)}, tensor is on {root.device}")
    grad = xp.array(grad, dtype=root.dtype)  # a copy (the caller keeps its array); a number becomes 0-d
    if grad.shape != root.shape:
        raise RuntimeError(
            f"backward(): gradient of shape {grad.shape} does not match the tensor's shape {root.shape}"
        )
    return grad


def _input_gradients(node: Context, g) -> tuple:
    """``node.fn.backward``: one gradient (or None) per input of the op."""
    in_grads = node.fn.backward(node, g)
    if not isinstance(in_grads, tuple):
        in_grads = (in_grads,)
    if len(in_grads) != len(node.inputs):
        raise RuntimeError(
            f"{node.fn.__name__}.backward returned {len(in_grads)} gradients for {len(node.inputs)} inputs"
        )
    return in_grads


_FREED = (
    "trying to backward through the graph a second time: its saved arrays were freed "
    "after the first backward(); call backward(retain_graph=True) the first time"
)


def _accumulate(leaf: Tensor, g) -> None:
    if leaf.grad is None:
        # Copied: ops like add pass their incoming gradient through unchanged, so ``g`` may
        # still be waiting to flow into another node; an optimiser or hook that updates
        # .grad in place must not change it.
        leaf.grad = Tensor(g.copy())
    else:
        leaf.grad = Tensor(leaf.grad.data + g)


# --------------------------------------------------------------------------- observers

# Factories ``observer(order) -> callable(node) or None``, asked at the start of every walk;
# the callable runs once the walk is done with each node (step 5). Data-parallel training
# registers one (distributed/grad_hooks.py) to learn when a parameter's gradient is complete.
_observers: list = []


def add_walk_observer(observer) -> None:
    """Register ``observer(order)`` to be asked at the start of every ``backward``."""
    _observers.append(observer)
