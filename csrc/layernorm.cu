// Layer normalisation over the last axis (Ba et al. 2016; paper section 3.1), forward and
// backward, for x of shape (N, D) with optional weight and bias of shape (D,).
//
//     mean = (1/D) sum_c x_c      rstd = 1 / sqrt((1/D) sum_c (x_c - mean)^2 + eps)
//     y_c  = (x_c - mean) * rstd * w_c + b_c
//
// Forward: one warp per row. The statistics take one pass over the row: every lane runs
// Welford's update over its columns, and the 32 partial (count, mean, M2) triples are merged
// with Chan et al.'s formula, which is exact in real arithmetic and avoids the cancellation of
// sum(x^2) - D mean^2. A second, cache-resident read of the row writes y. Saves mean and rstd
// (float32, (N,)).
//
// Backward, with xhat = (x - mean) * rstd and gh = g * w:
//     dx = rstd * (gh - mean_c(gh) - xhat * mean_c(gh * xhat))
//     dw = sum_rows g * xhat          db = sum_rows g
// dx is again one warp per row. The column sums dw, db are accumulated in shared memory, one
// slice per warp, where every column belongs to one lane (no atomics, no bank conflicts);
// each block sums its warps' slices into one partial row, and a second kernel sums the rows
// over blocks: no atomics anywhere, a deterministic result. The slices take 8 D bytes per
// warp: with 4 warps, 128 KiB at D = 4096, more than RTX 30/40, A10, L4 and L40 allow a block
// (99 KiB); there, rows wider than 3168 run in blocks of 2 warps (launch_config.cuh).
//
// NumPy twin   minitransformer/kernels/reference/layernorm.py
// tests        tests/kernels/test_layernorm.py: the twin against the formula, these kernels in
//              the CPU emulator and on the device against float64.
#include <vector>

#include "common.cuh"
#include "launch_config.cuh"
#include "limits.cuh"

namespace mt {
namespace {

constexpr int kWarpsPerBlock = 4;  // forward; backward where its shared memory allows

// VEC consecutive elements moved as one 16-byte (or narrower) memory access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_pack(const T* src, int c, float (&out)[VEC]) {
    Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(src + c);
    #pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_float(p.v[e]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* dst, int c, const float (&in)[VEC]) {
    Pack<T, VEC> p;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) p.v[e] = from_float<T>(in[e]);
    *reinterpret_cast<Pack<T, VEC>*>(dst + c) = p;
}

template <typename T, int VEC>
__global__ void layernorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                         const T* __restrict__ b, T* __restrict__ y,
                                         float* __restrict__ mean, float* __restrict__ rstd,
                                         int N, int D, float eps) {
    const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const T* xr = x + size_t(row) * D;

    float count = 0.f, mu = 0.f, m2 = 0.f;  // this lane's Welford state
    for (int c = lane * VEC; c < D; c += 32 * VEC) {
        float v[VEC];
        load_pack<T, VEC>(xr, c, v);
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            count += 1.f;
            float d = v[e] - mu;
            mu += d / count;
            m2 += d * (v[e] - mu);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {  // Chan et al.: merge (count, mu, m2) of two lanes
        float cb = __shfl_xor_sync(0xffffffffu, count, o);
        float mub = __shfl_xor_sync(0xffffffffu, mu, o);
        float m2b = __shfl_xor_sync(0xffffffffu, m2, o);
        float total = count + cb;
        if (total > 0.f) {
            float delta = mub - mu;
            mu += delta * (cb / total);
            m2 += m2b + delta * delta * (count * cb / total);
        }
        count = total;
    }
    // Lanes may differ in the last bit after the butterfly; everyone uses lane 0's values.
    mu = __shfl_sync(0xffffffffu, mu, 0);
    const float rs = rsqrtf(__shfl_sync(0xffffffffu, m2, 0) / D + eps);
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
    T* yr = y + size_t(row) * D;
    for (int c = lane * VEC; c < D; c += 32 * VEC) {
        float v[VEC], wv[VEC], bv[VEC];
        load_pack<T, VEC>(xr, c, v);
        if (w) load_pack<T, VEC>(w, c, wv);
        if (b) load_pack<T, VEC>(b, c, bv);
        #pragma unroll
        for (int e = 0; e < VEC; ++e)
            v[e] = (v[e] - mu) * rs * (w ? wv[e] : 1.f) + (b ? bv[e] : 0.f);
        store_pack<T, VEC>(yr, c, v);
    }
}

// Where column c of a warp's slice lives: lane l handles columns l * VEC + e (+ 32 VEC j), so
// storing element e of every pack contiguously puts a warp's 32 lanes in 32 banks.
template <int VEC>
__device__ __forceinline__ int slice_slot(int c, int D) {
    return (c % VEC) * (D / VEC) + c / VEC;
}

// dx per row; per-block partial column sums of g * xhat and g into partial[block] (2, D).
// Blocks of WARPS warps.
template <typename T, int VEC, int WARPS>
__global__ void layernorm_backward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd,
                                          const T* __restrict__ g, T* __restrict__ dx,
                                          float* __restrict__ partial, int N, int D) {
    extern __shared__ __align__(128) unsigned char smem[];
    float* slices = SmemCarver{smem}.take<float>(2 * D * WARPS);  // per warp: g * xhat, then g
    for (int c = threadIdx.x; c < 2 * D * WARPS; c += blockDim.x) slices[c] = 0.f;
    __syncthreads();
    const int lane = threadIdx.x % 32;
    float* mine = slices + (threadIdx.x / 32) * 2 * D;
    for (int row = blockIdx.x * WARPS + threadIdx.x / 32; row < N; row += gridDim.x * WARPS) {
        const T* xr = x + size_t(row) * D;
        const T* gr = g + size_t(row) * D;
        const float mu = mean[row], rs = rstd[row];
        float sum_gh = 0.f, sum_gh_xhat = 0.f;
        for (int c = lane * VEC; c < D; c += 32 * VEC) {
            float xv[VEC], gv[VEC], wv[VEC];
            load_pack<T, VEC>(xr, c, xv);
            load_pack<T, VEC>(gr, c, gv);
            if (w) load_pack<T, VEC>(w, c, wv);
            #pragma unroll
            for (int e = 0; e < VEC; ++e) {
                float xhat = (xv[e] - mu) * rs;
                float gh = gv[e] * (w ? wv[e] : 1.f);
                sum_gh += gh;
                sum_gh_xhat += gh * xhat;
                const int slot = slice_slot<VEC>(c + e, D);
                mine[slot] += gv[e] * xhat;
                mine[D + slot] += gv[e];
            }
        }
        const float mean_gh = warp_sum(sum_gh) / D, mean_gh_xhat = warp_sum(sum_gh_xhat) / D;
        T* dxr = dx + size_t(row) * D;
        for (int c = lane * VEC; c < D; c += 32 * VEC) {
            float xv[VEC], gv[VEC], wv[VEC], out[VEC];
            load_pack<T, VEC>(xr, c, xv);
            load_pack<T, VEC>(gr, c, gv);
            if (w) load_pack<T, VEC>(w, c, wv);
            #pragma unroll
            for (int e = 0; e < VEC; ++e) {
                float xhat = (xv[e] - mu) * rs;
                float gh = gv[e] * (w ? wv[e] : 1.f);
                out[e] = rs * (gh - mean_gh - xhat * mean_gh_xhat);
            }
            store_pack<T, VEC>(dxr, c, out);
        }
    }
    __syncthreads();
    float* out = partial + size_t(blockIdx.x) * 2 * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        const int slot = slice_slot<VEC>(c, D);
        float sw = 0.f, sb = 0.f;
        #pragma unroll
        for (int wi = 0; wi < WARPS; ++wi) {
            sw += slices[wi * 2 * D + slot];
            sb += slices[wi * 2 * D + D + slot];
        }
        out[c] = sw;
        out[D + c] = sb;
    }
}

// dw[c] = sum over blocks of partial[blk][0][c]; db likewise from partial[blk][1][c].
template <typename T>
__global__ void layernorm_param_grad_kernel(const float* __restrict__ partial, int blocks, int D,
                                            T* __restrict__ dw, T* __restrict__ db) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    float sw = 0.f, sb = 0.f;
    for (int blk = 0; blk < blocks; ++blk) {
        sw += partial[size_t(blk) * 2 * D + c];
        sb += partial[size_t(blk) * 2 * D + D + c];
    }
    if (dw) dw[c] = from_float<T>(sw);
    if (db) db[c] = from_float<T>(sb);
}

// 16-byte accesses when every row starts 16-byte aligned (D a multiple of 16 / sizeof(T)).
template <typename T, typename F>
void with_vec(int D, F&& f) {
    constexpr int kVec = 16 / sizeof(T);
    if (D % kVec == 0) f(std::integral_constant<int, kVec>{});
    else f(std::integral_constant<int, 1>{});
}

// A compiled backward kernel and the shared memory its blocks take for rows of D.
template <typename T, int VEC>
struct BackwardKernel : LaunchConfig {
    int warps;
    void (*kernel)(const T*, const T*, const float*, const float*, const T*, T*, float*, int, int);
};

// Blocks of 4 warps, or of 2 where 4 warps' column sums do not fit (launch_config.cuh).
template <typename T, int VEC>
std::vector<BackwardKernel<T, VEC>> backward_kernels(int D) {
    auto with_warps = [D](auto warps) -> BackwardKernel<T, VEC> {
        constexpr int W = decltype(warps)::value;
        return {{instance_name("layernorm_backward_kernel", type_name<T>(), VEC, W),
                 2 * size_t(D) * W * sizeof(float)},
                W, layernorm_backward_kernel<T, VEC, W>};
    };
    return {with_warps(std::integral_constant<int, kWarpsPerBlock>{}),
            with_warps(std::integral_constant<int, 2>{})};
}

}  // namespace

void layernorm_forward(const void* x, const void* w, const void* b, void* y, float* mean,
                       float* rstd, int dtype, int N, int D, float eps, cudaStream_t stream) {
    with_type(dtype, "layernorm_forward", [&](auto tag) {
        using T = decltype(tag);
        with_vec<T>(D, [&](auto vec) {
            layernorm_forward_kernel<T, decltype(vec)::value>
                <<<ceil_div(N, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
                    static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(b),
                    static_cast<T*>(y), mean, rstd, N, D, eps);
        });
    });
    check_launch("layernorm_forward");
}

void layernorm_backward(const void* x, const void* w, const float* mean, const float* rstd,
                        const void* g, void* dx, void* dw, void* db, float* partial, int blocks,
                        int dtype, int N, int D, size_t smem_limit, cudaStream_t stream) {
    if (D > limits::kLayernormMaxD)
        throw std::invalid_argument("layernorm_backward: D = " + std::to_string(D) + " exceeds " +
                                    std::to_string(limits::kLayernormMaxD) +
                                    ", the widest row whose column sums fit in shared memory");
    with_type(dtype, "layernorm_backward", [&](auto tag) {
        using T = decltype(tag);
        with_vec<T>(D, [&](auto vec) {
            const auto kernels = backward_kernels<T, decltype(vec)::value>(D);
            const auto& k = choose(kernels, smem_limit, "layernorm_backward");
            auto kernel = k.kernel;
            allow_shared_memory(kernel, k.smem, "layernorm_backward");
            kernel<<<blocks, 32 * k.warps, k.smem, stream>>>(
                static_cast<const T*>(x), static_cast<const T*>(w), mean, rstd,
                static_cast<const T*>(g), static_cast<T*>(dx), partial, N, D);
        });
        check_launch("layernorm_backward");
        if (dw || db) {
            layernorm_param_grad_kernel<T><<<ceil_div(D, 256), 256, 0, stream>>>(
                partial, blocks, D, static_cast<T*>(dw), static_cast<T*>(db));
            check_launch("layernorm_backward (weight and bias gradients)");
        }
    });
}

std::vector<LaunchConfig> layernorm_backward_configs(int dtype, int D) {
    std::vector<LaunchConfig> configs;
    with_type(dtype, "layernorm_backward_configs", [&](auto tag) {
        using T = decltype(tag);
        with_vec<T>(D, [&](auto vec) {
            for (const auto& k : backward_kernels<T, decltype(vec)::value>(D)) configs.push_back(k);
        });
    });
    return configs;
}

}  // namespace mt
