"""Communicators: the few collectives that data-parallel training needs, over MPI or NCCL.

Every communicator works in place on one contiguous array per call:

    all_reduce(buf, op)          buf <- op over ranks of buf           ("sum", "max", "min")
    all_reduce_async(buf, op)    the same, started now; ``handle.wait()`` finishes it
    broadcast(buf, root)         buf <- root's buf
    barrier()                    returns once every rank has entered it
    all_reduce_scalar(x, op)     a Python number reduced over ranks, returned

Three backends, chosen by ``distributed.init``; none of them moves a byte itself:

    MPICommunicator    NumPy buffers in host memory, through mpi4py (Iallreduce, Ibcast, Ibarrier).
    NCCLCommunicator   CuPy buffers, one GPU per rank, through ``cupy.cuda.nccl``. Its kernels run
                       on a stream of their own, so an all-reduce overlaps the kernels that
                       backward keeps queueing on the compute stream. Ordering is by CUDA events,
                       never by blocking the host: the NCCL stream first waits for the compute
                       stream (the buffer must hold this step's gradients), and ``wait()`` makes
                       the compute stream wait for the NCCL stream (the optimizer must read the
                       reduced values).
    LocalCommunicator  world size 1: every collective is the identity, so single-process
                       training runs the same code path.

Collectives must be called in the same order on every rank; a rank that skips one hangs the
others (MPI) or deadlocks the GPUs (NCCL). ``DistributedDataParallel`` guarantees that order.
"""

from __future__ import annotations

import time

import numpy as np

from .. import backend

OPS = ("sum", "max", "min")

# 16-bit floats: float16, and bfloat16 where ml_dtypes provides it (backend.bfloat16).
HALF_DTYPES = tuple(np.dtype(d) for d in (np.float16, backend.bfloat16) if d is not None)
# What the host backends reduce (MPI through a float32 copy for the 16-bit ones). A broadcast
# copies bytes and takes any dtype.
HOST_DTYPES = HALF_DTYPES + tuple(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))


class Communicator:
    """What every backend shares: identity, argument checks, and the scalar helper."""

    backend_name = ""
    device = "cpu"
    dtypes: tuple = ()

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    def all_reduce(self, buf, op: str = "sum") -> None:
        """Reduce ``buf`` over all ranks, in place; returns when ``buf`` is safe to read."""
        self.all_reduce_async(buf, op).wait()

    def all_reduce_scalar(self, value, op: str = "sum"):
        """``value`` (a bool, int or float) reduced over ranks, as the same Python type.

        For example ``all_reduce_scalar(len(batches), "min")`` gives every rank the same number
        of steps, and ``all_reduce_scalar(stop, "max")`` stops all ranks when one wants to.
        Integers travel as float64: exact up to 2**53.
        """
        xp = backend.get_array_module(self.device)
        buf = xp.asarray([value], dtype=np.float64)
        self.all_reduce(buf, op)
        return type(value)(buf[0].item())

    def _check(self, buf, op: str | None = "sum") -> None:
        """Device, contiguity, and for a reduction (``op`` not None) the op and dtype."""
        if op is not None and op not in OPS:
            raise ValueError(
                f"{self.backend_name}: unknown reduction {op!r}; expected one of {OPS}")
        if not hasattr(buf, "flags") or backend.device_of(buf) != self.device:
            raise TypeError(
                f"the {self.backend_name} communicator works on {self.device} arrays, got a "
                f"{type(buf).__module__}.{type(buf).__name__}"
            )
        if not buf.flags.c_contiguous:
            raise ValueError(
                f"{self.backend_name}: collectives work in place on contiguous arrays; got a "
                f"non-contiguous view of shape {buf.shape} (pass a copy)"
            )
        if op is not None and buf.dtype not in self.dtypes:
            names = ", ".join(str(np.dtype(d)) for d in self.dtypes)
            raise TypeError(
                f"{self.backend_name}: dtype {buf.dtype} is not supported (use {names})")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(
                f"broadcast root {root} is not a rank of a world of size {self.world_size}")


class _Done:
    """The handle of a collective that had already finished when it was returned."""

    def wait(self) -> None:
        """Nothing to wait for."""


# --------------------------------------------------------------------------- one process


class LocalCommunicator(Communicator):
    """World size 1, no MPI: every collective leaves its buffer as it is."""

    backend_name = "local"
    dtypes = HOST_DTYPES

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(rank=0, world_size=1)
        self.device = backend.check_device(device)

    def all_reduce_async(self, buf, op: str = "sum") -> _Done:
        self._check(buf, op)
        return _Done()

    def broadcast(self, buf, root: int = 0) -> None:
        self._check(buf, op=None)
        self._check_root(root)

    def barrier(self) -> None:
        """A lone process has nobody to wait for."""


# --------------------------------------------------------------------------- MPI


def _wait(request) -> None:
    """``request.Wait()``, polled from Python so that a signal is handled while it waits.

    MPI_Wait busy-polls inside C, where Python cannot run its signal handlers: a rank waiting
    there for a rank that Ctrl-C or SIGTERM took out of the loop would wait forever, never
    clean up, and be killed silently by that rank's abort (distributed.run_main). Polling costs
    what MPI_Wait's own polling costs."""
    done = request.Test()
    while not done:  # back in Python between tests: a pending signal's handler runs here
        done = request.Test()


class _MPIRequest:
    def __init__(self, request, finish=None) -> None:
        self.request = request
        self.finish = finish  # run once the reduction is complete (copies a staged result back)

    def wait(self) -> None:
        _wait(self.request)
        if self.finish is not None:
            self.finish()
            self.finish = None


class MPICommunicator(Communicator):
    """Collectives on NumPy buffers through an mpi4py communicator (usually ``COMM_WORLD``).

    MPI moves host memory; there is no CuPy path here (an MPI built with CUDA support could
    take device pointers, but the PyPI ``mpich`` wheel is not one). float16 and bfloat16 have no
    portable MPI datatype (bfloat16 none at all): they are reduced as a float32 copy, rounded
    once on the way back. A broadcast moves bytes, whatever the dtype.
    """

    backend_name = "mpi"
    dtypes = HOST_DTYPES

    def __init__(self, mpi_comm) -> None:
        from mpi4py import MPI

        super().__init__(rank=mpi_comm.Get_rank(), world_size=mpi_comm.Get_size())
        self.comm = mpi_comm
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._in_place = MPI.IN_PLACE

    def all_reduce_async(self, buf, op: str = "sum") -> _MPIRequest:
        """Start a non-blocking all-reduce (``MPI_Iallreduce``).

        MPICH makes progress on it inside later MPI calls, so on CPUs it overlaps little with
        computation; the point is the same code path as the NCCL backend.
        """
        self._check(buf, op)
        if buf.dtype in HALF_DTYPES:
            wide = buf.astype(np.float32)

            def finish():
                buf[...] = wide

            return _MPIRequest(self.comm.Iallreduce(self._in_place, wide, op=self._ops[op]), finish)
        return _MPIRequest(self.comm.Iallreduce(self._in_place, buf, op=self._ops[op]))

    def broadcast(self, buf, root: int = 0) -> None:
        self._check(buf, op=None)
        self._check_root(root)
        _wait(self.comm.Ibcast(buf.reshape(-1).view(np.uint8), root=root))

    def barrier(self) -> None:
        """Waits without spinning: MPI_Barrier busy-polls, so the ranks that wait while rank 0
        validates would each keep a core at 100% (taking it from rank 0's BLAS threads)."""
        request, pause = self.comm.Ibarrier(), 1e-5
        while not request.Test():
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


# --------------------------------------------------------------------------- NCCL


class _StreamEvent:
    """Handle of an NCCL collective: an event recorded on the NCCL stream after it."""

    def __init__(self, event) -> None:
        self.event = event

    def wait(self) -> None:
        # The compute stream waits on the GPU; the host goes on queueing work.
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.event)


def import_nccl():
    """``cupy.cuda.nccl``, or a RuntimeError that says why it is unusable.

    CuPy's ``cupy.cuda.nccl`` imports even when no NCCL library is found: it then only sets
    ``available = False`` and lacks ``get_unique_id`` and ``NcclCommunicator``."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        nccl, error = None, str(e)
    else:
        error = "CuPy found no NCCL library (cupy.cuda.nccl.available is False)"
    if nccl is None or not getattr(nccl, "available", True):
        raise RuntimeError(
            f"the NCCL backend needs cupy.cuda.nccl, which is unusable: {error}; install NCCL "
            f"for CuPy (pip install nvidia-nccl-cu13, or python -m cupyx.tools.install_library "
            f"--library nccl)"
        )
    return nccl


def _mark(stream):
    """An event recorded on ``stream``, for ordering only (no timestamps: cheaper to record)."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


class NCCLCommunicator(Communicator):
    """Collectives on CuPy buffers through NCCL, one GPU (the current device) per rank.

    ``unique_id`` comes from ``cupy.cuda.nccl.get_unique_id()`` on rank 0, handed to the other
    ranks out of band (``distributed.init`` broadcasts it with MPI). With ``world_size=1`` no
    exchange is needed, which is how a single GPU runs this path end to end.
    """

    backend_name = "nccl"
    device = "cuda"

    def __init__(self, rank: int, world_size: int, unique_id: bytes) -> None:
        import cupy

        nccl = import_nccl()
        super().__init__(rank, world_size)
        self._nccl = nccl
        self.comm = nccl.NcclCommunicator(world_size, unique_id, rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        self._types = {
            np.dtype(np.float16): nccl.NCCL_FLOAT16,
            np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float64): nccl.NCCL_FLOAT64,
            np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64,
        }
        if backend.bfloat16 is not None and hasattr(nccl, "NCCL_BFLOAT16"):  # NCCL >= 2.10
            self._types[backend.bfloat16] = nccl.NCCL_BFLOAT16
        self.dtypes = tuple(self._types)

    def _after_compute(self) -> None:
        import cupy

        self.stream.wait_event(_mark(cupy.cuda.get_current_stream()))

    def all_reduce_async(self, buf, op: str = "sum") -> _StreamEvent:
        self._check(buf, op)
        self._after_compute()
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype],
                            self._ops[op], self.stream.ptr)
        return _StreamEvent(_mark(self.stream))

    def broadcast(self, buf, root: int = 0) -> None:
        self._check(buf, op=None)
        self._check_root(root)
        self._after_compute()
        self.comm.bcast(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, root, self.stream.ptr)
        _StreamEvent(_mark(self.stream)).wait()

    def barrier(self) -> None:
        # NCCL has no barrier: an all-reduce of one element that the host waits for is one.
        import cupy

        self.all_reduce(cupy.zeros(1, dtype=np.float32))
        cupy.cuda.get_current_stream().synchronize()
