"""Post-accumulate gradient hooks: ``hook(leaf)`` runs as soon as ``leaf.grad`` is complete
in a backward pass, while the walk goes on through the rest of the graph.

Data-parallel training (ddp.py) registers one on every parameter, to start all-reducing a
bucket of gradients while backward is still busy with the layers below it (PyTorch calls
these ``register_post_accumulate_grad_hook``).

When is a leaf's gradient complete? Once the walk has passed every context that uses the
leaf: each adds one term to ``.grad``. So, at the start of a walk, count those uses in the
walk's order, and count down as the walk finishes each context; at zero, run the hooks. The
walk knows nothing of this: it calls ``autograd``'s observer after each context.
"""

from __future__ import annotations

import weakref

from .. import autograd
from ..tensor import Tensor

_hooks: dict[int, tuple[weakref.ref, list]] = {}  # id(leaf) -> (weak reference, hooks)


def register_post_accumulate_grad_hook(leaf: Tensor, hook) -> None:
    """Call ``hook(leaf)`` once ``leaf.grad`` is complete in each backward pass (PyTorch's
    ``Tensor.register_post_accumulate_grad_hook``). The registry forgets a leaf when the leaf is
    collected, so a hook should use the tensor it is given, not one it closes over: that
    reference would keep the leaf, and its hooks, alive for good (DDP's hooks hold weak ones)."""
    if leaf._ctx is not None:
        raise RuntimeError("post-accumulate hooks can only be registered on leaf tensors, "
                           f"not on the output of {leaf._ctx.fn.__name__}")
    key = id(leaf)
    if key not in _hooks:
        # Keyed by id, not by the tensor (whose == is elementwise); the entry goes with the leaf.
        _hooks[key] = (weakref.ref(leaf, lambda _, hooks=_hooks: hooks.pop(key, None)), [])
    _hooks[key][1].append(hook)


def _countdown(order: list) -> object:
    """The walk observer: for this walk's ``order``, a callable run after each context."""
    if not _hooks:
        return None
    remaining: dict[int, int] = {}  # id(hooked leaf) -> contexts still to pass that use it
    for node in order:
        for t in node.inputs:
            if t is not None and id(t) in _hooks:
                remaining[id(t)] = remaining.get(id(t), 0) + 1
    if not remaining:
        return None

    def node_done(node) -> None:
        for t in node.inputs:
            if t is not None and id(t) in remaining:
                remaining[id(t)] -= 1
                if remaining[id(t)] == 0:
                    del remaining[id(t)]
                    for hook in _hooks[id(t)][1]:
                        hook(t)

    return node_done


autograd.add_walk_observer(_countdown)
