// Small kernels around NCCL EP calls: overflow bookkeeping after prepare,
// zeroing of unused receive rows and of unrouted tokens' output rows, copies
// into zero-copy windows, the routing guard, the debug routing check, and the
// device checks (routing and overflow agreed on the device, poisoned steps
// zeroed). Each is one launch on the caller's stream, with no host
// synchronisation, so the ops stay capturable in a CUDA graph.
#include "common/nccl_ep_wrap.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace te_ep {
namespace nccl_ep {

namespace {

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("te_ep nccl_ep backend: launching ") + kernel +
                             " failed: " + cudaGetErrorString(err));
  }
}

constexpr int kWarp = 32;

__global__ void finish_prepare_kernel(HandleState* state, int32_t* counts, int64_t num_local_experts,
                                      int32_t* total_out, int64_t capacity, int32_t* host_record) {
  int64_t sum = 0;
  for (int64_t e = threadIdx.x; e < num_local_experts; e += kWarp) sum += counts[e];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x != 0) return;

  const int64_t needed = max(sum, static_cast<int64_t>(state->recv_total_raw));
  int64_t total = sum;
  if (needed > capacity) {
    // NCCL EP dropped what did not fit; whether its counters are pre- or
    // post-drop, clip them so every zone lies inside the buffer.
    int64_t used = 0;
    for (int64_t e = 0; e < num_local_experts; ++e) {
      const int64_t keep = min(static_cast<int64_t>(counts[e]), capacity - used);
      counts[e] = static_cast<int32_t>(keep);
      used += keep;
    }
    total = used;
    state->overflow = 1;
    state->worst_needed = static_cast<int32_t>(max(needed, static_cast<int64_t>(state->worst_needed)));
  }
  state->total = static_cast<int32_t>(total);
  total_out[0] = static_cast<int32_t>(total);
  if (host_record != nullptr) {
    const int32_t* record = &state->overflow;
    volatile int32_t* dst = host_record;
    for (size_t i = 0; i < kDefaultRecordBytes / sizeof(int32_t); ++i) dst[i] = record[i];
    __threadfence_system();
  }
}

__global__ void zero_unused_rows_kernel(const HandleState* state, uint4* rows, int64_t vecs_per_row, float* weights,
                                        int64_t capacity, DirtyRows* dirty) {
  const int64_t first_row = min(static_cast<int64_t>(state->total), capacity);
  const int64_t end_row = dirty == nullptr ? capacity : min(static_cast<int64_t>(dirty->rows), capacity);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vecs = max(end_row - first_row, int64_t{0}) * vecs_per_row;
  uint4* base = rows + first_row * vecs_per_row;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t i = start; i < vecs; i += stride) base[i] = zero;
  if (weights != nullptr) {
    for (int64_t i = first_row + start; i < capacity; i += stride) weights[i] = 0.0f;
  }
  if (dirty == nullptr) return;
  // Lower dirty->rows once every block has read it: the last block to finish
  // does it (and resets the count for the next launch).
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&dirty->blocks_done, 1u) != gridDim.x - 1) return;
  dirty->rows = static_cast<int32_t>(first_row);
  dirty->blocks_done = 0;
}

__device__ void mark_dirty(const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole) {
  const int64_t rows = whole ? capacity : max(static_cast<int64_t>(dirty->rows), static_cast<int64_t>(state->total));
  dirty->rows = static_cast<int32_t>(min(rows, capacity));
}

__global__ void mark_dirty_rows_kernel(const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole) {
  mark_dirty(state, dirty, capacity, whole);
}

// One warp per token; only the rows of unrouted tokens are written.
__global__ void zero_unrouted_rows_kernel(const uint8_t* unrouted, int64_t num_tokens, uint4* rows,
                                          int64_t vecs_per_row, const HandleState* state, DirtyRows* dirty,
                                          int64_t capacity, bool whole) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; t < num_tokens;
       t += warps) {
    if (unrouted[t] == 0) continue;
    uint4* row = rows + t * vecs_per_row;
    for (int64_t v = lane; v < vecs_per_row; v += kWarp) row[v] = zero;
  }
  if (dirty != nullptr && blockIdx.x == 0 && threadIdx.x == 0) mark_dirty(state, dirty, capacity, whole);
}

template <typename Index>
__device__ uint8_t no_valid_choice(const Index* row, int64_t top_k) {
  for (int64_t k = 0; k < top_k; ++k) {
    if (row[k] >= 0) return 0;
  }
  return 1;
}

template <typename Index>
__global__ void mark_unrouted_kernel(const Index* idx, int64_t num_tokens, int64_t top_k, uint8_t* unrouted) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token < num_tokens) unrouted[token] = no_valid_choice(idx + token * top_k, top_k);
}

__global__ void copy_used_rows_kernel(const HandleState* state, const uint4* src, uint4* dst, int64_t vecs_per_row,
                                      int64_t capacity) {
  const int64_t rows = min(static_cast<int64_t>(state->total), capacity);
  const int64_t vecs = rows * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs; i += stride) {
    dst[i] = src[i];
  }
}

// What is wrong with choice k of a token's row: kBitOutOfRange (not in
// [-1, E)) and/or kBitRepeated (an expert named earlier in the row); 0 if
// nothing. One rule for every check mode.
template <typename Index>
__device__ int choice_error_bits(const Index* row, int64_t k, int64_t num_experts) {
  const int64_t expert = static_cast<int64_t>(row[k]);
  int bits = (expert < -1 || expert >= num_experts) ? kBitOutOfRange : 0;
  if (expert >= 0) {
    for (int64_t j = 0; j < k; ++j) {
      if (static_cast<int64_t>(row[j]) == expert) bits |= kBitRepeated;
    }
  }
  return bits;
}

template <typename Index>
__global__ void check_routing_kernel(const Index* idx, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                     HandleState* state) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const Index* row = idx + token * top_k;
  int error = 0;
  for (int64_t k = 0; k < top_k; ++k) error |= choice_error_bits(row, k, num_experts);
  if (error != 0) {
    atomicOr(&state->routing_error, error);
    atomicMin(&state->first_bad_token, static_cast<int32_t>(min(token, static_cast<int64_t>(INT_MAX))));
  }
}

template <typename Index>
__global__ void guard_routing_kernel(const Index* idx, Index* idx_out, int64_t num_tokens, int64_t top_k,
                                     int64_t num_experts, HandleState* state, uint8_t* unrouted) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const Index* row = idx + token * top_k;
  Index* out = idx_out + token * top_k;
  for (int64_t k = 0; k < top_k; ++k) {
    const int bits = choice_error_bits(row, k, num_experts);
    out[k] = bits != 0 ? static_cast<Index>(-1) : row[k];
    if (bits != 0) {
      const int64_t expert = static_cast<int64_t>(row[k]);
      atomicOr(&state->guard_bits, bits);
      const int64_t key = min(token * top_k + k, static_cast<int64_t>(INT_MAX));
      const int64_t clipped = max(min(expert, static_cast<int64_t>(INT_MAX)), static_cast<int64_t>(INT_MIN));
      const unsigned long long packed =
          (static_cast<unsigned long long>(INT_MAX - key) << 32) | static_cast<uint32_t>(static_cast<int32_t>(clipped));
      atomicMax(&state->guard_first, packed);
    }
  }
  unrouted[token] = no_valid_choice(out, top_k);
}

// ---- device checks ------------------------------------------------------------

template <typename Index>
__global__ void check_routing_on_device_kernel(const Index* idx, int64_t num_tokens, int64_t top_k,
                                               int64_t num_experts, HandleState* state) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const Index* row = idx + token * top_k;
  for (int64_t k = 0; k < top_k; ++k) {
    const int bits = choice_error_bits(row, k, num_experts);
    if (bits != 0) {
      atomicOr(&state->check_bits, bits);
      atomicMin(&state->check_first_key, static_cast<int32_t>(token * top_k + k));
    }
  }
}

template <typename Index>
__global__ void publish_routing_kernel(const Index* idx, int64_t top_k, int64_t rank, const HandleState* state,
                                       int32_t* record) {
  if (state->check_bits == 0) return;
  const int32_t key = state->check_first_key;
  int32_t* mine = record + rank * kRecordInts;
  mine[kRecordBits] = state->check_bits;
  mine[kRecordToken] = static_cast<int32_t>(key / top_k);
  mine[kRecordChoice] = static_cast<int32_t>(key % top_k);
  const int64_t value = static_cast<int64_t>(idx[key]);
  mine[kRecordValue] = static_cast<int32_t>(max(min(value, static_cast<int64_t>(INT_MAX)),
                                                static_cast<int64_t>(INT_MIN)));
}

__device__ bool any_failed(const int32_t* record, int64_t world) {
  for (int64_t r = 0; r < world; ++r) {
    if (record[r * kRecordInts + kRecordBits] != 0) return true;
  }
  return false;
}

// Keeps the first failing step's record for the host: sticky[0] is the flag.
__device__ void keep_first(const int32_t* record, int64_t world, int32_t* sticky) {
  if (sticky[0] != 0) return;
  sticky[0] = 1;
  for (int64_t i = 0; i < world * kRecordInts; ++i) sticky[1 + i] = record[i];
}

template <typename Index>
__global__ void apply_routing_verdict_kernel(const Index* idx, Index* idx_out, int64_t n, const int32_t* record,
                                             int64_t world, HandleState* state, int32_t* sticky) {
  const bool failed = any_failed(record, world);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    idx_out[i] = failed ? static_cast<Index>(-1) : idx[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    state->poisoned = failed ? 1 : 0;
    if (failed) keep_first(record, world, sticky);
  }
}

__global__ void publish_overflow_kernel(const HandleState* state, int64_t capacity, int64_t rank,
                                        int32_t* overflow) {
  const int64_t needed = state->recv_total_raw;
  overflow[rank] = needed > capacity ? static_cast<int32_t>(needed) : 0;
}

// values[r]: rank r's finding (0: none); `bit` says what a finding is
// (kBitOverflow: the receive rows needed; kBitArgument: the op's code).
__global__ void apply_rank_verdict_kernel(const int32_t* values, int64_t world, int32_t bit, HandleState* state,
                                          int32_t* sticky) {
  bool any = false;
  for (int64_t r = 0; r < world; ++r) any = any || values[r] != 0;
  if (!any) return;
  state->poisoned = 1;
  if (sticky[0] != 0) return;
  sticky[0] = 1;
  for (int64_t r = 0; r < world; ++r) {
    int32_t* row = sticky + 1 + r * kRecordInts;
    row[kRecordBits] = values[r] != 0 ? bit : 0;
    row[kRecordToken] = 0;
    row[kRecordChoice] = 0;
    row[kRecordValue] = values[r];
  }
}

__global__ void publish_rank_value_kernel(int32_t* values, int64_t world, int64_t rank, int32_t value) {
  for (int64_t r = 0; r < world; ++r) values[r] = r == rank ? value : 0;
}

__global__ void zero_if_poisoned_kernel(const HandleState* state, uint4* data, int64_t vecs, int64_t tail_bytes) {
  if (state->poisoned == 0) return;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < vecs; i += stride) data[i] = zero;
  if (first < tail_bytes) reinterpret_cast<uint8_t*>(data + vecs)[first] = 0;
}

int zero_fill_blocks(int64_t work_items) {
  // Enough blocks to fill an H100/H200 several times over; the grid-stride
  // loop covers the rest. Sized for the worst case (nothing received) because
  // the number of unused rows is only known on the device.
  constexpr int64_t kMaxBlocks = 1056;
  const int64_t needed = (work_items + 255) / 256;
  return static_cast<int>(std::max<int64_t>(1, std::min(needed, kMaxBlocks)));
}

}  // namespace

void launch_finish_prepare(HandleState* state, int32_t* expert_counts, int64_t num_local_experts, int32_t* total_out,
                           int64_t capacity, int32_t* host_record, cudaStream_t stream) {
  finish_prepare_kernel<<<1, kWarp, 0, stream>>>(state, expert_counts, num_local_experts, total_out, capacity,
                                                 host_record);
  check_launch("finish_prepare_kernel");
}

void launch_zero_unused_rows(const HandleState* state, void* rows, int64_t row_bytes, float* recv_weights,
                             int64_t capacity, DirtyRows* dirty, cudaStream_t stream) {
  if (capacity == 0) return;
  const int64_t vecs_per_row = row_bytes / static_cast<int64_t>(sizeof(uint4));
  zero_unused_rows_kernel<<<zero_fill_blocks(capacity * vecs_per_row), 256, 0, stream>>>(
      state, static_cast<uint4*>(rows), vecs_per_row, recv_weights, capacity, dirty);
  check_launch("zero_unused_rows_kernel");
}

void launch_mark_dirty_rows(const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole,
                            cudaStream_t stream) {
  mark_dirty_rows_kernel<<<1, 1, 0, stream>>>(state, dirty, capacity, whole);
  check_launch("mark_dirty_rows_kernel");
}

void launch_zero_unrouted_rows(const uint8_t* unrouted, int64_t num_tokens, void* rows, int64_t row_bytes,
                               const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole,
                               cudaStream_t stream) {
  if (num_tokens == 0 && dirty == nullptr) return;
  constexpr int kThreads = 256;
  constexpr int64_t kWarpsPerBlock = kThreads / kWarp;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                                                1056));
  zero_unrouted_rows_kernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(
      unrouted, num_tokens, static_cast<uint4*>(rows), row_bytes / static_cast<int64_t>(sizeof(uint4)), state, dirty,
      capacity, whole);
  check_launch("zero_unrouted_rows_kernel");
}

void launch_mark_unrouted(const void* topk_idx, bool is_int64, int64_t num_tokens, int64_t top_k, uint8_t* unrouted,
                          cudaStream_t stream) {
  if (num_tokens == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>((num_tokens + threads - 1) / threads);
  if (is_int64) {
    mark_unrouted_kernel<int64_t><<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx), num_tokens,
                                                                  top_k, unrouted);
  } else {
    mark_unrouted_kernel<int32_t><<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx), num_tokens,
                                                                  top_k, unrouted);
  }
  check_launch("mark_unrouted_kernel");
}

void launch_copy_used_rows(const HandleState* state, const void* src, void* dst, int64_t row_bytes, int64_t capacity,
                           cudaStream_t stream) {
  if (capacity == 0) return;
  const int64_t vecs_per_row = row_bytes / static_cast<int64_t>(sizeof(uint4));
  copy_used_rows_kernel<<<zero_fill_blocks(capacity * vecs_per_row), 256, 0, stream>>>(
      state, static_cast<const uint4*>(src), static_cast<uint4*>(dst), vecs_per_row, capacity);
  check_launch("copy_used_rows_kernel");
}

void launch_check_routing(const void* topk_idx, bool is_int64, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts, HandleState* state, cudaStream_t stream) {
  cudaMemsetAsync(&state->routing_error, 0, sizeof(int32_t), stream);
  // 0x7f7f7f7f: larger than any token index, so atomicMin finds the first.
  cudaMemsetAsync(&state->first_bad_token, 0x7f, sizeof(int32_t), stream);
  if (num_tokens == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>((num_tokens + threads - 1) / threads);
  if (is_int64) {
    check_routing_kernel<int64_t><<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx), num_tokens,
                                                                  top_k, num_experts, state);
  } else {
    check_routing_kernel<int32_t><<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx), num_tokens,
                                                                  top_k, num_experts, state);
  }
  check_launch("check_routing_kernel");
}

void launch_guard_routing(const void* topk_idx, void* idx_out, bool is_int64, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts, HandleState* state, uint8_t* unrouted, cudaStream_t stream) {
  if (num_tokens == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>((num_tokens + threads - 1) / threads);
  if (is_int64) {
    guard_routing_kernel<int64_t><<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx),
                                                                  static_cast<int64_t*>(idx_out), num_tokens, top_k,
                                                                  num_experts, state, unrouted);
  } else {
    guard_routing_kernel<int32_t><<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx),
                                                                  static_cast<int32_t*>(idx_out), num_tokens, top_k,
                                                                  num_experts, state, unrouted);
  }
  check_launch("guard_routing_kernel");
}

void launch_check_routing_on_device(const void* topk_idx, bool is_int64, int64_t num_tokens, int64_t top_k,
                                    int64_t num_experts, HandleState* state, cudaStream_t stream) {
  cudaMemsetAsync(&state->check_bits, 0, sizeof(int32_t), stream);
  // 0x7f7f7f7f: larger than any key, so atomicMin finds the first.
  cudaMemsetAsync(&state->check_first_key, 0x7f, sizeof(int32_t), stream);
  if (num_tokens == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>((num_tokens + threads - 1) / threads);
  if (is_int64) {
    check_routing_on_device_kernel<int64_t><<<blocks, threads, 0, stream>>>(
        static_cast<const int64_t*>(topk_idx), num_tokens, top_k, num_experts, state);
  } else {
    check_routing_on_device_kernel<int32_t><<<blocks, threads, 0, stream>>>(
        static_cast<const int32_t*>(topk_idx), num_tokens, top_k, num_experts, state);
  }
  check_launch("check_routing_on_device_kernel");
}

void launch_publish_routing(const void* topk_idx, bool is_int64, int64_t top_k, int64_t rank,
                            const HandleState* state, int32_t* record, cudaStream_t stream) {
  if (is_int64) {
    publish_routing_kernel<int64_t><<<1, 1, 0, stream>>>(static_cast<const int64_t*>(topk_idx), top_k, rank, state,
                                                        record);
  } else {
    publish_routing_kernel<int32_t><<<1, 1, 0, stream>>>(static_cast<const int32_t*>(topk_idx), top_k, rank, state,
                                                        record);
  }
  check_launch("publish_routing_kernel");
}

void launch_apply_routing_verdict(const void* topk_idx, void* idx_out, bool is_int64, int64_t n, const int32_t* record,
                                  int64_t world, HandleState* state, int32_t* sticky, cudaStream_t stream) {
  const int blocks = zero_fill_blocks(std::max<int64_t>(n, 1));
  if (is_int64) {
    apply_routing_verdict_kernel<int64_t><<<blocks, 256, 0, stream>>>(
        static_cast<const int64_t*>(topk_idx), static_cast<int64_t*>(idx_out), n, record, world, state, sticky);
  } else {
    apply_routing_verdict_kernel<int32_t><<<blocks, 256, 0, stream>>>(
        static_cast<const int32_t*>(topk_idx), static_cast<int32_t*>(idx_out), n, record, world, state, sticky);
  }
  check_launch("apply_routing_verdict_kernel");
}

void launch_publish_overflow(const HandleState* state, int64_t capacity, int64_t rank, int32_t* overflow,
                             cudaStream_t stream) {
  publish_overflow_kernel<<<1, 1, 0, stream>>>(state, capacity, rank, overflow);
  check_launch("publish_overflow_kernel");
}

void launch_apply_overflow_verdict(const int32_t* overflow, int64_t world, HandleState* state, int32_t* sticky,
                                   cudaStream_t stream) {
  apply_rank_verdict_kernel<<<1, 1, 0, stream>>>(overflow, world, kBitOverflow, state, sticky);
  check_launch("apply_rank_verdict_kernel");
}

void launch_publish_op_error(int32_t* values, int64_t world, int64_t rank, int32_t op_code, cudaStream_t stream) {
  publish_rank_value_kernel<<<1, 1, 0, stream>>>(values, world, rank, op_code);
  check_launch("publish_rank_value_kernel");
}

void launch_apply_op_verdict(const int32_t* values, int64_t world, HandleState* state, int32_t* sticky,
                             cudaStream_t stream) {
  apply_rank_verdict_kernel<<<1, 1, 0, stream>>>(values, world, kBitArgument, state, sticky);
  check_launch("apply_rank_verdict_kernel");
}

void launch_zero_if_poisoned(const HandleState* state, void* ptr, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  const int64_t vecs = bytes / static_cast<int64_t>(sizeof(uint4));
  const int64_t tail = bytes - vecs * static_cast<int64_t>(sizeof(uint4));
  zero_if_poisoned_kernel<<<zero_fill_blocks(std::max<int64_t>(vecs, 1)), 256, 0, stream>>>(
      state, static_cast<uint4*>(ptr), vecs, tail);
  check_launch("zero_if_poisoned_kernel");
}

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
