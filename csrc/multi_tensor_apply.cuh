// Generic multi-tensor launcher in the spirit of NVIDIA apex's multi_tensor_apply, with the
// tensor list in device memory instead of in the kernel's arguments.
//
// Plain CUDA, no torch headers: tensors are passed as raw pointers, so this header (and the
// kernels built on it) compile with nvcc alone. Each tensor is cut into chunks of
// `chunk_size` elements and one CUDA block processes one chunk (grid-stride over all chunks).
//
// [Note: the tensor table]
// apex passes up to a few dozen tensor pointers by value in each launch, so a bucket of 4,096
// gradients costs about a hundred launches of a 4 KB argument block, and on an H100 that launch
// cost, not memory, was the whole time of the op (0.03-0.10 of a plain copy of the same bytes).
// Here the host writes one table for the whole list (see TensorTable) into pinned memory, it goes
// to the device in one asynchronous copy on the op's stream, and ONE launch covers every chunk of
// every tensor: a block finds its tensor by binary search in the table's chunk prefix.
// A table of a few tensors (up to kInlineTensors) travels in the launch's arguments instead
// (InlineTable): its pinned block and copy cost two host calls, about as long as the kernel
// on a small bucket.
//
// Reusing a table (fused_reduce.cpp: TableCache, device_table). A training step packs the same
// buckets each step: the caching allocator hands the gradients back at the same addresses and the
// bucket buffers are fixed, so the table's words are the same as last step's. Building the pinned
// block and copying it then cost most of the op's host time (a 4,096-tensor bucket: 0.7 ms wall
// against 0.09 ms of GPU time on an H200), so the device copies of the last few tables are kept
// and a call whose words are equal, word for word, launches on the kept copy. The rules:
// * a table holds only addresses and numels, and the kernel reads nothing else from it, so equal
//   words describe the same memory work even where the tensors behind them were freed and others
//   allocated at the same addresses; scale and accumulate are launch arguments, not in the table;
// * an entry belongs to one (device, stream): its copy was queued on that stream, and its device
//   block was allocated there, so the caching allocator may reuse the block on that stream alone
//   once the entry is dropped, and every launch that read it is ordered before that reuse. (A
//   stream handle destroyed and recreated at the same value by other code would break this; torch's
//   streams come from pools that are never destroyed.)
// * no reuse, and no insertion, while the stream is captured into a CUDA graph: a replay would read
//   an entry that the cache may since have dropped;
// * the cache object is never destroyed (its device tensors must not be freed after the CUDA
//   runtime has shut down at exit); set_cuda_table_cache(0) turns it off and drops every entry.
// Tables that go in the launch's arguments are not cached: there is no copy to save.
//
// The functor returns true if it saw a non-finite value, which the kernel reports by writing
// 1.0f to a device flag (never cleared, so launches accumulate).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsm {

constexpr int kBlockThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // blocks per launch; more chunks are strided over

// The table of `count` tensors, Depth pointers each: int64 words, laid out as
//   ptr[0][0..count) ... ptr[Depth-1][0..count)  numel[0..count)  first_chunk[0..count]
// where first_chunk is the prefix sum of ceil(numel / chunk_size) (first_chunk[count] = chunks).
// Every numel must be > 0, so first_chunk is strictly increasing.
template <int Depth>
struct TensorTable {
  static constexpr int64_t words(int64_t count) { return (Depth + 2) * count + 1; }
};

// Where the kernel reads the table's words: device memory, or the launch's own arguments.
struct DeviceTable {
  const int64_t* __restrict__ words;
  __device__ __forceinline__ int64_t operator[](int64_t i) const { return words[i]; }
};

// Tables of up to this many tensors go by value (kernel arguments are limited to 4 KB).
constexpr int64_t kInlineTensors = 32;

template <int Depth>
struct InlineTable {
  int64_t words[TensorTable<Depth>::words(kInlineTensors)];  // the first words(count) are used
  __device__ __forceinline__ int64_t operator[](int64_t i) const { return words[i]; }
};

template <int Depth, class Table, class Functor>
__global__ void __launch_bounds__(kBlockThreads)
    multi_tensor_table_kernel(const Table table, int64_t count, int64_t chunks, int64_t chunk_size,
                              float* nonfinite_flag, Functor op) {
  const int64_t numel = Depth * count, first = numel + count;  // offsets of the two columns
  for (int64_t b = blockIdx.x; b < chunks; b += gridDim.x) {
    int64_t lo = 0, hi = count - 1;  // the tensor t with first[t] <= b < first[t + 1]
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (table[first + mid] <= b) lo = mid; else hi = mid - 1;
    }
    const int64_t start = (b - table[first + lo]) * chunk_size;
    const int64_t left = table[numel + lo] - start;
    void* ptrs[Depth];
#pragma unroll
    for (int d = 0; d < Depth; ++d) ptrs[d] = reinterpret_cast<void*>(table[d * count + lo]);
    if (op(ptrs, start, left < chunk_size ? left : chunk_size)) *nonfinite_flag = 1.0f;  // benign race
  }
}

// Bytes one vectorized access moves: 16 (one 128-bit load or store), less where ILP elements are fewer.
template <class T, int ILP>
__host__ __device__ constexpr int vector_bytes() {
  return sizeof(T) * ILP < 16 ? sizeof(T) * ILP : 16;
}

template <class T, int ILP>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % vector_bytes<T, ILP>() == 0;
}

// ILP elements of T, loaded/stored as 16-byte (or smaller) aligned vectors.
template <class T, int ILP>
struct alignas(vector_bytes<T, ILP>()) Pack {
  T v[ILP];
};

// Apply `f(const In&, Out&)` element-wise over n elements of one chunk with the whole block.
// Both pointers aligned: each thread moves ILP elements per step as vectors, then a guarded
// scalar tail. Otherwise (a tensor at an odd offset of a bucket, where the two sides are
// aligned differently): each thread still keeps ILP independent loads in flight, at strided
// indices so that every load instruction is coalesced across the block.
// ReadDst = false skips loading dst (for ops that only write it).
template <int ILP, bool ReadDst, class In, class Out, class F>
__device__ __forceinline__ void block_for_each(const In* src, Out* dst, int64_t n, F f) {
  const int64_t threads = blockDim.x;
  if (is_aligned<In, ILP>(src) && is_aligned<Out, ILP>(dst)) {
    const int64_t vec_end = n - n % ILP;
    for (int64_t i = threadIdx.x * int64_t{ILP}; i < vec_end; i += threads * ILP) {
      Pack<In, ILP> a = *reinterpret_cast<const Pack<In, ILP>*>(src + i);
      Pack<Out, ILP> b;
      if (ReadDst) b = *reinterpret_cast<Pack<Out, ILP>*>(dst + i);
#pragma unroll
      for (int j = 0; j < ILP; ++j) f(a.v[j], b.v[j]);
      *reinterpret_cast<Pack<Out, ILP>*>(dst + i) = b;
    }
    for (int64_t i = vec_end + threadIdx.x; i < n; i += threads) f(src[i], dst[i]);
    return;
  }
  for (int64_t base = 0; base < n; base += threads * ILP) {
    In a[ILP];
    Out b[ILP];
#pragma unroll
    for (int j = 0; j < ILP; ++j) {
      const int64_t i = base + threadIdx.x + j * threads;
      if (i < n) {
        a[j] = src[i];
        if (ReadDst) b[j] = dst[i];
      }
    }
#pragma unroll
    for (int j = 0; j < ILP; ++j) {
      const int64_t i = base + threadIdx.x + j * threads;
      if (i < n) {
        f(a[j], b[j]);
        dst[i] = b[j];
      }
    }
  }
}

// One launch of `op` over every chunk of the `count` tensors of a TensorTable<Depth> (`chunks` =
// its first_chunk[count]). `table` is a device pointer, or a host one when `on_host` (then count
// <= kInlineTensors and the words go in the launch's arguments). Returns the launch's CUDA error.
template <int Depth, class Functor>
cudaError_t multi_tensor_apply(const int64_t* table, bool on_host, int64_t count, int64_t chunks,
                               int64_t chunk_size, float* nonfinite_flag, cudaStream_t stream, Functor op) {
  if (count == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(chunks < kMaxGrid ? chunks : kMaxGrid);
  if (on_host) {
    if (count > kInlineTensors) return cudaErrorInvalidValue;
    InlineTable<Depth> inline_table;
    for (int64_t i = 0; i < TensorTable<Depth>::words(count); ++i) inline_table.words[i] = table[i];
    multi_tensor_table_kernel<Depth><<<grid, kBlockThreads, 0, stream>>>(inline_table, count, chunks, chunk_size,
                                                                         nonfinite_flag, op);
  } else {
    multi_tensor_table_kernel<Depth><<<grid, kBlockThreads, 0, stream>>>(DeviceTable{table}, count, chunks,
                                                                         chunk_size, nonfinite_flag, op);
  }
  return cudaGetLastError();
}

}  // namespace dsm
