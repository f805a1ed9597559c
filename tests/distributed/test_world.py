"""distributed.init and the local communicator in a process that no MPI launcher started."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from minitransformer import distributed as dist
from minitransformer.distributed import world as world_module

LAUNCHER_VARS = [v for pair in world_module._LAUNCHER_VARS for v in pair]


@pytest.fixture
def lone_process(monkeypatch):
    """No launcher variables, no world yet (restored afterwards)."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(world_module, "_world", None)


def test_a_lone_process_is_a_world_of_one(lone_process):
    assert not dist.launched_by_mpi()
    assert dist.is_main_process() and dist.get_rank() == 0 and dist.get_world_size() == 1
    world = dist.init("cpu")
    assert (world.rank, world.world_size, world.local_rank) == (0, 1, 0)
    assert isinstance(world.comm, dist.LocalCommunicator) and world.is_main
    assert dist.init("cpu") is world and dist.get_world() is world
    assert "mpi4py.MPI" not in sys.modules  # a lone process never starts MPI
    with pytest.raises(RuntimeError, match="already initialised"):
        dist.init("cpu", "mpi")


def test_a_lone_process_works_alone_as_it_is(lone_process):
    world = dist.init("cpu")
    with dist.main_process_alone(world) as main:
        assert main


def test_a_lone_process_runs_main_process_first_once(lone_process):
    calls = []
    assert dist.main_process_first(dist.init("cpu"), lambda: calls.append(1) or "result") == "result"
    assert calls == [1]


def test_backend_and_device_must_match(lone_process):
    with pytest.raises(ValueError, match="does not serve device"):
        dist.init("cpu", "nccl")


def test_under_a_launcher_the_world_needs_init(lone_process, monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    assert dist.launched_by_mpi()
    with pytest.raises(RuntimeError, match="call minitransformer.distributed.init"):
        dist.is_main_process()


def test_local_collectives_leave_buffers_and_check_them():
    comm = dist.LocalCommunicator("cpu")
    x = np.random.default_rng().standard_normal(9).astype(np.float32)
    y = x.copy()
    comm.all_reduce(y)
    comm.all_reduce_async(y, "max").wait()
    comm.broadcast(y)
    comm.barrier()
    np.testing.assert_array_equal(y, x)
    assert comm.all_reduce_scalar(7, "min") == 7 and type(comm.all_reduce_scalar(True)) is bool
    with pytest.raises(ValueError, match="non-contiguous"):
        comm.all_reduce(np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(ValueError, match="unknown reduction 'prod'"):
        comm.all_reduce(x, "prod")
    with pytest.raises(TypeError, match="works on cpu arrays, got a builtins.list"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype complex64 is not supported"):
        comm.all_reduce(np.zeros(3, np.complex64))
    for half in dist.comm.HALF_DTYPES:  # float16, and bfloat16 with ml_dtypes
        comm.all_reduce(np.ones(3, half))
    with pytest.raises(ValueError, match="root 1 is not a rank"):
        comm.broadcast(x, root=1)
