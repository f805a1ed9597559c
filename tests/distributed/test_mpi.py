"""Two, three and eight ranks (``mpiexec -n N``), checked against one process doing the same work.

Each test launches tests/distributed/mpi_worker.py under mpiexec with a fresh seed, loads what
every rank wrote, and rebuilds the expected values here without MPI. Two ranks' sums are one
addition, the same everywhere; from three on, the order of the additions is the library's, so
those sums are checked against a bound on rounding that grows with the number of ranks, and
against each other (every rank must get the same bits). Eight ranks, the design's, share the
machine's cores (conftest.py keeps waiting ranks from spinning). The collectives, training
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
from minitransformer.train import accumulated_step
from tests.helpers import micro_batches, union

# float32 training for a few steps, two ranks: the two orders of summation (per rank then
# across ranks, versus all tokens at once) differ by a few ulps per step. On "cuda" the loss is
# the fused kernel's (exp2 of z log2 e), whose rounding differs from the composite op's by ~1e-6
# more. Each further rank adds one more rounded addition to every gradient: tolerance().
TOLERANCE = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}
RTOL, ATOL = TOLERANCE["cpu"]["rtol"], TOLERANCE["cpu"]["atol"]
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def tolerance(device: str, n: int) -> dict:
    """The two-rank tolerance, times the n - 1 additions that join n ranks' gradients."""
    return {key: value * (n - 1) for key, value in TOLERANCE[device].items()}


def _a_gpu_per_rank() -> bool:
    """Two ranks on "cuda" need two GPUs (NCCL refuses two ranks on one), or the emulation."""
    return backend.has_cuda() and (backend.is_emulated("cuda")
                                   or backend._cupy.cuda.runtime.getDeviceCount() >= 2)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _a_gpu_per_rank(), reason="two ranks need two GPUs, or the emulated device (MT_EMULATE_CUDA=1)"))]


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def run_ok(mpirun, tmp_path, scenario, *options, device="cpu", n=2):
    seed = fresh_seed()
    proc = mpirun(scenario, tmp_path, seed, *options, "--device", device, n=n)
    assert proc.returncode == 0, (
        f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(n)]
    return seed, ranks


@pytest.mark.slow  # many mpiexec launches
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("device", DEVICES)
def test_collectives_on_odd_sizes(mpirun, tmp_path, worker, device, n):
    seed, ranks = run_ok(mpirun, tmp_path, "collectives", device=device, n=n)
    for dtype in worker.DTYPES:
        for size in worker.SIZES:
            key = f"{dtype}_{size}"
            saved = np.dtype(np.float32) if dtype == "bfloat16" else backend.resolve_dtype(dtype)
            inputs = [worker.rank_input(seed, r, size, dtype).astype(saved) for r in range(n)]
            for out in ranks:
                assert out[f"sum_{key}"].dtype == saved
                np.testing.assert_array_equal(out[f"sum_{key}"], ranks[0][f"sum_{key}"], err_msg=key)
                if n == 2 or dtype == "int64":
                    # Two operands: a + b is one IEEE addition, the same in MPI as in NumPy
                    # (16-bit floats: summed in float32, rounded once, as NumPy does).
                    expected = sum(inputs).astype(backend.resolve_dtype(dtype)).astype(saved)
                    np.testing.assert_array_equal(out[f"sum_{key}"], expected, err_msg=key)
                else:
                    # n - 1 additions in the library's order, each rounded (NCCL's in the type
                    # itself): within (n - 1) eps of the sum of the magnitudes.
                    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
                    bound = (n - 1) * EPS[dtype] * np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
                    error = np.abs(out[f"sum_{key}"].astype(np.float64) - exact)
                    assert (error <= bound).all(), (key, float((error - bound).max()))
                np.testing.assert_array_equal(out[f"max_{key}"], np.maximum.reduce(inputs), err_msg=key)
                np.testing.assert_array_equal(out[f"min_{key}"], np.minimum.reduce(inputs), err_msg=key)
                np.testing.assert_array_equal(out[f"bcast_{key}"], inputs[1], err_msg=key)
    for out in ranks:
        assert out["scalar_sum"] == n * (n + 1) // 2 and out["scalar_min"] == 10
        assert out["flag_max"] == True  # noqa: E712 - a numpy bool
        assert out["float_sum"] == 0.25 * n * (n + 1) / 2


def reference_training(worker, seed, steps, lr, n=2, nan_step=-1, unused_on_rank1=False,
                       empty_rank=-1):
    """One process, no MPI: every step takes the union of the n ranks' batches."""
    params = [mt.tensor(a, requires_grad=True) for a in worker.init_params(seed)]  # rank 0's
    for step in range(steps):
        if step == nan_step:
            continue  # the step every rank must skip
        parts = [worker.batch(seed, step, r, empty_rank) for r in range(n)]
        x = np.concatenate([x for x, _ in parts])
        y = np.concatenate([y for _, y in parts])
        # rows of rank 1 do not see the extra parameter when rank 1 does not use it
        extra_rows = np.concatenate([np.full(len(part[1]), 0.0 if unused_on_rank1 and r == 1 else 1.0)
                                     for r, part in enumerate(parts)])
        loss = worker.mlp_loss(params, x, y, extra_rows, "mean")
        loss.backward()
        for p in params:
            p.data -= lr * p.grad.data
            p.grad = None
    return [p.numpy() for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, overlap, bucket_bytes", [
    (2, 1, 52), (2, 0, 52), (2, 1, 25 * 2**20), (2, 0, 25 * 2**20),
    (3, 1, 52), (8, 1, 52), (8, 0, 25 * 2**20),
], ids=lambda v: {52: "13-float-buckets", 25 * 2**20: "25MiB"}.get(v, str(v)))
@pytest.mark.slow  # many mpiexec launches
def test_ranks_match_one_process_on_the_union(mpirun, tmp_path, worker, n, overlap, bucket_bytes,
                                              device):
    """From three ranks on, the last one's batch is empty at one step (its data ran out)."""
    steps, lr, empty_rank = 4, 0.5, (n - 1 if n > 2 else -1)
    seed, ranks = run_ok(mpirun, tmp_path, "train", "--steps", steps, "--lr", lr,
                         "--bucket-bytes", bucket_bytes, "--overlap", overlap,
                         "--empty-rank", empty_rank, device=device, n=n)
    expected = reference_training(worker, seed, steps, lr, n=n, empty_rank=empty_rank)  # on the CPU
    init0 = worker.init_params(seed)
    for i, e in enumerate(expected):
        for out in ranks:
            # the other ranks started from other weights: the broadcast gave them rank 0's
            np.testing.assert_array_equal(out[f"init_{i}"], init0[i])
            np.testing.assert_allclose(out[f"final_{i}"], e, **tolerance(device, n))
            # identical reduced gradients on every rank keep them bit for bit in step
            np.testing.assert_array_equal(out[f"final_{i}"], ranks[0][f"final_{i}"])
    tokens = [sum(int((worker.batch(seed, s, r, empty_rank)[1] != worker.PAD).sum()) for r in range(n))
              for s in range(steps)]
    for out in ranks:
        np.testing.assert_array_equal(out["tokens"], tokens)
        assert out["finite"].all()
        if bucket_bytes == 52:
            assert out["n_buckets"] > 5  # 137 floats in 13-float buckets: parameters split
        # every bucket once a step, in the layout's order, the same on every rank
        np.testing.assert_array_equal(
            out["order"], [(s, start) for s in range(steps) for start in out["bucket_starts"]])
        # with hooks, buckets start during backward (also on a rank with no batch, whose
        # backward still runs); without, none does before reduce_gradients
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


@pytest.mark.slow  # many mpiexec launches
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_and_buffers_come_from_rank_0(mpirun, tmp_path, device, n):
    seed, ranks = run_ok(mpirun, tmp_path, "state", device=device, n=n)
    for key in ("weight", "bias", "stat", "flags"):  # trained, frozen, buffers (float, bool)
        for out in ranks[1:]:
            np.testing.assert_array_equal(out[key], ranks[0][key], err_msg=key)


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


def test_ctrl_c_reaches_a_rank_waiting_for_a_rank_that_left(mpirun, tmp_path):
    """A rank that waits in a collective for a rank that Ctrl-C or SIGTERM already took out of
    the loop still gets its own interrupt, so that it cleans up and rank 0 says how to continue
    (MPI_Allreduce and MPI_Bcast would hold it in C, where Python runs no signal handler)."""
    proc = mpirun("interrupt", tmp_path, fresh_seed(), timeout=60)  # TimeoutExpired = a hang
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert (tmp_path / "interrupted0").exists() and (tmp_path / "interrupted1").exists()


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


@pytest.mark.parametrize("device", DEVICES)
def test_an_accumulated_step_over_ranks_is_one_step_on_the_union(mpirun, tmp_path, worker, device):
    """Three micro-batches split between two ranks (the one-sentence one leaves a rank an empty
    share): every rank's reduced gradient, its loss and token count, are one process's on all
    the sentences at once. The ranks all-reduce once, after the last micro-batch."""
    seed, ranks = run_ok(mpirun, tmp_path, "accumulate", device=device, n=2)
    model, optimizer = worker.accumulation_model(seed, "cpu")
    whole = accumulated_step(model, optimizer, None, [union(micro_batches(seed))], label_smoothing=0.1)
    for out in ranks:
        assert str(out["skipped"]) == "None" and int(out["tokens"]) == whole.num_tokens
        assert out["all_reduced"] == out["gradients"]  # each gradient once a step, not once a micro-batch
        np.testing.assert_allclose(float(out["loss"]), whole.loss, rtol=1e-12)
        for i, p in enumerate(model.parameters()):
            np.testing.assert_allclose(out[f"grad_{i}"], p.grad.numpy(), rtol=1e-9, atol=1e-10)
            np.testing.assert_array_equal(out[f"grad_{i}"], ranks[0][f"grad_{i}"])
