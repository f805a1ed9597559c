"""The NCCL communicator and DistributedDataParallel on one GPU (world size 1).

NCCL refuses two ranks on one GPU, so a one-GPU machine checks the NCCL path end to end as a
one-rank world; the values then equal a CPU run's. Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import distributed as dist
from minitransformer.backend import has_cuda
from minitransformer.distributed.comm import import_nccl

pytestmark = pytest.mark.skipif(not has_cuda(), reason="needs CuPy and a CUDA GPU")


def nccl_or_skip():
    try:
        return import_nccl()
    except RuntimeError as e:  # cupy.cuda.nccl imports even without NCCL; then it is unusable
        pytest.skip(str(e))


@pytest.fixture
def nccl_comm():
    return dist.NCCLCommunicator(0, 1, nccl_or_skip().get_unique_id())


def test_nccl_collectives_on_one_rank(nccl_comm):
    import cupy

    for dtype in (np.float16, np.float32, np.float64, np.int64):
        x = cupy.asarray(np.random.default_rng().standard_normal(1001) * 100).astype(dtype)
        y = x.copy()
        nccl_comm.all_reduce(y)
        nccl_comm.all_reduce_async(y, "max").wait()
        nccl_comm.broadcast(y, root=0)
        cupy.testing.assert_array_equal(y, x)
    nccl_comm.barrier()
    assert nccl_comm.all_reduce_scalar(5, "max") == 5
    with pytest.raises(TypeError, match="works on cuda arrays"):
        nccl_comm.all_reduce(np.zeros(3, np.float32))


def mlp_grads(device, comm, bucket_bytes, seed):
    rng = np.random.default_rng(seed)
    params = [mt.tensor(rng.standard_normal(s).astype(np.float32), device=device,
                        requires_grad=True) for s in [(6, 9), (9,), (9, 4), (4,)]]
    x = mt.tensor(rng.standard_normal((13, 6)).astype(np.float32), device=device)
    y = mt.tensor(rng.integers(0, 4, 13), device=device)
    world = dist.World(0, 1, 0, device, comm)
    ddp = dist.DistributedDataParallel(params, world, bucket_bytes=bucket_bytes)
    w1, b1, w2, b2 = params
    loss = F.cross_entropy(F.linear(F.linear(x, w1, b1).relu(), w2, b2), y, reduction="sum")
    loss.backward()
    stats = ddp.reduce_gradients(13, loss)
    assert stats.finite and stats.num_tokens == 13
    return [p.grad.numpy() for p in params]


def test_ddp_over_nccl_matches_the_cpu(nccl_comm):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    gpu = mlp_grads("cuda", nccl_comm, bucket_bytes=44, seed=seed)  # 11-float buckets
    cpu = mlp_grads("cpu", dist.LocalCommunicator("cpu"), bucket_bytes=44, seed=seed)
    # float32 on both sides, but the fused cross-entropy (exp2 of z log2 e) and cuBLAS round
    # differently from the CPU's composite ops: entries that cancel to ~0 differ by ~1e-6.
    for g, c in zip(gpu, cpu):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-5)


def test_init_on_cuda_alone_needs_nccl_only_when_asked(monkeypatch):
    from minitransformer.distributed import world as world_module

    nccl_or_skip()
    for var in [v for pair in world_module._LAUNCHER_VARS for v in pair]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(world_module, "_world", None)
    world = dist.init("cuda")  # one GPU, nothing to exchange
    assert isinstance(world.comm, dist.LocalCommunicator) and world.comm.device == "cuda"
    monkeypatch.setattr(world_module, "_world", None)
    world = dist.init("cuda", "nccl")
    assert isinstance(world.comm, dist.NCCLCommunicator) and world.world_size == 1
