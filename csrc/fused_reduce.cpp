// Fused gradient-bucket ops: pack (flatten + scale + cast) and unpack_accumulate
// (slice + cast + scale + assign/accumulate), each returning a non-finite flag
// computed in the same pass.
//
// Both ops reduce to one primitive: a list of segments (src pointer, dst pointer,
// element count, src dtype, dst dtype), each computing
//     dst[k] = cast(float(src[k]) * scale)                 (assign)
//     dst[k] = cast(float(dst[k]) + float(src[k]) * scale)  (accumulate)
// (one exception: an assign at scale 1 between equal 16-bit dtypes copies the bits, NaN payloads
// included, as copy_ does; see copy16_loop)
// pack:   segment i = (tensors[i], out + offset_i);
// unpack: segment i = (src + offset_i, outs[i]).
// On CPU the segments are processed by at::parallel_for over the flat element
// range (so big tensors are split across threads and tiny ones are batched);
// on CUDA (built with -DDSM_WITH_CUDA) by the multi-tensor kernels in
// fused_reduce_cuda.cu.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#ifdef DSM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
// Defined in fused_reduce_cuda.cu; returns a cudaError_t value (0 = success). `table` is a
// dsm::TensorTable<2> (multi_tensor_apply.cuh): src and dst pointers, numel, first chunk, as int64
// words; its device copy, or the host words themselves when `on_host` (at most
// dsm_cuda_inline_tensors() segments, passed in the launch's arguments).
int dsm_cuda_scale_table(int in_code, int out_code, bool accumulate, const int64_t* table, bool on_host,
                         int64_t count, int64_t chunks, int64_t chunk_size, float scale, float* flag, void* stream);
int64_t dsm_cuda_inline_tensors();
#endif

namespace py = pybind11;

namespace {

// dtype codes shared with fused_reduce_cuda.cu: 0 = float32, 1 = bfloat16, 2 = float16.
constexpr int kNumCodes = 3;

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// ---------------------------------------------------------------------------
// Element codecs: load to fp32, store from fp32 with round-to-nearest-even (the
// same rounding as torch's casts), and a bit test for inf/nan on the stored value.
// Written as plain bit operations so that gcc -O3 vectorizes the loops.
inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}
inline float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

struct F32 {
  using T = float;
  static float load(T v) { return v; }
  static T store(float v) { return v; }
  static uint32_t nonfinite(T v) { return (bits_of(v) & 0x7f800000u) == 0x7f800000u; }
};

struct BF16 {
  using T = uint16_t;
  static float load(T v) { return float_of(static_cast<uint32_t>(v) << 16); }
  // c10::detail::round_to_nearest_even without the branch (nan -> 0x7fc0).
  static T store(float v) {
    const uint32_t u = bits_of(v);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<T>(v != v ? 0x7fc0u : rounded);
  }
  static uint32_t nonfinite(T v) { return (v & 0x7f80u) == 0x7f80u; }
};

// IEEE half <-> float as in c10::detail::fp16_ieee_{to,from}_fp32_value (the FP16 library's
// branch-free algorithms), restated here so that the loops inline and vectorize.
struct F16 {
  using T = uint16_t;
  static float load(T h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (0xe0u << 23)) * float_of(0x07800000u);  // * 2^-112
    const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized));
    return float_of(result);
  }
  static T store(float f) {
    const float scale_to_inf = float_of(0x77800000u);   // 2^112
    const float scale_to_zero = float_of(0x08800000u);  // 2^-110
    float base = (float_of(bits_of(f) & 0x7fffffffu) * scale_to_inf) * scale_to_zero;
    const uint32_t w = bits_of(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = bits_of(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return static_cast<T>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
  }
  static uint32_t nonfinite(T v) { return (v & 0x7c00u) == 0x7c00u; }
};

// One segment's inner loop. Returns nonzero if any stored value is inf/nan.
// (An inf/nan input always yields an inf/nan output, so testing the stored
// value covers both the inputs and the scaled, cast outputs.)
template <class In, class Out, bool Acc>
inline __attribute__((always_inline)) uint32_t scale_loop(const void* src_v, void* dst_v, int64_t n,
                                                          float scale) {
  const typename In::T* __restrict__ src = static_cast<const typename In::T*>(src_v);
  typename Out::T* __restrict__ dst = static_cast<typename Out::T*>(dst_v);
  uint32_t bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    float v = In::load(src[k]) * scale;
    if (Acc) v = Out::load(dst[k]) + v;
    const typename Out::T stored = Out::store(v);
    dst[k] = stored;
    bad |= Out::nonfinite(stored);
  }
  return bad;
}

// The same loop compiled twice: for the x86-64 baseline (SSE2) and, selected at run time, for
// AVX2 (wider integer ops make the half/bfloat16 conversions vectorize). No -march=native, so
// the cached build stays valid on any x86-64 host. -ffp-contract=off keeps mul and add separate
// (no FMA), so the rounding matches the reference exactly.
template <class In, class Out, bool Acc>
uint32_t scale_segment(const void* src, void* dst, int64_t n, float scale) {
  return scale_loop<In, Out, Acc>(src, dst, n, scale);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Explicit AVX2 + F16C path, selected at run time (no -march=native, so the cached build stays
// valid on any x86-64 host): 8 lanes per step through the V8 codecs, then the scalar loop for
// the tail. Half conversions use the F16C instructions (round-to-nearest-even, as torch does);
// bfloat16 uses the same integer rounding as BF16::store.
#define DSM_HAVE_AVX2_PATH 1
#define DSM_AVX2 __attribute__((target("avx2,f16c")))

template <class C>
struct V8;

template <>
struct V8<F32> {
  DSM_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  // Stores and returns a nonzero mask if any lane is inf/nan.
  DSM_AVX2 static int store(float* p, __m256 v) {
    _mm256_storeu_ps(p, v);
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exp), exp));
  }
};

DSM_AVX2 inline int store_halves(uint16_t* p, __m128i h, int16_t exp_mask) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  const __m128i exp = _mm_set1_epi16(exp_mask);
  return _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
}

template <>
struct V8<BF16> {
  DSM_AVX2 static __m256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  DSM_AVX2 static int store(uint16_t* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), is_nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    return store_halves(p, _mm256_castsi256_si128(packed), 0x7f80);
  }
};

template <>
struct V8<F16> {
  DSM_AVX2 static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  DSM_AVX2 static int store(uint16_t* p, __m256 v) {
    return store_halves(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 0x7c00);
  }
};

template <class In, class Out, bool Acc>
DSM_AVX2 uint32_t scale_segment_avx2(const void* src_v, void* dst_v, int64_t n, float scale) {
  const typename In::T* src = static_cast<const typename In::T*>(src_v);
  typename Out::T* dst = static_cast<typename Out::T*>(dst_v);
  const __m256 vscale = _mm256_set1_ps(scale);
  int bad = 0;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 v = _mm256_mul_ps(V8<In>::load(src + k), vscale);
    if (Acc) v = _mm256_add_ps(V8<Out>::load(dst + k), v);
    bad |= V8<Out>::store(dst + k, v);
  }
  return static_cast<uint32_t>(bad != 0) | scale_loop<In, Out, Acc>(src + k, dst + k, n - k, scale);
}

const bool kUseAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif

using SegmentFn = uint32_t (*)(const void*, void*, int64_t, float);

template <class In, class Out, bool Acc>
SegmentFn pick_isa() {
#ifdef DSM_HAVE_AVX2_PATH
  if (kUseAvx2) return &scale_segment_avx2<In, Out, Acc>;
#endif
  return &scale_segment<In, Out, Acc>;
}

template <class In, bool Acc>
SegmentFn pick_out(int out_code) {
  switch (out_code) {
    case 0: return pick_isa<In, F32, Acc>();
    case 1: return pick_isa<In, BF16, Acc>();
    default: return pick_isa<In, F16, Acc>();
  }
}

template <bool Acc>
SegmentFn pick(int in_code, int out_code) {
  switch (in_code) {
    case 0: return pick_out<F32, Acc>(out_code);
    case 1: return pick_out<BF16, Acc>(out_code);
    default: return pick_out<F16, Acc>(out_code);
  }
}

// Same 16-bit dtype in and out, scale 1, assign: each value is its input, so the bits are copied
// as they are (as copy_ copies them; the widening path above would also rewrite a NaN's payload
// to the canonical one) and the flag tests the exponent bits. This keeps a plain bucket pack of
// bf16/fp16 gradients as fast as the per-tensor copy_ it replaces, where the widening path is not.
template <uint16_t Exp>
inline __attribute__((always_inline)) uint32_t copy16_loop(const void* src_v, void* dst_v, int64_t n) {
  const uint16_t* __restrict__ src = static_cast<const uint16_t*>(src_v);
  uint16_t* __restrict__ dst = static_cast<uint16_t*>(dst_v);
  uint32_t bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    dst[k] = src[k];
    bad |= (src[k] & Exp) == Exp;
  }
  return bad;
}

template <uint16_t Exp>
uint32_t copy16_segment(const void* src, void* dst, int64_t n, float) {
  return copy16_loop<Exp>(src, dst, n);
}

#ifdef DSM_HAVE_AVX2_PATH
template <uint16_t Exp>
DSM_AVX2 uint32_t copy16_segment_avx2(const void* src_v, void* dst_v, int64_t n, float) {
  const uint16_t* src = static_cast<const uint16_t*>(src_v);
  uint16_t* dst = static_cast<uint16_t*>(dst_v);
  const __m256i exp = _mm256_set1_epi16(static_cast<int16_t>(Exp));
  __m256i hits = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), v);
    hits = _mm256_or_si256(hits, _mm256_cmpeq_epi16(_mm256_and_si256(v, exp), exp));
  }
  return static_cast<uint32_t>(!_mm256_testz_si256(hits, hits)) | copy16_loop<Exp>(src + k, dst + k, n - k);
}
#endif

template <uint16_t Exp>
SegmentFn pick_copy16_isa() {
#ifdef DSM_HAVE_AVX2_PATH
  if (kUseAvx2) return &copy16_segment_avx2<Exp>;
#endif
  return &copy16_segment<Exp>;
}

// The segment function for (in dtype, out dtype, accumulate, scale).
SegmentFn pick_segment(int in_code, int out_code, bool accumulate, float scale) {
  if (accumulate) return pick<true>(in_code, out_code);
  if (scale == 1.f && in_code == out_code && in_code == 1) return pick_copy16_isa<0x7f80>();
  if (scale == 1.f && in_code == out_code && in_code == 2) return pick_copy16_isa<0x7c00>();
  return pick<false>(in_code, out_code);
}

// ---------------------------------------------------------------------------
struct Segment {
  const char* src;
  char* dst;
  int64_t numel;
  int in_code;
  int out_code;
};

struct Plan {
  std::vector<Segment> segments;  // non-empty segments only
  std::vector<int64_t> offsets;   // flat start of each segment, plus the total at the end
  std::vector<at::Tensor> keep;   // contiguous copies that segments point into

  explicit Plan(size_t capacity) {
    segments.reserve(capacity);
    offsets.reserve(capacity + 1);
    offsets.push_back(0);
  }
  int64_t total() const { return offsets.back(); }
  void add(const void* src, int in_code, void* dst, int out_code, int64_t numel) {
    if (numel == 0) return;
    segments.push_back({static_cast<const char*>(src), static_cast<char*>(dst), numel, in_code, out_code});
    offsets.push_back(total() + numel);
  }
};

constexpr int64_t kGrain = 1 << 15;  // elements per thread at least

float run_cpu(const Plan& plan, float scale, bool accumulate) {
  if (plan.segments.empty()) return 0.f;
  std::vector<SegmentFn> fns(plan.segments.size());
  std::vector<int> in_size(plan.segments.size()), out_size(plan.segments.size());
  static const int kSize[kNumCodes] = {4, 2, 2};
  for (size_t i = 0; i < plan.segments.size(); ++i) {
    const Segment& s = plan.segments[i];
    fns[i] = pick_segment(s.in_code, s.out_code, accumulate, scale);
    in_size[i] = kSize[s.in_code];
    out_size[i] = kSize[s.out_code];
  }
  const std::vector<int64_t>& off = plan.offsets;  // size segments + 1
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, plan.total(), kGrain, [&](int64_t begin, int64_t end) {
    uint32_t local = 0;
    size_t i = std::upper_bound(off.begin(), off.end(), begin) - off.begin() - 1;
    while (begin < end) {
      const Segment& s = plan.segments[i];
      const int64_t stop = std::min(end, off[i + 1]);
      const int64_t k = begin - off[i];
      local |= fns[i](s.src + k * in_size[i], s.dst + k * out_size[i], stop - begin, scale);
      begin = stop;
      ++i;
    }
    if (local) bad.fetch_or(1u, std::memory_order_relaxed);
  });
  return bad.load() ? 1.f : 0.f;
}

#ifdef DSM_WITH_CUDA
constexpr int64_t kCudaChunk = 16384;  // elements per CUDA block and step of the grid
// Tables of up to this many segments go in the launch's arguments; set_cuda_inline_tensors(0)
// sends every table through device memory (the benchmark's baseline, the tests' second path).
int64_t g_inline_tensors = -1;  // -1: dsm_cuda_inline_tensors()

int64_t inline_tensors() { return g_inline_tensors < 0 ? dsm_cuda_inline_tensors() : g_inline_tensors; }

int64_t set_cuda_inline_tensors(int64_t n) {
  const int64_t previous = inline_tensors();
  if (n < 0 || n > dsm_cuda_inline_tensors()) {
    throw py::value_error("deepspeed_multi fused_reduce: set_cuda_inline_tensors(" + std::to_string(n) +
                          "): expected 0.." + std::to_string(dsm_cuda_inline_tensors()) +
                          " (the most a launch's arguments hold)");
  }
  g_inline_tensors = n;
  return previous;
}

// The device tables of recent calls, for reuse by a call whose table words are the same
// ([Note: the tensor table], "Reusing a table"). Entries are most recently used first. Guarded by
// its mutex (the GIL is held in run_cuda today; the mutex costs nothing uncontended and does not
// rely on that).
struct TableCache {
  struct Entry {
    int device;
    void* stream;
    int in_code, out_code;
    uint64_t hash;               // of words: finds candidates; equality is decided by the words
    std::vector<int64_t> words;  // the host words, compared exactly
    at::Tensor table;            // their device copy, allocated and copied on `stream`
  };
  std::mutex mutex;
  std::vector<Entry> entries;
  int64_t capacity = 16;
  int64_t hits = 0, misses = 0;
  int64_t full_misses = 0;  // misses that found the cache full: every 8th enters as most recent
  std::vector<int64_t> scratch;  // the words being built; kept to avoid an allocation per call
};

// Never destroyed: its entries hold device tensors, which must not be freed by a static
// destructor after the CUDA runtime has shut down at process exit.
TableCache& table_cache() {
  static TableCache* cache = new TableCache();
  return *cache;
}

int64_t set_cuda_table_cache(int64_t n) {
  TableCache& cache = table_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  const int64_t previous = cache.capacity;
  if (n < 0 || n > 1024) {
    throw py::value_error("deepspeed_multi fused_reduce: set_cuda_table_cache(" + std::to_string(n) +
                          "): expected 0..1024 (the number of device tables kept; 0 turns the cache off)");
  }
  cache.capacity = n;
  if (static_cast<int64_t>(cache.entries.size()) > n) cache.entries.resize(static_cast<size_t>(n));
  return previous;
}

py::dict cuda_table_cache_stats() {
  TableCache& cache = table_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  int64_t bytes = 0;
  for (const TableCache::Entry& e : cache.entries) bytes += 2 * static_cast<int64_t>(e.words.size() * sizeof(int64_t));
  py::dict stats;
  stats["hits"] = cache.hits;
  stats["misses"] = cache.misses;
  stats["entries"] = static_cast<int64_t>(cache.entries.size());
  stats["capacity"] = cache.capacity;
  stats["bytes"] = bytes;  // host words + their device copies
  return stats;
}

void throw_cuda(const char* what, int err) {  // not TORCH_CHECK: its message is formatted with iostreams (see ints_str)
  throw std::runtime_error(std::string("deepspeed_multi fused_reduce: ") + what + " failed with cudaError " +
                           std::to_string(err));
}

// The device table for `words` (TensorTable<2>, count segments) on `stream`: a cached copy whose
// words are equal, or a new copy through pinned memory (then cached, unless the cache is off or the
// stream is being captured into a CUDA graph, whose replays would read a table the cache may
// since have freed). Returns its device pointer; `keep` holds a new copy until the launch is queued.
const int64_t* device_table(TableCache& cache, const std::vector<int64_t>& words, uint64_t hash, int in_code,
                            int out_code, const at::Device& device, void* stream, at::Tensor& keep) {
  const int index = device.index();
  bool use_cache = cache.capacity > 0;
  if (use_cache) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
    if (err != cudaSuccess) throw_cuda("cudaStreamIsCapturing", static_cast<int>(err));
    use_cache = capture == cudaStreamCaptureStatusNone;
  }
  auto& entries = cache.entries;
  if (use_cache) {
    for (size_t i = 0; i < entries.size(); ++i) {
      const TableCache::Entry& e = entries[i];
      if (e.hash != hash || e.device != index || e.stream != stream || e.in_code != in_code ||
          e.out_code != out_code || e.words.size() != words.size() ||
          std::memcmp(e.words.data(), words.data(), words.size() * sizeof(int64_t)) != 0) {
        continue;
      }
      ++cache.hits;
      std::rotate(entries.begin(), entries.begin() + i, entries.begin() + i + 1);  // most recent first
      return entries.front().table.data_ptr<int64_t>();
    }
    ++cache.misses;
  }
  // Pinned, so that the copy is asynchronous (the caching host allocator keeps the block until that
  // copy has run: non_blocking records an event on the stream).
  at::Tensor host = at::empty({static_cast<int64_t>(words.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), words.data(), words.size() * sizeof(int64_t));
  keep = host.to(device, /*non_blocking=*/true);
  if (use_cache) {
    TableCache::Entry entry{index, stream, in_code, out_code, hash, words, keep};
    if (static_cast<int64_t>(entries.size()) < cache.capacity) {
      entries.insert(entries.begin(), std::move(entry));
    } else {
      // Full: the new table replaces the least recently used one and stays least recent (the next
      // miss replaces it) unless it is hit first, except every 8th, which enters as most recent. So
      // a step that cycles through more tables than the cache holds still hits on capacity - 1 of
      // them (plain LRU would miss on every one), and a cache full of tables no longer used (another
      // model, new buckets) still turns over, within about 8 * capacity misses.
      entries.back() = std::move(entry);
      if (++cache.full_misses % 8 == 0) std::rotate(entries.begin(), entries.end() - 1, entries.end());
    }
  }
  return keep.data_ptr<int64_t>();
}

at::Tensor run_cuda(const Plan& plan, float scale, bool accumulate, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  // The flag, zeroed by a memset on the stream: at::zeros would dispatch a fill kernel through
  // TensorIterator, several microseconds of host time per call.
  at::Tensor flag = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
  const cudaError_t set = cudaMemsetAsync(flag.data_ptr<float>(), 0, sizeof(float), static_cast<cudaStream_t>(stream));
  if (set != cudaSuccess) throw_cuda("cudaMemsetAsync of the flag", static_cast<int>(set));
  int64_t per_pair[kNumCodes * kNumCodes] = {};
  for (const Segment& s : plan.segments) ++per_pair[s.in_code * kNumCodes + s.out_code];
  TableCache& cache = table_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  std::vector<int64_t>& words = cache.scratch;
  // One table and one launch per (src dtype, dst dtype) pair present ([Note: the tensor table]).
  for (int pair = 0; pair < kNumCodes * kNumCodes; ++pair) {
    const int64_t count = per_pair[pair];
    if (count == 0) continue;
    const int in_code = pair / kNumCodes, out_code = pair % kNumCodes;
    words.resize(static_cast<size_t>(4 * count + 1));
    int64_t* first = words.data() + 3 * count;
    int64_t k = 0;
    uint64_t hash = static_cast<uint64_t>(count);
    first[0] = 0;
    for (const Segment& s : plan.segments) {
      if (s.in_code != in_code || s.out_code != out_code) continue;
      words[k] = reinterpret_cast<int64_t>(s.src);
      words[count + k] = reinterpret_cast<int64_t>(s.dst);
      words[2 * count + k] = s.numel;
      first[k + 1] = first[k] + (s.numel + kCudaChunk - 1) / kCudaChunk;
      // A sum, not a chain of multiplies, so that it costs no latency per segment; collisions only
      // cost a comparison of words.
      hash += reinterpret_cast<uintptr_t>(s.src) * 0x9e3779b97f4a7c15ull ^
              reinterpret_cast<uintptr_t>(s.dst) * 0xc2b2ae3d27d4eb4full ^ static_cast<uint64_t>(s.numel);
      ++k;
    }
    // A small table goes in the launch's arguments (no copy, nothing to cache); a large one through
    // device memory, reused from the cache where a recent call had the same words.
    const bool on_host = count <= inline_tensors();
    at::Tensor keep;
    const int64_t* table = on_host ? words.data()
                                   : device_table(cache, words, hash, in_code, out_code, device, stream, keep);
    const int err = dsm_cuda_scale_table(in_code, out_code, accumulate, table, on_host, count, first[count],
                                         kCudaChunk, scale, flag.data_ptr<float>(), stream);
    if (err != 0) throw_cuda("CUDA kernel launch", err);
  }
  return flag;
}
#endif

at::Tensor run(const Plan& plan, float scale, bool accumulate, const at::Device& device) {
  if (device.is_cuda()) {
#ifdef DSM_WITH_CUDA
    return run_cuda(plan, scale, accumulate, device);
#else
    throw py::value_error(
        "deepspeed_multi fused_reduce: got CUDA tensors but this build of the extension has no CUDA "
        "kernels (it was built where torch.cuda.is_available() was False); set DSM_FUSED_REDUCE=ref "
        "or rebuild it on a machine with CUDA");
#endif
  }
  if (!device.is_cpu()) {
    throw py::value_error("deepspeed_multi fused_reduce: tensors are on " + device.str() +
                          "; the extension supports cpu and cuda only; set DSM_FUSED_REDUCE=ref");
  }
  float flag;
  {
    py::gil_scoped_release no_gil;
    flag = run_cpu(plan, scale, accumulate);
  }
  return at::scalar_tensor(flag, at::TensorOptions().dtype(at::kFloat));
}

// ---------------------------------------------------------------------------
// Argument checks. Each error names the op, the argument (with its index),
// what was expected, what was found, and what to do.
// A tensor argument named lazily: base "tensors" + index 3 -> "tensors[3]"; index < 0 -> base.
// Names are only formatted when an error is raised, to keep the per-tensor cost minimal.
struct Arg {
  const char* base;
  int64_t index;
  std::string str() const { return index < 0 ? base : std::string(base) + "[" + std::to_string(index) + "]"; }
};

// "[3, 2]", as torch prints sizes. Messages are built from std::string alone: no iostreams in this
// extension, whose stream code can differ from torch's where the host compiler does (an error path
// that printed sizes through std::ostream crashed with g++ 13 against torch 2.11+cu130).
std::string ints_str(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string describe(const Arg& name, const at::Tensor& t) {
  return name.str() + " (shape " + ints_str(t.sizes()) + ", dtype " + dtype_name(t.scalar_type()) + ", device " +
         t.device().str() + ")";
}

int checked_code(const char* op, const Arg& name, const at::Tensor& t) {
  const int code = dtype_code(t.scalar_type());
  if (code < 0) {
    throw py::value_error(std::string(op) + ": " + describe(name, t) +
                          " has an unsupported dtype; expected torch.float32, torch.bfloat16 or "
                          "torch.float16; cast it first (e.g. t.float())");
  }
  return code;
}

void check_device(const char* op, const Arg& name, const at::Tensor& t, const char* ref_name,
                  const at::Device& device) {
  if (t.device() != device) {
    throw py::value_error(std::string(op) + ": " + describe(name, t) + " is on " + t.device().str() +
                          " but " + std::string(ref_name) + " is on " + device.str() +
                          "; move all tensors to one device first");
  }
}

void check_flat(const char* op, const Arg& name, const at::Tensor& t) {
  if (t.dim() != 1 || !t.is_contiguous()) {
    throw py::value_error(std::string(op) + ": " + describe(name, t) +
                          " must be a 1-D contiguous tensor; pass a flat buffer (e.g. buf.view(-1) of a "
                          "contiguous tensor)");
  }
}

void check_fits(const char* op, const Arg& name, const at::Tensor& t, int64_t offset, const char* buf,
                int64_t capacity) {
  if (offset + t.numel() > capacity) {
    throw py::value_error(std::string(op) + ": " + describe(name, t) + " needs " + buf + " elements [" +
                          std::to_string(offset) + ", " + std::to_string(offset + t.numel()) + ") but " + buf +
                          " has " + std::to_string(capacity) + "; pass a " + buf +
                          " with at least the total numel of all tensors");
  }
}

// The tensor-list arguments, read from the Python sequence without pybind's std::vector<at::Tensor>
// caster: that caster cost about 70 ns a tensor (an at::Tensor copy, so an atomic reference count
// up and down, and a sequence item fetch, per element), 280 us of a 4,096-tensor call whose checks
// and CPU kernel took 170 us (x86-64 CPU, tiny tensors); this costs about 3 ns a tensor. The tuple
// holds a reference to every tensor for the call, so a list that another thread changes while run()
// has released the GIL cannot free one under the kernel. Accepts what the caster accepted: any
// sequence but str/bytes.
class TensorList {
 public:
  TensorList(const char* op, const char* name, const py::handle& seq) {
    PyObject* obj = seq.ptr();
    if (!PySequence_Check(obj) || PyUnicode_Check(obj) || PyBytes_Check(obj)) {
      throw py::type_error(std::string(op) + ": " + name + " must be a list or tuple of tensors, got " +
                           Py_TYPE(obj)->tp_name);
    }
    items_ = py::reinterpret_steal<py::tuple>(PySequence_Tuple(obj));
    if (!items_) throw py::error_already_set();
    for (size_t i = 0; i < size(); ++i) {
      PyObject* item = PyTuple_GET_ITEM(items_.ptr(), i);
      if (!THPVariable_Check(item)) {
        throw py::type_error(std::string(op) + ": " + name + "[" + std::to_string(i) + "] is a " +
                             Py_TYPE(item)->tp_name + ", not a torch.Tensor; pass a list of tensors");
      }
    }
  }
  size_t size() const { return static_cast<size_t>(PyTuple_GET_SIZE(items_.ptr())); }
  // The tensor the i-th Python object wraps (a reference into that object, which items_ keeps alive).
  const at::Tensor& operator[](size_t i) const { return THPVariable_Unpack(PyTuple_GET_ITEM(items_.ptr(), i)); }

 private:
  py::tuple items_;
};

at::Tensor pack(const py::handle& tensor_seq, const at::Tensor& out, double scale) {
  constexpr const char* op = "pack";
  const TensorList tensors(op, "tensors", tensor_seq);
  const Arg out_arg{"out", -1};
  check_flat(op, out_arg, out);
  const int out_code = checked_code(op, out_arg, out);
  char* dst = static_cast<char*>(out.data_ptr());
  Plan plan(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const Arg name{"tensors", static_cast<int64_t>(i)};
    const int in_code = checked_code(op, name, t);
    check_device(op, name, t, "out", out.device());
    check_fits(op, name, t, plan.total(), "out", out.numel());
    const at::Tensor* src = &t;
    if (t.numel() > 0 && !t.is_contiguous()) {
      plan.keep.push_back(t.contiguous());
      src = &plan.keep.back();
    }
    plan.add(src->data_ptr(), in_code, dst + plan.total() * out.element_size(), out_code, t.numel());
  }
  return run(plan, static_cast<float>(scale), /*accumulate=*/false, out.device());
}

at::Tensor unpack_accumulate(const at::Tensor& src, const py::handle& out_seq, double scale, bool accumulate) {
  constexpr const char* op = "unpack_accumulate";
  const TensorList outs(op, "outs", out_seq);
  const Arg src_arg{"src", -1};
  check_flat(op, src_arg, src);
  const int in_code = checked_code(op, src_arg, src);
  const char* base = static_cast<const char*>(src.data_ptr());
  Plan plan(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& t = outs[i];
    const Arg name{"outs", static_cast<int64_t>(i)};
    const int out_code = checked_code(op, name, t);
    check_device(op, name, t, "src", src.device());
    if (!t.is_contiguous()) {
      throw py::value_error(std::string(op) + ": " + describe(name, t) + " is not contiguous (strides " +
                            ints_str(t.strides()) +
                            "); it is written in place, so pass a contiguous tensor (e.g. make the gradient "
                            "partition contiguous, or unpack into a contiguous buffer and copy_ it back)");
    }
    check_fits(op, name, t, plan.total(), "src", src.numel());
    plan.add(base + plan.total() * src.element_size(), in_code, t.data_ptr(), out_code, t.numel());
  }
  return run(plan, static_cast<float>(scale), accumulate, src.device());
}

at::Tensor pack_partitions(const py::handle& tensor_seq, const at::Tensor& out, int64_t world, double scale) {
  // ZeRO-3's interleaved reduce-scatter input in one pass: rank r's block of out holds, for each
  // tensor i, its r-th chunk of c_i = ceil(n_i / world) elements at offset sum_{j<i} c_j; the
  // blocks are P = sum_i c_i long. A chunk shorter than c_i (the tail of a tensor whose numel is
  // not a multiple of world) leaves its padding untouched.
  constexpr const char* op = "pack_partitions";
  const TensorList tensors(op, "tensors", tensor_seq);
  const Arg out_arg{"out", -1};
  check_flat(op, out_arg, out);
  const int out_code = checked_code(op, out_arg, out);
  if (world < 1) {
    throw py::value_error(std::string(op) + ": world must be >= 1 (the number of ranks the tensors are "
                          "partitioned over), got " + std::to_string(world));
  }
  std::vector<int64_t> chunk(tensors.size());
  int64_t block = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    chunk[i] = (tensors[i].numel() + world - 1) / world;
    block += chunk[i];
  }
  if (block * world > out.numel()) {
    throw py::value_error(std::string(op) + ": " + describe(out_arg, out) + " has " + std::to_string(out.numel()) +
                          " elements but world * sum(ceil(numel / world)) = " + std::to_string(block * world) +
                          " are needed; allocate out with that many elements");
  }
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t out_size = out.element_size();
  Plan plan(tensors.size() * static_cast<size_t>(world));
  std::vector<at::Tensor> srcs;  // contiguous (a copy where a tensor is not), alive until run() returns
  srcs.reserve(tensors.size());
  std::vector<int> codes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const Arg name{"tensors", static_cast<int64_t>(i)};
    codes[i] = checked_code(op, name, t);
    check_device(op, name, t, "out", out.device());
    srcs.push_back(t.numel() > 0 && !t.is_contiguous() ? t.contiguous() : t);
  }
  for (int64_t r = 0; r < world; ++r) {
    int64_t offset = r * block;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int64_t n = srcs[i].numel();
      const int64_t begin = std::min(r * chunk[i], n), end = std::min(r * chunk[i] + chunk[i], n);
      if (end > begin) {
        const char* src = static_cast<const char*>(srcs[i].data_ptr()) + begin * srcs[i].element_size();
        plan.add(src, codes[i], dst + offset * out_size, out_code, end - begin);
      }
      offset += chunk[i];
    }
  }
  return run(plan, static_cast<float>(scale), /*accumulate=*/false, out.device());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack,
        "Write cat(t.reshape(-1) for t in tensors) * scale, cast to out.dtype, into out[:total]; "
        "returns a 0-dim float32 flag (1.0 if any input or output value is inf/nan).",
        py::arg("tensors"), py::arg("out"), py::arg("scale"));
  m.def("unpack_accumulate", &unpack_accumulate,
        "For each outs[i], assign (or add, if accumulate) src[o_i:o_i+n_i].float() * scale; "
        "returns a 0-dim float32 flag (1.0 if any written value is inf/nan).",
        py::arg("src"), py::arg("outs"), py::arg("scale"), py::arg("accumulate"));
  m.def("pack_partitions", &pack_partitions,
        "ZeRO-3's reduce-scatter input: for each rank r, for each tensor i, write its r-th chunk of "
        "ceil(numel_i / world) elements, * scale and cast to out.dtype, at out[r * P + sum_{j<i} c_j] "
        "(P = sum_i c_i); padding is left untouched; returns the non-finite flag.",
        py::arg("tensors"), py::arg("out"), py::arg("world"), py::arg("scale"));
#ifdef DSM_WITH_CUDA
  m.attr("has_cuda") = true;
  m.attr("cuda_inline_tensors") = dsm_cuda_inline_tensors();  // a table up to this size goes by value
  m.def("set_cuda_inline_tensors", &set_cuda_inline_tensors,
        "Tables of up to n segments go in the launch's arguments (0: all through device memory); "
        "returns the previous n.", py::arg("n"));
  m.def("set_cuda_table_cache", &set_cuda_table_cache,
        "Keep the device tables of the last n calls' large tables for reuse by a call with the same table "
        "(0: off, every call copies its table); returns the previous n.", py::arg("n"));
  m.def("cuda_table_cache_stats", &cuda_table_cache_stats,
        "The table cache's counters: hits, misses, entries, capacity, bytes (host + device).");
#else
  m.attr("has_cuda") = false;
#endif
}
