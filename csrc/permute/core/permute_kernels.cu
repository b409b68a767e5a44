#include "permute/core/permute_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <initializer_list>
#include <type_traits>

namespace te_ep {
namespace permutation {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxRowThreads = 256;

template <typename T>
struct Convert;

template <>
struct Convert<float> {
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
};

template <>
struct Convert<__half> {
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Convert<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// N elements moved as one access; with N * sizeof(T) == 16 the copies compile
// to 128-bit loads and stores.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ Pack<T, N> zero_pack() {
  Pack<T, N> p;
#pragma unroll
  for (int k = 0; k < N; ++k) p.v[k] = Convert<T>::from_float(0.f);
  return p;
}

template <typename T, int N>
__device__ Pack<T, N> scale_pack(const Pack<T, N>& in, float w) {
  Pack<T, N> out;
#pragma unroll
  for (int k = 0; k < N; ++k) out.v[k] = Convert<T>::from_float(Convert<T>::to_float(in.v[k]) * w);
  return out;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads for a kernel that gives one row of `num_vectors` packs to a block
// and `per_thread` packs to each thread: enough for the row, never fewer than
// a warp (the compaction below runs on warp 0).
int row_threads(int64_t num_vectors, int64_t per_thread) {
  const int64_t wanted = ceil_div(ceil_div(num_vectors, per_thread), kWarpSize) * kWarpSize;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(wanted, kWarpSize), kMaxRowThreads));
}

// Calls f(T{}, std::integral_constant<int, N>{}) with the element type of
// `dtype` and the widest pack the row size and every pointer allow: 16 bytes
// when rows are a multiple of 16 bytes and the buffers 16-byte aligned (any
// torch allocation is), else one element.
template <typename T, typename F>
void with_pack_width(int64_t hidden, std::initializer_list<const void*> buffers, F&& f) {
  constexpr int kWide = 16 / sizeof(T);
  bool wide = hidden % kWide == 0;
  for (const void* p : buffers) wide = wide && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (wide) {
    f(T{}, std::integral_constant<int, kWide>{});
  } else {
    f(T{}, std::integral_constant<int, 1>{});
  }
}

template <typename F>
void with_row_type(DType dtype, int64_t hidden, std::initializer_list<const void*> buffers, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      with_pack_width<float>(hidden, buffers, f);
      return;
    case DType::kFloat16:
      with_pack_width<__half>(hidden, buffers, f);
      return;
    case DType::kBFloat16:
      with_pack_width<__nv_bfloat16>(hidden, buffers, f);
      return;
    default:  // not a row type: the adapter has refused it
      return;
  }
}

// Shared-memory list of one token's routed slots, in choice order, so that
// the copy loops iterate only over rows that exist. Filled by warp 0 with a
// ballot so the order (and hence every float sum) is deterministic.
struct TokenSlots {
  int32_t* rows;
  int32_t* choices;
  float* weights;

  __device__ static TokenSlots carve(int32_t* smem, int num_choices) {
    return {smem, smem + num_choices, reinterpret_cast<float*>(smem + 2 * num_choices)};
  }

  static size_t bytes(int64_t num_choices) { return static_cast<size_t>(num_choices) * 12; }
};

__device__ int collect_token_slots(const int32_t* token_rows, const float* token_scale, int num_choices,
                                   TokenSlots slots, int* s_count) {
  if (threadIdx.x < kWarpSize) {
    const unsigned lane = threadIdx.x;
    int base = 0;
    for (int c0 = 0; c0 < num_choices; c0 += kWarpSize) {
      const int c = c0 + static_cast<int>(lane);
      const int32_t row = c < num_choices ? token_rows[c] : -1;
      const unsigned routed = __ballot_sync(0xffffffffu, row >= 0);
      if (row >= 0) {
        const int pos = base + __popc(routed & ((1u << lane) - 1u));
        slots.rows[pos] = row;
        slots.choices[pos] = c;
        slots.weights[pos] = token_scale != nullptr ? token_scale[c] : 1.f;
      }
      base += __popc(routed);
    }
    if (lane == 0) *s_count = base;
  }
  __syncthreads();
  return *s_count;
}

// One block per token: the token row is read once and written to each of its
// rows. Reading once and writing K times moves (1 + K) / 2K of the bytes of a
// gather that reads the token for every output row.
template <typename T, int N, bool kScale>
__global__ void permute_rows_kernel(const T* __restrict__ tokens, int64_t hidden, int num_choices,
                                    const int32_t* __restrict__ row_id_map, const float* __restrict__ scale,
                                    const float* __restrict__ probs, T* __restrict__ out,
                                    float* __restrict__ out_probs) {
  extern __shared__ int32_t smem[];
  __shared__ int s_count;
  const TokenSlots slots = TokenSlots::carve(smem, num_choices);
  const int64_t slot0 = static_cast<int64_t>(blockIdx.x) * num_choices;
  const int n = collect_token_slots(row_id_map + slot0, kScale ? scale + slot0 : nullptr, num_choices, slots,
                                    &s_count);
  if (out_probs != nullptr) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) out_probs[slots.rows[j]] = probs[slot0 + slots.choices[j]];
  }
  using P = Pack<T, N>;
  constexpr int kUnroll = 4;
  const int64_t num_vectors = hidden / N;
  const P* src = reinterpret_cast<const P*>(tokens) + static_cast<int64_t>(blockIdx.x) * num_vectors;
  P* dst = reinterpret_cast<P*>(out);
  for (int64_t base = threadIdx.x; base < num_vectors; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < num_vectors) v[u] = src[i];
    }
    for (int j = 0; j < n; ++j) {
      P* row = dst + static_cast<int64_t>(slots.rows[j]) * num_vectors;
      const float w = slots.weights[j];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
        if (i < num_vectors) {
          if constexpr (kScale) {
            row[i] = scale_pack(v[u], w);
          } else {
            row[i] = v[u];
          }
        }
      }
    }
  }
}

// Rows no slot maps to (alignment padding, unused capacity): one warp per row.
template <typename T, int N>
__global__ void zero_unmapped_rows_kernel(const int32_t* __restrict__ src_slot, int64_t capacity, int64_t hidden,
                                          T* __restrict__ out, float* __restrict__ out_probs) {
  using P = Pack<T, N>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t num_vectors = hidden / N;
  const P zero = zero_pack<T, N>();
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize; row < capacity;
       row += warps) {
    if (src_slot[row] >= 0) continue;
    P* dst = reinterpret_cast<P*>(out) + row * num_vectors;
    for (int64_t i = lane; i < num_vectors; i += kWarpSize) dst[i] = zero;
    if (out_probs != nullptr && lane == 0) out_probs[row] = 0.f;
  }
}

// One block per token; every thread accumulates its packs over the token's
// rows in choice order, eight independent row loads in flight per step (all
// of a top-8 token's rows at once).
template <typename T, int N, bool kScale>
__global__ void unpermute_rows_kernel(const T* __restrict__ input, int64_t hidden, int num_choices,
                                      const int32_t* __restrict__ row_id_map, const float* __restrict__ scale,
                                      T* __restrict__ out) {
  extern __shared__ int32_t smem[];
  __shared__ int s_count;
  const TokenSlots slots = TokenSlots::carve(smem, num_choices);
  const int64_t slot0 = static_cast<int64_t>(blockIdx.x) * num_choices;
  const int n = collect_token_slots(row_id_map + slot0, kScale ? scale + slot0 : nullptr, num_choices, slots,
                                    &s_count);
  using P = Pack<T, N>;
  constexpr int kRowsInFlight = 8;
  const int64_t num_vectors = hidden / N;
  const P* src = reinterpret_cast<const P*>(input);
  P* dst = reinterpret_cast<P*>(out) + static_cast<int64_t>(blockIdx.x) * num_vectors;
  for (int64_t i = threadIdx.x; i < num_vectors; i += blockDim.x) {
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.f;
    int j = 0;
    for (; j + kRowsInFlight <= n; j += kRowsInFlight) {
      P v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) v[u] = src[static_cast<int64_t>(slots.rows[j + u]) * num_vectors + i];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const float w = slots.weights[j + u];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = fmaf(w, Convert<T>::to_float(v[u].v[k]), acc[k]);
      }
    }
    for (; j < n; ++j) {
      const P v = src[static_cast<int64_t>(slots.rows[j]) * num_vectors + i];
      const float w = slots.weights[j];
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = fmaf(w, Convert<T>::to_float(v.v[k]), acc[k]);
    }
    P o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = Convert<T>::from_float(acc[k]);
    dst[i] = o;
  }
}

__device__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One block per token; the dot product of each routed row with the token's
// output gradient is reduced in a fixed order (lanes, then warps).
template <typename T, int N>
__global__ void unpermute_probs_grad_kernel(const T* __restrict__ grad_out, const T* __restrict__ input,
                                            int64_t hidden, int num_choices, const int32_t* __restrict__ row_id_map,
                                            float* __restrict__ grad_probs) {
  extern __shared__ int32_t smem[];
  __shared__ int s_count;
  __shared__ float s_partial[kMaxRowThreads / kWarpSize];
  const TokenSlots slots = TokenSlots::carve(smem, num_choices);
  const int64_t slot0 = static_cast<int64_t>(blockIdx.x) * num_choices;
  const int n = collect_token_slots(row_id_map + slot0, nullptr, num_choices, slots, &s_count);
  for (int c = threadIdx.x; c < num_choices; c += blockDim.x) {
    if (row_id_map[slot0 + c] < 0) grad_probs[slot0 + c] = 0.f;
  }
  using P = Pack<T, N>;
  const int64_t num_vectors = hidden / N;
  const P* g = reinterpret_cast<const P*>(grad_out) + static_cast<int64_t>(blockIdx.x) * num_vectors;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  for (int j = 0; j < n; ++j) {
    const P* x = reinterpret_cast<const P*>(input) + static_cast<int64_t>(slots.rows[j]) * num_vectors;
    float dot = 0.f;
    for (int64_t i = threadIdx.x; i < num_vectors; i += blockDim.x) {
      const P a = g[i];
      const P b = x[i];
#pragma unroll
      for (int k = 0; k < N; ++k) dot = fmaf(Convert<T>::to_float(a.v[k]), Convert<T>::to_float(b.v[k]), dot);
    }
    dot = warp_sum(dot);
    if (threadIdx.x % kWarpSize == 0) s_partial[warp] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < num_warps; ++w) total += s_partial[w];
      grad_probs[slot0 + slots.choices[j]] = total;
    }
    __syncthreads();
  }
}

__global__ void gather_values_kernel(const int32_t* __restrict__ index, int64_t n, const float* __restrict__ values,
                                     float* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = index[i] >= 0 ? values[index[i]] : 0.f;
  }
}

// One block per output row (row copies of sort_chunks_by_index).
template <typename T, int N>
__global__ void gather_rows_kernel(const T* __restrict__ input, int64_t hidden, const int32_t* __restrict__ index,
                                   const float* __restrict__ probs, T* __restrict__ out,
                                   float* __restrict__ out_probs) {
  using P = Pack<T, N>;
  constexpr int kUnroll = 4;
  const int64_t row = blockIdx.x;
  const int32_t src_row = index[row];
  if (out_probs != nullptr && threadIdx.x == 0) out_probs[row] = src_row >= 0 ? probs[src_row] : 0.f;
  const int64_t num_vectors = hidden / N;
  P* dst = reinterpret_cast<P*>(out) + row * num_vectors;
  if (src_row < 0) {
    const P zero = zero_pack<T, N>();
    for (int64_t i = threadIdx.x; i < num_vectors; i += blockDim.x) dst[i] = zero;
    return;
  }
  const P* src = reinterpret_cast<const P*>(input) + static_cast<int64_t>(src_row) * num_vectors;
  for (int64_t base = threadIdx.x; base < num_vectors; base += static_cast<int64_t>(blockDim.x) * kUnroll) {
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < num_vectors) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < num_vectors) dst[i] = v[u];
    }
  }
}

// ---- permute map ------------------------------------------------------------
//
// Four passes over token blocks, no atomics, so the layout is reproducible:
//   1. count: block_counts[b][e] = slots of token block b routed to expert e;
//   2. block scan (a warp per expert): exclusive prefix over token blocks, and
//      the expert's padded zone size;
//   3. zone scan (one block): zone start of every expert, in expert order;
//   4. assign: thread e walks block b's slots in order and hands out rows
//      from zone_start[e] + prefix[b][e].
// Passes 1 and 4 give each expert to one thread, which scans the token block
// from shared memory: T * C * E comparisons in all, a few microseconds at
// T = 16384, K = 8, E = 256, whatever the skew of the routing.

constexpr int kMapThreads = 256;
constexpr int kScanThreads = 1024;

// Small token blocks give passes 1 and 4 many blocks to spread over the SMs;
// a top-k block keeps its tokens_per_block * K ids in shared memory.
int64_t map_tokens_per_block(const Routing& routing) {
  if (routing.format == RoutingFormat::kMask) return 64;
  return std::max<int64_t>(1, std::min<int64_t>(64, 1024 / std::max<int64_t>(routing.num_choices, 1)));
}

template <typename IdT, bool kAssign>
__global__ void topk_map_kernel(const IdT* __restrict__ ids, int64_t num_tokens, int num_choices, int num_experts,
                                int64_t tokens_per_block, int32_t* __restrict__ block_counts,
                                const int64_t* __restrict__ zone_start, int64_t capacity,
                                int32_t* __restrict__ row_id_map, int32_t* __restrict__ src_slot) {
  extern __shared__ int32_t s_experts[];
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int64_t block_slots = std::min<int64_t>(tokens_per_block, num_tokens - first_token) * num_choices;
  const int64_t slot0 = first_token * num_choices;
  for (int64_t i = threadIdx.x; i < block_slots; i += blockDim.x) {
    const IdT expert = ids[slot0 + i];
    const bool valid = expert >= 0 && expert < num_experts;
    s_experts[i] = valid ? static_cast<int32_t>(expert) : -1;
    if (kAssign && !valid) row_id_map[slot0 + i] = -1;
  }
  __syncthreads();
  int32_t* counts = block_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if constexpr (!kAssign) {
      int32_t count = 0;
      for (int64_t i = 0; i < block_slots; ++i) count += s_experts[i] == e;
      counts[e] = count;
    } else {
      int64_t row = zone_start[e] + counts[e];
      for (int64_t i = 0; i < block_slots; ++i) {
        if (s_experts[i] != e) continue;
        const int64_t slot = slot0 + i;
        if (row < capacity) {
          row_id_map[slot] = static_cast<int32_t>(row);
          src_slot[row] = static_cast<int32_t>(slot);
        } else {
          row_id_map[slot] = -1;
        }
        ++row;
      }
    }
  }
}

template <bool kAssign>
__global__ void mask_map_kernel(const uint8_t* __restrict__ mask, int64_t num_tokens, int num_experts,
                                int64_t tokens_per_block, int32_t* __restrict__ block_counts,
                                const int64_t* __restrict__ zone_start, int64_t capacity,
                                int32_t* __restrict__ row_id_map, int32_t* __restrict__ src_slot) {
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int64_t last_token = std::min<int64_t>(first_token + tokens_per_block, num_tokens);
  int32_t* counts = block_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if constexpr (!kAssign) {
      int32_t count = 0;
      for (int64_t t = first_token; t < last_token; ++t) count += mask[t * num_experts + e] != 0;
      counts[e] = count;
    } else {
      int64_t row = zone_start[e] + counts[e];
      for (int64_t t = first_token; t < last_token; ++t) {
        const int64_t slot = t * num_experts + e;
        if (mask[slot] == 0) {
          row_id_map[slot] = -1;
          continue;
        }
        if (row < capacity) {
          row_id_map[slot] = static_cast<int32_t>(row);
          src_slot[row] = static_cast<int32_t>(slot);
        } else {
          row_id_map[slot] = -1;
        }
        ++row;
      }
    }
  }
}

__global__ void block_scan_kernel(int32_t* __restrict__ block_counts, int64_t num_blocks, int num_experts,
                                  int64_t alignment, int64_t* __restrict__ zone_size) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  if (e >= num_experts) return;
  int64_t carry = 0;
  for (int64_t b0 = 0; b0 < num_blocks; b0 += kWarpSize) {
    const int64_t idx = (b0 + lane) * num_experts + e;
    const bool in_range = b0 + lane < num_blocks;
    const int32_t count = in_range ? block_counts[idx] : 0;
    int32_t inclusive = count;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (in_range) block_counts[idx] = static_cast<int32_t>(carry + inclusive - count);
    carry += __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
  }
  if (lane == 0) zone_size[e] = round_up(carry, alignment);
}

// Turns zone sizes into zone starts (in place) and writes the clipped counts.
// The launch bound keeps registers within what a 1024-thread block may use
// (65536 per block): without it the launch fails on sm_90.
__global__ void __launch_bounds__(kScanThreads) zone_scan_kernel(int64_t* __restrict__ zone_start, int num_experts, int64_t capacity,
                                 int32_t* __restrict__ expert_counts, int64_t* __restrict__ required_rows) {
  using Scan = cub::BlockScan<long long, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int per_thread = (num_experts + kScanThreads - 1) / kScanThreads;
  const int lo = std::min(num_experts, static_cast<int>(threadIdx.x) * per_thread);
  const int hi = std::min(num_experts, lo + per_thread);
  long long local = 0;
  for (int e = lo; e < hi; ++e) local += zone_start[e];
  long long prefix = 0;
  long long total = 0;
  Scan(scan_storage).ExclusiveSum(local, prefix, total);
  for (int e = lo; e < hi; ++e) {
    const int64_t padded = zone_start[e];
    zone_start[e] = prefix;
    expert_counts[e] = static_cast<int32_t>(prefix >= capacity ? 0 : std::min<int64_t>(padded, capacity - prefix));
    prefix += padded;
  }
  if (threadIdx.x == 0) *required_rows = total;
}

// ---- chunk map ----------------------------------------------------------------

template <typename IdxT>
__device__ int64_t load_count(const IdxT* data, int64_t i) {
  const int64_t v = data[i];
  return v > 0 ? v : 0;
}

// Exclusive prefix sums of the chunk sizes in input order (in_offset) and in
// sorted order (out_offset), both [num_chunks + 1], by one block in tiles.
template <typename SizeT, typename IdxT>
__global__ void __launch_bounds__(kScanThreads) chunk_offsets_kernel(const SizeT* __restrict__ split_sizes, const IdxT* __restrict__ sorted_index,
                                     int64_t num_chunks, int64_t* __restrict__ in_offset,
                                     int64_t* __restrict__ out_offset) {
  using Scan = cub::BlockScan<long long, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  for (int pass = 0; pass < 2; ++pass) {
    int64_t* offsets = pass == 0 ? in_offset : out_offset;
    long long carry = 0;
    for (int64_t tile = 0; tile < num_chunks; tile += kScanThreads) {
      const int64_t j = tile + threadIdx.x;
      long long size = 0;
      if (j < num_chunks) {
        if (pass == 0) {
          size = load_count(split_sizes, j);
        } else {
          const int64_t chunk = sorted_index[j];
          size = chunk >= 0 && chunk < num_chunks ? load_count(split_sizes, chunk) : 0;
        }
      }
      long long prefix = 0;
      long long tile_total = 0;
      Scan(scan_storage).ExclusiveSum(size, prefix, tile_total);
      if (j < num_chunks) offsets[j] = carry + prefix;
      carry += tile_total;
      __syncthreads();
    }
    if (threadIdx.x == 0) offsets[num_chunks] = carry;
  }
}

template <typename IdxT>
__global__ void chunk_rows_kernel(const IdxT* __restrict__ sorted_index, const int64_t* __restrict__ in_offset,
                                  const int64_t* __restrict__ out_offset, int64_t num_chunks, int64_t num_rows,
                                  int32_t* __restrict__ row_map) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_rows) return;
  int64_t src = i;
  if (i < out_offset[num_chunks]) {
    // Last chunk (in sorted order) starting at or before i: empty chunks share
    // their start with the next one, so this is the chunk holding row i.
    int64_t lo = 0;
    int64_t hi = num_chunks;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (out_offset[mid] <= i) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const int64_t j = lo - 1;
    const int64_t chunk = sorted_index[j];
    src = in_offset[chunk] + (i - out_offset[j]);
  }
  const bool valid = src < num_rows;
  row_map[i] = valid ? static_cast<int32_t>(src) : -1;
  if (valid) row_map[num_rows + src] = static_cast<int32_t>(i);
}

template <typename F>
void with_index_type(IndexType type, F&& f) {
  if (type == IndexType::kInt32) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

}  // namespace

size_t permute_map_workspace_bytes(const Routing& routing, int64_t num_experts) {
  const int64_t num_blocks = ceil_div(routing.num_tokens, map_tokens_per_block(routing));
  return static_cast<size_t>(round_up(num_blocks * num_experts * 4, 16) + num_experts * 8);
}

cudaError_t build_permute_map_cuda(const Routing& routing, int64_t num_experts, int64_t capacity, int64_t alignment,
                                   int32_t* row_id_map, int32_t* src_slot, int32_t* expert_counts,
                                   int64_t* required_rows, void* workspace, cudaStream_t stream) {
  const int64_t tokens_per_block = map_tokens_per_block(routing);
  const int64_t num_blocks = ceil_div(routing.num_tokens, tokens_per_block);
  auto* block_counts = static_cast<int32_t*>(workspace);
  auto* zone_start =
      reinterpret_cast<int64_t*>(static_cast<char*>(workspace) + round_up(num_blocks * num_experts * 4, 16));
  const int experts = static_cast<int>(num_experts);
  const int choices = static_cast<int>(routing.num_choices);
  if (capacity > 0) {
    const cudaError_t err = cudaMemsetAsync(src_slot, 0xff, static_cast<size_t>(capacity) * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  auto run_pass = [&](auto assign) {
    constexpr bool kAssign = decltype(assign)::value;
    if (num_blocks == 0) return;
    if (routing.format == RoutingFormat::kMask) {
      mask_map_kernel<kAssign><<<num_blocks, kMapThreads, 0, stream>>>(
          static_cast<const uint8_t*>(routing.data), routing.num_tokens, experts, tokens_per_block, block_counts,
          zone_start, capacity, row_id_map, src_slot);
      return;
    }
    const size_t smem = static_cast<size_t>(tokens_per_block * routing.num_choices) * sizeof(int32_t);
    with_index_type(routing.index_type, [&](auto id_tag) {
      using IdT = decltype(id_tag);
      topk_map_kernel<IdT, kAssign><<<num_blocks, kMapThreads, smem, stream>>>(
          static_cast<const IdT*>(routing.data), routing.num_tokens, choices, experts, tokens_per_block,
          block_counts, zone_start, capacity, row_id_map, src_slot);
    });
  };
  run_pass(std::false_type{});
  constexpr int kExpertsPerBlock = kMapThreads / kWarpSize;
  block_scan_kernel<<<ceil_div(num_experts, kExpertsPerBlock), kMapThreads, 0, stream>>>(
      block_counts, num_blocks, experts, alignment, zone_start);
  zone_scan_kernel<<<1, kScanThreads, 0, stream>>>(zone_start, experts, capacity, expert_counts, required_rows);
  run_pass(std::true_type{});
  return cudaGetLastError();
}

cudaError_t permute_rows_cuda(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden,
                              int64_t num_choices, const int32_t* row_id_map, const float* scale, const float* probs,
                              int64_t capacity, const int32_t* src_slot, void* out, float* out_probs,
                              cudaStream_t stream) {
  with_row_type(dtype, hidden, {tokens, out}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int N = decltype(width)::value;
    const int64_t num_vectors = hidden / N;
    if (num_tokens > 0) {
      const int threads = row_threads(num_vectors, 4);
      const size_t smem = TokenSlots::bytes(num_choices);
      const int choices = static_cast<int>(num_choices);
      if (scale != nullptr) {
        permute_rows_kernel<T, N, true><<<num_tokens, threads, smem, stream>>>(
            static_cast<const T*>(tokens), hidden, choices, row_id_map, scale, probs, static_cast<T*>(out),
            out_probs);
      } else {
        permute_rows_kernel<T, N, false><<<num_tokens, threads, smem, stream>>>(
            static_cast<const T*>(tokens), hidden, choices, row_id_map, nullptr, probs, static_cast<T*>(out),
            out_probs);
      }
    }
    if (capacity > 0) {
      constexpr int kThreads = 256;
      const int64_t blocks = std::min<int64_t>(ceil_div(capacity, kThreads / kWarpSize), 8192);
      zero_unmapped_rows_kernel<T, N>
          <<<blocks, kThreads, 0, stream>>>(src_slot, capacity, hidden, static_cast<T*>(out), out_probs);
    }
  });
  return cudaGetLastError();
}

cudaError_t unpermute_rows_cuda(const void* input, DType dtype, int64_t num_tokens, int64_t hidden,
                                int64_t num_choices, const int32_t* row_id_map, const float* scale, void* out,
                                cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  with_row_type(dtype, hidden, {input, out}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int N = decltype(width)::value;
    const int threads = row_threads(hidden / N, 2);
    const size_t smem = TokenSlots::bytes(num_choices);
    const int choices = static_cast<int>(num_choices);
    if (scale != nullptr) {
      unpermute_rows_kernel<T, N, true><<<num_tokens, threads, smem, stream>>>(
          static_cast<const T*>(input), hidden, choices, row_id_map, scale, static_cast<T*>(out));
    } else {
      unpermute_rows_kernel<T, N, false><<<num_tokens, threads, smem, stream>>>(
          static_cast<const T*>(input), hidden, choices, row_id_map, nullptr, static_cast<T*>(out));
    }
  });
  return cudaGetLastError();
}

cudaError_t gather_values_cuda(const int32_t* index, int64_t n, const float* values, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 4096);
  gather_values_kernel<<<blocks, kThreads, 0, stream>>>(index, n, values, out);
  return cudaGetLastError();
}

cudaError_t unpermute_probs_grad_cuda(const void* grad_out, const void* input, DType dtype, int64_t num_tokens,
                                      int64_t hidden, int64_t num_choices, const int32_t* row_id_map,
                                      float* grad_probs, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  with_row_type(dtype, hidden, {grad_out, input}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int N = decltype(width)::value;
    const int threads = row_threads(hidden / N, 2);
    unpermute_probs_grad_kernel<T, N><<<num_tokens, threads, TokenSlots::bytes(num_choices), stream>>>(
        static_cast<const T*>(grad_out), static_cast<const T*>(input), hidden, static_cast<int>(num_choices),
        row_id_map, grad_probs);
  });
  return cudaGetLastError();
}

size_t chunk_map_workspace_bytes(int64_t num_chunks) { return static_cast<size_t>(2 * (num_chunks + 1) * 8); }

cudaError_t build_chunk_map_cuda(const void* split_sizes, IndexType sizes_type, const void* sorted_index,
                                 IndexType index_type, int64_t num_chunks, int64_t num_rows, int32_t* row_map,
                                 void* workspace, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  auto* in_offset = static_cast<int64_t*>(workspace);
  int64_t* out_offset = in_offset + num_chunks + 1;
  // Input rows that no output row reads (only possible with invalid sizes)
  // keep -1 in the inverse half.
  cudaError_t err = cudaMemsetAsync(row_map + num_rows, 0xff, static_cast<size_t>(num_rows) * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  with_index_type(sizes_type, [&](auto size_tag) {
    using SizeT = decltype(size_tag);
    with_index_type(index_type, [&](auto index_tag) {
      using IdxT = decltype(index_tag);
      chunk_offsets_kernel<SizeT, IdxT><<<1, kScanThreads, 0, stream>>>(
          static_cast<const SizeT*>(split_sizes), static_cast<const IdxT*>(sorted_index), num_chunks, in_offset,
          out_offset);
      constexpr int kThreads = 256;
      chunk_rows_kernel<IdxT><<<ceil_div(num_rows, kThreads), kThreads, 0, stream>>>(
          static_cast<const IdxT*>(sorted_index), in_offset, out_offset, num_chunks, num_rows, row_map);
    });
  });
  return cudaGetLastError();
}

cudaError_t gather_rows_cuda(const void* input, DType dtype, int64_t num_rows, int64_t hidden, const int32_t* index,
                             const float* probs, void* out, float* out_probs, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  with_row_type(dtype, hidden, {input, out}, [&](auto tag, auto width) {
    using T = decltype(tag);
    constexpr int N = decltype(width)::value;
    gather_rows_kernel<T, N><<<num_rows, row_threads(hidden / N, 4), 0, stream>>>(
        static_cast<const T*>(input), hidden, index, probs, static_cast<T*>(out), out_probs);
  });
  return cudaGetLastError();
}

}  // namespace permutation
}  // namespace te_ep
