"""Data parallelism: every rank holds the whole model and takes its own batch; before each
optimizer step the ranks combine their gradients, so that their parameters stay identical.

    world = distributed.init(device)
    ddp = DistributedDataParallel(model)              # broadcasts rank 0's parameters
    for src, tgt_in, tgt_out in batches:              # this rank's share of the batch
        loss = F.cross_entropy(model(src, tgt_in), tgt_out, ignore_index=pad, reduction="sum")
        loss.backward()                               # buckets are all-reduced meanwhile
        stats = ddp.reduce_gradients(num_tokens=int((tgt_out != pad).sum()))
        if stats.finite:                              # False on every rank, or on none
            optimizer.step()
        optimizer.zero_grad()

This object does not wrap the model's forward; it owns the gradients' way between ranks.

The gradient contract: backpropagate a SUM over tokens
------------------------------------------------------
The training loss is the mean over target tokens (as in tensor2tensor; the paper does not say
how the loss is normalised), and batches are cut by
token count (section 5.1), so the ranks' shares hold different numbers of tokens n_r. With
G_r = d/dθ (sum of rank r's token losses) and N = sum_r n_r, the gradient of the mean over all
N tokens is

    g = (1 / N) * sum_r G_r

which is not the mean of the ranks' per-token means unless every n_r is equal. Hence:

    each rank backpropagates the SUM of its token losses (equivalently its per-token mean
    times n_r) and calls ``reduce_gradients(n_r)``, which all-reduces the G_r and the n_r and
    divides by N.

Every ``.grad`` then holds g, identical on all ranks and equal (to rounding) to what one process
computes on the union of the batches. For a loss that is not per token, pass ``num_tokens=1``
on every rank: the divisor becomes the world size.

Buckets
-------
One all-reduce per parameter would pay the collective's latency a hundred times a step; one
for the whole model could only start after backward has ended. The gradients are therefore
packed into one flat buffer (per dtype) in the reverse of the parameters' registration order,
roughly the order backward completes them (the last decoder layer first; with tied embeddings
the output matrix is the source embedding, registered first and so placed last, which suits it:
its gradient is complete only once backward has reached the embedding lookups), and the buffer is cut into
buckets of ``bucket_bytes`` (25 MiB by default, as in PyTorch). A bucket boundary may split a
parameter: its first elements end one bucket, the rest begin the next, so every bucket but the
last has the full size.

    flat:     [ p_n | p_{n-1} | ........ | p_1 | p_0 ]       p_i: parameter i's gradient
    buckets:  [     b0     |     b1     |     b2    | b3 ]

Overlap
-------
Each parameter has a post-accumulate-grad hook. When backward has finished a parameter's
gradient, the hook copies it into its place in the flat buffer; when a bucket's last piece has
arrived, its all-reduce starts (on GPUs on NCCL's own stream) while backward goes on with the
earlier layers. Buckets start strictly in the order b0, b1, b2...: collectives must be issued in
the same order on every rank, and the order in which gradients become ready may differ between
ranks (a parameter unused on one rank), so the layout fixes the order, not the timing.
``reduce_gradients`` writes what backward did not produce (zeros for unused parameters), starts
the remaining buckets and waits for all of them. Each ``.grad`` is then a view into the flat
buffer, not a copy.

Agreement between ranks
-----------------------
- A non-finite gradient on any rank makes the sum non-finite on every rank (inf + x = inf,
  inf - inf = NaN). Each rank checks the reduced buffer and the flags are all-reduced too, so
  all ranks skip the step together: ``finite`` is False and every ``.grad`` is cleared.
- Every rank must call ``reduce_gradients`` once per step, so all take the same number of
  steps: agree on it first with ``world.comm.all_reduce_scalar(len(batches), "min")``.
- Gradient accumulation: run all but the last backward of a step inside ``with ddp.no_sync():``
  (the hooks then let gradients accumulate in ``.grad``), then reduce once with the total count
  (``train.accumulated_step`` does).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..tensor import Tensor
from .grad_hooks import register_post_accumulate_grad_hook
from .world import World, get_world

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class StepStats:
    """What ``reduce_gradients`` learned from all ranks about this step."""

    finite: bool  # False: some rank had an inf or NaN gradient; every rank skips the step
    num_tokens: int  # N, the tokens of all ranks together
    loss_sum: float  # sum over ranks of the loss_sum each passed in

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.num_tokens, 1)


@dataclass
class Bucket:
    """A contiguous range [start, stop) of one flat gradient buffer, all-reduced at once."""

    flat: int  # index of the flat buffer (one per dtype)
    start: int
    stop: int
    params: tuple  # indices of the parameters with elements in this bucket
    pending: int = 0  # pieces not yet written in this step


class DistributedDataParallel:
    """Broadcasts parameters from rank 0, then reduces gradients in buckets (module docstring).

    ``params``: an object with a ``parameters()`` method, or an iterable of leaf Tensors; the
    ones that require grad are kept, each once, in order. ``world`` defaults to the one
    ``distributed.init`` made. ``overlap=False`` registers no hooks: all buckets are reduced
    inside ``reduce_gradients``.
    """

    def __init__(self, params, world: World | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.world = world if world is not None else get_world()
        self.comm = self.world.comm
        self.params = _parameter_list(params)
        self._state = _state_list(params, self.params)
        self.device = self.params[0].device
        for i, p in enumerate(self.params):
            if p.device != self.device:
                raise ValueError(f"parameter {i} (shape {p.shape}) is on {p.device}, "
                                 f"parameter 0 on {self.device}: keep the model on one device")
        if self.device != self.comm.device:
            raise ValueError(f"parameters are on {self.device} but the {self.comm.backend_name} "
                             f"communicator works on {self.comm.device}")
        self._build_layout(bucket_bytes)
        self._no_sync = False
        self._start_step()
        self.broadcast_parameters()
        if overlap:
            ref = weakref.ref(self)
            for i, p in enumerate(self.params):
                register_post_accumulate_grad_hook(p, _hook(ref, i))

    # ----------------------------------------------------------------- layout

    def _build_layout(self, bucket_bytes: int) -> None:
        xp = backend.get_array_module(self.device)
        flat_of_dtype: dict = {}
        sizes: list[int] = []
        slots = [None] * len(self.params)  # parameter i -> (flat, offset)
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            f = flat_of_dtype.setdefault(p.dtype, len(flat_of_dtype))
            if f == len(sizes):
                sizes.append(0)
            slots[i] = (f, sizes[f])
            sizes[f] += p.size
        dtypes = list(flat_of_dtype)
        self.flats = [xp.zeros(n, dtype=d) for n, d in zip(sizes, dtypes)]
        self._views = [self.flats[f][o:o + p.size].reshape(p.shape)
                       for (f, o), p in zip(slots, self.params)]

        self.buckets: list[Bucket] = []
        self._buckets_of: list[list[int]] = [[] for _ in self.params]
        for f, (n, d) in enumerate(zip(sizes, dtypes)):
            cap = max(1, bucket_bytes // d.itemsize)  # elements per bucket
            first = len(self.buckets)
            for start in range(0, n, cap):
                self.buckets.append(Bucket(f, start, min(start + cap, n), ()))
            for i, (pf, o) in enumerate(slots):
                n_i = self.params[i].size
                if pf == f and n_i:  # elements o .. o + n_i - 1 fall in these buckets
                    for b in range(first + o // cap, first + (o + n_i - 1) // cap + 1):
                        self._buckets_of[i].append(b)
                        self.buckets[b].params += (i,)

    def _bucket_array(self, b: Bucket):
        return self.flats[b.flat][b.start:b.stop]

    # ----------------------------------------------------------------- per step

    def _start_step(self) -> None:
        self._written = [False] * len(self.params)
        for b in self.buckets:
            b.pending = len(b.params)
        self._handles = []

    @property
    def launched_buckets(self) -> int:
        """How many buckets' all-reduces have started in the current step."""
        return len(self._handles)

    def _grad_ready(self, i: int) -> None:
        if self._no_sync:
            return
        if self._written[i]:
            raise RuntimeError(
                f"parameter {i} (shape {self.params[i].shape}) got a second gradient before "
                f"reduce_gradients(): for gradient accumulation run all but the last backward "
                f"inside ddp.no_sync()"
            )
        self._write(i)
        self._launch_ready()

    def _write(self, i: int) -> None:
        grad, view = self.params[i].grad, self._views[i]
        if grad is None:  # not used in this step's graph
            view[...] = 0
        elif grad.data is not view:
            view[...] = grad.data
        self._written[i] = True
        for b in self._buckets_of[i]:
            self.buckets[b].pending -= 1

    def _launch_ready(self) -> None:
        while len(self._handles) < len(self.buckets):
            b = self.buckets[len(self._handles)]
            if b.pending:
                return
            self._handles.append(self.comm.all_reduce_async(self._bucket_array(b)))

    def reduce_gradients(self, num_tokens, loss_sum=0.0) -> StepStats:
        r"""All-reduce this step's gradients and divide them by the global token count.

        ``num_tokens``: the target tokens $n_r$ this rank's summed loss covers. The gradient
        of the mean over all $N = \sum_r n_r$ tokens is $\frac{1}{N} \sum_r G_r$, with $G_r$ the
        gradient of rank $r$'s summed loss: not the mean of the ranks' per-token means unless
        every $n_r$ is equal.
        ``loss_sum``: this rank's summed loss (a float, or a one-element Tensor, which stays on
        its device), returned summed over ranks for logging. Every rank must call this once
        per step. Returns ``StepStats``; when ``finite`` is False every ``.grad`` is None.
        """
        if self._no_sync:
            raise RuntimeError("reduce_gradients() called inside no_sync()")
        for i, written in enumerate(self._written):
            if not written:
                self._write(i)
        self._launch_ready()
        for h in self._handles:
            h.wait()

        xp = backend.get_array_module(self.device)
        stats = xp.zeros(3, dtype=np.float64)  # tokens, ranks with non-finite grads, loss
        stats[0] = num_tokens
        for flat in self.flats:
            stats[1] += ~xp.isfinite(flat).all()
        stats[2] = loss_sum.data.reshape(()) if isinstance(loss_sum, Tensor) else loss_sum
        self.comm.all_reduce(stats)
        tokens, bad, loss = (float(v) for v in backend.to_device(stats, "cpu"))

        finite = bad == 0
        if finite:
            if tokens > 0:  # no tokens anywhere: the gradients are zero sums, keep them
                for flat in self.flats:
                    flat /= tokens
            for p, view in zip(self.params, self._views):
                p.grad = Tensor(view)
        else:
            for p in self.params:
                p.grad = None
        self._start_step()
        return StepStats(finite, int(round(tokens)), loss)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate ``.grad`` locally (gradient accumulation)."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def broadcast_parameters(self, root: int = 0) -> None:
        """Copy rank ``root``'s parameter values to every rank, in place: the trained ones, and
        for a model (an object with ``parameters()``) also its frozen parameters and buffers,
        which no gradient would keep in step (each rank may have drawn its own).

        Called at construction; call it again after only rank ``root`` loaded a checkpoint.
        """
        for p in self._state:
            buf = p.data if p.data.flags.c_contiguous else p.data.copy()
            self.comm.broadcast(buf, root)
            if buf is not p.data:
                p.data[...] = buf
            p.bump_version()


def _hook(ref, i: int):
    # A weak reference: a discarded DistributedDataParallel must not be kept alive (and fed)
    # by the hooks it left on the parameters.
    def hook(_param):
        ddp = ref()
        if ddp is not None:
            ddp._grad_ready(i)

    return hook


def _state_list(params, trained: list[Tensor]) -> list[Tensor]:
    """``trained``, then a model's other parameters and its buffers, each once."""
    out, seen = list(trained), {id(p) for p in trained}
    if hasattr(params, "parameters"):
        more = list(params.parameters()) + list(getattr(params, "buffers", list)())
        for t in more:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _parameter_list(params) -> list[Tensor]:
    if hasattr(params, "parameters"):
        params = params.parameters()
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a Tensor")
        if not p.is_leaf:
            raise ValueError(f"parameter {i} (shape {p.shape}) is not a leaf tensor")
        if p.requires_grad and id(p) not in seen:  # a shared (tied) weight is reduced once
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError("DistributedDataParallel got no parameters that require grad")
    return out
