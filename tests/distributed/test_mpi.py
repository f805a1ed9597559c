"""Two ranks (``mpiexec -n 2``), checked against one process doing the same work.

Each test launches tests/distributed/mpi_worker.py under mpiexec with a fresh seed, loads what
every rank wrote, and rebuilds the expected values here without MPI. The collectives, training
and broadcast scenarios run on "cpu" (MPI) and on "cuda" (NCCL, one GPU per rank; without GPUs,
the emulated device with its NCCL carried over MPI, which also checks the stream and event
ordering around every collective).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend

# float32 training for a few steps: the two orders of summation (per rank then across ranks,
# versus all tokens at once) differ by a few ulps per step. On "cuda" the loss is the fused
# kernel's (exp2 of z log2 e), whose rounding differs from the composite op's by ~1e-6 more.
TOLERANCE = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}
RTOL, ATOL = TOLERANCE["cpu"]["rtol"], TOLERANCE["cpu"]["atol"]


def _a_gpu_per_rank() -> bool:
    """Two ranks on "cuda" need two GPUs (NCCL refuses two ranks on one), or the emulation."""
    return backend.has_cuda() and (backend.is_emulated("cuda")
                                   or backend._cupy.cuda.runtime.getDeviceCount() >= 2)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _a_gpu_per_rank(), reason="two ranks need two GPUs, or the emulated device (MT_EMULATE_CUDA=1)"))]


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def run_ok(mpirun, tmp_path, scenario, *options, device="cpu"):
    seed = fresh_seed()
    proc = mpirun(scenario, tmp_path, seed, *options, "--device", device)
    assert proc.returncode == 0, (
        f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    return seed, ranks


@pytest.mark.parametrize("device", DEVICES)
def test_collectives_on_odd_sizes(mpirun, tmp_path, worker, device):
    seed, ranks = run_ok(mpirun, tmp_path, "collectives", device=device)
    for dtype in worker.DTYPES:
        for size in worker.SIZES:
            key = f"{dtype}_{size}"
            a, b = (worker.rank_input(seed, r, size, dtype) for r in range(2))
            saved = np.dtype(np.float32) if dtype == "bfloat16" else backend.resolve_dtype(dtype)
            a, b = a.astype(saved), b.astype(saved)
            for out in ranks:
                # Two operands: a + b is one IEEE addition, the same in MPI as in NumPy (16-bit
                # floats: summed in float32, rounded once, as NumPy does).
                expected = (a + b).astype(backend.resolve_dtype(dtype)).astype(saved)
                np.testing.assert_array_equal(out[f"sum_{key}"], expected, err_msg=key)
                assert out[f"sum_{key}"].dtype == saved
                np.testing.assert_array_equal(out[f"max_{key}"], np.maximum(a, b), err_msg=key)
                np.testing.assert_array_equal(out[f"min_{key}"], np.minimum(a, b), err_msg=key)
                np.testing.assert_array_equal(out[f"bcast_{key}"], b, err_msg=key)
    for out in ranks:
        assert out["scalar_sum"] == 3 and out["scalar_min"] == 10
        assert out["flag_max"] == True  # noqa: E712 - a numpy bool
        assert out["float_sum"] == 0.75


def reference_training(worker, seed, steps, lr, nan_step=-1, unused_on_rank1=False):
    """One process, no MPI: every step takes the union of both ranks' batches."""
    params = [mt.tensor(a, requires_grad=True) for a in worker.init_params(seed)]  # rank 0's
    for step in range(steps):
        if step == nan_step:
            continue  # the step every rank must skip
        parts = [worker.batch(seed, step, r) for r in range(2)]
        x = np.concatenate([x for x, _ in parts])
        y = np.concatenate([y for _, y in parts])
        # rows of rank 1 do not see the extra parameter when rank 1 does not use it
        extra_rows = np.concatenate([np.ones(len(parts[0][1])),
                                     np.full(len(parts[1][1]), 0.0 if unused_on_rank1 else 1.0)])
        loss = worker.mlp_loss(params, x, y, extra_rows, "mean")
        loss.backward()
        for p in params:
            p.data -= lr * p.grad.data
            p.grad = None
    return [p.numpy() for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [1, 0], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("bucket_bytes", [52, 25 * 2**20], ids=["13-float-buckets", "25MiB"])
def test_two_ranks_match_one_process_on_the_union(mpirun, tmp_path, worker, overlap, bucket_bytes,
                                                  device):
    steps, lr = 4, 0.5
    seed, ranks = run_ok(mpirun, tmp_path, "train", "--steps", steps, "--lr", lr,
                         "--bucket-bytes", bucket_bytes, "--overlap", overlap, device=device)
    expected = reference_training(worker, seed, steps, lr)  # on the CPU
    init0 = worker.init_params(seed)
    for i, e in enumerate(expected):
        for out in ranks:
            # rank 1 started from other weights: the broadcast gave it rank 0's
            np.testing.assert_array_equal(out[f"init_{i}"], init0[i])
            np.testing.assert_allclose(out[f"final_{i}"], e, **TOLERANCE[device])
        # identical reduced gradients on both ranks keep them bit for bit in step
        np.testing.assert_array_equal(ranks[0][f"final_{i}"], ranks[1][f"final_{i}"])
    for out in ranks:
        tokens = [sum(int((worker.batch(seed, s, r)[1] != worker.PAD).sum()) for r in range(2))
                  for s in range(steps)]
        np.testing.assert_array_equal(out["tokens"], tokens)
        assert out["finite"].all()
        if bucket_bytes == 52:
            assert out["n_buckets"] > 5  # 137 floats in 13-float buckets: parameters split
        # with hooks, buckets start during backward; without, none does before reduce_gradients
        assert (out["launched"] > 0).all() if overlap else (out["launched"] == 0).all()


def test_parameter_unused_on_one_rank(mpirun, tmp_path, worker):
    """Rank 1 never produces the extra parameter's gradient; the buckets must still be
    reduced in the same order on both ranks (else a hang) and its gradient averaged."""
    steps, lr = 3, 0.5
    seed, ranks = run_ok(mpirun, tmp_path, "train", "--steps", steps, "--lr", lr,
                         "--bucket-bytes", 24, "--unused-on-rank1", 1)
    expected = reference_training(worker, seed, steps, lr, unused_on_rank1=True)
    for i, e in enumerate(expected):
        for out in ranks:
            np.testing.assert_allclose(out[f"final_{i}"], e, rtol=RTOL, atol=ATOL)
    # the extra parameter comes last, so it fills bucket 0: rank 1 can start nothing early
    assert (ranks[1]["launched"] == 0).all() and (ranks[0]["launched"] > 0).all()


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(mpirun, tmp_path, worker):
    steps, lr, nan_step = 4, 0.5, 1
    seed, ranks = run_ok(mpirun, tmp_path, "train", "--steps", steps, "--lr", lr,
                         "--bucket-bytes", 40, "--nan-step", nan_step)
    for out in ranks:
        np.testing.assert_array_equal(out["finite"], [s != nan_step for s in range(steps)])
    expected = reference_training(worker, seed, steps, lr, nan_step=nan_step)
    for i, e in enumerate(expected):
        for out in ranks:
            assert np.isfinite(out[f"final_{i}"]).all()
            np.testing.assert_allclose(out[f"final_{i}"], e, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not backend.is_emulated("cuda"), reason="the emulated NCCL's check (a real one hangs)")
def test_ranks_given_different_nccl_ids_are_refused(mpirun, tmp_path):
    seed, ranks = run_ok(mpirun, tmp_path, "nccl_ids", device="cuda")
    for out in ranks:
        assert "different unique ids" in str(out["error"])


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_and_buffers_come_from_rank_0(mpirun, tmp_path, device):
    seed, ranks = run_ok(mpirun, tmp_path, "state", device=device)
    for key in ("weight", "bias", "stat", "flags"):  # trained, frozen, buffers (float, bool)
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)


def test_a_rank_that_exits_ends_the_whole_job(mpirun, tmp_path):
    """sys.exit on rank 1 (no excepthook sees it) while rank 0 waits: under run_main, the job
    ends non-zero instead of hanging."""
    start = time.monotonic()
    proc = mpirun("exit", tmp_path, fresh_seed(), timeout=60)
    assert proc.returncode != 0
    assert "rank 1 gives up" in proc.stderr and "[rank 1/2] exiting with status 1" in proc.stderr
    assert time.monotonic() - start < 30


def test_a_rank_that_raises_ends_the_whole_job(mpirun, tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier: the job must end, non-zero, quickly."""
    start = time.monotonic()
    proc = mpirun("raise", tmp_path, fresh_seed(), timeout=60)  # TimeoutExpired = a hang
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "boom from rank 1" in proc.stderr
    assert "[rank 1/2] uncaught exception" in proc.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


def test_each_cpu_rank_gets_its_share_of_the_cores(mpirun, tmp_path, monkeypatch):
    """Two ranks on one node: init gives each rank's BLAS half the cores (at least one), unless
    the user set a thread count, which wins; rank 0 takes them all while it works alone."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    _, ranks = run_ok(mpirun, tmp_path, "blas_threads")
    cores = int(ranks[0]["cores"])
    share = max(1, cores // 2)
    assert [out["threads"].tolist() for out in ranks] == [[share], [share]]
    assert [bool(out["main"]) for out in ranks] == [True, False]
    assert [out["alone"].tolist() for out in ranks] == [[cores], [share]]
    if share + 1 > cores:
        pytest.skip("one core: no other thread count to set and see kept")
    monkeypatch.setenv("OMP_NUM_THREADS", str(share + 1))
    _, ranks = run_ok(mpirun, tmp_path, "blas_threads")
    assert [out["threads"].tolist() for out in ranks] == [[share + 1], [share + 1]]
    assert [out["alone"].tolist() for out in ranks] == [[share + 1], [share + 1]]
