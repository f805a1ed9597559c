"""``cupy.cuda.nccl`` for the emulated device: NCCL's calls carried out over MPI.

Each rank is one process with its own emulated GPU (mpiexec starts them). The calls take what
NCCL takes (raw device addresses, element counts, NCCL's type and operation codes, a stream
handle), find the emulated arrays behind the addresses, check that the stream may use them
(see cupy.py's stream-order check), and move the data with MPI. So what
``NCCLCommunicator`` does is exercised for real: the unique-id exchange (ranks given different
ids fail, where NCCL would hang), the address and count arithmetic, the type codes, and the
stream and event ordering around each collective. A world of one rank needs no MPI.

Sums of 16-bit floats are taken in float32 and rounded once; NCCL adds in the type itself,
rank by rank in an order of its own. For two ranks that rounds the same; for more, NCCL's sum
may differ from this one by up to one rounding per rank, so the tests of three and eight ranks
hold both to the bound (n - 1) eps sum|x| and not to each other's bits.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from . import cupy as _cupy

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
available = True


def _dtypes() -> dict[int, np.dtype]:
    types_ = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
              NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16,
              NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
    if importlib.util.find_spec("ml_dtypes") is not None:  # bfloat16, as for the package itself
        import ml_dtypes

        types_[NCCL_BFLOAT16] = ml_dtypes.bfloat16
    return {code: np.dtype(t) for code, t in types_.items()}


class NcclError(RuntimeError):
    """What an NCCL call returned instead of ncclSuccess (its message names the code)."""


def get_unique_id() -> bytes:
    """128 random bytes, as ``ncclGetUniqueId`` gives (CuPy 14 returns bytes)."""
    return os.urandom(128)


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:
        self._dtypes = _dtypes()
        self._ndev, self._rank = int(ndev), int(rank)
        self._mpi = None
        if self._ndev == 1:
            if self._rank != 0:
                raise NcclError(f"ncclInvalidArgument: rank {rank} in a communicator of 1")
            return
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if world.Get_size() != self._ndev or world.Get_rank() != self._rank:
            raise NcclError(f"ncclInvalidUsage: NcclCommunicator({ndev}, ..., {rank}) in MPI rank "
                            f"{world.Get_rank()} of {world.Get_size()} (the emulation maps NCCL "
                            f"ranks onto MPI's one to one)")
        self._mpi = world.Dup()  # collective, as ncclCommInitRank is
        ids = self._mpi.allgather(bytes(commId))
        if len(set(ids)) != 1:
            raise NcclError("ncclInvalidUsage: the ranks were given different unique ids (NCCL "
                            "would hang here): rank 0's id must reach every rank")
        self._MPI = MPI

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def _buffers(self, send: int, recv: int, count: int, datatype: int, stream: int):
        """The NumPy views behind NCCL's arguments, read and written on ``stream``."""
        if datatype not in self._dtypes:
            raise NcclError(f"ncclInvalidArgument: data type code {datatype}")
        dtype, stream = self._dtypes[datatype], _cupy.stream_from_ptr(stream)
        source = _cupy.device_buffer(send, count, dtype, stream, write=recv == send)
        target = source if recv == send else _cupy.device_buffer(recv, count, dtype, stream, write=True)
        return source, target

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        source, target = self._buffers(sendbuf, recvbuf, count, datatype, stream)
        if self._mpi is None:
            target[...] = source
            return
        mpi_op = {NCCL_SUM: self._MPI.SUM, NCCL_PROD: self._MPI.PROD, NCCL_MAX: self._MPI.MAX,
                  NCCL_MIN: self._MPI.MIN}[op]
        wide = source.astype(np.float32) if source.dtype.itemsize == 2 and source.dtype.kind != "i" else source.copy()
        result = np.empty_like(wide)
        self._mpi.Allreduce(wide, result, op=mpi_op)
        target[...] = result.astype(target.dtype)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        data, _ = self._buffers(buff, buff, count, datatype, stream)
        if self._mpi is not None:
            self._mpi.Bcast(data.view(np.uint8), root=root)

    def destroy(self) -> None:
        if self._mpi is not None:
            self._mpi.Free()
            self._mpi = None

    abort = destroy
