// Just enough of CUDA to run csrc/'s kernels on the CPU, so that their indexing, masking,
// synchronisation and arithmetic can be tested on a machine without a GPU.
//
// Force-included (g++ -include emu.h) ahead of the kernel sources, which build.py copies after
// textual rewrites: `kernel<<<grid, block, smem, stream>>>(args)` becomes
// `mt_emu::launch(kernel, grid, block, smem, stream)(args)`, the dynamic shared-memory
// declaration becomes a pointer to a per-block buffer, and <cuda_pipeline.h> is replaced by
// the synchronous cp.async below (so the emulation cannot see a missing wait).
//
// Model: blocks run one after another; the threads of a block are real std::threads.
//   __syncthreads        a std::barrier over the block's threads
//   __shfl_*_sync        every lane posts its value in the warp's slots, a barrier over the
//                        warp, read the partner's slot, a second barrier
//   __shared__ (static)  `static`: one copy, and only one block runs at a time
//   atomicAdd            under a mutex
//   ldmatrix.x4.trans    every lane posts its row address; each reads its column pairs
//   mma.sync m16n8k16    every lane posts its registers, each rebuilds A and B from the PTX
//                        ISA's fragment layout and computes its own four outputs in float32
//                        (the tensor cores' products of 16-bit inputs are exact, and they
//                        accumulate in float32 too)
// Functions map to the C library's (more exact than the GPU's approximate exp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace mt_emu {

struct Warp {
    explicit Warp(int lanes) : barrier(lanes) {}
    std::barrier<> barrier;
    float slot[32];
    uint32_t mma_a[32][4], mma_b[32][2];
    const void* rows[32];
};

struct ThreadState {
    uint3 thread, block;
    dim3 block_dim, grid_dim;
    std::barrier<>* block_barrier;
    Warp* warp;
    unsigned char* smem;
};
inline thread_local ThreadState ts;
inline std::mutex atomic_mutex;

inline unsigned char* dynamic_smem() { return ts.smem; }
inline int lane() { return int(ts.thread.x % 32); }

template <typename... KArgs>
struct Launcher {
    void (*kernel)(KArgs...);
    dim3 grid, block;
    size_t smem;

    template <typename... Args>
    void operator()(Args&&... args) const {
        std::tuple<std::decay_t<KArgs>...> packed(std::forward<Args>(args)...);
        const int threads = int(block.x * block.y * block.z);
        std::vector<unsigned char> smem_buffer(smem + 128);
        unsigned char* aligned = smem_buffer.data() + (128 - uintptr_t(smem_buffer.data()) % 128) % 128;
        for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    std::barrier<> block_barrier(threads);
                    std::vector<std::unique_ptr<Warp>> warps;
                    for (int w = 0; w < (threads + 31) / 32; ++w)
                        warps.push_back(std::make_unique<Warp>(std::min(32, threads - 32 * w)));
                    std::vector<std::thread> pool;
                    for (int t = 0; t < threads; ++t) {
                        pool.emplace_back([&, t] {
                            ts = ThreadState{uint3{unsigned(t), 0, 0}, uint3{bx, by, bz}, block, grid,
                                             &block_barrier, warps[t / 32].get(), aligned};
                            std::apply(kernel, packed);
                            // An exited thread no longer holds up its block's or warp's barriers.
                            block_barrier.arrive_and_drop();
                            warps[t / 32]->barrier.arrive_and_drop();
                        });
                    }
                    for (auto& th : pool) th.join();
                }
    }
};

template <typename... KArgs>
Launcher<KArgs...> launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t) {
    return {kernel, grid, block, smem};
}

}  // namespace mt_emu

#define threadIdx (mt_emu::ts.thread)
#define blockIdx (mt_emu::ts.block)
#define blockDim (mt_emu::ts.block_dim)
#define gridDim (mt_emu::ts.grid_dim)
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

#define cudaGetLastError() cudaSuccess
#define cudaGetErrorName(e) "emulated"
#define cudaGetErrorString(e) "emulated"
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaMemsetAsync(ptr, value, bytes, stream) (std::memset((ptr), (value), (bytes)), cudaSuccess)

inline void __syncthreads() { mt_emu::ts.block_barrier->arrive_and_wait(); }

inline float __shfl_sync(unsigned, float v, int src) {
    mt_emu::Warp& w = *mt_emu::ts.warp;
    w.slot[mt_emu::lane()] = v;
    w.barrier.arrive_and_wait();
    float r = w.slot[src];
    w.barrier.arrive_and_wait();
    return r;
}

inline float __shfl_xor_sync(unsigned mask, float v, int offset) {
    mt_emu::Warp& w = *mt_emu::ts.warp;
    w.slot[mt_emu::lane()] = v;
    w.barrier.arrive_and_wait();
    float r = w.slot[mt_emu::lane() ^ offset];
    w.barrier.arrive_and_wait();
    return r;
}

// cp.async, done at once: copy size - zfill bytes, zero the rest. Waits have nothing to wait for.
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size, size_t zfill = 0) {
    std::memcpy(dst, src, size - zfill);
    std::memset(static_cast<char*>(dst) + size - zfill, 0, zfill);
}
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}

inline float atomicAdd(float* address, float value) {
    std::lock_guard<std::mutex> lock(mt_emu::atomic_mutex);
    float old = *address;
    *address = old + value;
    return old;
}

// CUDA's device-side integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }


// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: see mma_16816 in attention.cu for the
// layout (lane = 4 g + t; a[0] A[g][2t..], a[1] A[g+8][2t..], a[2] A[g][2t+8..],
// a[3] A[g+8][2t+8..]; b[0] B[2t..][g], b[1] B[2t+8..][g]; d D[g][2t..], D[g+8][2t..]).
#define MT_EMULATED_MMA 1

inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
float unpack_half(uint32_t bits, int which) {
    uint16_t h = uint16_t(which ? bits >> 16 : bits & 0xffffu);
    T value;
    std::memcpy(&value, &h, 2);
    return as_float(value);
}

template <typename T>
void emulated_mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mt_emu::Warp& w = *mt_emu::ts.warp;
    const int me = mt_emu::lane();
    std::memcpy(w.mma_a[me], a, sizeof(a));
    std::memcpy(w.mma_b[me], b, sizeof(b));
    w.barrier.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = unpack_half<T>(w.mma_a[l][0], e);
            A[g + 8][2 * t + e] = unpack_half<T>(w.mma_a[l][1], e);
            A[g][2 * t + 8 + e] = unpack_half<T>(w.mma_a[l][2], e);
            A[g + 8][2 * t + 8 + e] = unpack_half<T>(w.mma_a[l][3], e);
            B[2 * t + e][g] = unpack_half<T>(w.mma_b[l][0], e);
            B[2 * t + 8 + e][g] = unpack_half<T>(w.mma_b[l][1], e);
        }
    }
    w.barrier.arrive_and_wait();  // the slots are free for the next product
    const int g = me / 4, t = me % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
        float acc = d[e];
        for (int kk = 0; kk < 16; ++kk) acc += A[row][kk] * B[kk][col];
        d[e] = acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane l gives row l % 8 of 8x8 tile l / 8;
// r[i] of lane 4 g + t = (tile i)[2t][g] | (tile i)[2t + 1][g] << 16.
inline void emulated_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    if (uintptr_t(row) % 16 != 0) {
        std::fprintf(stderr, "ldmatrix row address %p is not 16-byte aligned\n", row);
        std::abort();
    }
    mt_emu::Warp& w = *mt_emu::ts.warp;
    const int me = mt_emu::lane();
    w.rows[me] = row;
    w.barrier.arrive_and_wait();
    const int g = me / 4, t = me % 4;
    for (int i = 0; i < 4; ++i) {
        const uint16_t* r0 = static_cast<const uint16_t*>(w.rows[8 * i + 2 * t]);
        const uint16_t* r1 = static_cast<const uint16_t*>(w.rows[8 * i + 2 * t + 1]);
        r[i] = uint32_t(r0[g]) | (uint32_t(r1[g]) << 16);
    }
    w.barrier.arrive_and_wait();
}
