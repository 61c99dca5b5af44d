// Generic multi-tensor launcher in the spirit of NVIDIA apex's multi_tensor_apply.
//
// Plain CUDA, no torch headers: tensors are passed as raw pointers, so this header (and the
// kernels built on it) compile with nvcc alone. Each tensor is cut into chunks of
// `chunk_size` elements; one CUDA block processes one chunk. The kernel argument carries
// the pointers of up to kMaxTensors tensors and the (tensor, chunk) of up to kMaxBlocks
// blocks, so one launch covers many tensors; a tensor that does not fit is continued in
// the next launch. The functor returns true if it saw a non-finite value, which the kernel
// reports by writing 1.0f to a device flag (never cleared, so launches accumulate).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsm {

// Sized so that TensorListMeta<2> stays under the classic 4 KB kernel-parameter limit.
constexpr int kMaxTensors = 64;
constexpr int kMaxBlocks = 320;
constexpr int kBlockThreads = 512;
constexpr int64_t kChunkSize = 65536;

template <int Depth>
struct TensorListMeta {
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// One tensor on the host side: its Depth pointers (e.g. source and destination) and numel.
template <int Depth>
struct TensorRef {
  void* ptr[Depth];
  int64_t numel;
};

template <int Depth, class Functor>
__global__ void __launch_bounds__(kBlockThreads)
    multi_tensor_kernel(int64_t chunk_size, TensorListMeta<Depth> meta, float* nonfinite_flag, Functor op) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * chunk_size;
  const int64_t remaining = meta.sizes[t] - start;
  const int64_t n = remaining < chunk_size ? remaining : chunk_size;
  void* ptrs[Depth];
#pragma unroll
  for (int d = 0; d < Depth; ++d) ptrs[d] = meta.addresses[d][t];
  if (op(ptrs, start, n)) *nonfinite_flag = 1.0f;  // benign race: every writer stores 1.0f
}

// True if p is aligned for a vector of `ilp` elements of T.
template <class T>
__device__ __forceinline__ bool is_aligned(const T* p, int ilp) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * ilp) == 0;
}

// Vector of ILP elements, loaded/stored in one aligned transaction.
template <class T, int ILP>
struct alignas(sizeof(T) * ILP) Pack {
  T v[ILP];
};

// Apply `f(const In&, Out&)` element-wise over n elements of one chunk with the whole block:
// an aligned, vectorized body of ILP elements per thread and step when both pointers allow
// it, then a guarded scalar tail (also the whole loop when the pointers are misaligned).
// ReadDst = false skips loading dst in the vectorized body (for ops that only write it).
template <int ILP, bool ReadDst, class In, class Out, class F>
__device__ __forceinline__ void block_for_each(const In* src, Out* dst, int64_t n, F f) {
  int64_t vec_end = 0;
  if (is_aligned(src, ILP) && is_aligned(dst, ILP)) {
    vec_end = n - n % ILP;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * ILP; i < vec_end; i += static_cast<int64_t>(blockDim.x) * ILP) {
      Pack<In, ILP> a = *reinterpret_cast<const Pack<In, ILP>*>(src + i);
      Pack<Out, ILP> b;
      if (ReadDst) b = *reinterpret_cast<Pack<Out, ILP>*>(dst + i);
#pragma unroll
      for (int j = 0; j < ILP; ++j) f(a.v[j], b.v[j]);
      *reinterpret_cast<Pack<Out, ILP>*>(dst + i) = b;
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < n; i += blockDim.x) f(src[i], dst[i]);
}

// Launch `op` over all tensors; returns the first CUDA error (cudaSuccess if none).
template <int Depth, class Functor>
cudaError_t multi_tensor_apply(const TensorRef<Depth>* tensors, int64_t count, int64_t chunk_size,
                               float* nonfinite_flag, cudaStream_t stream, Functor op) {
  TensorListMeta<Depth> meta;
  int loc_tensor = 0;
  int loc_block = 0;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t numel = tensors[t].numel;
    if (numel == 0) continue;
    meta.sizes[loc_tensor] = numel;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][loc_tensor] = tensors[t].ptr[d];
    ++loc_tensor;
    const int64_t chunks = (numel + chunk_size - 1) / chunk_size;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[loc_block] = static_cast<unsigned char>(loc_tensor - 1);
      meta.block_to_chunk[loc_block] = static_cast<int>(c);
      ++loc_block;
      const bool tensor_done = c == chunks - 1;
      if (loc_block < kMaxBlocks && !(tensor_done && loc_tensor == kMaxTensors)) continue;
      multi_tensor_kernel<Depth><<<loc_block, kBlockThreads, 0, stream>>>(chunk_size, meta, nonfinite_flag, op);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      loc_block = 0;
      if (tensor_done) {
        loc_tensor = 0;
      } else {  // the current tensor continues in the next launch, as entry 0
        meta.sizes[0] = meta.sizes[loc_tensor - 1];
        for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][loc_tensor - 1];
        loc_tensor = 1;
      }
    }
  }
  if (loc_block > 0) {
    multi_tensor_kernel<Depth><<<loc_block, kBlockThreads, 0, stream>>>(chunk_size, meta, nonfinite_flag, op);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace dsm
