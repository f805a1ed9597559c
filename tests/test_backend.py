"""backend: the CPU's row blocks and dropout masks (devices and dtypes are tested with the
tensors that use them, in test_tensor.py)."""

import threading

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend


@pytest.mark.parametrize("n_rows, row_bytes", [(1, 8), (7, 8), (1000, 24), (1000, 1 << 20)])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_row_blocks_cover_every_row_once_in_order(monkeypatch, n_rows, row_bytes, threads):
    monkeypatch.setattr(backend, "BLOCK_BYTES", 200)
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    seen = np.zeros(n_rows, int)
    names = set()

    def fn(rows):
        seen[rows] += 1
        names.add(threading.current_thread().name)
        return rows.start, rows.stop

    blocks = backend.for_row_blocks(np, n_rows, row_bytes, fn)
    np.testing.assert_array_equal(seen, 1)
    assert blocks[0][0] == 0 and blocks[-1][1] == n_rows
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # consecutive, in order
    per_block = max(1, 200 // row_bytes)
    assert all(0 < stop - start <= per_block for start, stop in blocks)
    me = threading.current_thread().name
    if threads == "1" or n_rows <= per_block:
        assert names == {me}  # inline, no pool
    else:  # this thread takes the first share, the pool's the others
        assert me in names and all(n == me or n.startswith("minitransformer") for n in names)


def test_row_blocks_pass_an_error_on(monkeypatch):
    monkeypatch.setattr(backend, "BLOCK_BYTES", 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")

    def fn(rows):
        if rows.start == 3:
            raise ValueError("block 3")

    with pytest.raises(ValueError, match="block 3"):
        backend.for_row_blocks(np, 10, 8, fn)


def test_cpu_threads_follow_the_blas_variables(monkeypatch):
    for var in backend.BLAS_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    assert backend.cpu_threads() >= 1
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert backend.cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert backend.cpu_threads() == 1


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
