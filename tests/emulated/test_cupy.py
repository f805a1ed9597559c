"""The emulated device's own checks can fail: CuPy's strictness about host arrays, the
stream-order check (on its own, and planted into the NCCL communicator), the pool's figures.

Runs where "cuda" is the emulated device (MT_EMULATE_CUDA=1, which tests/conftest.py sets
without a GPU); skipped on a real GPU, whose CuPy is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import backend
from minitransformer import distributed as dist

pytestmark = pytest.mark.skipif(not backend.is_emulated("cuda"),
                                reason="the emulated device is off (a GPU, or MT_EMULATE_CUDA=0)")


@pytest.fixture
def cp():
    return backend.get_array_module("cuda")


@pytest.fixture
def emulation():
    from minitransformer.emulated import cupy as emulated_cupy

    return emulated_cupy


def test_host_arrays_are_refused_as_on_a_gpu(cp):
    x = cp.asarray(np.arange(6, dtype=np.float32))
    host = np.ones(6, np.float32)
    for mix in (lambda: x + host, lambda: host + x, lambda: cp.maximum(x, host),
                lambda: cp.concatenate([x, host])):
        with pytest.raises(TypeError, match="Unsupported type"):
            mix()
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(x)
    # What CuPy allows: Python and NumPy scalars, host indices, and explicit moves.
    assert float((x * np.float32(2) + 1).sum()) == 36.0
    np.testing.assert_array_equal(x[np.array([5, 0])].get(), [5, 0])
    np.testing.assert_array_equal(cp.asnumpy(cp.asarray(host)), host)
    # A tensor op that mixes the devices is the library's own error, which names both.
    with pytest.raises(RuntimeError, match="expected all tensors on one device"):
        mt.tensor(host, device="cuda") + mt.tensor(host)


def test_arrays_behave_like_cupys(cp):
    x = cp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    total = x.sum()
    assert isinstance(total, cp.ndarray) and total.shape == ()  # CuPy reduces to 0-d arrays
    assert backend.device_of(x) == "cuda" and x.device.id == 0
    assert x.data.ptr % 16 == 0  # a fresh allocation: an address the kernels take
    view = x[1:]
    assert view.data.ptr == x.data.ptr + 4 * 4
    assert isinstance(np.exp(x), cp.ndarray)  # NumPy's functions dispatch to the device
    # A view's base is the owning array itself, never an intermediate view, and an op that
    # gives its input back gives the same object: autograd tells a tensor's views by them.
    assert view.base is x and view.T[1:].base is x and x.base is None
    assert x.astype(np.float32, copy=False) is x and x.astype(np.float64).base is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_bytes_a_view_spans_are_numpys_byte_bounds(emulation, data):
    """The stream-order check's extent of an array (_extent, made cheap for owners) against
    NumPy's byte_bounds, over views: slices with steps of either sign, transposes, broadcasts
    (stride 0), empty ones."""
    from numpy.lib.array_utils import byte_bounds

    shape = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), label="shape")
    root = np.zeros(shape, np.float32)
    view = root
    if data.draw(st.booleans(), label="sliced"):
        view = view[tuple(slice(data.draw(st.integers(0, n)), data.draw(st.integers(0, n)),
                                data.draw(st.sampled_from([1, 2, -1, -3]))) for n in shape)]
    if data.draw(st.booleans(), label="transposed"):
        view = view.T
    if data.draw(st.booleans(), label="broadcast"):
        view = np.broadcast_to(view[..., :1], view.shape[:-1] + (3,)) if view.shape[-1] else view
    record, _ = emulation._allocation(view)
    low, high = byte_bounds(view)
    assert emulation._extent(view, record) == (low - root.ctypes.data, high - root.ctypes.data)


def test_a_read_on_another_stream_must_wait_for_the_write(cp, emulation):
    a = cp.zeros(1000, dtype=np.float32)  # written (zeroed) on the current, null stream
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        with pytest.raises(emulation.StreamOrderError, match="has not waited"):
            a[:500] += 1  # `other` could run before the zeroing
    other.wait_event(cp.cuda.get_current_stream().record())
    with other:
        a[:500] += 1  # written on `other`
    with pytest.raises(emulation.StreamOrderError, match="has not waited"):
        float(a.sum())  # the current (null) stream reads it with no event in between
    a[500:] += 1  # the other half was never written on `other`: no conflict
    with other:
        a[:500] += 1
    cp.cuda.get_current_stream().wait_event(other.record())
    assert float(a.sum()) == 1500.0
    with other:
        a[:10] = 5
    other.synchronize()  # a host synchronisation orders everything before it, too
    assert float(a[:10].sum()) == 50.0


def test_a_write_on_another_stream_must_wait_for_the_reads(cp, emulation):
    """A KV cache reused while a copy of it is still in flight on another stream: on a GPU the
    copy could read the new values."""
    cache = cp.ones((2, 8), dtype=np.float32)
    copier = cp.cuda.Stream(non_blocking=True)
    copier.wait_event(cp.cuda.get_current_stream().record())
    with copier:
        snapshot = cache[0].copy()  # reads the first row of `cache` on the copier stream
    with pytest.raises(emulation.StreamOrderError, match="has not waited for that read"):
        cache[0] = 0  # the null stream overwrites it without waiting for the copy
    cache[1] = 2  # the row the copy did not read
    cp.cuda.get_current_stream().wait_event(copier.record())
    cache[0] = 3  # after the copy
    cp.cuda.get_current_stream().wait_event(copier.record())
    assert float(snapshot.sum()) == 8.0 and float(cache.sum()) == 40.0


def test_a_bucket_refilled_while_nccl_sends_it_is_caught(cp, emulation):
    """An out-of-place all-reduce only reads its send buffer: backward writing the next step's
    gradients into it must wait for the all-reduce."""
    from minitransformer.distributed.comm import import_nccl

    nccl = import_nccl()
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    bucket, reduced = cp.ones(16, dtype=np.float32), cp.zeros(16, dtype=np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    comm.allReduce(bucket.data.ptr, reduced.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    with pytest.raises(emulation.StreamOrderError, match="has not waited for that read"):
        bucket[...] = 2  # the compute (null) stream refills the bucket mid-send
    cp.cuda.get_current_stream().wait_event(side.record())
    bucket[...] = 2
    assert float(reduced.sum()) == 16.0


def test_events_order_transitively(cp, emulation):
    a = cp.ones(8, dtype=np.float32)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    s1.wait_event(cp.cuda.get_current_stream().record())  # after `a` was written
    with s1:
        a *= 2
    s2.wait_event(s1.record())
    done = s2.record()  # s2 has seen s1's write
    cp.cuda.get_current_stream().wait_event(done)
    assert float(a.sum()) == 16.0


@pytest.fixture
def nccl_world():
    from minitransformer.distributed.comm import import_nccl

    comm = dist.NCCLCommunicator(0, 1, import_nccl().get_unique_id())
    return dist.World(0, 1, 0, "cuda", comm)


def mlp_backward_with_ddp(world):
    rng = np.random.default_rng(0)
    params = [mt.tensor(rng.standard_normal(s).astype(np.float32), device="cuda", requires_grad=True)
              for s in [(6, 9), (9,), (9, 4), (4,)]]
    ddp = dist.DistributedDataParallel(params, world, bucket_bytes=44)
    x = mt.tensor(rng.standard_normal((13, 6)).astype(np.float32), device="cuda")
    y = mt.tensor(rng.integers(0, 4, 13), device="cuda")
    w1, b1, w2, b2 = params
    F.cross_entropy(F.linear(F.linear(x, w1, b1).relu(), w2, b2), y, reduction="sum").backward()
    return ddp.reduce_gradients(13)


def test_ddp_over_nccl_keeps_the_stream_order(nccl_world):
    assert mlp_backward_with_ddp(nccl_world).finite


@pytest.mark.parametrize("planted", ["no wait before the all-reduce", "no wait after it"])
def test_a_missing_event_wait_in_the_nccl_communicator_is_caught(nccl_world, emulation, monkeypatch,
                                                                 planted):
    """The bugs the stream-order check exists for: on a GPU, NCCL would read a bucket before
    backward finished writing it, or the optimiser would read it mid-reduction."""
    from minitransformer.distributed import comm as comm_module

    if planted == "no wait before the all-reduce":
        monkeypatch.setattr(comm_module.NCCLCommunicator, "_after_compute", lambda self: None)
    else:
        monkeypatch.setattr(comm_module._StreamEvent, "wait", lambda self: None)
    with pytest.raises(emulation.StreamOrderError):
        mlp_backward_with_ddp(nccl_world)


def test_host_arrays_are_not_assigned_into_device_arrays(cp):
    x = cp.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        x[...] = np.ones(4, np.float32)  # CuPy refuses it too; cp.asarray it first
    x[...] = 1.0
    x[1:3] = cp.asarray(np.array([5.0, 6.0], np.float32))
    np.testing.assert_array_equal(x.get(), [1, 5, 6, 1])


def test_memory_pool_figures(cp):
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.used_bytes()
    a = cp.empty(1 << 20, dtype=np.float32)
    assert pool.used_bytes() - base == 4 << 20
    del a
    assert pool.used_bytes() == base
    assert pool.total_bytes() - base >= 4 << 20  # the pool keeps the block until freed
    pool.free_all_blocks()
    assert pool.total_bytes() == pool.used_bytes()


# A fresh process: configure() must come before anything reads the device's attributes.
PLAY_ANOTHER_GPU = """
from minitransformer import backend
from minitransformer.kernels import launch
from minitransformer.emulated import cupy as emulated_cupy

cp = backend.get_array_module("cuda")
previous = emulated_cupy.configure(max_shared_memory_per_block_optin=101376)
assert launch.shared_memory_limit() == 101376, launch.shared_memory_limit()
assert previous["max_shared_memory_per_block_optin"] == 232448
emulated_cupy.configure(max_shared_memory_per_block_optin=101376)  # no change: allowed
try:
    emulated_cupy.configure(**previous)
except RuntimeError as e:
    print(e)
assert launch.shared_memory_limit() == 101376
assert "emulated" in cp.cuda.runtime.getDeviceProperties(0)["name"].decode().lower()
"""


def test_device_attributes_play_another_gpu_until_they_are_read():
    env = dict(os.environ, MT_EMULATE_CUDA="1", PYTHONPATH=str(Path(mt.__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", PLAY_ANOTHER_GPU], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("configure(max_shared_memory_per_block_optin=232448): the device's attributes were "
            "already read in this process") in result.stdout


def test_kernel_launches_are_ordered_too(cp, emulation):
    """The kernels take raw addresses: their launches are still uses of the arrays behind them."""
    from minitransformer import kernels

    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    w = cp.ones(64, dtype=np.float32)
    other = cp.cuda.Stream(non_blocking=True)
    other.wait_event(cp.cuda.get_current_stream().record())
    with other:
        w *= 2  # written on `other`
    with pytest.raises(emulation.StreamOrderError):
        kernels.layernorm_forward(x, w)  # read on the null stream, which has not waited
    cp.cuda.get_current_stream().wait_event(other.record())
    kernels.layernorm_forward(x, w)
    logits = cp.asarray(rng.standard_normal((3, 9)).astype(np.float32))
    kernels.cross_entropy_forward(logits, cp.asarray(np.array([1, 2, 3])), 0.1, grad="inplace")
    with other:  # the kernel wrote the logits on the null stream
        with pytest.raises(emulation.StreamOrderError):
            float(logits.sum())
