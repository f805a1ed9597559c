// Launch configurations: how a launcher chooses among the compiled variants of a kernel by the
// shared memory the device lets one block use, and what bindings.cpp reports of them. Plain
// C++ (bindings.cpp, compiled without nvcc, includes it too).
//
// A block may use up to the device's cudaDevAttrMaxSharedMemoryPerBlockOptin bytes of shared
// memory, static plus dynamic, and GPUs that run the same build differ: 163 KiB on an A100
// (sm_80), 99 KiB on RTX 30/40, A10, L4 and L40 (sm_86, sm_89), 227 KiB on an H100 (sm_90). A
// kernel that may need more than the smallest is compiled in several variants, listed largest
// first, and its launcher takes the first that fits the limit Python passes in.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace mt {

struct LaunchConfig {
    std::string name;  // the kernel instance, as ptxas and c++filt name it: "kernel<args>"
    size_t smem;       // dynamic shared memory per block, bytes
    int rows = 0;      // the tile a block works on: attention's BR queries by BC keys
    int cols = 0;      // (0 for a kernel that is not tiled so)
};

// No configuration of a kernel fits the device's shared memory; raised before any launch
// (Python: minitransformer.kernels._C.SharedMemoryLimitError, a RuntimeError).
struct SharedMemoryLimitError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The first of `configs` (a launcher's list, in its order of preference) whose dynamic shared
// memory fits `limit` bytes; nullptr if none does. Config is LaunchConfig or derives from it.
template <typename Config>
const Config* first_fit(const std::vector<Config>& configs, size_t limit) {
    for (const Config& c : configs)
        if (c.smem <= limit) return &c;
    return nullptr;
}

// The first of `configs` that fits, or SharedMemoryLimitError naming the smallest (the last).
template <typename Config>
const Config& choose(const std::vector<Config>& configs, size_t limit, const char* launcher) {
    if (const Config* c = first_fit(configs, limit)) return *c;
    throw SharedMemoryLimitError(std::string(launcher) + ": " + configs.back().name +
                                 ", its smallest configuration, needs " +
                                 std::to_string(configs.back().smem) +
                                 " bytes of shared memory per block; the device allows " +
                                 std::to_string(limit));
}

}  // namespace mt
