// What the kernels can take, in one place (plain C++: bindings.cpp includes it too).
//
// Python reads these through _C.limits(): minitransformer/kernels/launch.py decides from them
// whether a call goes to a kernel (attention_refusal, layernorm_refusal), and functional
// falls back to its composite op otherwise. The launchers throw past them, as the last guard.
#pragma once

namespace mt::limits {

template <int... Values>
struct IntList {};

// The head dims (d_k = d_v) the attention kernels are compiled for: attention.cu instantiates
// one kernel per dim, dtype and tile configuration.
using AttentionHeadDims = IntList<32, 64, 128>;

// Attention's grid has one row of blocks per (batch, head): B * H along the grid's y axis.
constexpr long long kMaxGridY = 65535;

// attention_tiled.cu keeps each query's D outputs in the registers of its 16 threads, D / 16
// each (at 256, 16 of them, ptxas spills under the kernel's launch bounds), and its tiles of Q
// and of K or V in shared memory: 17 KiB at this D.
constexpr int kAttentionTiledMaxD = 128;

// layernorm_backward keeps 2 x D float column sums per warp in shared memory; 4096 (32 KiB a
// warp) fits every GPU at the smallest warp count (launch_config.cuh).
constexpr int kLayernormMaxD = 4096;

}  // namespace mt::limits
