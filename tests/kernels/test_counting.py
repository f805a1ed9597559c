"""The emulator's counters (emu.h's Counting), on small kernels whose costs are known by hand.

Each kernel below is one access pattern; the test runs it in the count variant and compares
what was counted with what the GPU's rules give: 32-byte sectors for a warp's global request,
and for a shared one, phases of 128 bytes of lanes, each taking as many wavefronts as its
busiest bank has distinct 4-byte words.
"""

from __future__ import annotations

import ctypes

import emulated
import numpy as np
import pytest

from minitransformer.emulated import emulator

KERNELS = r"""
#include "common.cuh"

// Lane l loads x[offset + stride l] and stores it to y[l].
__global__ void strided_kernel(const float* x, float* y, int stride, int offset) {
    y[threadIdx.x] = x[offset + stride * threadIdx.x];
}

// Lane l loads x[32 i + l] for i < 4 (the i-th request of the load), and even lanes store.
__global__ void loop_kernel(const float* x, float* y) {
    float sum = 0.f;
    for (int i = 0; i < 4; ++i) sum += x[32 * i + threadIdx.x];
    if (threadIdx.x % 2 == 0) y[threadIdx.x] = sum;
}

// Lane l of warp w writes row l of warp w's 32 x (32 + pad) tile, a column at a time, then reads
// its column l, a row at a time, then every lane reads one word.
__global__ void tile_kernel(float* y, int pad) {
    __shared__ float tile[2 * 32 * 33];
    const int lane = threadIdx.x % 32, ld = 32 + pad;
    float* mine = tile + threadIdx.x / 32 * 32 * 33;
    for (int c = 0; c < 32; ++c) mine[lane * ld + c] = float(c);
    __syncthreads();
    float sum = mine[0];
    for (int r = 0; r < 32; ++r) sum += mine[r * ld + lane];
    y[threadIdx.x] = sum;
}

// 16-byte accesses: lane l stores chunk l (contiguous), then chunk `stride` l, and loads it back;
// then lanes below `valid` copy a chunk of x through a register that the others leave zero.
__global__ void vector_kernel(const uint4* x, uint4* y, int stride, int valid) {
    __shared__ uint4 chunks[32 * 9];
    const uint4 v = make_uint4(threadIdx.x, 1, 2, 3);
    chunks[threadIdx.x] = v;
    __syncthreads();
    chunks[stride * threadIdx.x] = v;
    __syncthreads();
    y[threadIdx.x] = chunks[stride * threadIdx.x];
    uint4 copied = make_uint4(0u, 0u, 0u, 0u);
    if (int(threadIdx.x) < valid) copied = x[threadIdx.x];
    y[threadIdx.x] = copied;
}

// cp.async of lane l's 16 bytes into chunk `stride` l, then ldmatrix with lane l's row there,
// and two mma.sync.
__global__ void async_kernel(const uint4* x, uint4* y, int stride) {
    __shared__ uint4 chunks[32 * 9];
    __pipeline_memcpy_async(&chunks[stride * threadIdx.x], &x[threadIdx.x], 16);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    uint32_t r[4];
    emulated_ldmatrix_x4_trans(r, &chunks[stride * threadIdx.x]);
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t a[4] = {r[0], r[1], r[2], r[3]}, b[2] = {r[0], r[1]};
    emulated_mma_16816<__half>(d, a, b);
    emulated_mma_16816<__half>(d, a, b);
    y[threadIdx.x] = make_uint4(r[0], r[1], r[2], unsigned(d[0] != 0.f));
}

extern "C" void strided(const float* x, float* y, int stride, int offset) {
    strided_kernel<<<1, 32, 0, 0>>>(x, y, stride, offset);
}
extern "C" void loop(const float* x, float* y) { loop_kernel<<<3, 32, 0, 0>>>(x, y); }
extern "C" void tile(float* y, int pad) { tile_kernel<<<1, 64, 0, 0>>>(y, pad); }
extern "C" void vector(const uint4* x, uint4* y, int stride, int valid) {
    vector_kernel<<<1, 32, 0, 0>>>(x, y, stride, valid);
}
extern "C" void async(const uint4* x, uint4* y, int stride) { async_kernel<<<2, 32, 0, 0>>>(x, y, stride); }
"""


@pytest.fixture(scope="module")
def kernels():
    emulated.require_emulator()
    path = emulator.compile_kernels(KERNELS, "count", name="counted.cu")
    return path, ctypes.CDLL(str(path))


def run(kernels, name, *args, memory=()):
    """The counts of one launch of ``name`` with ``args`` (arrays passed by address)."""
    path, library = kernels
    with emulator.logged_launches(path, memory=memory) as log:
        getattr(library, name)(*(ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else a for a in args))
    (launch,) = log
    assert launch.kernel.split("(")[0].endswith(f"{name}_kernel")
    return launch


def figures(launch, kind):
    t = launch.total(kind)
    return t.requests, t.accesses, t.bytes, t.units, t.ideal


@pytest.mark.parametrize("stride, offset, sectors, ideal", [
    (1, 0, 4, 4),     # 128 contiguous bytes: four sectors
    (1, 4, 5, 4),     # the same 16 bytes off a sector's start: one more
    (2, 0, 8, 4),     # every other float: twice the sectors for the same bytes
    (32, 0, 32, 4),   # a float a row of 128 bytes: a sector each
])
def test_a_warps_global_load_takes_the_sectors_its_lanes_touch(kernels, stride, offset, sectors, ideal):
    x, y = np.zeros(32 * 32 + 4, np.float32), np.zeros(32, np.float32)
    launch = run(kernels, "strided", x, y, stride, offset, memory=(x, y))
    assert figures(launch, "global load") == (1, 32, 128, sectors, ideal)
    assert figures(launch, "global store") == (1, 32, 128, 4, 4)
    assert {c.line for c in launch.counts} == {"counted.cu:6"}


def test_memory_not_registered_as_global_is_not_counted(kernels):
    x, y = np.zeros(32, np.float32), np.zeros(32, np.float32)
    launch = run(kernels, "strided", x, y, 1, 0, memory=(x,))
    assert [c.kind for c in launch.counts] == ["global load"]


def test_each_lanes_kth_access_at_one_place_makes_the_kth_request_and_idle_lanes_make_none(kernels):
    x, y = np.zeros(128, np.float32), np.zeros(32, np.float32)
    launch = run(kernels, "loop", x, y, memory=(x, y))  # 3 blocks of one warp
    assert figures(launch, "global load") == (3 * 4, 3 * 128, 3 * 512, 3 * 16, 3 * 16)
    # 16 even lanes store 4 bytes each, 8 bytes apart: all four sectors of 128 bytes for 64 used.
    assert figures(launch, "global store") == (3, 3 * 16, 3 * 64, 3 * 4, 3 * 2)


@pytest.mark.parametrize("pad, wavefronts", [(0, 32), (1, 1)])
def test_a_tiles_column_conflicts_in_one_bank_unless_the_rows_are_padded(kernels, pad, wavefronts):
    y = np.zeros(64, np.float32)
    launch = run(kernels, "tile", y, pad)
    # Two warps, each 32 stores down a column: lane l's word l (32 + pad) lies in bank l pad % 32.
    assert figures(launch, "shared store") == (2 * 32, 2 * 1024, 2 * 4096, 2 * 32 * wavefronts, 2 * 32)
    # Reads along rows take one wavefront each; the first, every lane reading word 0, broadcasts.
    assert figures(launch, "shared load") == (2 * 33, 2 * 33 * 32, 2 * 33 * 128, 2 * 33, 2 * 33)
    assert figures(launch, "barrier") == (2, 64, 0, 2, 2)


@pytest.mark.parametrize("stride, wavefronts", [(1, 4), (8, 32), (9, 4)])
def test_16_byte_accesses_go_in_four_phases_of_eight_lanes(kernels, stride, wavefronts):
    x, y = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    launch = run(kernels, "vector", x, y, stride, 20, memory=(x, y))
    stores = [c for c in launch.counts if c.kind == "shared store"]
    assert [(c.requests, c.units, c.ideal) for c in stores] == [(1, 4, 4), (1, wavefronts, 4)]
    # Rows of 128 bytes put a phase's eight lanes in the same four banks: eight words each.
    assert figures(launch, "shared load") == (1, 32, 512, wavefronts, 4)
    # The copy through a register stays 16 bytes a lane (not four accesses of its members): 20
    # lanes load 320 contiguous bytes, ten sectors.
    assert figures(launch, "global load") == (1, 20, 320, 10, 10)
    assert figures(launch, "global store") == (2, 64, 1024, 32, 32)


@pytest.mark.parametrize("stride, wavefronts", [(1, 4), (8, 32), (9, 4)])
def test_cp_async_ldmatrix_and_mma_count_as_the_instructions_they_are(kernels, stride, wavefronts):
    x, y = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    launch = run(kernels, "async", x, y, stride, memory=(x, y))  # 2 blocks of one warp
    assert figures(launch, "cp.async read") == (2, 64, 2 * 512, 2 * 16, 2 * 16)
    assert figures(launch, "cp.async write") == (2, 64, 2 * 512, 2 * wavefronts, 2 * 4)
    assert figures(launch, "ldmatrix") == (2, 64, 2 * 512, 2 * wavefronts, 2 * 4)
    assert figures(launch, "mma") == (4, 128, 0, 4, 4)
    assert figures(launch, "barrier") == (2, 64, 0, 2, 2)
    # ldmatrix's reads of the other lanes' rows, and cp.async's landing, are not loads of the lane.
    assert figures(launch, "shared load") == (0, 0, 0, 0, 0)
