// minitransformer.kernels._C: one Python function per kernel launcher.
//
// Arrays arrive as raw device pointers (CuPy's `a.data.ptr`, a Python int; 0 for an absent
// optional array) with their sizes and a dtype code (0 float32, 1 float16, 2 bfloat16); the
// stream is CuPy's current stream (`cupy.cuda.get_current_stream().ptr`). The Python wrappers
// in minitransformer/kernels/ check shapes, dtypes, devices and contiguity of the CuPy arrays,
// and what the kernels can take (csrc/limits.cuh, handed to them by limits() below); this layer
// checks pointers (present and aligned), dtype codes and sizes before any launch, and turns
// every C++ exception and CUDA error into a Python exception that names the kernel. No math.
//
// Attention and layernorm_backward take the device's shared memory per block (smem_limit,
// bytes: Python reads cudaDevAttrMaxSharedMemoryPerBlockOptin) and launch the largest variant of
// their kernel that fits it; when none does, SharedMemoryLimitError is raised before anything
// is launched. launch_configs and launch_config report those variants (launch_config.cuh).
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "launch_config.cuh"
#include "limits.cuh"

namespace py = pybind11;

namespace mt {
// Launchers, defined in attention.cu, attention_naive.cu, attention_tiled.cu, layernorm.cu and
// softmax.cu.
void attention_forward(const void* q, const void* k, const void* v, void* o, float* lse,
                       const int* kv_lens, int dtype, int B, int H, int T, int S, int D,
                       float scale, bool causal, float dropout_p, uint64_t seed,
                       size_t smem_limit, cudaStream_t stream);
void attention_backward(const void* q, const void* k, const void* v, const void* o,
                        const void* dout, const float* lse, const int* kv_lens, void* dq,
                        void* dk, void* dv, float* dq_accum, float* delta, int dtype, int B,
                        int H, int T, int S, int D, float scale, bool causal, float dropout_p,
                        uint64_t seed, size_t smem_limit, cudaStream_t stream);
void attention_naive_forward(const void* q, const void* k, const void* v, void* o, float* p,
                             const int* kv_lens, int dtype, int B, int H, int T, int S, int D,
                             float scale, bool causal, cudaStream_t stream);
void attention_tiled_forward(const void* q, const void* k, const void* v, void* o, const int* kv_lens,
                             int dtype, int B, int H, int T, int S, int D, float scale, bool causal,
                             cudaStream_t stream);
void layernorm_forward(const void* x, const void* w, const void* b, void* y, float* mean,
                       float* rstd, int dtype, int N, int D, float eps, cudaStream_t stream);
void layernorm_backward(const void* x, const void* w, const float* mean, const float* rstd,
                        const void* g, void* dx, void* dw, void* db, float* partial, int blocks,
                        int dtype, int N, int D, size_t smem_limit, cudaStream_t stream);
void softmax_forward(const void* x, const uint8_t* mask, void* y, int dtype, int N, int V,
                     float scale, cudaStream_t stream);
void softmax_backward(const void* y, const void* g, void* dx, int dtype, int N, int V,
                      float scale, cudaStream_t stream);
void cross_entropy_forward(const void* logits, const int64_t* target, float* loss, float* nll,
                           void* grad, int dtype, int N, int V, float smoothing, bool has_ignore,
                           int64_t ignore_index, cudaStream_t stream);
// The variants of a launcher's kernel for dtype and D, in its order of preference.
std::vector<LaunchConfig> attention_configs(bool backward, int dtype, int D);
std::vector<LaunchConfig> layernorm_backward_configs(int dtype, int D);
}  // namespace mt

namespace {

[[noreturn]] void fail(const std::string& fn, const std::string& msg) {
    throw std::invalid_argument(fn + ": " + msg);
}

// A device pointer from Python. `align` bytes of alignment are needed by vectorised loads.
template <typename P = void>
P* pointer(uintptr_t address, const char* fn, const char* name, bool required = true,
           uintptr_t align = 1) {
    if (address == 0) {
        if (required) fail(fn, std::string(name) + " is required (got a null pointer)");
        return nullptr;
    }
    if (address % align != 0)
        fail(fn, std::string(name) + " must be " + std::to_string(align) +
                     "-byte aligned (pass a freshly allocated contiguous array)");
    return reinterpret_cast<P*>(address);
}

void check_dtype(int dtype, const char* fn) {
    if (dtype < 0 || dtype > 2)
        fail(fn, "dtype code " + std::to_string(dtype) + " is not 0 (float32), 1 (float16) or 2 (bfloat16)");
}

void check_positive(const char* fn, std::initializer_list<std::pair<const char*, long long>> sizes) {
    for (auto& [name, value] : sizes)
        if (value <= 0) fail(fn, std::string(name) + " must be positive, got " + std::to_string(value));
}

void check_attention(const char* fn, int dtype, int B, int H, int T, int S, int D,
                     float dropout_p, long long smem_limit) {
    check_dtype(dtype, fn);
    check_positive(fn, {{"B", B}, {"H", H}, {"T", T}, {"S", S}, {"D", D}, {"smem_limit", smem_limit}});
    if (!(dropout_p >= 0.f && dropout_p < 1.f))
        fail(fn, "dropout_p must be in [0, 1), got " + std::to_string(dropout_p));
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// The variants that `launcher` chooses from for dtype and D (the head dim, or the row width of
// layernorm_backward), in its order of preference.
std::vector<mt::LaunchConfig> launch_configs(const std::string& launcher, int dtype, int D) {
    const char* fn = "launch_configs";
    check_dtype(dtype, fn);
    if (launcher == "attention_forward") return mt::attention_configs(false, dtype, D);
    if (launcher == "attention_backward") return mt::attention_configs(true, dtype, D);
    if (launcher == "layernorm_backward") {
        check_positive(fn, {{"D", D}});
        return mt::layernorm_backward_configs(dtype, D);
    }
    fail(fn, "launcher '" + launcher + "' is not attention_forward, attention_backward or "
             "layernorm_backward (the others use no dynamic shared memory)");
}

template <int... Ds>
py::tuple as_tuple(mt::limits::IntList<Ds...>) {
    return py::make_tuple(Ds...);
}

py::dict as_dict(const mt::LaunchConfig& c) {
    py::dict d(py::arg("kernel") = c.name, py::arg("smem") = c.smem);
    if (c.rows) d["tile"] = py::make_tuple(c.rows, c.cols);
    return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "minitransformer's CUDA kernels (see csrc/ and minitransformer/kernels/)";
    py::register_exception<mt::SharedMemoryLimitError>(m, "SharedMemoryLimitError", PyExc_RuntimeError);

    m.def("attention_forward",
          [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse, uintptr_t kv_lens,
             int dtype, int B, int H, int T, int S, int D, float scale, bool causal,
             float dropout_p, uint64_t seed, long long smem_limit, uintptr_t stream) {
              const char* fn = "attention_forward";
              check_attention(fn, dtype, B, H, T, S, D, dropout_p, smem_limit);
              mt::attention_forward(pointer(q, fn, "q", true, 16), pointer(k, fn, "k", true, 16),
                                    pointer(v, fn, "v", true, 16), pointer(o, fn, "o", true, 16),
                                    pointer<float>(lse, fn, "lse"),
                                    pointer<const int>(kv_lens, fn, "kv_lens", false), dtype, B,
                                    H, T, S, D, scale, causal, dropout_p, seed, smem_limit,
                                    as_stream(stream));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"),
          py::arg("kv_lens"), py::arg("dtype"), py::arg("B"), py::arg("H"), py::arg("T"),
          py::arg("S"), py::arg("D"), py::arg("scale"), py::arg("causal"), py::arg("dropout_p"),
          py::arg("seed"), py::arg("smem_limit"), py::arg("stream"));

    m.def("attention_backward",
          [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t dout, uintptr_t lse,
             uintptr_t kv_lens, uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t dq_accum,
             uintptr_t delta, int dtype, int B, int H, int T, int S, int D, float scale,
             bool causal, float dropout_p, uint64_t seed, long long smem_limit, uintptr_t stream) {
              const char* fn = "attention_backward";
              check_attention(fn, dtype, B, H, T, S, D, dropout_p, smem_limit);
              mt::attention_backward(
                  pointer(q, fn, "q", true, 16), pointer(k, fn, "k", true, 16),
                  pointer(v, fn, "v", true, 16), pointer(o, fn, "o", true, 16),
                  pointer(dout, fn, "dout", true, 16), pointer<const float>(lse, fn, "lse"),
                  pointer<const int>(kv_lens, fn, "kv_lens", false), pointer(dq, fn, "dq"),
                  pointer(dk, fn, "dk"), pointer(dv, fn, "dv"),
                  pointer<float>(dq_accum, fn, "dq_accum"), pointer<float>(delta, fn, "delta"),
                  dtype, B, H, T, S, D, scale, causal, dropout_p, seed, smem_limit,
                  as_stream(stream));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("dout"), py::arg("lse"),
          py::arg("kv_lens"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("dq_accum"),
          py::arg("delta"), py::arg("dtype"), py::arg("B"), py::arg("H"), py::arg("T"),
          py::arg("S"), py::arg("D"), py::arg("scale"), py::arg("causal"), py::arg("dropout_p"),
          py::arg("seed"), py::arg("smem_limit"), py::arg("stream"));

    m.def("attention_naive_forward",
          [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t p, uintptr_t kv_lens,
             int dtype, int B, int H, int T, int S, int D, float scale, bool causal, uintptr_t stream) {
              const char* fn = "attention_naive_forward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"B", B}, {"H", H}, {"T", T}, {"S", S}, {"D", D}});
              mt::attention_naive_forward(pointer(q, fn, "q", true, 16), pointer(k, fn, "k", true, 16),
                                          pointer(v, fn, "v", true, 16), pointer(o, fn, "o", true, 16),
                                          pointer<float>(p, fn, "p", true, 16),
                                          pointer<const int>(kv_lens, fn, "kv_lens", false), dtype, B,
                                          H, T, S, D, scale, causal, as_stream(stream));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("p"), py::arg("kv_lens"),
          py::arg("dtype"), py::arg("B"), py::arg("H"), py::arg("T"), py::arg("S"), py::arg("D"),
          py::arg("scale"), py::arg("causal"), py::arg("stream"));

    m.def("attention_tiled_forward",
          [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t kv_lens, int dtype, int B, int H,
             int T, int S, int D, float scale, bool causal, uintptr_t stream) {
              const char* fn = "attention_tiled_forward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"B", B}, {"H", H}, {"T", T}, {"S", S}, {"D", D}});
              mt::attention_tiled_forward(pointer(q, fn, "q", true, 16), pointer(k, fn, "k", true, 16),
                                          pointer(v, fn, "v", true, 16), pointer(o, fn, "o", true, 16),
                                          pointer<const int>(kv_lens, fn, "kv_lens", false), dtype, B, H, T,
                                          S, D, scale, causal, as_stream(stream));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("kv_lens"), py::arg("dtype"),
          py::arg("B"), py::arg("H"), py::arg("T"), py::arg("S"), py::arg("D"), py::arg("scale"),
          py::arg("causal"), py::arg("stream"));

    m.def("limits",
          []() {
              return py::dict(py::arg("attention_head_dims") = as_tuple(mt::limits::AttentionHeadDims{}),
                              py::arg("attention_tiled_max_d") = mt::limits::kAttentionTiledMaxD,
                              py::arg("max_grid_y") = mt::limits::kMaxGridY,
                              py::arg("layernorm_max_d") = mt::limits::kLayernormMaxD);
          },
          "What the kernels can take (csrc/limits.cuh): attention_head_dims, attention_tiled_max_d, max_grid_y (attention's "
          "B * H), layernorm_max_d (layernorm_backward's widest row).");

    m.def("launch_configs",
          [](const std::string& launcher, int dtype, int D) {
              py::list configs;
              for (const mt::LaunchConfig& c : launch_configs(launcher, dtype, D)) configs.append(as_dict(c));
              return configs;
          },
          "The variants of a launcher's kernel (attention_forward, attention_backward or "
          "layernorm_backward) for dtype and D, in the order it tries them: dicts of kernel (the "
          "instance's name), smem (its dynamic shared memory per block, bytes) and, for attention, "
          "tile (the rows and columns of the score matrix that one block works on: BR queries by "
          "BC keys).",
          py::arg("launcher"), py::arg("dtype"), py::arg("D"));

    m.def("launch_config",
          [](const std::string& launcher, int dtype, int D, long long smem_limit) -> py::object {
              const auto configs = launch_configs(launcher, dtype, D);
              const mt::LaunchConfig* c = mt::first_fit(configs, size_t(std::max(smem_limit, 0LL)));
              return c ? py::object(as_dict(*c)) : py::none();
          },
          "The variant that the launcher launches under smem_limit bytes of shared memory per "
          "block, or None if none fits (then the launcher raises SharedMemoryLimitError).",
          py::arg("launcher"), py::arg("dtype"), py::arg("D"), py::arg("smem_limit"));

    m.def("layernorm_forward",
          [](uintptr_t x, uintptr_t w, uintptr_t b, uintptr_t y, uintptr_t mean, uintptr_t rstd,
             int dtype, int N, int D, float eps, uintptr_t stream) {
              const char* fn = "layernorm_forward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"N", N}, {"D", D}});
              mt::layernorm_forward(pointer(x, fn, "x", true, 16), pointer(w, fn, "weight", false, 16),
                                    pointer(b, fn, "bias", false, 16), pointer(y, fn, "y", true, 16),
                                    pointer<float>(mean, fn, "mean"), pointer<float>(rstd, fn, "rstd"),
                                    dtype, N, D, eps, as_stream(stream));
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("y"), py::arg("mean"),
          py::arg("rstd"), py::arg("dtype"), py::arg("N"), py::arg("D"), py::arg("eps"),
          py::arg("stream"));

    m.def("layernorm_backward",
          [](uintptr_t x, uintptr_t w, uintptr_t mean, uintptr_t rstd, uintptr_t g, uintptr_t dx,
             uintptr_t dw, uintptr_t db, uintptr_t partial, int blocks, int dtype, int N, int D,
             long long smem_limit, uintptr_t stream) {
              const char* fn = "layernorm_backward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"N", N}, {"D", D}, {"blocks", blocks}, {"smem_limit", smem_limit}});
              mt::layernorm_backward(
                  pointer(x, fn, "x", true, 16), pointer(w, fn, "weight", false, 16),
                  pointer<const float>(mean, fn, "mean"), pointer<const float>(rstd, fn, "rstd"),
                  pointer(g, fn, "grad", true, 16), pointer(dx, fn, "dx", true, 16),
                  pointer(dw, fn, "dweight", false), pointer(db, fn, "dbias", false),
                  pointer<float>(partial, fn, "partial"), blocks, dtype, N, D, smem_limit,
                  as_stream(stream));
          },
          py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("grad"),
          py::arg("dx"), py::arg("dweight"), py::arg("dbias"), py::arg("partial"),
          py::arg("blocks"), py::arg("dtype"), py::arg("N"), py::arg("D"), py::arg("smem_limit"),
          py::arg("stream"));

    m.def("softmax_forward",
          [](uintptr_t x, uintptr_t mask, uintptr_t y, int dtype, int N, int V, float scale,
             uintptr_t stream) {
              const char* fn = "softmax_forward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"N", N}, {"V", V}});
              mt::softmax_forward(pointer(x, fn, "x"), pointer<const uint8_t>(mask, fn, "mask", false),
                                  pointer(y, fn, "y"), dtype, N, V, scale, as_stream(stream));
          },
          py::arg("x"), py::arg("mask"), py::arg("y"), py::arg("dtype"), py::arg("N"),
          py::arg("V"), py::arg("scale"), py::arg("stream"));

    m.def("softmax_backward",
          [](uintptr_t y, uintptr_t g, uintptr_t dx, int dtype, int N, int V, float scale,
             uintptr_t stream) {
              const char* fn = "softmax_backward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"N", N}, {"V", V}});
              mt::softmax_backward(pointer(y, fn, "y"), pointer(g, fn, "grad"), pointer(dx, fn, "dx"),
                                   dtype, N, V, scale, as_stream(stream));
          },
          py::arg("y"), py::arg("grad"), py::arg("dx"), py::arg("dtype"), py::arg("N"),
          py::arg("V"), py::arg("scale"), py::arg("stream"));

    m.def("cross_entropy_forward",
          [](uintptr_t logits, uintptr_t target, uintptr_t loss, uintptr_t nll, uintptr_t grad,
             int dtype, int N, int V, float smoothing, bool has_ignore, int64_t ignore_index,
             uintptr_t stream) {
              const char* fn = "cross_entropy_forward";
              check_dtype(dtype, fn);
              check_positive(fn, {{"N", N}, {"V", V}});
              if (!(smoothing >= 0.f && smoothing <= 1.f))
                  fail(fn, "label smoothing must be in [0, 1], got " + std::to_string(smoothing));
              mt::cross_entropy_forward(pointer(logits, fn, "logits"),
                                        pointer<const int64_t>(target, fn, "target", true, 8),
                                        pointer<float>(loss, fn, "loss"),
                                        pointer<float>(nll, fn, "nll", false),
                                        pointer(grad, fn, "grad", false),
                                        dtype, N, V, smoothing, has_ignore, ignore_index,
                                        as_stream(stream));
          },
          py::arg("logits"), py::arg("target"), py::arg("loss"), py::arg("nll"), py::arg("grad"),
          py::arg("dtype"), py::arg("N"), py::arg("V"), py::arg("smoothing"), py::arg("has_ignore"),
          py::arg("ignore_index"), py::arg("stream"));
}
