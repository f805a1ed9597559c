// Tiled scaled-dot-product attention, forward only: the ladder's second rung, between the naive
// kernels (attention_naive.cu) and the fused one (attention.cu). Paper section 3.2.1, equation (1):
//
//     O = softmax(Q K^T * scale + M) V          scale = 1/sqrt(d_k) by default
//
// Shapes and mask as attention.cu's: q, o (B, H, T, D); k, v (B, H, S, D); kv_lens (B,) int32
// or null; query i of batch b sees key j when j < kv_lens[b] and, if causal, j <= i + (S - T).
// A query that sees no key gets O = 0. Any head dim D up to kMaxD; no dropout.
//
// One kernel. A block of 256 threads owns BR = 16 queries and streams K and V through shared
// memory in tiles of BC = 16 keys; each thread owns one score of the 16 x 16 tile, (r, c) =
// (threadIdx.x / BC, threadIdx.x % BC). What the naive kernels sent through global memory, the
// scores and the weights, stays in shared memory a tile at a time. But the softmax needs a row's
// maximum before its first exponential, and without the fused kernel's online rescaling that
// takes a pass of its own, so the scores are computed twice:
//   pass 1   for each tile of K: the tile's scores; m_i = the maximum of row i's scores
//   pass 2   for each tile of K and V: the scores again, P = exp(S - m_i) (0 where masked);
//            l_i += sum_j P_ij and acc_i += P V, the tile of V taking K's place in shared memory
//   then     O_i = acc_i / l_i (0 where l_i = 0: the query sees no key)
// K is read twice and Q K^T computed twice, where the fused kernel reads K once: the price of
// the separate pass, which the online softmax (Milakov & Gimelshein, 2018) removes.
//
// NumPy twin   minitransformer/kernels/reference/attention_tiled.py
// tests        tests/kernels/test_attention_tiled.py: the twin against the formula, this kernel
//              in the CPU emulator and on the device against float64.
#include "common.cuh"
#include "limits.cuh"

namespace mt {
namespace {

constexpr int BR = 16;              // queries per block
constexpr int BC = 16;              // keys per tile
constexpr int kThreads = BR * BC;   // a thread per score of the tile
constexpr int kMaxD = limits::kAttentionTiledMaxD;
constexpr int kOutputs = kMaxD / BC;  // outputs a thread keeps: d = c, c + BC, ... < D

// Rows of the Q and K/V tiles in shared memory, D floats each, at an odd stride: the 16 threads
// of a row read K_j[d] for 16 keys j at once, which an odd stride puts in 16 different banks
// (at an even D, say 64, all 16 would share one bank).
__host__ __device__ constexpr int tile_ld(int D) { return D | 1; }

// Shared memory of one block, at row stride ld: carved so by the kernel, and with a null base
// by shared_bytes, which sizes the launch; one layout, so the two cannot disagree.
struct Tiles {
    float* q;   // the Q tile: BR rows
    float* kv;  // a tile of K, then of V: BC rows
    float* s;   // the tile's scores (pass 1) or weights (pass 2)
    __host__ __device__ Tiles(SmemCarver& c, int ld)
        : q(c.take<float>(BR * ld)), kv(c.take<float>(BC * ld)), s(c.take<float>(BR * BC)) {}
};

__host__ __device__ size_t shared_bytes(int D) {
    SmemCarver c{nullptr};
    Tiles(c, tile_ld(D));  // a null base: only the offsets advance
    return c.offset;
}

// rows x D of src (rows of D elements, contiguous) into dst at stride ld as float32; the rows at
// and past `valid` as zeros: padding and the rows past T or S are never read.
template <typename Elem>
__device__ void load_rows(float* dst, int ld, const Elem* src, int rows, int valid, int D) {
    for (int e = threadIdx.x; e < rows * D; e += kThreads) {
        const int row = e / D, d = e % D;
        dst[row * ld + d] = row < valid ? to_float(src[size_t(row) * D + d]) : 0.f;
    }
}

// The score of the tile's query row r and key row c, q_r . k_c * scale: one thread's dot product,
// its operands read from shared memory a float at a time.
__device__ __forceinline__ float score(const float* sQ, const float* sK, int ld, int r, int c, int D, float scale) {
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += sQ[r * ld + d] * sK[c * ld + d];
    return s * scale;
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads) attention_tiled_kernel(
        const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v,
        const int* __restrict__ kv_lens, Elem* __restrict__ o, int H, int T, int S, int D, float scale, bool causal) {
    extern __shared__ __align__(128) unsigned char smem[];
    SmemCarver carve{smem};
    const int ld = tile_ld(D);
    const Tiles tiles(carve, ld);
    float *sQ = tiles.q, *sKV = tiles.kv, *sS = tiles.s;

    const int bh = blockIdx.y, b = bh / H, q0 = blockIdx.x * BR;
    const int r = threadIdx.x / BC, c = threadIdx.x % BC, i = q0 + r;
    const int kv_len = kv_lens ? min(max(kv_lens[b], 0), S) : S;
    // Query i sees the keys j < end; the block's last query sees the most of them.
    const int end = causal ? min(kv_len, i + (S - T) + 1) : kv_len;
    const int block_end = causal ? min(kv_len, min(q0 + BR, T) + (S - T)) : kv_len;
    const Elem* kb = k + size_t(bh) * S * D;
    const Elem* vb = v + size_t(bh) * S * D;

    load_rows(sQ, ld, q + (size_t(bh) * T + q0) * D, BR, T - q0, D);


    // Pass 1: m = the maximum of the row's scores.
    float m = -INFINITY;
    for (int k0 = 0; k0 < block_end; k0 += BC) {
        load_rows(sKV, ld, kb + size_t(k0) * D, BC, block_end - k0, D);
        __syncthreads();
        sS[r * BC + c] = k0 + c < end ? score(sQ, sKV, ld, r, c, D, scale) : -INFINITY;  // -inf: masked
        __syncthreads();
        // No barrier after this: the next tile's load writes sKV, which no thread reads past the
        // barrier above, and sS is written again only past the barrier after that load.
        for (int j = 0; j < BC; ++j) m = fmaxf(m, sS[r * BC + j]);
    }  // pass 1 done: m is final

    // Pass 2: P = exp(S - m), its row sums l, and acc = P V, this thread's outputs d = c + BC n.
    float l = 0.f, acc[kOutputs] = {};
    for (int k0 = 0; k0 < block_end; k0 += BC) {
        load_rows(sKV, ld, kb + size_t(k0) * D, BC, block_end - k0, D);
        __syncthreads();
        // Where key k0 + c is seen, m is finite (at least its score).
        sS[r * BC + c] = k0 + c < end ? exp_diff(score(sQ, sKV, ld, r, c, D, scale), m) : 0.f;
        __syncthreads();  // the weights complete, and the K tile read: V takes its place
        load_rows(sKV, ld, vb + size_t(k0) * D, BC, block_end - k0, D);
        __syncthreads();
        for (int j = 0; j < BC; ++j) {
            const float p = sS[r * BC + j];
            l += p;
            #pragma unroll
            for (int n = 0; n < kOutputs; ++n)
                if (c + BC * n < D) acc[n] += p * sKV[j * ld + c + BC * n];
        }
        __syncthreads();
    }  // pass 2 done

    if (i >= T) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;  // l >= 1 where a key is seen: its maximum's exp(0)
    Elem* out = o + (size_t(bh) * T + i) * D;
    #pragma unroll
    for (int n = 0; n < kOutputs; ++n)
        if (c + BC * n < D) out[c + BC * n] = from_float<Elem>(acc[n] * inv);
}

}  // namespace

void attention_tiled_forward(const void* q, const void* k, const void* v, void* o, const int* kv_lens,
                             int dtype, int B, int H, int T, int S, int D, float scale, bool causal,
                             cudaStream_t stream) {
    if (D > kMaxD)
        throw std::invalid_argument("attention_tiled_forward: head dim " + std::to_string(D) +
                                    " is past the kernel's " + std::to_string(kMaxD));
    if (static_cast<long long>(B) * H > limits::kMaxGridY)
        throw std::invalid_argument("attention_tiled_forward: B * H = " +
                                    std::to_string(static_cast<long long>(B) * H) + " exceeds " +
                                    std::to_string(limits::kMaxGridY) + ", the blocks a grid may have along y");
    const dim3 grid(ceil_div(T, BR), B * H);  // a block per BR queries
    with_type(dtype, "attention_tiled_forward", [&](auto tag) {
        using Elem = decltype(tag);
        attention_tiled_kernel<Elem><<<grid, kThreads, shared_bytes(D), stream>>>(
            static_cast<const Elem*>(q), static_cast<const Elem*>(k), static_cast<const Elem*>(v), kv_lens,
            static_cast<Elem*>(o), H, T, S, D, scale, causal);
        check_launch("attention_tiled_forward");
    });
}

}  // namespace mt
