// Fused scaled-dot-product attention, forward and backward, in the FlashAttention manner
// (Dao et al. 2022; FlashAttention-2, Dao 2023). Paper section 3.2.1, equation (1):
//
//     O = softmax(Q K^T * scale + M) V          scale = 1/sqrt(d_k) by default
//
// Shapes (contiguous): q, o (B, H, T, D); k, v (B, H, S, D); lse (B, H, T) float32;
// kv_lens (B,) int32 or null. D is 32, 64 or 128. The mask M is built on the fly:
//   - key padding: key j of batch b exists only for j < kv_lens[b];
//   - causal: query i sees keys j <= i + (S - T) (aligned bottom-right, as the composite op).
// A query that sees no key at all gets O = 0 and lse = -inf, and zero gradients.
//
// Forward. One block owns BR query rows of one (b, h) and streams K/V in tiles of BC keys,
// so the T x S score matrix never exists in memory. Per row it keeps the online-softmax state
// (running max m, running sum l, unnormalised output O):
//     S_tile = Q K_tile^T * scale (masked -> -inf)       m' = max(m, rowmax S_tile)
//     P = exp(S_tile - m')     l = l * exp(m - m') + rowsum P     O = O * exp(m - m') + P V_tile
// and finally O /= l and lse = m + log l (the only statistic saved for backward).
// Key tiles entirely in a query tile's causal future are never loaded.
//
// Backward (FlashAttention-2). delta_i = sum_d dO_i,d O_i,d first; then one block owns BC keys
// and streams the query tiles that can see them, recomputing P from lse:
//     P = exp(Q K^T * scale - lse)      dV += P^T dO      dP = dO V^T
//     dS = P * (dP - delta) * scale     dK += dS^T Q      dQ += dS K   (atomics into float32)
//
// Dropout on the attention weights (rate p) uses a counter-based generator: the keep bit of
// weight (b*H + h, i, j) is a pure function of (seed, b*H + h, i, j) (Philox4x32-10, Salmon et
// al. 2011), so backward regenerates exactly forward's mask without storing it. Kept weights are
// scaled by 1/(1-p); l is summed before dropout, so softmax normalisation is unaffected.
//
// Two implementations, chosen by dtype:
//   float16 / bfloat16   tensor cores (PTX mma.sync, float32 accumulation) with
//                        FlashAttention-2's warp layout: each warp keeps its rows' scores,
//                        softmax state and accumulators in registers. The block's own tile
//                        is loaded once into shared memory (Q forward, kept as fragments;
//                        K/V backward, read as fragments each query tile); the streamed tiles
//                        (K/V forward, Q/dO backward) are double-buffered there with cp.async,
//                        and dS^T passes through it once per query tile. P and dS are rounded to the 16-bit type as
//                        mma.sync inputs.
//   float32              the reference-precision path: every tile in shared memory, products
//                        as register-blocked float32 FMAs, the same algorithm step by step.
//
// NumPy twin   minitransformer/kernels/reference/attention.py
// tests        tests/kernels/test_attention.py: the twin against the formula, these kernels in
//              the CPU emulator and on the device against float64.
#include <cuda_pipeline.h>

#include <type_traits>
#include <vector>

#include "common.cuh"
#include "launch_config.cuh"
#include "limits.cuh"

namespace mt {
namespace {

constexpr int kThreads = 128;  // 4 warps per block
constexpr int kWarps = kThreads / 32;

// Shared-memory row padding (16 bytes) so that consecutive rows start in different banks.
template <typename T> __host__ __device__ constexpr int pad_of() { return 16 / sizeof(T); }

struct AttnParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;     // forward output (read by backward)
    const void* dout;  // backward only
    void* out;         // forward: o; backward: unused
    void* dk;
    void* dv;
    float* lse;
    float* delta;      // backward: rowsum(dO * O)
    float* dq_accum;   // backward: float32 dQ accumulator (B, H, T, D)
    const int* kv_lens;
    int B, H, T, S;
    float scale;
    bool causal;
    uint32_t drop_threshold;  // drop where philox bits < threshold; 0 = no dropout
    float keep_scale;         // 1 / (1 - p)
    uint32_t seed0, seed1;
};

// ---------------------------------------------------------------------------- dropout RNG

// Philox4x32-10: ten rounds of multiply-xorshift on a 128-bit counter under a 64-bit key.
// Counter (j, i, bh, 0); the first output word decides weight (bh, i, j).
__device__ __forceinline__ uint32_t philox_bits(uint32_t c0, uint32_t c1, uint32_t c2,
                                                uint32_t k0, uint32_t k1) {
    uint32_t c3 = 0;
    #pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return c0;
}

// The factor that dropout applies to weight (bh, i, j): 0 or 1/(1-p).
__device__ __forceinline__ float dropout_factor(const AttnParams& p, int bh, int i, int j) {
    if (p.drop_threshold == 0) return 1.f;
    uint32_t bits = philox_bits(uint32_t(j), uint32_t(i), uint32_t(bh), p.seed0, p.seed1);
    return bits >= p.drop_threshold ? p.keep_scale : 0.f;
}

// ---------------------------------------------------------------------------- tile helpers

// Copy `valid` rows of a (rows, D) row-major global tile into shared memory with leading
// dimension `ld`, 16 bytes at a time; rows past `valid` become zeros (so that padding keys,
// whose memory may hold anything, contribute exact zeros to P V).
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int valid) {
    constexpr int kVec = 16 / sizeof(T);
    constexpr int kChunks = D / kVec;
    for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
        int r = i / kChunks, c = (i % kChunks) * kVec;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r < valid) val = *reinterpret_cast<const uint4*>(src + size_t(r) * D + c);
        *reinterpret_cast<uint4*>(dst + r * ld + c) = val;
    }
}

// The same tile copy issued asynchronously (cp.async, sm_80+), so that the next tile loads
// while the current one is computed on; rows past `valid` are zero-filled without reading
// global memory. Complete with __pipeline_commit, __pipeline_wait_prior and a barrier.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile_async(T* dst, int ld, const T* src, int valid) {
    constexpr int kVec = 16 / sizeof(T);
    constexpr int kChunks = D / kVec;
    for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
        int r = i / kChunks, c = (i % kChunks) * kVec;
        const bool ok = r < valid;
        __pipeline_memcpy_async(dst + r * ld + c, src + (ok ? size_t(r) * D + c : 0), 16, ok ? 0 : 16);
    }
}

template <int ROWS, int COLS>
__device__ __forceinline__ void zero_tile(float* dst, int ld) {
    for (int i = threadIdx.x; i < ROWS * COLS; i += kThreads) dst[(i / COLS) * ld + i % COLS] = 0.f;
}

struct RowMajor {};
struct ColMajor {};

// The leading dimension, in floats, of a float array of ROWS rows and COLS columns that
// smem_gemm and the row loops reach without bank conflicts (for COLS a multiple of 32). A warp of smem_gemm
// touches four rows ROWS / 16 apart, which a stride of COLS + kThreads / ROWS puts 8 banks
// apart (the 8 columns each row's lanes touch fill them); a row loop of kThreads / ROWS threads
// a row touches as many consecutive columns of each of 32 / (kThreads / ROWS) consecutive rows,
// which the same stride lays side by side over the 32 banks.
template <int ROWS, int COLS>
__host__ __device__ constexpr int padded_ld() {
    static_assert(kThreads % ROWS == 0, "padded_ld's shapes");
    return COLS + kThreads / ROWS;
}

// Element (r, c) of a shared-memory matrix stored in layout L with leading dimension ld.
template <typename L, typename T>
__device__ __forceinline__ const T* at(const T* base, int ld, int r, int c) {
    if constexpr (std::is_same_v<L, RowMajor>) return base + r * ld + c;
    else return base + r + c * ld;
}

// C (M x N, row-major, ldc) = [C +] A (M x K) B (K x N), float32, all in shared memory.
// 16 x 8 threads, each owning TM consecutive rows and TN columns strided by 8: every k step
// loads TM + TN operands for TM * TN FMAs, and a warp's loads of one B row or column fall in
// distinct banks. Callers synchronise before (operands written) and after (C read by others).
template <int M, int N, int K, typename LA, typename LB, bool ACCUMULATE>
__device__ __forceinline__ void smem_gemm(const float* A, int lda, const float* B, int ldb, float* C,
                                          int ldc) {
    static_assert(kThreads == 128 && M % 16 == 0 && N % 8 == 0, "tile shape");
    constexpr int TM = M / 16, TN = N / 8;
    const int m0 = (threadIdx.x / 8) * TM, n0 = threadIdx.x % 8;
    float acc[TM][TN];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = ACCUMULATE ? C[(m0 + i) * ldc + n0 + 8 * j] : 0.f;
    for (int k = 0; k < K; ++k) {
        float a[TM], b[TN];
        #pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = *at<LA>(A, lda, m0 + i, k);
        #pragma unroll
        for (int j = 0; j < TN; ++j) b[j] = *at<LB>(B, ldb, k, n0 + 8 * j);
        #pragma unroll
        for (int i = 0; i < TM; ++i)
            #pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < TN; ++j) C[(m0 + i) * ldc + n0 + 8 * j] = acc[i][j];
}

// ---------------------------------------------------------------------------- mma.sync

// One warp: d (16x8, float32) += a (16x16, row-major) * b (16x8, column-major), T = __half or
// __nv_bfloat16, on tensor cores (PTX mma.sync.aligned.m16n8k16). Unlike WMMA, the PTX ISA
// specifies which lane holds which element, so results can stay in registers. For lane
// 4 g + t (g = lane / 4, t = lane % 4), each 32-bit register holding two consecutive elements:
//     a[0]: A[g][2t, 2t+1]    a[1]: A[g+8][2t, 2t+1]    a[2]: A[g][2t+8, 2t+9]    a[3]: A[g+8][2t+8, 2t+9]
//     b[0]: B[2t, 2t+1][g]    b[1]: B[2t+8, 2t+9][g]
//     d[0], d[1]: D[g][2t, 2t+1]                        d[2], d[3]: D[g+8][2t, 2t+1]
// So the accumulators of two adjacent 16x8 tiles are, element for element, the A operand of
// a 16x16 tile: the probabilities computed from S feed P V without leaving registers.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef MT_EMULATED_MMA  // the CPU emulation in minitransformer/emulated/emulator.py supplies the product
    emulated_mma_16816<T>(d, a, b);
#else
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#endif
}

// Two floats rounded to T and packed into one register, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same_v<T, __half>) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
}

// Two consecutive 16-bit elements of shared memory as one register (p is 4-byte aligned).
template <typename T>
__device__ __forceinline__ uint32_t load2(const T* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

// Four 8x8 tiles of 16-bit elements from shared memory, transposed on the way
// (ldmatrix.x4.trans): lane l passes the address of row l % 8 of tile l / 8 (16-byte
// aligned) and receives in r[i] the elements at rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4,
// of tile i: the column pairs that mma_16816's B operand, or an A operand stored transposed,
// is made of.
template <typename T>
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const T* row) {
#ifdef MT_EMULATED_MMA
    emulated_ldmatrix_x4_trans(r, row);
#else
    const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#endif
}

// B operands for two adjacent 16x8 output tiles, B(k, n) = base[k * ld + n] with k in
// [k0, k0 + 16) and n in [n0, n0 + 16): {r[0], r[1]} for columns n0.., {r[2], r[3]} for n0 + 8..
template <typename T>
__device__ __forceinline__ void load_b_pair(uint32_t (&r)[4], const T* base, int ld, int k0, int n0) {
    const int lane = threadIdx.x % 32, tile = lane / 8;
    ldmatrix_x4_trans(r, base + (k0 + (tile & 1) * 8 + lane % 8) * ld + n0 + (tile >> 1) * 8);
}

// The A operand (16x16 at m0, k0) of a matrix stored transposed: A(m, k) = base[k * ld + m].
template <typename T>
__device__ __forceinline__ void load_a_transposed(uint32_t (&r)[4], const T* base, int ld, int m0, int k0) {
    const int lane = threadIdx.x % 32, tile = lane / 8;
    ldmatrix_x4_trans(r, base + (k0 + (tile >> 1) * 8 + lane % 8) * ld + m0 + (tile & 1) * 8);
}

// Whether query i may attend to key j: j is not padding, and not in i's causal future.
__device__ __forceinline__ bool key_visible(const AttnParams& p, int kv_len, int i, int j) {
    return j < kv_len && (!p.causal || j <= i + (p.S - p.T));
}

// ---------------------------------------------------------------------------- forward

// Forward, float32: one block of 128 threads owns BR query rows; Q, the K and V tiles, the
// scores, the probabilities and the output accumulator all live in shared memory, and
// kThreads / BR threads share each row's online-softmax state.
template <int D, int BR, int BC>
struct F32FwdLayout {
    // Q, K, V tiles: rows 16-byte aligned for load_tile, so at BR = 64 Q's rows as smem_gemm's A
    // meet two to a bank (costs.py's ledger)
    static constexpr int LDT = D + 4;
    static constexpr int LDS = padded_ld<BR, BC>();  // scores
    static constexpr int LDP = padded_ld<BR, BC>();  // probabilities (after dropout)
    static constexpr int LDO = padded_ld<BR, D>();   // output accumulator
    __host__ __device__ static size_t bytes() {
        SmemCarver c{nullptr};
        c.take<float>(BR * LDT); c.take<float>(BC * LDT); c.take<float>(BC * LDT);
        c.take<float>(BR * LDS); c.take<float>(BR * LDP); c.take<float>(BR * LDO);
        return c.offset;
    }
};

template <int D, int BR, int BC>
__global__ void __launch_bounds__(kThreads) attention_forward_f32_kernel(AttnParams p) {
    using T = float;
    using L = F32FwdLayout<D, BR, BC>;
    constexpr int TPR = kThreads / BR;  // threads sharing one query row
    extern __shared__ __align__(128) unsigned char smem[];
    SmemCarver carve{smem};
    T* sQ = carve.take<T>(BR * L::LDT);
    T* sK = carve.take<T>(BC * L::LDT);
    T* sV = carve.take<T>(BC * L::LDT);
    float* sS = carve.take<float>(BR * L::LDS);
    T* sP = carve.take<T>(BR * L::LDP);
    float* sO = carve.take<float>(BR * L::LDO);

    const int bh = blockIdx.y, b = bh / p.H;
    // Causal: the last query tiles see the most keys; launching them first shortens the tail.
    const int q0 = (p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const int kv_len = p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
    int k_end = kv_len;  // keys at or beyond k_end are masked for every row of this tile
    if (p.causal) k_end = min(k_end, min(q0 + BR, p.T) + (p.S - p.T));

    const T* q = static_cast<const T*>(p.q) + (size_t(bh) * p.T + q0) * D;
    const T* k = static_cast<const T*>(p.k) + size_t(bh) * p.S * D;
    const T* v = static_cast<const T*>(p.v) + size_t(bh) * p.S * D;

    load_tile<T, D, BR>(sQ, L::LDT, q, min(BR, p.T - q0));
    zero_tile<BR, D>(sO, L::LDO);

    const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR;
    const int i = q0 + r;
    float m_row = -INFINITY, l_row = 0.f;

    for (int k0 = 0; k0 < k_end; k0 += BC) {
        load_tile<T, D, BC>(sK, L::LDT, k + size_t(k0) * D, min(BC, kv_len - k0));
        load_tile<T, D, BC>(sV, L::LDT, v + size_t(k0) * D, min(BC, kv_len - k0));
        __syncthreads();
        smem_gemm<BR, BC, D, RowMajor, ColMajor, false>(sQ, L::LDT, sK, L::LDT, sS, L::LDS);
        __syncthreads();

        float tile_max = -INFINITY;
        for (int c = sub; c < BC; c += TPR) {
            float s = key_visible(p, kv_len, i, k0 + c) ? sS[r * L::LDS + c] * p.scale : -INFINITY;
            sS[r * L::LDS + c] = s;
            tile_max = fmaxf(tile_max, s);
        }
        #pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1)
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
        const float m_new = fmaxf(m_row, tile_max);
        // No visible key yet: subtract 0 instead of -inf, so exp(-inf) = 0, never NaN.
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = __expf(m_row - m_use);
        float tile_sum = 0.f;
        for (int c = sub; c < BC; c += TPR) {
            float e = __expf(sS[r * L::LDS + c] - m_use);
            tile_sum += e;
            sP[r * L::LDP + c] = from_float<T>(e * dropout_factor(p, bh, i, k0 + c));
        }
        #pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, o);
        l_row = l_row * alpha + tile_sum;
        m_row = m_new;
        for (int d = sub; d < D; d += TPR) sO[r * L::LDO + d] *= alpha;
        __syncthreads();
        smem_gemm<BR, D, BC, RowMajor, RowMajor, true>(sP, L::LDP, sV, L::LDT, sO, L::LDO);
        __syncthreads();
    }

    __syncthreads();  // sO complete (also when no key tile was visited)
    if (i < p.T) {
        const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
        T* out = static_cast<T*>(p.out) + (size_t(bh) * p.T + i) * D;
        for (int d = sub; d < D; d += TPR) out[d] = from_float<T>(sO[r * L::LDO + d] * inv);
        if (sub == 0) p.lse[size_t(bh) * p.T + i] = l_row > 0.f ? m_row + logf(l_row) : -INFINITY;
    }
}

// Forward for float16 / bfloat16, FlashAttention-2's layout: each of the 4 warps owns 16 query
// rows and keeps everything about them in registers (Q fragments, the scores of the current
// key tile, the running max and sum, the output accumulator), after staging Q once through
// shared memory. The streamed K and V tiles are double-buffered there: tile j + 1 is copied in
// (cp.async) while tile j is used.
template <typename T, int D>
struct MmaFwdLayout {
    static constexpr int BR = 16 * kWarps;  // query rows per block
    static constexpr int BC = 64;           // keys per tile
    static constexpr int LDT = D + pad_of<T>();
    __host__ __device__ static size_t bytes() {
        SmemCarver c{nullptr};
        c.take<T>(BR * LDT); c.take<T>(2 * BC * LDT); c.take<T>(2 * BC * LDT);
        return c.offset;
    }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_forward_mma_kernel(AttnParams p) {
    using L = MmaFwdLayout<T, D>;
    constexpr int BR = L::BR, BC = L::BC, LDT = L::LDT;
    constexpr int NS = BC / 8;  // 16x8 score tiles per warp and key tile
    constexpr int NO = D / 8;   // 16x8 output tiles per warp
    extern __shared__ __align__(128) unsigned char smem[];
    SmemCarver carve{smem};
    T* sQ = carve.take<T>(BR * LDT);
    T* sK = carve.take<T>(2 * BC * LDT);  // two buffers of BC rows
    T* sV = carve.take<T>(2 * BC * LDT);

    const int bh = blockIdx.y, b = bh / p.H;
    // Causal: the last query tiles see the most keys; launching them first shortens the tail.
    const int q0 = (p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const int kv_len = p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
    int k_end = kv_len;
    if (p.causal) k_end = min(k_end, min(q0 + BR, p.T) + (p.S - p.T));
    const int n_tiles = k_end > 0 ? ceil_div(k_end, BC) : 0;
    const T* k = static_cast<const T*>(p.k) + size_t(bh) * p.S * D;
    const T* v = static_cast<const T*>(p.v) + size_t(bh) * p.S * D;
    auto prefetch = [&](int tile) {  // K and V rows [tile * BC, tile * BC + BC) into buffer tile % 2
        const int k0 = tile * BC;
        load_tile_async<T, D, BC>(sK + (tile & 1) * BC * LDT, LDT, k + size_t(k0) * D, min(BC, kv_len - k0));
        load_tile_async<T, D, BC>(sV + (tile & 1) * BC * LDT, LDT, v + size_t(k0) * D, min(BC, kv_len - k0));
        __pipeline_commit();
    };
    if (n_tiles > 0) prefetch(0);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r0 = warp * 16;                        // this warp's first row in the tile
    const int i_lo = q0 + r0 + g, i_hi = i_lo + 8;   // the two query rows this lane holds

    load_tile<T, D, BR>(sQ, LDT, static_cast<const T*>(p.q) + (size_t(bh) * p.T + q0) * D,
                        min(BR, p.T - q0));
    __syncthreads();
    uint32_t qf[D / 16][4];  // this warp's 16 x D slice of Q as A fragments
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const T* row = sQ + (r0 + g) * LDT + kk * 16 + 2 * t;
        qf[kk][0] = load2(row);
        qf[kk][1] = load2(row + 8 * LDT);
        qf[kk][2] = load2(row + 8);
        qf[kk][3] = load2(row + 8 * LDT + 8);
    }

    float o[NO][4] = {};
    float m_lo = -INFINITY, m_hi = -INFINITY;  // running max of rows i_lo, i_hi
    float l_lo = 0.f, l_hi = 0.f;              // this lane's share of the running sums

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k0 = tile * BC;
        if (tile + 1 < n_tiles) {
            prefetch(tile + 1);  // into the buffer every warp finished reading last iteration
            __pipeline_wait_prior(1);
        } else {
            __pipeline_wait_prior(0);
        }
        __syncthreads();  // this tile's copies, from every thread, are visible
        const T* sKt = sK + (tile & 1) * BC * LDT;
        const T* sVt = sV + (tile & 1) * BC * LDT;

        float s[NS][4] = {};  // S = Q K^T: B(d, key) = K[key][d], a row pair of K
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            #pragma unroll
            for (int n = 0; n < NS; ++n) {
                const T* key = sKt + (n * 8 + g) * LDT + kk * 16 + 2 * t;
                uint32_t bf[2] = {load2(key), load2(key + 8)};
                mma_16816<T>(s[n], qf[kk], bf);
            }
        }

        float max_lo = -INFINITY, max_hi = -INFINITY;
        #pragma unroll
        for (int n = 0; n < NS; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e < 2 ? i_lo : i_hi, j = k0 + n * 8 + 2 * t + (e & 1);
                s[n][e] = key_visible(p, kv_len, i, j) ? s[n][e] * p.scale : -INFINITY;
            }
            max_lo = fmaxf(max_lo, fmaxf(s[n][0], s[n][1]));
            max_hi = fmaxf(max_hi, fmaxf(s[n][2], s[n][3]));
        }
        #pragma unroll
        for (int off = 1; off < 4; off <<= 1) {  // the 4 lanes of a row group
            max_lo = fmaxf(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, off));
            max_hi = fmaxf(max_hi, __shfl_xor_sync(0xffffffffu, max_hi, off));
        }
        const float new_lo = fmaxf(m_lo, max_lo), new_hi = fmaxf(m_hi, max_hi);
        const float use_lo = new_lo == -INFINITY ? 0.f : new_lo;  // no visible key yet
        const float use_hi = new_hi == -INFINITY ? 0.f : new_hi;
        const float alpha_lo = __expf(m_lo - use_lo), alpha_hi = __expf(m_hi - use_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo *= alpha_lo;
        l_hi *= alpha_hi;
        #pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[n][0] *= alpha_lo; o[n][1] *= alpha_lo;
            o[n][2] *= alpha_hi; o[n][3] *= alpha_hi;
        }
        #pragma unroll
        for (int n = 0; n < NS; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e < 2 ? i_lo : i_hi, j = k0 + n * 8 + 2 * t + (e & 1);
                const float prob = __expf(s[n][e] - (e < 2 ? use_lo : use_hi));
                (e < 2 ? l_lo : l_hi) += prob;  // summed before dropout
                s[n][e] = prob * dropout_factor(p, bh, i, j);
            }
        }

        // O += P V, P straight from the score registers; B(key, d) = V[key][d].
        #pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t pf[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            #pragma unroll
            for (int n = 0; n < NO; n += 2) {
                uint32_t vb[4];
                load_b_pair(vb, sVt, LDT, kk * 16, n * 8);
                uint32_t lo[2] = {vb[0], vb[1]}, hi[2] = {vb[2], vb[3]};
                mma_16816<T>(o[n], pf, lo);
                mma_16816<T>(o[n + 1], pf, hi);
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }

    #pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
    T* out = static_cast<T*>(p.out) + size_t(bh) * p.T * D;
    #pragma unroll
    for (int n = 0; n < NO; ++n) {
        const int d = n * 8 + 2 * t;
        if (i_lo < p.T)
            *reinterpret_cast<uint32_t*>(out + size_t(i_lo) * D + d) = pack2<T>(o[n][0] * inv_lo, o[n][1] * inv_lo);
        if (i_hi < p.T)
            *reinterpret_cast<uint32_t*>(out + size_t(i_hi) * D + d) = pack2<T>(o[n][2] * inv_hi, o[n][3] * inv_hi);
    }
    if (t == 0) {
        if (i_lo < p.T) p.lse[size_t(bh) * p.T + i_lo] = l_lo > 0.f ? m_lo + logf(l_lo) : -INFINITY;
        if (i_hi < p.T) p.lse[size_t(bh) * p.T + i_hi] = l_hi > 0.f ? m_hi + logf(l_hi) : -INFINITY;
    }
}

// ---------------------------------------------------------------------------- backward

// delta_i = sum_d dO_i,d * O_i,d, one warp per row; also the row's term of dS = P (dP - delta).
template <typename T, int D>
__global__ void attention_backward_delta_kernel(const T* o, const T* dout, float* delta, int rows) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    float acc = 0.f;
    for (int d = lane; d < D; d += 32)
        acc += to_float(o[size_t(row) * D + d]) * to_float(dout[size_t(row) * D + d]);
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = acc;
}

template <typename T>
__global__ void cast_from_float_kernel(const float* src, T* dst, size_t n) {
    for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < n;
         idx += size_t(gridDim.x) * blockDim.x)
        dst[idx] = from_float<T>(src[idx]);
}

// Backward, float32: one block owns BC keys, with every tile and accumulator in shared memory.
template <int D, int BR, int BC>
struct F32BwdLayout {
    static constexpr int LDT = D + 4;                 // K, V, Q, dO tiles (16-byte aligned rows)
    static constexpr int LDS = padded_ld<BR, BC>();   // P, dP
    static constexpr int LDP = padded_ld<BR, BC>();   // dropped P, dS
    static constexpr int LDO = padded_ld<BC, D>();    // dK, dV
    static constexpr int LDQ = padded_ld<BR, D>();    // dQ
    __host__ __device__ static size_t bytes() {
        SmemCarver c{nullptr};
        c.take<float>(BC * LDT); c.take<float>(BC * LDT);  // K, V
        c.take<float>(BR * LDT); c.take<float>(BR * LDT);  // Q, dO
        c.take<float>(BR * LDS); c.take<float>(BR * LDS);  // P, dP
        c.take<float>(BR * LDP); c.take<float>(BR * LDP);  // dropped P, dS
        c.take<float>(BC * LDO); c.take<float>(BC * LDO);  // dK, dV
        c.take<float>(BR * LDQ);                           // this tile's dQ
        c.take<float>(BR); c.take<float>(BR);              // lse, delta
        return c.offset;
    }
};

// Its tiles fill most of an SM's shared memory, so a block has the SM to itself: saying so
// (at least 1 block per SM) lets ptxas use the registers, where its default occupancy target
// held it to 80 on sm_80 and spilled.
template <int D, int BR, int BC>
__global__ void __launch_bounds__(kThreads, 1) attention_backward_f32_kernel(AttnParams p) {
    using T = float;
    using L = F32BwdLayout<D, BR, BC>;
    extern __shared__ __align__(128) unsigned char smem[];
    SmemCarver carve{smem};
    T* sK = carve.take<T>(BC * L::LDT);
    T* sV = carve.take<T>(BC * L::LDT);
    T* sQ = carve.take<T>(BR * L::LDT);
    T* sdO = carve.take<T>(BR * L::LDT);
    float* sS = carve.take<float>(BR * L::LDS);
    float* sdP = carve.take<float>(BR * L::LDS);
    T* sP = carve.take<T>(BR * L::LDP);
    T* sdS = carve.take<T>(BR * L::LDP);
    float* sdK = carve.take<float>(BC * L::LDO);
    float* sdV = carve.take<float>(BC * L::LDO);
    float* sdQ = carve.take<float>(BR * L::LDQ);
    float* sLse = carve.take<float>(BR);
    float* sDelta = carve.take<float>(BR);

    const int bh = blockIdx.y, b = bh / p.H;
    const int k0 = blockIdx.x * BC;
    const int kv_len = p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
    const size_t kv_off = (size_t(bh) * p.S + k0) * D;

    zero_tile<BC, D>(sdK, L::LDO);
    zero_tile<BC, D>(sdV, L::LDO);
    if (k0 < kv_len) {
        load_tile<T, D, BC>(sK, L::LDT, static_cast<const T*>(p.k) + kv_off, min(BC, kv_len - k0));
        load_tile<T, D, BC>(sV, L::LDT, static_cast<const T*>(p.v) + kv_off, min(BC, kv_len - k0));
        // The first query that sees key k0 under the causal mask is k0 - (S - T).
        int q_begin = p.causal ? max(0, k0 - (p.S - p.T)) : 0;
        q_begin = q_begin / BR * BR;
        for (int q0 = q_begin; q0 < p.T; q0 += BR) {
            const size_t q_off = (size_t(bh) * p.T + q0) * D;
            const int q_valid = min(BR, p.T - q0);
            load_tile<T, D, BR>(sQ, L::LDT, static_cast<const T*>(p.q) + q_off, q_valid);
            load_tile<T, D, BR>(sdO, L::LDT, static_cast<const T*>(p.dout) + q_off, q_valid);
            for (int r = threadIdx.x; r < BR; r += kThreads) {
                bool ok = r < q_valid;
                sLse[r] = ok ? p.lse[size_t(bh) * p.T + q0 + r] : -INFINITY;
                sDelta[r] = ok ? p.delta[size_t(bh) * p.T + q0 + r] : 0.f;
            }
            __syncthreads();
            smem_gemm<BR, BC, D, RowMajor, ColMajor, false>(sQ, L::LDT, sK, L::LDT, sS, L::LDS);
            __syncthreads();
            // P recomputed from the saved log-sum-exp; rows with lse = -inf saw no key.
            for (int idx = threadIdx.x; idx < BR * BC; idx += kThreads) {
                int r = idx / BC, c = idx % BC, i = q0 + r, j = k0 + c;
                float lse = sLse[r];
                float prob = (lse != -INFINITY && key_visible(p, kv_len, i, j))
                                 ? __expf(sS[r * L::LDS + c] * p.scale - lse) : 0.f;
                sS[r * L::LDS + c] = prob;
                sP[r * L::LDP + c] = from_float<T>(prob * dropout_factor(p, bh, i, j));
            }
            __syncthreads();
            // dV += P_dropped^T dO  and  dP = dO V^T  (independent, one phase)
            smem_gemm<BC, D, BR, ColMajor, RowMajor, true>(sP, L::LDP, sdO, L::LDT, sdV, L::LDO);
            smem_gemm<BR, BC, D, RowMajor, ColMajor, false>(sdO, L::LDT, sV, L::LDT, sdP, L::LDS);
            __syncthreads();
            for (int idx = threadIdx.x; idx < BR * BC; idx += kThreads) {
                int r = idx / BC, c = idx % BC;
                float dp = sdP[r * L::LDS + c] * dropout_factor(p, bh, q0 + r, k0 + c);
                sdS[r * L::LDP + c] = from_float<T>(sS[r * L::LDS + c] * (dp - sDelta[r]) * p.scale);
            }
            __syncthreads();
            // dK += dS^T Q  and  dQ_tile = dS K
            smem_gemm<BC, D, BR, ColMajor, RowMajor, true>(sdS, L::LDP, sQ, L::LDT, sdK, L::LDO);
            smem_gemm<BR, D, BC, RowMajor, RowMajor, false>(sdS, L::LDP, sK, L::LDT, sdQ, L::LDQ);
            __syncthreads();
            for (int idx = threadIdx.x; idx < q_valid * D; idx += kThreads) {
                int r = idx / D, d = idx % D;
                atomicAdd(p.dq_accum + q_off + size_t(r) * D + d, sdQ[r * L::LDQ + d]);
            }
            __syncthreads();  // the next tile overwrites sQ, sdO and sdQ
        }
    }
    __syncthreads();  // sdK, sdV complete (also when no query tile was visited)
    // Keys beyond kv_len were never seen: their rows of dK and dV stay zero.
    const int k_valid = min(BC, p.S - k0);
    T* dk = static_cast<T*>(p.dk) + kv_off;
    T* dv = static_cast<T*>(p.dv) + kv_off;
    for (int idx = threadIdx.x; idx < k_valid * D; idx += kThreads) {
        int r = idx / D, d = idx % D;
        dk[size_t(r) * D + d] = from_float<T>(sdK[r * L::LDO + d]);
        dv[size_t(r) * D + d] = from_float<T>(sdV[r * L::LDO + d]);
    }
}

// Backward for float16 / bfloat16, FlashAttention-2's layout: a block owns BC = 64 keys, each
// warp 16 of them, and streams query tiles of BR rows. A warp computes the transposed scores
// S^T = K Q^T for its keys, so that P^T, dP^T and dS^T come out of mma.sync as accumulators
// that feed dV += P^T dO and dK += dS^T Q as A operands without leaving registers; dK and dV
// stay in registers for the whole loop. dQ = dS K needs all 64 keys of the block: dS^T goes
// through shared memory once per query tile, and the warps add their dQ tiles into the
// float32 accumulator with atomics.
template <typename T, int D>
struct MmaBwdLayout {
    static constexpr int BC = 16 * kWarps;        // keys per block
    static constexpr int BR = D <= 64 ? 64 : 32;  // queries per tile (registers bound it at D = 128)
    static constexpr int LDT = D + pad_of<T>();
    static constexpr int LDS = BR + pad_of<T>();  // dS^T, (keys, queries)
    __host__ __device__ static size_t bytes() {
        SmemCarver c{nullptr};
        c.take<T>(BC * LDT); c.take<T>(BC * LDT);          // K, V
        c.take<T>(2 * BR * LDT); c.take<T>(2 * BR * LDT);  // Q, dO: two buffers each
        c.take<T>(BC * LDS);                               // dS^T
        c.take<float>(2 * BR); c.take<float>(2 * BR);      // lse, delta: two buffers each
        return c.offset;
    }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_backward_mma_kernel(AttnParams p) {
    using L = MmaBwdLayout<T, D>;
    constexpr int BC = L::BC, BR = L::BR, LDT = L::LDT, LDS = L::LDS;
    constexpr int NQ = BR / 8;  // 16x8 tiles of S^T per warp (queries along n)
    constexpr int NO = D / 8;   // 16x8 tiles of dK, dV per warp
    extern __shared__ __align__(128) unsigned char smem[];
    SmemCarver carve{smem};
    T* sK = carve.take<T>(BC * LDT);
    T* sV = carve.take<T>(BC * LDT);
    T* sQ2 = carve.take<T>(2 * BR * LDT);
    T* sdO2 = carve.take<T>(2 * BR * LDT);
    T* sdS = carve.take<T>(BC * LDS);
    float* sLse2 = carve.take<float>(2 * BR);
    float* sDelta2 = carve.take<float>(2 * BR);

    const int bh = blockIdx.y, b = bh / p.H;
    const int k0 = blockIdx.x * BC;
    const int kv_len = p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
    const size_t kv_off = (size_t(bh) * p.S + k0) * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kr = warp * 16;                        // this warp's first key in the block
    const int j_lo = k0 + kr + g, j_hi = j_lo + 8;   // the two keys this lane's rows hold

    float dk[NO][4] = {}, dv[NO][4] = {};
    if (k0 < kv_len) {
        // The first query that sees key k0 under the causal mask is k0 - (S - T).
        const int q_first = (p.causal ? max(0, k0 - (p.S - p.T)) : 0) / BR * BR;
        const int n_tiles = q_first < p.T ? ceil_div(p.T - q_first, BR) : 0;
        // Query tile `tile` into buffer tile % 2: Q and dO by cp.async, lse and delta plainly.
        auto prefetch = [&](int tile) {
            const int q0 = q_first + tile * BR, valid = min(BR, p.T - q0), buf = tile & 1;
            const size_t q_off = (size_t(bh) * p.T + q0) * D;
            load_tile_async<T, D, BR>(sQ2 + buf * BR * LDT, LDT, static_cast<const T*>(p.q) + q_off, valid);
            load_tile_async<T, D, BR>(sdO2 + buf * BR * LDT, LDT, static_cast<const T*>(p.dout) + q_off, valid);
            __pipeline_commit();
            for (int r = threadIdx.x; r < BR; r += kThreads) {
                const bool ok = r < valid;
                sLse2[buf * BR + r] = ok ? p.lse[size_t(bh) * p.T + q0 + r] : -INFINITY;
                sDelta2[buf * BR + r] = ok ? p.delta[size_t(bh) * p.T + q0 + r] : 0.f;
            }
        };
        if (n_tiles > 0) prefetch(0);
        load_tile<T, D, BC>(sK, LDT, static_cast<const T*>(p.k) + kv_off, min(BC, kv_len - k0));
        load_tile<T, D, BC>(sV, LDT, static_cast<const T*>(p.v) + kv_off, min(BC, kv_len - k0));
        __syncthreads();
        for (int tile = 0; tile < n_tiles; ++tile) {
            const int q0 = q_first + tile * BR, q_valid = min(BR, p.T - q0);
            const size_t q_off = (size_t(bh) * p.T + q0) * D;
            if (tile + 1 < n_tiles) {
                prefetch(tile + 1);  // into the buffers every warp finished with last iteration
                __pipeline_wait_prior(1);
            } else {
                __pipeline_wait_prior(0);
            }
            __syncthreads();  // this tile's Q, dO, lse and delta, from every thread, are visible
            const T* sQ = sQ2 + (tile & 1) * BR * LDT;
            const T* sdO = sdO2 + (tile & 1) * BR * LDT;
            const float* sLse = sLse2 + (tile & 1) * BR;
            const float* sDelta = sDelta2 + (tile & 1) * BR;

            // S^T = K Q^T and dP^T = V dO^T: A is this warp's 16 keys of K or V, read from shared
            // memory each tile (kept in registers beside dK and dV, K alone would spill at
            // D = 128); B(d, query) is a row pair of Q or dO.
            float st[NQ][4] = {}, dpt[NQ][4] = {};
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const T* krow = sK + (kr + g) * LDT + kk * 16 + 2 * t;
                const T* vrow = sV + (kr + g) * LDT + kk * 16 + 2 * t;
                uint32_t kf[4] = {load2(krow), load2(krow + 8 * LDT), load2(krow + 8), load2(krow + 8 * LDT + 8)};
                uint32_t vf[4] = {load2(vrow), load2(vrow + 8 * LDT), load2(vrow + 8), load2(vrow + 8 * LDT + 8)};
                #pragma unroll
                for (int n = 0; n < NQ; ++n) {
                    const T* qrow = sQ + (n * 8 + g) * LDT + kk * 16 + 2 * t;
                    const T* orow = sdO + (n * 8 + g) * LDT + kk * 16 + 2 * t;
                    uint32_t qb[2] = {load2(qrow), load2(qrow + 8)};
                    uint32_t ob[2] = {load2(orow), load2(orow + 8)};
                    mma_16816<T>(st[n], kf, qb);
                    mma_16816<T>(dpt[n], vf, ob);
                }
            }
            // P^T from the saved log-sum-exp; dS^T = P^T (dP^T - delta) scale. st becomes the
            // dropped P^T (for dV), dpt becomes dS^T.
            #pragma unroll
            for (int n = 0; n < NQ; ++n) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = n * 8 + 2 * t + (e & 1), i = q0 + r, j = e < 2 ? j_lo : j_hi;
                    const float lse = sLse[r];
                    const float prob = (lse != -INFINITY && key_visible(p, kv_len, i, j))
                                           ? __expf(st[n][e] * p.scale - lse) : 0.f;
                    const float z = dropout_factor(p, bh, i, j);
                    st[n][e] = prob * z;
                    dpt[n][e] = prob * (dpt[n][e] * z - sDelta[r]) * p.scale;
                }
            }
            // dV += P^T dO, dK += dS^T Q: A from the registers above, B(query, d) a column
            // pair of dO or Q.
            #pragma unroll
            for (int kk = 0; kk < BR / 16; ++kk) {
                uint32_t pa[4] = {pack2<T>(st[2 * kk][0], st[2 * kk][1]), pack2<T>(st[2 * kk][2], st[2 * kk][3]),
                                  pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                  pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
                uint32_t sa[4] = {pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]),
                                  pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                  pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
                #pragma unroll
                for (int n = 0; n < NO; n += 2) {
                    uint32_t ob[4], qb[4];
                    load_b_pair(ob, sdO, LDT, kk * 16, n * 8);
                    load_b_pair(qb, sQ, LDT, kk * 16, n * 8);
                    uint32_t o_lo[2] = {ob[0], ob[1]}, o_hi[2] = {ob[2], ob[3]};
                    uint32_t q_lo[2] = {qb[0], qb[1]}, q_hi[2] = {qb[2], qb[3]};
                    mma_16816<T>(dv[n], pa, o_lo);
                    mma_16816<T>(dv[n + 1], pa, o_hi);
                    mma_16816<T>(dk[n], sa, q_lo);
                    mma_16816<T>(dk[n + 1], sa, q_hi);
                }
                // dS^T to shared memory, rounded as it enters the dQ product
                *reinterpret_cast<uint32_t*>(sdS + (kr + g) * LDS + kk * 16 + 2 * t) = sa[0];
                *reinterpret_cast<uint32_t*>(sdS + (kr + g + 8) * LDS + kk * 16 + 2 * t) = sa[1];
                *reinterpret_cast<uint32_t*>(sdS + (kr + g) * LDS + kk * 16 + 8 + 2 * t) = sa[2];
                *reinterpret_cast<uint32_t*>(sdS + (kr + g + 8) * LDS + kk * 16 + 8 + 2 * t) = sa[3];
            }
            __syncthreads();
            // dQ += dS K over the block's keys: A(query, key) = dS^T[key][query], sdS read
            // transposed; B(key, d) = K. The warps share out pairs of 16x8 output tiles.
            for (int tile = warp; tile < (BR / 16) * (NO / 2); tile += kWarps) {
                const int m0 = (tile / (NO / 2)) * 16, n = (tile % (NO / 2)) * 2;
                float acc[2][4] = {};
                #pragma unroll
                for (int kk = 0; kk < BC / 16; ++kk) {
                    uint32_t a[4], kb[4];
                    load_a_transposed(a, sdS, LDS, m0, kk * 16);
                    load_b_pair(kb, sK, LDT, kk * 16, n * 8);
                    uint32_t k_lo[2] = {kb[0], kb[1]}, k_hi[2] = {kb[2], kb[3]};
                    mma_16816<T>(acc[0], a, k_lo);
                    mma_16816<T>(acc[1], a, k_hi);
                }
                float* dq = p.dq_accum + q_off;
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int d = (n + h) * 8 + 2 * t;
                    if (m0 + g < q_valid) {
                        atomicAdd(dq + size_t(m0 + g) * D + d, acc[h][0]);
                        atomicAdd(dq + size_t(m0 + g) * D + d + 1, acc[h][1]);
                    }
                    if (m0 + g + 8 < q_valid) {
                        atomicAdd(dq + size_t(m0 + g + 8) * D + d, acc[h][2]);
                        atomicAdd(dq + size_t(m0 + g + 8) * D + d + 1, acc[h][3]);
                    }
                }
            }
            __syncthreads();  // Q, dO and dS^T of this tile are no longer read
        }
    }
    // Keys beyond kv_len were never seen: their dK and dV rows are the zeros they started as.
    T* dkp = static_cast<T*>(p.dk) + size_t(bh) * p.S * D;
    T* dvp = static_cast<T*>(p.dv) + size_t(bh) * p.S * D;
    #pragma unroll
    for (int n = 0; n < NO; ++n) {
        const int d = n * 8 + 2 * t;
        if (j_lo < p.S) {
            *reinterpret_cast<uint32_t*>(dkp + size_t(j_lo) * D + d) = pack2<T>(dk[n][0], dk[n][1]);
            *reinterpret_cast<uint32_t*>(dvp + size_t(j_lo) * D + d) = pack2<T>(dv[n][0], dv[n][1]);
        }
        if (j_hi < p.S) {
            *reinterpret_cast<uint32_t*>(dkp + size_t(j_hi) * D + d) = pack2<T>(dk[n][2], dk[n][3]);
            *reinterpret_cast<uint32_t*>(dvp + size_t(j_hi) * D + d) = pack2<T>(dv[n][2], dv[n][3]);
        }
    }
}

// ---------------------------------------------------------------------------- launchers

// A compiled kernel of one pass and its tiles: BR query rows by BC keys (rows, cols). The
// attention kernels take all their shared memory dynamically (none is static), so `smem` is all
// a block asks for.
struct AttnKernel : LaunchConfig {
    void (*kernel)(AttnParams);
};

template <int D, int BR, int BC>
AttnKernel f32_forward() {
    return {{instance_name("attention_forward_f32_kernel", D, BR, BC), F32FwdLayout<D, BR, BC>::bytes(),
             BR, BC}, attention_forward_f32_kernel<D, BR, BC>};
}

template <int D, int BR, int BC>
AttnKernel f32_backward() {
    return {{instance_name("attention_backward_f32_kernel", D, BR, BC), F32BwdLayout<D, BR, BC>::bytes(),
             BR, BC}, attention_backward_f32_kernel<D, BR, BC>};
}

template <typename T, int D>
AttnKernel mma_forward() {
    using L = MmaFwdLayout<T, D>;
    return {{instance_name("attention_forward_mma_kernel", type_name<T>(), D), L::bytes(),
             L::BR, L::BC}, attention_forward_mma_kernel<T, D>};
}

template <typename T, int D>
AttnKernel mma_backward() {
    using L = MmaBwdLayout<T, D>;
    return {{instance_name("attention_backward_mma_kernel", type_name<T>(), D), L::bytes(),
             L::BR, L::BC}, attention_backward_mma_kernel<T, D>};
}

// The kernels of each pass for (T, D), in the launcher's order of preference. The float32 path
// keeps every tile in shared memory, so for D >= 64 its tiles (BR x BC) come in two sizes: the
// larger needs an A100's or H100's limit, the smaller fits the 99 KiB of sm_86 / sm_89.
//
//     D      forward          backward
//     32     64x64  (70 KiB)  32x64  (84 KiB)
//     64     64x64 (102 KiB)  32x64 (128 KiB)
//            32x64  (68 KiB)  32x32  (78 KiB)
//     128    32x64 (116 KiB)  32x32 (134 KiB)
//            32x32  (75 KiB)  32x16  (93 KiB)
//
// The 16-bit kernels keep their tiles in registers and have one configuration each (at most
// 85 KiB). The shared memory of every configuration is tested against every architecture's
// limit by tests/kernels/test_resources.py.
template <typename T, int D>
const std::vector<AttnKernel>& forward_kernels() {
    static const std::vector<AttnKernel> kernels = []() -> std::vector<AttnKernel> {
        if constexpr (!std::is_same_v<T, float>) return {mma_forward<T, D>()};
        else if constexpr (D == 32) return {f32_forward<D, 64, 64>()};
        else if constexpr (D == 64) return {f32_forward<D, 64, 64>(), f32_forward<D, 32, 64>()};
        else {
            static_assert(D == 128, "a head dim added to limits.cuh needs its tiles here");
            return {f32_forward<D, 32, 64>(), f32_forward<D, 32, 32>()};
        }
    }();
    return kernels;
}

template <typename T, int D>
const std::vector<AttnKernel>& backward_kernels() {
    static const std::vector<AttnKernel> kernels = []() -> std::vector<AttnKernel> {
        if constexpr (!std::is_same_v<T, float>) return {mma_backward<T, D>()};
        else if constexpr (D == 32) return {f32_backward<D, 32, 64>()};
        else if constexpr (D == 64) return {f32_backward<D, 32, 64>(), f32_backward<D, 32, 32>()};
        else {
            static_assert(D == 128, "a head dim added to limits.cuh needs its tiles here");
            return {f32_backward<D, 32, 32>(), f32_backward<D, 32, 16>()};
        }
    }();
    return kernels;
}

template <typename T, int D>
void launch_forward(const AttnParams& p, size_t smem_limit, cudaStream_t stream) {
    const AttnKernel& k = choose(forward_kernels<T, D>(), smem_limit, "attention_forward");
    auto kernel = k.kernel;
    allow_shared_memory(kernel, k.smem, "attention_forward");
    dim3 grid(ceil_div(p.T, k.rows), p.B * p.H);  // a block per BR queries
    kernel<<<grid, kThreads, k.smem, stream>>>(p);
    check_launch("attention_forward");
}

// Backward writes dQ into the float32 accumulator p.dq_accum, then casts it into dq.
template <typename T, int D>
void launch_backward(const AttnParams& p, void* dq, size_t smem_limit, cudaStream_t stream) {
    const AttnKernel& k = choose(backward_kernels<T, D>(), smem_limit, "attention_backward");
    const int rows = p.B * p.H * p.T;
    check_cuda(cudaMemsetAsync(p.dq_accum, 0, size_t(rows) * D * sizeof(float), stream),
               "attention_backward (zeroing dq)");
    attention_backward_delta_kernel<T, D><<<ceil_div(rows, 4), 128, 0, stream>>>(
        static_cast<const T*>(p.o), static_cast<const T*>(p.dout), p.delta, rows);
    check_launch("attention_backward_delta");

    auto kernel = k.kernel;
    allow_shared_memory(kernel, k.smem, "attention_backward");
    dim3 grid(ceil_div(p.S, k.cols), p.B * p.H);  // a block per BC keys
    kernel<<<grid, kThreads, k.smem, stream>>>(p);
    check_launch("attention_backward");

    const size_t n = size_t(rows) * D;
    const int blocks = int(std::min<size_t>((n + 255) / 256, 4096));
    cast_from_float_kernel<T><<<blocks, 256, 0, stream>>>(p.dq_accum, static_cast<T*>(dq), n);
    check_launch("attention_backward (dq cast)");
}

// Calls f(std::integral_constant<int, D>{}) if D is one of Ds; returns false if D is none of them.
template <typename F, int... Ds>
bool with_head_dim(int D, F&& f, limits::IntList<Ds...>) {
    return ((D == Ds && (f(std::integral_constant<int, Ds>{}), true)) || ...);
}

// Calls f(T{}, std::integral_constant<int, D>{}) for a dtype code and a head dim.
template <typename F>
void with_type_and_dim(int dtype, int D, const char* name, F&& f) {
    with_type(dtype, name, [&](auto tag) {
        if (!with_head_dim(D, [&](auto dim) { f(tag, dim); }, limits::AttentionHeadDims{}))
            throw std::invalid_argument(std::string(name) + ": head dim " + std::to_string(D) +
                                        " is not supported (see csrc/limits.cuh)");
    });
}

AttnParams make_params(const char* launcher, int B, int H, int T, int S, float scale, bool causal,
                       float dropout_p, uint64_t seed, const int* kv_lens) {
    if (static_cast<long long>(B) * H > limits::kMaxGridY)
        throw std::invalid_argument(std::string(launcher) + ": B * H = " + std::to_string(static_cast<long long>(B) * H) +
                                    " exceeds " + std::to_string(limits::kMaxGridY) +
                                    ", the blocks a grid may have along y");
    AttnParams p{};
    p.B = B; p.H = H; p.T = T; p.S = S;
    p.scale = scale;
    p.causal = causal;
    p.kv_lens = kv_lens;
    // Keep weight where bits >= threshold: P(keep) = 1 - threshold / 2^32 = 1 - p.
    double threshold = double(dropout_p) * 4294967296.0;
    p.drop_threshold = dropout_p > 0.f ? uint32_t(fmin(threshold, 4294967295.0)) : 0u;
    p.keep_scale = dropout_p > 0.f ? 1.f / (1.f - dropout_p) : 1.f;
    p.seed0 = uint32_t(seed & 0xffffffffu);
    p.seed1 = uint32_t(seed >> 32);
    return p;
}

}  // namespace

void attention_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                       const int* kv_lens, int dtype, int B, int H, int T, int S, int D,
                       float scale, bool causal, float dropout_p, uint64_t seed,
                       size_t smem_limit, cudaStream_t stream) {
    AttnParams p = make_params("attention_forward", B, H, T, S, scale, causal, dropout_p, seed, kv_lens);
    p.q = q; p.k = k; p.v = v; p.out = o; p.lse = lse;
    with_type_and_dim(dtype, D, "attention_forward", [&](auto tag, auto dim) {
        launch_forward<decltype(tag), decltype(dim)::value>(p, smem_limit, stream);
    });
}

void attention_backward(const void* q, const void* k, const void* v, const void* o,
                        const void* dout, const float* lse, const int* kv_lens, void* dq,
                        void* dk, void* dv, float* dq_accum, float* delta, int dtype, int B,
                        int H, int T, int S, int D, float scale, bool causal, float dropout_p,
                        uint64_t seed, size_t smem_limit, cudaStream_t stream) {
    AttnParams p = make_params("attention_backward", B, H, T, S, scale, causal, dropout_p, seed, kv_lens);
    p.q = q; p.k = k; p.v = v; p.o = o; p.dout = dout;
    p.lse = const_cast<float*>(lse);
    p.dk = dk; p.dv = dv; p.dq_accum = dq_accum; p.delta = delta;
    with_type_and_dim(dtype, D, "attention_backward", [&](auto tag, auto dim) {
        launch_backward<decltype(tag), decltype(dim)::value>(p, dq, smem_limit, stream);
    });
}

std::vector<LaunchConfig> attention_configs(bool backward, int dtype, int D) {
    std::vector<LaunchConfig> configs;
    with_type_and_dim(dtype, D, "attention_configs", [&](auto tag, auto dim) {
        using T = decltype(tag);
        constexpr int d = decltype(dim)::value;
        for (const AttnKernel& k : backward ? backward_kernels<T, d>() : forward_kernels<T, d>())
            configs.push_back(k);
    });
    return configs;
}

}  // namespace mt
