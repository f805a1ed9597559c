// Row softmax (with scale and mask), its backward, and the vocabulary softmax fused with
// label-smoothed cross-entropy (paper section 5.4) and its gradient.
//
// Softmax of row x (length V), with optional scale a and mask (0 = masked):
//     y_k = exp(a x_k - m) / sum_j exp(a x_j - m)     over unmasked k, m = max_j a x_j
// One read pass computes m and the sum together (online softmax: the running sum is rescaled
// whenever the running maximum grows), a second pass writes y. A fully masked row, or one whose
// entries are all -inf, gives y = 0. Every exponential is of a difference with the maximum
// (exp_diff in common.cuh), so logits anywhere in the type's range work.
// Backward: dx = a * y * (g - sum_k g_k y_k).
//
// Cross-entropy of logits z (N, V) against targets t, smoothing eps, per row:
//     lse  = m + log sum_k exp(z_k - m),  m = max_k z_k
//     loss = (1 - eps) (lse - z_t) + eps (lse - mean_k z_k)
// with lse - z_t taken as (m - z_t) + log sum and lse - mean z as (m - z_0) - mean_k (z_k - z_0)
// + log sum: at logits of 1e30 the loss is a few units, which lse - z_t or a sum of the logits
// would lose to cancellation (the differences are exact where logits are close, however large;
// dividing each by V first keeps their sum finite).
//     dloss/dz_k = softmax(z)_k - eps / V - (1 - eps) [k == t]
// and, where the caller asks for it, the unsmoothed nll = lse - z_t (for perplexity). The first
// pass gathers max, sum of exponentials and sum of logits in one read; the second writes the
// gradient, optionally over the logits themselves (at a 37k vocabulary the logits are the
// largest tensor of a step, so the gradient takes no new memory). Rows whose target is
// ignore_index get loss 0 (and nll 0) and gradient 0. The gradient is that of each row's own
// loss; the caller scales it by the reduction's weights in backward.
//
// Rows of up to 1024 elements take one warp each (4 rows per block); longer rows a whole
// 256-thread block, which reduces through shared memory.
//
// NumPy twins  minitransformer/kernels/reference/softmax.py, reference/cross_entropy.py
// tests        tests/kernels/test_softmax.py, test_cross_entropy.py: each twin against its
//              formula, these kernels in the CPU emulator and on the device against float64.
#include "common.cuh"

namespace mt {
namespace {

template <int THREADS> __host__ __device__ constexpr int rows_per_block() { return THREADS == 32 ? 4 : 1; }

template <int THREADS>
__device__ __forceinline__ int row_index() {
    return blockIdx.x * rows_per_block<THREADS>() + threadIdx.x / THREADS;
}

template <typename T, int THREADS>
__global__ void softmax_forward_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask,
                                       T* __restrict__ y, int N, int V, float scale) {
    const int row = row_index<THREADS>(), tid = threadIdx.x % THREADS;
    // Block-wide rows never exit early: every thread must reach the reductions' barriers.
    const bool active = row < N;
    const size_t base = size_t(active ? row : 0) * V;
    MaxSum acc{-INFINITY, 0.f};
    if (active) {
        for (int k = tid; k < V; k += THREADS) {
            if (mask && !mask[base + k]) continue;
            acc = maxsum_add(acc, scale * to_float(x[base + k]));
        }
    }
    acc = row_maxsum<THREADS>(acc);
    if (!active) return;
    // A row with nothing to normalise (fully masked, or every entry -inf) keeps m = -inf; take
    // m = 0 there, so its entries give exp(-inf) * 0 = 0 rather than exp(-inf + inf) = NaN.
    const float m = acc.s > 0.f ? acc.m : 0.f;
    const float inv = acc.s > 0.f ? 1.f / acc.s : 0.f;
    for (int k = tid; k < V; k += THREADS) {
        bool masked = mask && !mask[base + k];
        y[base + k] = from_float<T>(masked ? 0.f : exp_diff(scale * to_float(x[base + k]), m) * inv);
    }
}

template <typename T, int THREADS>
__global__ void softmax_backward_kernel(const T* __restrict__ y, const T* __restrict__ g,
                                        T* __restrict__ dx, int N, int V, float scale) {
    const int row = row_index<THREADS>(), tid = threadIdx.x % THREADS;
    const bool active = row < N;
    const size_t base = size_t(active ? row : 0) * V;
    float dot = 0.f;
    if (active)
        for (int k = tid; k < V; k += THREADS) dot += to_float(g[base + k]) * to_float(y[base + k]);
    dot = row_sum<THREADS>(dot);
    if (!active) return;
    for (int k = tid; k < V; k += THREADS) {
        float yk = to_float(y[base + k]);
        dx[base + k] = from_float<T>(scale * yk * (to_float(g[base + k]) - dot));
    }
}

template <typename T, int THREADS>
__global__ void cross_entropy_kernel(const T* logits, const int64_t* __restrict__ target,
                                     float* __restrict__ loss, float* __restrict__ nll, T* grad,
                                     int N, int V, float smoothing, bool has_ignore, int64_t ignore_index) {
    // `logits` and `grad` may be the same array, hence no __restrict__ on them.
    const int row = row_index<THREADS>(), tid = threadIdx.x % THREADS;
    const bool active = row < N;
    const size_t base = size_t(active ? row : 0) * V;
    const int64_t t = active ? target[row] : 0;
    const bool ignored = !active || (has_ignore && t == ignore_index);
    // Read everything this row needs before any thread overwrites it with the gradient.
    const float z_t = ignored ? 0.f : to_float(logits[base + t]);
    const float z_0 = ignored ? 0.f : to_float(logits[base]);
    MaxSum acc{-INFINITY, 0.f};
    float mean_d = 0.f;  // mean_k (z_k - z_0)
    const float inv_V = 1.f / V;
    if (!ignored) {
        for (int k = tid; k < V; k += THREADS) {
            float z = to_float(logits[base + k]);
            acc = maxsum_add(acc, z);
            mean_d += (z - z_0) * inv_V;
        }
    }
    acc = row_maxsum<THREADS>(acc);
    mean_d = row_sum<THREADS>(mean_d);
    if (!active) return;
    const float log_s = logf(acc.s);  // lse = acc.m + log_s
    if (tid == 0) {
        const float nll_t = (acc.m - z_t) + log_s;
        loss[row] = ignored ? 0.f
                            : (1.f - smoothing) * nll_t + smoothing * (((acc.m - z_0) - mean_d) + log_s);
        if (nll) nll[row] = ignored ? 0.f : nll_t;
    }
    if (!grad) return;
    const float off = smoothing / V;
    for (int k = tid; k < V; k += THREADS) {
        float gk = 0.f;
        if (!ignored) {
            gk = exp2f(((to_float(logits[base + k]) - acc.m) - log_s) * kLog2e) - off;
            if (k == t) gk -= 1.f - smoothing;
        }
        grad[base + k] = from_float<T>(gk);
    }
}

// Calls f(integral_constant<THREADS>) with the row width for V, and gives the grid size.
template <typename F>
void with_row_threads(int N, int V, cudaStream_t stream, F&& f) {
    if (V <= 1024) f(std::integral_constant<int, 32>{}, ceil_div(N, rows_per_block<32>()));
    else f(std::integral_constant<int, 256>{}, N);
}

}  // namespace

void softmax_forward(const void* x, const uint8_t* mask, void* y, int dtype, int N, int V,
                     float scale, cudaStream_t stream) {
    with_type(dtype, "softmax_forward", [&](auto tag) {
        using T = decltype(tag);
        with_row_threads(N, V, stream, [&](auto threads, int grid) {
            constexpr int R = decltype(threads)::value;
            softmax_forward_kernel<T, R><<<grid, R * rows_per_block<R>(), 0, stream>>>(
                static_cast<const T*>(x), mask, static_cast<T*>(y), N, V, scale);
        });
    });
    check_launch("softmax_forward");
}

void softmax_backward(const void* y, const void* g, void* dx, int dtype, int N, int V,
                      float scale, cudaStream_t stream) {
    with_type(dtype, "softmax_backward", [&](auto tag) {
        using T = decltype(tag);
        with_row_threads(N, V, stream, [&](auto threads, int grid) {
            constexpr int R = decltype(threads)::value;
            softmax_backward_kernel<T, R><<<grid, R * rows_per_block<R>(), 0, stream>>>(
                static_cast<const T*>(y), static_cast<const T*>(g), static_cast<T*>(dx), N, V, scale);
        });
    });
    check_launch("softmax_backward");
}

void cross_entropy_forward(const void* logits, const int64_t* target, float* loss, float* nll,
                           void* grad, int dtype, int N, int V, float smoothing, bool has_ignore,
                           int64_t ignore_index, cudaStream_t stream) {
    with_type(dtype, "cross_entropy_forward", [&](auto tag) {
        using T = decltype(tag);
        with_row_threads(N, V, stream, [&](auto threads, int grid) {
            constexpr int R = decltype(threads)::value;
            cross_entropy_kernel<T, R><<<grid, R * rows_per_block<R>(), 0, stream>>>(
                static_cast<const T*>(logits), target, loss, nll, static_cast<T*>(grad), N, V,
                smoothing, has_ignore, ignore_index);
        });
    });
    check_launch("cross_entropy_forward");
}

}  // namespace mt
