// CUDA kernels of the fused gradient-bucket ops (see fused_reduce.cpp for the op semantics).
//
// Plain CUDA with a raw-pointer entry point, no torch headers: fused_reduce.cpp (built with
// -DDSM_WITH_CUDA) does the ATen glue (argument checks, current stream, flag tensor) and calls
// dsm_cuda_scale_table once per (src dtype, dst dtype) pair. This file therefore compiles
// with `nvcc -std=c++17 -c` even against a CPU-only torch install.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "multi_tensor_apply.cuh"

namespace dsm {
namespace {

// Element codecs: load to float, store from float with round-to-nearest-even, and an
// inf/nan test of the stored value (an inf/nan input always gives an inf/nan output).
struct F32 {
  using T = float;
  __device__ static float load(T v) { return v; }
  __device__ static T store(float v) { return v; }
  __device__ static bool nonfinite(T v) { return !isfinite(v); }
};

struct BF16 {
  using T = __nv_bfloat16;
  __device__ static float load(T v) { return __bfloat162float(v); }
  __device__ static T store(float v) { return __float2bfloat16_rn(v); }
  __device__ static bool nonfinite(T v) { return (__bfloat16_as_ushort(v) & 0x7f80u) == 0x7f80u; }
};

struct F16 {
  using T = __half;
  __device__ static float load(T v) { return __half2float(v); }
  __device__ static T store(float v) { return __float2half_rn(v); }
  __device__ static bool nonfinite(T v) { return (__half_as_ushort(v) & 0x7c00u) == 0x7c00u; }
};

// dst = cast(float(src) * scale), or dst = cast(float(dst) + float(src) * scale) if Acc.
// __fmul_rn/__fadd_rn keep the multiply and add separately rounded (no FMA contraction),
// matching the CPU kernel and the reference bit for bit.
template <class In, class Out, bool Acc>
struct ScaleFunctor {
  // Elements per thread and step: 16 bytes of the narrower side (8 for a 16-bit side, 4 for fp32).
  static constexpr int kIlp = 16 / (sizeof(typename In::T) < sizeof(typename Out::T) ? sizeof(typename In::T)
                                                                                        : sizeof(typename Out::T));
  float scale;

  __device__ bool operator()(void* const* ptrs, int64_t start, int64_t n) const {
    const typename In::T* src = static_cast<const typename In::T*>(ptrs[0]) + start;
    typename Out::T* dst = static_cast<typename Out::T*>(ptrs[1]) + start;
    bool bad = false;
    const float s = scale;
    block_for_each<kIlp, Acc>(src, dst, n, [&](const typename In::T& x, typename Out::T& y) {
      float v = __fmul_rn(In::load(x), s);
      if (Acc) v = __fadd_rn(Out::load(y), v);
      y = Out::store(v);
      bad |= Out::nonfinite(y);
    });
    return bad;
  }
};

template <class In, class Out, bool Acc>
cudaError_t launch(const int64_t* table, bool on_host, int64_t count, int64_t chunks, int64_t chunk_size, float scale,
                   float* flag, cudaStream_t stream) {
  return multi_tensor_apply<2>(table, on_host, count, chunks, chunk_size, flag, stream,
                               ScaleFunctor<In, Out, Acc>{scale});
}

template <class In, class Out>
cudaError_t launch_acc(bool accumulate, const int64_t* table, bool on_host, int64_t count, int64_t chunks,
                       int64_t chunk_size, float scale, float* flag, cudaStream_t stream) {
  return accumulate ? launch<In, Out, true>(table, on_host, count, chunks, chunk_size, scale, flag, stream)
                    : launch<In, Out, false>(table, on_host, count, chunks, chunk_size, scale, flag, stream);
}

template <class In>
cudaError_t launch_out(int out_code, bool accumulate, const int64_t* table, bool on_host, int64_t count,
                       int64_t chunks, int64_t chunk_size, float scale, float* flag, cudaStream_t stream) {
  switch (out_code) {
    case 0: return launch_acc<In, F32>(accumulate, table, on_host, count, chunks, chunk_size, scale, flag, stream);
    case 1: return launch_acc<In, BF16>(accumulate, table, on_host, count, chunks, chunk_size, scale, flag, stream);
    default: return launch_acc<In, F16>(accumulate, table, on_host, count, chunks, chunk_size, scale, flag, stream);
  }
}

}  // namespace
}  // namespace dsm

// dtype codes: 0 = float32, 1 = bfloat16, 2 = float16 (as in fused_reduce.cpp).
// `table` is a dsm::TensorTable<2> of `count` segments (source pointer, destination pointer,
// numel, first chunk; see multi_tensor_apply.cuh) in device memory, or in host memory when
// `on_host` (count <= dsm::kInlineTensors: it goes in the launch's arguments), holding `chunks`
// chunks of `chunk_size` elements. `stream` is a cudaStream_t; `flag` a device float set to 1.0f when a
// written value is inf/nan. Returns a cudaError_t value (0 = success).
int dsm_cuda_scale_table(int in_code, int out_code, bool accumulate, const int64_t* table, bool on_host,
                         int64_t count, int64_t chunks, int64_t chunk_size, float scale, float* flag, void* stream) {
  using namespace dsm;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  switch (in_code) {
    case 0:
      err = launch_out<F32>(out_code, accumulate, table, on_host, count, chunks, chunk_size, scale, flag, s);
      break;
    case 1:
      err = launch_out<BF16>(out_code, accumulate, table, on_host, count, chunks, chunk_size, scale, flag, s);
      break;
    default:
      err = launch_out<F16>(out_code, accumulate, table, on_host, count, chunks, chunk_size, scale, flag, s);
      break;
  }
  return static_cast<int>(err);
}

// The most segments a table passed with on_host may hold.
int64_t dsm_cuda_inline_tensors() { return dsm::kInlineTensors; }
