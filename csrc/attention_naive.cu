// Naive scaled-dot-product attention, forward only: the rung of the ladder between the formula
// (minitransformer/kernels/reference/formulas.py) and the fused kernel (attention.cu), written
// as llm.c's first attention kernels are. Paper section 3.2.1, equation (1):
//
//     O = softmax(Q K^T * scale + M) V          scale = 1/sqrt(d_k) by default
//
// Shapes and mask as attention.cu's: q, o (B, H, T, D); k, v (B, H, S, D); kv_lens (B,) int32
// or null; query i of batch b sees key j when j < kv_lens[b] and, if causal, j <= i + (S - T).
// A query that sees no key gets O = 0. Any head dim D; no dropout.
//
// Three kernels, one per step of the formula, each written as the step reads: no tiles, no
// shared memory, nothing fused.
//   scores    one thread per score:   P[bh,i,j] = scale * sum_d Q[bh,i,d] K[bh,j,d]  (-inf if masked)
//   softmax   one thread per row, in place, the textbook stable softmax in three passes: the
//             row's maximum, then e = exp(P - max) and its sum, then e / sum
//   pv        one thread per output:  O[bh,i,d] = sum_j P[bh,i,j] V[bh,j,d]
// Between them P, the B x H x T x S matrix of scores and then of weights, lives in global memory
// (float32, 4 B H T S bytes, allocated by the caller): the first kernel writes it, the second
// reads it three times and writes it twice, the third reads it. And every score re-reads a row
// of Q and a row of K, every output a column of V. The fused kernel moves none of P: it keeps
// each tile of scores on chip, and reads each row of K and V once per tile of queries.
//
// NumPy twin   minitransformer/kernels/reference/attention_naive.py
// tests        tests/kernels/test_attention_naive.py: the twin against the formula, these kernels
//              in the CPU emulator and on the device against float64.
#include "common.cuh"

namespace mt {
namespace {

constexpr int kThreads = 256;

// One past the last key that query i of batch b sees: it sees exactly the keys j < visible_end
// (the mask M; at most 0 for a query that sees none).
__device__ __forceinline__ int visible_end(const int* kv_lens, int b, int i, int T, int S, bool causal) {
    const int keys = kv_lens ? kv_lens[b] : S;
    return causal ? min(keys, i + (S - T) + 1) : keys;
}

// Elem is the storage type of q, k, v and o (float, __half or __nv_bfloat16); sums are float32.
template <typename Elem>
__global__ void scores_kernel(const Elem* __restrict__ q, const Elem* __restrict__ k,
                              const int* __restrict__ kv_lens, float* __restrict__ p, int H, int T,
                              int S, int D, float scale, bool causal, size_t count) {
    const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;  // ((bh * T) + i) * S + j
    if (idx >= count) return;
    const int j = int(idx % S);
    const size_t row = idx / S;  // bh * T + i
    const int i = int(row % T), b = int(row / T / H);
    if (j >= visible_end(kv_lens, b, i, T, S, causal)) {
        p[idx] = -INFINITY;
        return;
    }
    const Elem* qi = q + row * D;
    const Elem* kj = k + (row / T * S + j) * D;
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += to_float(qi[d]) * to_float(kj[d]);
    p[idx] = s * scale;
}

__global__ void softmax_kernel(float* __restrict__ p, int S, size_t rows) {
    const size_t row = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    float* r = p + row * S;
    float m = -INFINITY;
    for (int j = 0; j < S; ++j) m = fmaxf(m, r[j]);
    if (m == -INFINITY) {  // no visible key: weights 0, so O = 0 (exp(-inf - -inf) would be NaN)
        for (int j = 0; j < S; ++j) r[j] = 0.f;
        return;
    }
    float sum = 0.f;
    for (int j = 0; j < S; ++j) {
        r[j] = exp_diff(r[j], m);  // exp(-inf - m) = 0 for a masked key
        sum += r[j];
    }
    const float inv = 1.f / sum;  // sum >= 1: the maximum's own term is exp(0)
    for (int j = 0; j < S; ++j) r[j] *= inv;
}

template <typename Elem>
__global__ void pv_kernel(const float* __restrict__ p, const Elem* __restrict__ v,
                          const int* __restrict__ kv_lens, Elem* __restrict__ o, int H, int T,
                          int S, int D, bool causal, size_t count) {
    const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;  // ((bh * T) + i) * D + d
    if (idx >= count) return;
    const int d = int(idx % D);
    const size_t row = idx / D;  // bh * T + i
    const int i = int(row % T), b = int(row / T / H);
    const float* w = p + row * S;
    const Elem* vd = v + row / T * S * D + d;
    // Only the visible keys: a masked key's weight is 0, but its row of V, padding, may hold
    // anything (0 * inf is NaN).
    const int end = visible_end(kv_lens, b, i, T, S, causal);
    float acc = 0.f;
    for (int j = 0; j < end; ++j) acc += w[j] * to_float(vd[size_t(j) * D]);
    o[idx] = from_float<Elem>(acc);
}

// Blocks for one thread per item, checked against the grid's limit on x (2^31 - 1 blocks).
unsigned blocks_for(size_t items, const char* what) {
    const size_t blocks = (items + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffffu)
        throw std::invalid_argument(std::string("attention_naive_forward: ") + what + " needs " +
                                    std::to_string(blocks) + " blocks, past the grid's 2^31 - 1");
    return unsigned(blocks);
}

}  // namespace

void attention_naive_forward(const void* q, const void* k, const void* v, void* o, float* p,
                             const int* kv_lens, int dtype, int B, int H, int T, int S, int D,
                             float scale, bool causal, cudaStream_t stream) {
    const size_t rows = size_t(B) * H * T, scores = rows * S, outputs = rows * D;
    const unsigned score_blocks = blocks_for(scores, "the scores"), row_blocks = blocks_for(rows, "the softmax"),
                   output_blocks = blocks_for(outputs, "P V");
    with_type(dtype, "attention_naive_forward", [&](auto tag) {
        using Elem = decltype(tag);
        scores_kernel<Elem><<<score_blocks, kThreads, 0, stream>>>(
            static_cast<const Elem*>(q), static_cast<const Elem*>(k), kv_lens, p, H, T, S, D, scale,
            causal, scores);
        check_launch("attention_naive_forward (scores)");
        softmax_kernel<<<row_blocks, kThreads, 0, stream>>>(p, S, rows);
        check_launch("attention_naive_forward (softmax)");
        pv_kernel<Elem><<<output_blocks, kThreads, 0, stream>>>(
            p, static_cast<const Elem*>(v), kv_lens, static_cast<Elem*>(o), H, T, S, D, causal, outputs);
        check_launch("attention_naive_forward (P V)");
    });
}

}  // namespace mt
