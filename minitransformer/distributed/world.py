"""Who this process is: its rank, the world size, and its GPU, read from the MPI launcher.

    mpiexec -n 8 python examples/train_wmt.py --device cuda     8 ranks, one GPU each
    mpiexec -n 2 python examples/train_wmt.py --device cpu      2 ranks on CPUs, half the cores each
    python examples/train_wmt.py --device cpu                    1 rank, no MPI needed

Every copy of the program calls ``init(device)`` once, before it builds the model:

1. Was this process started by an MPI launcher? ``mpiexec`` (MPICH's hydra, Intel MPI, Slurm's
   PMI) sets ``PMI_SIZE``, Open MPI sets ``OMPI_COMM_WORLD_SIZE``, MVAPICH
   ``MV2_COMM_WORLD_SIZE``. If none is set, the process is alone: world size 1, no mpi4py
   import at all, and a ``LocalCommunicator`` whose collectives do nothing.
2. Otherwise mpi4py initialises MPI; rank and world size come from ``COMM_WORLD``. The local
   rank (this process's index among the ranks on its node) comes from splitting ``COMM_WORLD``
   by shared memory, which works for any launcher and any number of nodes.
3. On "cuda", local rank r takes GPU r (``cupy.cuda.Device(r).use()``); rank 0 creates the NCCL
   unique id and MPI broadcasts it, then every rank joins the NCCL communicator. On "cpu" the
   communicator is MPI's.
4. An uncaught exception on any rank prints its traceback and calls ``MPI_Abort``, which ends
   every rank with a non-zero status: the other ranks would otherwise wait forever in their next
   collective for a rank that is gone. ``SystemExit`` (``sys.exit``, argparse) never reaches
   that hook: only a ``main`` run under ``run_main(main)`` ends every rank on one.

Only rank 0 should log, evaluate and write checkpoints: ``is_main_process()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass

from .. import backend, cli
from .comm import Communicator, LocalCommunicator, MPICommunicator, NCCLCommunicator, import_nccl

# (rank, size) variables that MPI launchers put in each rank's environment.
_LAUNCHER_VARS = (
    ("PMI_RANK", "PMI_SIZE"),  # MPICH (hydra), Intel MPI, Slurm with PMI-1/2
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),  # MVAPICH
)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks, and the communicator that joins them."""

    rank: int
    world_size: int
    local_rank: int
    device: str
    comm: Communicator

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_world: World | None = None
log = logging.getLogger(__name__)

# Variables that cap the threads of NumPy's BLAS (read when NumPy is imported).
_BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (see the module docstring)."""
    return any(size in os.environ for _, size in _LAUNCHER_VARS)


def init(device: str = "cpu", backend_name: str | None = None) -> World:
    """Join the other ranks (if any) and return this process's ``World``.

    ``backend_name`` is "nccl" (default for "cuda" under a launcher), "mpi" (default for "cpu"
    under a launcher) or "local" (default for a lone process: world size 1, nothing to
    exchange, so a single GPU needs no NCCL). ``init("cuda", "nccl")`` in a lone process builds
    a one-rank NCCL communicator, which is how one GPU exercises the NCCL path. Calling ``init``
    again with the same arguments returns the same world.
    """
    global _world
    backend.check_device(device)
    mpi = launched_by_mpi()
    if backend_name is None:
        backend_name = ("nccl" if device == "cuda" else "mpi") if mpi else "local"
    if _world is not None:
        if (_world.device, _world.comm.backend_name) != (device, backend_name):
            raise RuntimeError(
                f"distributed.init({device!r}, {backend_name!r}): already initialised for "
                f"device {_world.device!r} with backend {_world.comm.backend_name!r}"
            )
        return _world
    if (backend_name, device) not in (("nccl", "cuda"), ("mpi", "cpu"), ("local", "cpu"),
                                      ("local", "cuda")):
        raise ValueError(
            f"backend {backend_name!r} does not serve device {device!r}: use 'nccl' for cuda, "
            f"'mpi' or 'local' for cpu"
        )

    # A lone process asked for "mpi" joins MPI as a one-rank world (an MPI singleton).
    mpi_comm = _mpi_world() if mpi or backend_name == "mpi" else None
    rank, world_size, local_rank, local_size = 0, 1, 0, 1
    if mpi_comm is not None:
        rank, world_size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        local = mpi_comm.Split_type(_mpi().COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        local.Free()
        if world_size > 1:
            _abort_all_ranks_on_uncaught_exception(rank, world_size)
    if backend_name == "local" and world_size > 1:
        raise ValueError(f"backend 'local' serves one process, but mpiexec started {world_size}")

    if device == "cpu" and local_size > 1:
        _share_the_cores(local_rank, local_size)
    if device == "cuda":
        _use_gpu(local_rank, local_size)
    if backend_name == "nccl":
        unique_id = import_nccl().get_unique_id() if rank == 0 else None  # bytes in CuPy >= 14
        if mpi_comm is not None:
            unique_id = mpi_comm.bcast(unique_id, root=0)
        comm = NCCLCommunicator(rank, world_size, unique_id)
    elif backend_name == "mpi":
        comm = MPICommunicator(mpi_comm)
    else:
        comm = LocalCommunicator(device)
    _world = World(rank, world_size, local_rank, device, comm)
    return _world


def run_main(main, *args, **kwargs):
    """``main(*args, **kwargs)``, under which a ``SystemExit`` with a non-zero status on one rank
    ends every rank, as an uncaught exception does.

    ``sys.excepthook`` never sees ``SystemExit`` (``sys.exit("message")``, argparse errors): the
    rank would finalise MPI and wait there, while the others wait in their next collective for
    it, forever. Wrap a program's entry point: ``distributed.run_main(main)``.
    """
    try:
        return main(*args, **kwargs)
    except SystemExit as e:
        world = _world
        if world is not None and world.world_size > 1 and e.code not in (None, 0):
            status = e.code if isinstance(e.code, int) else 1
            if status == cli.INTERRUPTED or status - 128 in cli.TERMINATING:
                # Ctrl-C, SIGTERM or SIGHUP reached every rank: rank 0 says how to continue and
                # aborts first; the others wait for it (a busy rank 0 may still be saving its
                # checkpoint), so that none cuts its cleanup short. Its abort ends their wait.
                time.sleep(0.5 if world.is_main else 10.0)
            else:
                why = "" if isinstance(e.code, int) else f": {e.code}"
                sys.stderr.write(f"[rank {world.rank}/{world.world_size}] exiting with status "
                                 f"{status}, aborting all ranks{why}\n")
                time.sleep(0.5)  # as in the excepthook: let mpiexec forward the message
            sys.stderr.flush()
            sys.stdout.flush()
            _mpi().COMM_WORLD.Abort(status)
        raise


def get_world() -> World:
    """The world ``init`` returned; a lone-process world on "cpu" if ``init`` was not called
    and no MPI launcher started this process."""
    if _world is not None:
        return _world
    if launched_by_mpi():
        raise RuntimeError(
            "this process was started by an MPI launcher: call "
            "minitransformer.distributed.init(device) before asking for the world"
        )
    return World(0, 1, 0, "cpu", LocalCommunicator("cpu"))


def get_rank() -> int:
    return get_world().rank


def get_world_size() -> int:
    return get_world().world_size


def is_main_process() -> bool:
    """True on rank 0, the one rank that logs, evaluates and writes checkpoints."""
    return get_world().is_main


# --------------------------------------------------------------------------- helpers


def _share_the_cores(local_rank: int, local_size: int) -> None:
    """Give this rank an equal share of the node's cores for NumPy's BLAS (threadpoolctl sets
    it at run time). Each rank's BLAS would otherwise start a thread per core and the ranks
    would slow each other down (3x measured with 2 ranks on 2 cores). A thread count the user
    set (OMP_NUM_THREADS and kin) wins."""
    global _shared_cores
    if any(v in os.environ for v in _BLAS_THREAD_VARS):
        return
    share = max(1, backend.cpu_cores() // local_size)
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        threadpool_info = None
    if threadpool_info is None or not any(i["user_api"] == "blas" for i in threadpool_info()):
        if local_rank == 0:  # no threadpoolctl, or one too old to know NumPy's BLAS
            log.warning("%d ranks share this node's %d CPU cores, and threadpoolctl cannot give each "
                        "its share: pip install 'minitransformer[mpi]', or set each rank's "
                        "OMP_NUM_THREADS (mpiexec -genv OMP_NUM_THREADS %d ...)", local_size, backend.cpu_cores(), share)
        return
    threadpool_limits(share, user_api="blas")
    _shared_cores = True


_shared_cores = False  # True once _share_the_cores has cut this rank's BLAS threads


@contextlib.contextmanager
def main_process_alone(world: World):
    """Rank 0 works alone inside: ``with main_process_alone(world) as main: if main: ...``.

    For what only rank 0 does while the others wait (validation, checkpoints, the final
    test): on CPUs its BLAS takes every core of the node again (``init`` gave it a share), and
    the other ranks wait in a barrier that does not spin, leaving the cores to it."""
    try:
        if world.is_main and world.world_size > 1 and _shared_cores:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(backend.cpu_cores(), user_api="blas"):
                yield True
        else:
            yield world.is_main
    finally:
        world.comm.barrier()


def main_process_first(world: World, fn):
    """``fn()`` on every rank, rank 0 first and alone (with every core, as above), then the
    others: for work whose result rank 0 leaves on disk for them, such as a trained vocabulary."""
    with main_process_alone(world) as main:
        if main:
            return fn()
    return fn()


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            "this process was started by an MPI launcher, but mpi4py is not installed: "
            "pip install 'minitransformer[mpi]' (or run without mpiexec for one process)"
        ) from e
    return MPI


def _mpi_world():
    return _mpi().COMM_WORLD


def _use_gpu(local_rank: int, local_size: int) -> None:
    """Make GPU ``local_rank`` this process's current device.

    A launcher that already gave each rank its own GPU (CUDA_VISIBLE_DEVICES set per rank)
    leaves one visible device, which every rank then uses as device 0.
    """
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count >= local_size:
        cupy.cuda.Device(local_rank).use()
    elif count == 1:
        cupy.cuda.Device(0).use()
    else:
        raise RuntimeError(
            f"{local_size} ranks on this node but {count} visible GPUs: NCCL needs one GPU per "
            f"rank (start at most {count} ranks per node)"
        )


def _abort_all_ranks_on_uncaught_exception(rank: int, world_size: int) -> None:
    """Install a ``sys.excepthook`` that prints the traceback and aborts the whole job."""
    MPI = _mpi()

    def hook(exc_type, exc, tb):
        # One write, then a moment for mpiexec to forward it: Abort tears down the launcher's
        # output forwarding too, and a traceback written piecemeal was seen cut off.
        sys.stderr.write(f"[rank {rank}/{world_size}] uncaught exception, aborting all ranks:\n"
                         + "".join(traceback.format_exception(exc_type, exc, tb)))
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
