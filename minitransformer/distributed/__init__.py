"""Data-parallel training over MPI-launched ranks: NCCL on GPUs, MPI on CPUs.

    world.py   init(device): rank, world size, local rank -> GPU (on CPUs, a share of the
               node's cores for each rank's BLAS), from the MPI launcher; is_main_process();
               main_process_alone(world), for what rank 0 does while the others wait, and
               main_process_first(world, fn), for what rank 0 caches for them; every
               rank aborts when one raises (a SystemExit only under run_main)
    comm.py    communicators: all_reduce (sync and async), broadcast, barrier, scalar reduce;
               NCCLCommunicator, MPICommunicator, LocalCommunicator (one process)
    grad_hooks.py  register_post_accumulate_grad_hook: a hook run once a leaf's gradient is
               complete in backward (what lets DDP start a bucket's all-reduce early)
    ddp.py     DistributedDataParallel: parameter broadcast, bucketed gradient all-reduce that
               overlaps backward, averaging by the global token count, agreed step skipping

A program written against this package runs unchanged as one process (``python train.py``)
and as N ranks (``mpiexec -n N python train.py``). MPI (the ``[mpi]`` extra: mpi4py, the
``mpich`` wheel, and threadpoolctl for the CPU cores' shares) is needed only for the latter.
"""

from .comm import Communicator, LocalCommunicator, MPICommunicator, NCCLCommunicator
from .grad_hooks import register_post_accumulate_grad_hook
from .ddp import DEFAULT_BUCKET_BYTES, Bucket, DistributedDataParallel, StepStats
from .world import (
    World,
    get_rank,
    get_world,
    get_world_size,
    init,
    is_main_process,
    launched_by_mpi,
    main_process_alone,
    main_process_first,
    run_main,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "Communicator", "DistributedDataParallel",
    "LocalCommunicator", "MPICommunicator", "NCCLCommunicator", "StepStats", "World",
    "get_rank", "get_world", "get_world_size", "init", "is_main_process", "launched_by_mpi",
    "main_process_alone", "main_process_first", "register_post_accumulate_grad_hook", "run_main",
]
