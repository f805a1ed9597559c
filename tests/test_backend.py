"""backend: id range checks and dropout masks (devices and dtypes are tested with the tensors
that use them, in test_tensor.py)."""

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend


def test_check_ids_names_the_first_bad_id_and_its_position(device):
    ids = backend.to_device(np.array([[0, 2, 5], [-1, 1, 4]]), device)
    with pytest.raises(IndexError, match=r"^lookup id 5 at position \(0, 2\) of \(2, 3\) is outside \[0, 5\)$"):
        backend.check_ids(ids, 5, "lookup id")
    with pytest.raises(IndexError, match=r"id -1 at position \(1, 0\)"):
        backend.check_ids(ids, 6, "lookup id")
    live = backend.to_device(np.array([[True, True, False], [False, True, True]]), device)
    backend.check_ids(ids, 5, "lookup id", live=live)  # only the live ids are checked
    backend.check_ids(ids[:, :0], 1, "lookup id")  # nothing to check


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_mask_keeps_the_expectation(device, p):
    mt.manual_seed(7)
    keep, scale = backend.dropout_mask(device, (2000, 1000), p)
    keep = backend.to_device(keep, "cpu")
    assert keep.shape == (2000, 1000) and keep.dtype == bool
    # 2e6 draws: the kept fraction's standard deviation is under 3.6e-4
    assert abs(keep.mean() - (1 - p)) < 2e-3
    assert abs(keep.mean() * scale - 1) < 3e-3
    if device == "cpu":  # 16 random bits per element: the drop probability is a multiple of 2^-16
        dropped = round(p * 2**16)
        assert scale == 2**16 / (2**16 - dropped) and abs(dropped / 2**16 - p) <= 2**-17


def test_dropout_mask_is_reproducible_and_fresh(device):
    mt.manual_seed(3)
    a, _ = backend.dropout_mask(device, (5, 7), 0.5)
    b, _ = backend.dropout_mask(device, (5, 7), 0.5)
    mt.manual_seed(3)
    c, _ = backend.dropout_mask(device, (5, 7), 0.5)
    a, b, c = (backend.to_device(x, "cpu") for x in (a, b, c))
    np.testing.assert_array_equal(a, c)
    assert (a != b).any()


def test_manual_seed_refuses_what_no_generator_takes(device):
    """Refused at the call, not at the first draw; the seed in force stays."""
    mt.manual_seed(2**64 - 1)
    mt.manual_seed(5)
    want = mt.randn(3, device=device).numpy()
    for seed in (-1, 2**64, 1.0, True, "5", None):
        mt.manual_seed(5)
        with pytest.raises(ValueError) as e:
            mt.manual_seed(seed)
        assert "\n" not in str(e.value)
        np.testing.assert_array_equal(mt.randn(3, device=device).numpy(), want)


def test_dropout_mask_at_the_edges():
    """p below 2^-17 drops nothing on the CPU (scale 1); p next to 1 still keeps about one
    element in 2^16, with a finite scale; an empty shape gives an empty mask."""
    keep, scale = backend.dropout_mask("cpu", (1000, 100), 2**-18)
    assert keep.all() and scale == 1.0
    keep, scale = backend.dropout_mask("cpu", (1000, 1000), 1 - 2**-20)
    assert scale == 2**16 and 0 < keep.sum() < 50  # 10^6 draws at 2^-16: 15 expected, 4 the std
    keep, scale = backend.dropout_mask("cpu", (3, 0, 2), 0.5)
    assert keep.shape == (3, 0, 2) and keep.dtype == bool and scale == 2.0


@pytest.mark.parametrize("threads", ["1", "2", "5"])
@pytest.mark.parametrize("rows", [0, 1, 3, 17])
@pytest.mark.parametrize("min_rows", [1, 4, 100])
def test_row_blocks_cover_every_row_once_in_order(monkeypatch, threads, rows, min_rows):
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    seen = backend.row_blocks(lambda start, stop: (start, stop), rows, np.zeros(rows), min_rows)
    assert len(seen) == max(1, min(int(threads), rows // min_rows))  # no block below min_rows, unless one
    assert len(seen) == 1 or min(stop - start for start, stop in seen) >= min_rows
    assert [start for start, _ in seen] == [0] + [stop for _, stop in seen[:-1]]  # contiguous
    assert seen[0][0] == 0 and seen[-1][1] == rows


def test_row_blocks_run_on_threads_at_once(monkeypatch):
    import threading

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    barrier = threading.Barrier(3, timeout=10)  # passes only if the three blocks run together
    names = backend.row_blocks(lambda start, stop: (barrier.wait(), threading.current_thread().name)[1],
                               9, np.zeros(9))
    assert len(set(names)) == 3


def test_cpu_threads_follow_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert backend.cpu_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert backend.cpu_threads() >= 1
