"""DistributedDataParallel in one process: bucket layout, hooks, averaging, skipping, errors.

World size 1 through a communicator that records which slices of the flat gradient buffer it
was asked to reduce; the two-rank behaviour is in test_mpi.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
from minitransformer import distributed as dist
from minitransformer.distributed.grad_hooks import register_post_accumulate_grad_hook


class RecordingComm(dist.LocalCommunicator):
    """World size 1; remembers every buffer handed to all_reduce_async, in order."""

    def __init__(self):
        super().__init__("cpu")
        self.reduced = []

    def all_reduce_async(self, buf, op="sum"):
        self.reduced.append(buf)
        return super().all_reduce_async(buf, op)


def make_ddp(params, bucket_bytes, overlap=True):
    comm = RecordingComm()
    world = dist.World(rank=0, world_size=1, local_rank=0, device="cpu", comm=comm)
    ddp = dist.DistributedDataParallel(params, world, bucket_bytes=bucket_bytes, overlap=overlap)
    return ddp, comm


def offset_in(buf, flat) -> int:
    address = buf.__array_interface__["data"][0] - flat.__array_interface__["data"][0]
    return address // flat.itemsize


def linear_loss(params, coefs):
    """sum_i <p_i, c_i>, whose gradient with respect to p_i is c_i."""
    # Each term is kept (1,)-shaped: see the report on adding 0-d tensors.
    total = None
    for p, c in zip(params, coefs):
        term = (p * mt.tensor(c)).reshape(-1).sum(0, keepdims=True)
        total = term if total is None else total + term
    return total


shapes = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
                  min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(shapes=shapes, cap=st.integers(1, 40), overlap=st.booleans(), seed=st.integers(0, 2**31))
def test_buckets_tile_the_flat_buffer_in_order_and_split_parameters(shapes, cap, overlap, seed):
    rng = np.random.default_rng(seed)
    params = [mt.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True)
              for s in shapes]
    coefs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ddp, comm = make_ddp(params, bucket_bytes=4 * cap, overlap=overlap)

    # Parameter i's slot, computed independently: the flat buffer holds them in reverse order.
    sizes = [int(np.prod(s)) for s in shapes]
    start = {}
    offset = 0
    for i in reversed(range(len(sizes))):
        start[i] = offset
        offset += sizes[i]
    total = offset
    assert len(ddp.flats) == 1 and ddp.flats[0].size == total
    expected_bounds = [(b, min(b + cap, total)) for b in range(0, total, cap)]
    assert [(b.start, b.stop) for b in ddp.buckets] == expected_bounds
    for b in ddp.buckets:
        members = tuple(i for i in range(len(sizes))
                        if start[i] < b.stop and start[i] + sizes[i] > b.start)
        assert sorted(b.params) == sorted(members)

    linear_loss(params, coefs).backward()
    # Every parameter is used, so with hooks every bucket has started before reduce_gradients.
    assert ddp.launched_buckets == (len(ddp.buckets) if overlap else 0)
    tokens = int(rng.integers(1, 50))
    stats = ddp.reduce_gradients(tokens)
    assert stats.finite and stats.num_tokens == tokens
    reduced = [(offset_in(buf, ddp.flats[0]), buf.size) for buf in comm.reduced
               if np.shares_memory(buf, ddp.flats[0])]  # not the step's statistics
    assert reduced == [(b, e - b) for b, e in expected_bounds]  # each once, in bucket order
    for p, c in zip(params, coefs):
        np.testing.assert_allclose(p.grad.numpy(), c / np.float32(tokens), rtol=1e-6)


def test_a_parameter_spans_buckets_and_a_bucket_holds_two_parameters():
    p0 = mt.randn(3, 4, requires_grad=True)  # 12 floats
    p1 = mt.randn(5, requires_grad=True)  # 5 floats, first in the flat buffer
    ddp, _ = make_ddp([p0, p1], bucket_bytes=16)  # 4 floats a bucket
    assert [(b.start, b.stop, b.params) for b in ddp.buckets] == [
        (0, 4, (1,)), (4, 8, (0, 1)), (8, 12, (0,)), (12, 16, (0,)), (16, 17, (0,))]


def test_reverse_registration_order_lets_the_last_layer_start_first():
    """Backward reaches the last layer first; its bucket must be ready before the first
    layer's gradient exists."""
    w1, w2 = mt.randn(4, 6, requires_grad=True), mt.randn(6, 3, requires_grad=True)
    started_when_w1_ready = []  # this hook runs before the one DDP registers next
    register_post_accumulate_grad_hook(w1, lambda t: started_when_w1_ready.append(len(comm.reduced)))
    ddp, comm = make_ddp([w1, w2], bucket_bytes=4 * 18)  # w2 alone fills bucket 0
    x = mt.randn(5, 4)
    mt.functional.linear(mt.functional.linear(x, w1).relu(), w2).sum().backward()
    assert started_when_w1_ready == [1]  # bucket 0 (w2) had started; w1's bucket had not
    ddp.reduce_gradients(1)


def test_accumulation_under_no_sync_and_the_error_without_it():
    p = mt.randn(7, requires_grad=True)
    ddp, comm = make_ddp([p], bucket_bytes=12)
    cs = [np.random.default_rng(i).standard_normal(7).astype(np.float32) for i in range(3)]
    with ddp.no_sync():
        linear_loss([p], [cs[0]]).backward()
        linear_loss([p], [cs[1]]).backward()
    assert ddp.launched_buckets == 0
    linear_loss([p], [cs[2]]).backward()
    ddp.reduce_gradients(4)
    np.testing.assert_allclose(p.grad.numpy(), (cs[0] + cs[1] + cs[2]) / 4, rtol=1e-6)

    p.grad = None
    linear_loss([p], [cs[0]]).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        linear_loss([p], [cs[1]]).backward()


def test_unused_parameter_gets_zero_and_nonfinite_step_clears_grads():
    used, unused = mt.randn(3, requires_grad=True), mt.randn(2, requires_grad=True)
    ddp, _ = make_ddp([used, unused], bucket_bytes=8)
    c = np.random.default_rng(0).standard_normal(3).astype(np.float32)
    linear_loss([used], [c]).backward()
    stats = ddp.reduce_gradients(2, loss_sum=mt.tensor(5.0))
    np.testing.assert_array_equal(unused.grad.numpy(), np.zeros(2, np.float32))
    np.testing.assert_allclose(used.grad.numpy(), c / 2, rtol=1e-6)
    assert stats.loss_sum == 5.0 and stats.mean_loss == 2.5

    used.grad = unused.grad = None
    c[1] = np.inf
    linear_loss([used], [c]).backward()
    stats = ddp.reduce_gradients(2)
    assert not stats.finite and used.grad is None and unused.grad is None


def test_zero_tokens_leaves_the_sums():
    p = mt.randn(4, requires_grad=True)
    ddp, _ = make_ddp([p], bucket_bytes=64)
    c = np.random.default_rng(1).standard_normal(4).astype(np.float32)
    linear_loss([p], [c]).backward()
    assert ddp.reduce_gradients(0).num_tokens == 0
    np.testing.assert_array_equal(p.grad.numpy(), c)


def test_parameters_come_from_an_object_once_each_and_are_checked():
    shared, other = mt.randn(2, requires_grad=True), mt.randn(3, requires_grad=True)

    class Model:
        def parameters(self):
            return [shared, other, shared, mt.randn(4)]  # tied weight; a constant

    ddp, _ = make_ddp(Model(), bucket_bytes=64)
    assert ddp.params == [shared, other]
    with pytest.raises(TypeError, match="parameter 0 is a ndarray"):
        make_ddp([np.zeros(3)], bucket_bytes=64)
    with pytest.raises(ValueError, match="not a leaf"):
        make_ddp([shared * 2], bucket_bytes=64)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        make_ddp([mt.randn(3)], bucket_bytes=64)
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_ddp([shared], bucket_bytes=0)
