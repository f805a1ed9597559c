// Shared by every kernel file: scalar types, error checks that become Python exceptions,
// ceil_div, and the warp / row reductions the normalisation kernels are built from.
//
// Dtype codes (the Python side passes them with every pointer):
//     0 float32     1 float16 (__half)     2 bfloat16 (__nv_bfloat16)
// 16-bit values are loaded, converted to float, and every sum and product is accumulated
// in float32; only the final results are rounded back to the storage type (except that
// attention's tensor-core path rounds P and dS to 16 bits as mma.sync inputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mt {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Carves consecutive 128-byte-aligned arrays out of dynamic shared memory, each kernel's only
// way to it. With a null base it only counts: the host sizes a launch by carving its layout
// the same way. The emulator (emu.h) gives each array bounds of its own, so that an overrun
// from one array into the next is caught; on the GPU, take() is this pointer arithmetic.
struct SmemCarver {
    unsigned char* base;
    size_t offset = 0;
    template <typename U>
    __host__ __device__ U* take(size_t count) {
#ifdef MT_EMULATED_SMEM
        U* p = base ? static_cast<U*>(mt_emu::carve_shared(offset, count * sizeof(U))) : nullptr;
#else
        U* p = reinterpret_cast<U*>(base + offset);
#endif
        offset += (count * sizeof(U) + 127) / 128 * 128;
        return p;
    }
};

// The C++ name of an element type, as c++filt prints it in a kernel instance's name.
template <typename T> constexpr const char* type_name();
template <> constexpr const char* type_name<float>() { return "float"; }
template <> constexpr const char* type_name<__half>() { return "__half"; }
template <> constexpr const char* type_name<__nv_bfloat16>() { return "__nv_bfloat16"; }

// "kernel<a, b>", a kernel instance's name as c++filt prints it (the launchers report their
// configurations under it, and tests/kernels/test_resources.py joins ptxas's figures on it).
template <typename... Args>
std::string instance_name(const char* kernel, const Args&... args) {
    std::ostringstream name;
    name << kernel << '<';
    const char* separator = "";
    ((name << separator << args, separator = ", "), ...);
    name << '>';
    return name.str();
}

inline const char* dtype_name(int code) {
    switch (code) {
        case kFloat32: return "float32";
        case kFloat16: return "float16";
        case kBFloat16: return "bfloat16";
        default: return "unknown";
    }
}

// Call f with a value of the element type that a dtype code names (the launchers' dispatch).
template <typename F>
void with_type(int dtype, const char* name, F&& f) {
    switch (dtype) {
        case kFloat32: f(float{}); return;
        case kFloat16: f(__half{}); return;
        case kBFloat16: f(__nv_bfloat16{}); return;
    }
    throw std::invalid_argument(std::string(name) + ": unsupported dtype code " + std::to_string(dtype));
}

// Raise (as std::runtime_error -> Python RuntimeError) if the last launch failed.
// Launch errors (bad configuration, too much shared memory) surface here at once;
// faults inside a running kernel surface at the next synchronising call.
inline void check_launch(const char* kernel) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string(kernel) + ": CUDA error " + cudaGetErrorName(err) +
                                 ": " + cudaGetErrorString(err));
    }
}

inline void check_cuda(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string(what) + ": CUDA error " + cudaGetErrorName(err) +
                                 ": " + cudaGetErrorString(err));
    }
}

// Opt a kernel into more than the default 48 KiB of dynamic shared memory.
template <typename Kernel>
inline void allow_shared_memory(Kernel kernel, size_t bytes, const char* name) {
    if (bytes > 48 * 1024) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)),
                   name);
    }
}

__host__ __device__ constexpr inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------- conversions

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------- reductions

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Online softmax state of a set of values: running maximum m and s = sum exp(x - m). Two
// states merge exactly (Milakov & Gimelshein, 2018), so a row can be reduced in one pass across
// threads. m = -inf means "no finite value seen yet"; then s = 0. Each exponential is of a
// difference, taken first: exp(x - m) = 2^((x - m) log2 e), and exp2f is a single hardware
// instruction (MUFU.EX2) where an accurate expf is a dozen, which matters for kernels that must
// keep up with memory bandwidth. Scaling x by log2 e before subtracting would overflow a
// bfloat16 logit near its largest value (3.4e38 x 1.44) and, at |x| ~ 1e4, round away three
// digits that x - m keeps exactly.
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float exp_diff(float x, float m) { return exp2f((x - m) * kLog2e); }

struct MaxSum {
    float m;
    float s;
};

__device__ __forceinline__ MaxSum maxsum_merge(MaxSum a, MaxSum b) {
    float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.f};
    return {m, a.s * exp_diff(a.m, m) + b.s * exp_diff(b.m, m)};
}

// Add one value x to a state: one exponential per value (the sum is rescaled only when x is a
// new maximum). x = -inf (a masked entry) leaves the state unchanged.
__device__ __forceinline__ MaxSum maxsum_add(MaxSum a, float x) {
    if (x == -INFINITY) return a;  // also keeps -inf - (-inf) = NaN out of the empty state
    if (x <= a.m) return {a.m, a.s + exp_diff(x, a.m)};
    return {x, a.s * exp_diff(a.m, x) + 1.f};
}

__device__ __forceinline__ MaxSum warp_maxsum(MaxSum v) {
    for (int o = 16; o > 0; o >>= 1) {
        MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
        v = maxsum_merge(v, other);
    }
    return v;
}

// Reductions over the THREADS threads that share one row: a warp (THREADS == 32, no shared
// memory, no barrier) or a whole block (THREADS > 32: warp results meet in shared memory).
// Every thread of the row gets the result. Each kernel makes at most one call of each per
// block, so none waits for an earlier call's readers of its shared array: a kernel that called
// one twice would need a __syncthreads() between the calls, as CUB's block reductions do.
template <int THREADS>
__device__ __forceinline__ float row_sum(float v) {
    v = warp_sum(v);
    if constexpr (THREADS > 32) {
        __shared__ float part[THREADS / 32];
        int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) part[warp] = v;
        __syncthreads();
        v = lane < THREADS / 32 ? part[lane] : 0.f;
        v = warp_sum(v);
    }
    return v;
}

template <int THREADS>
__device__ __forceinline__ MaxSum row_maxsum(MaxSum v) {
    v = warp_maxsum(v);
    if constexpr (THREADS > 32) {
        __shared__ float part_m[THREADS / 32];
        __shared__ float part_s[THREADS / 32];
        int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) {
            part_m[warp] = v.m;
            part_s[warp] = v.s;
        }
        __syncthreads();
        v = lane < THREADS / 32 ? MaxSum{part_m[lane], part_s[lane]} : MaxSum{-INFINITY, 0.f};
        v = warp_maxsum(v);
    }
    return v;
}

}  // namespace mt
