// Small kernels around NCCL EP calls: overflow bookkeeping after prepare,
// zeroing of unused receive rows and of unrouted tokens' output rows, copies
// into zero-copy windows, and the check policy's device side (one detection
// kernel, one record format, one verdict). Each is one launch on the caller's
// stream, with no host synchronisation, so the ops stay capturable in a CUDA
// graph.
#include "nccl_ep/core/nccl_ep_wrap.h"

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

__device__ void publish_row(CheckScan* scan, int64_t top_k, int64_t rank, int64_t world, int32_t op, int32_t handle,
                            bool argument_error, int32_t* record);
__device__ bool keep_verdict(const int32_t* record, int64_t world, bool poison, CheckScan* scan, int32_t* sticky,
                             int64_t step);

// The rows in use after a prepare and its bookkeeping (the first warp of
// block 0 of the finish kernel): overflow, the counts handed out (`counts`,
// from NCCL EP's `raw`, clipped on an overflow), state->total, total_out, and
// the local mode's verdict. `sum`: the raw counts' sum, in every lane.
__device__ void finish_step(HandleState* state, const int32_t* raw, int32_t* counts, int64_t num_local_experts,
                            int32_t* total_out, int64_t capacity, CheckScan* scan, const LocalVerdict& local,
                            int64_t sum) {
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t needed = max(sum, static_cast<int64_t>(state->recv_total_raw));
  int64_t total = sum;
  if (needed <= capacity) {
    for (int64_t e = lane; e < num_local_experts; e += kWarp) counts[e] = raw[e];
    if (lane != 0) return;
  } else {
    if (lane != 0) return;
    // NCCL EP dropped what did not fit; whether its counters are pre- or
    // post-drop, clip them so every zone lies inside the buffer.
    int64_t used = 0;
    for (int64_t e = 0; e < num_local_experts; ++e) {
      const int64_t keep = min(static_cast<int64_t>(raw[e]), capacity - used);
      counts[e] = static_cast<int32_t>(keep);
      used += keep;
    }
    total = used;
    scan->bits |= kBitOverflow;
    scan->needed = static_cast<int32_t>(min(needed, static_cast<int64_t>(INT_MAX)));
  }
  state->total = static_cast<int32_t>(total);
  total_out[0] = static_cast<int32_t>(total);
  if (local.record == nullptr) return;
  // The local mode's agreement of one rank, in the same launch.
  publish_row(scan, local.top_k, 0, 1, kOpPrepare, local.handle, false, local.record);
  (void)keep_verdict(local.record, 1, false, scan, local.sticky, local.step);
}

// Zeroes rows [first_row, end) of `rows` and [first_row, capacity) of
// `weights` (when given), the whole grid striding; `end` is capacity, or with
// `dirty` the rows that may hold an earlier step's data, which the grid's
// last block then lowers to first_row.
__device__ void zero_rows_past(int64_t first_row, uint4* rows, int64_t vecs_per_row, float* weights,
                               int64_t capacity, DirtyRows* dirty) {
  const int64_t end_row = dirty == nullptr ? capacity : min(static_cast<int64_t>(dirty->rows), capacity);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (rows != nullptr) {
    const int64_t vecs = max(end_row - first_row, int64_t{0}) * vecs_per_row;
    uint4* base = rows + first_row * vecs_per_row;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int64_t i = start; i < vecs; i += stride) base[i] = zero;
  }
  if (weights != nullptr) {
    for (int64_t i = first_row + start; i < capacity; i += stride) weights[i] = 0.0f;
  }
  if (dirty == nullptr) return;
  if (end_row <= first_row) {
    // Nothing of the window to zero. dirty->rows moves only to first_row (just
    // below, or by the last block of a launch that zeroes), so every block of
    // this launch reads a value <= first_row and takes this path: none counts
    // itself done, and one thread records the rows this step wrote.
    if (blockIdx.x == 0 && threadIdx.x == 0) dirty->rows = static_cast<int32_t>(first_row);
    return;
  }
  // Lower dirty->rows once every block has read it: the last block to finish
  // does it (and resets the count for the next launch).
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(&dirty->blocks_done, 1u) != gridDim.x - 1) return;
  dirty->rows = static_cast<int32_t>(first_row);
  dirty->blocks_done = 0;
}

// Every block sums NCCL EP's counts itself rather than wait for block 0:
// `raw` is only read here (the counts handed out are written to `counts`).
__global__ void finish_kernel(HandleState* state, const int32_t* raw, int32_t* counts, int64_t num_local_experts,
                              int32_t* total_out, int64_t capacity, CheckScan* scan, LocalVerdict local, uint4* rows,
                              int64_t vecs_per_row, float* weights, DirtyRows* dirty) {
  __shared__ int64_t rows_in_use;
  if (threadIdx.x < kWarp) {
    int64_t sum = 0;
    for (int64_t e = threadIdx.x; e < num_local_experts; e += kWarp) sum += raw[e];
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) rows_in_use = min(sum, capacity);
    if (blockIdx.x == 0) finish_step(state, raw, counts, num_local_experts, total_out, capacity, scan, local, sum);
  }
  if (rows == nullptr && weights == nullptr) return;
  __syncthreads();
  zero_rows_past(rows_in_use, rows, vecs_per_row, weights, capacity, dirty);
}

__global__ void zero_unused_rows_kernel(const HandleState* state, uint4* rows, int64_t vecs_per_row, float* weights,
                                        int64_t capacity, DirtyRows* dirty) {
  zero_rows_past(min(static_cast<int64_t>(state->total), capacity), rows, vecs_per_row, weights, capacity, dirty);
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
// nothing.
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
__global__ void check_routing_kernel(const Index* idx, Index* idx_out, int64_t num_tokens, int64_t top_k,
                                     int64_t num_experts, CheckScan* scan, uint8_t* unrouted) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const Index* row = idx + token * top_k;
  Index* out = idx_out + token * top_k;
  uint8_t none = 1;
  for (int64_t k = 0; k < top_k; ++k) {
    const int bits = choice_error_bits(row, k, num_experts);
    out[k] = bits != 0 ? static_cast<Index>(-1) : row[k];
    if (bits == 0) {
      if (row[k] >= 0) none = 0;
      continue;
    }
    atomicOr(&scan->bits, bits);
    const int64_t key = min(token * top_k + k, static_cast<int64_t>(INT_MAX));
    const int64_t id = max(min(static_cast<int64_t>(row[k]), static_cast<int64_t>(INT_MAX)),
                           static_cast<int64_t>(INT_MIN));
    atomicMax(&scan->first, (static_cast<unsigned long long>(INT_MAX - key) << 32) |
                                static_cast<uint32_t>(static_cast<int32_t>(id)));
  }
  unrouted[token] = none;
}

__device__ void publish_row(CheckScan* scan, int64_t top_k, int64_t rank, int64_t world, int32_t op, int32_t handle,
                            bool argument_error, int32_t* record) {
  for (int64_t i = 0; i < world * kRecordInts; ++i) record[i] = 0;
  int32_t* mine = record + rank * kRecordInts;
  mine[kRecordBits] = scan->bits | (argument_error ? kBitArgument : 0);
  if (scan->bits & (kBitOutOfRange | kBitRepeated)) {
    // The one place top_k divides: never by zero.
    const int64_t k = top_k > 0 ? top_k : 1;
    const int64_t key = INT_MAX - static_cast<int64_t>(scan->first >> 32);
    mine[kRecordToken] = static_cast<int32_t>(key / k);
    mine[kRecordChoice] = static_cast<int32_t>(key % k);
    mine[kRecordValue] = static_cast<int32_t>(static_cast<uint32_t>(scan->first & 0xffffffffULL));
  }
  mine[kRecordNeeded] = scan->needed;
  mine[kRecordOp] = op;
  mine[kRecordHandle] = handle;
  scan->bits = 0;
  scan->needed = 0;
  scan->first = 0;
}

__global__ void publish_row_kernel(CheckScan* scan, int64_t top_k, int64_t rank, int64_t world, int32_t op,
                                   int32_t handle, bool argument_error, int32_t* record) {
  publish_row(scan, top_k, rank, world, op, handle, argument_error, record);
}

__device__ bool record_failed(const int32_t* record, int64_t world) {
  for (int64_t r = 0; r < world; ++r) {
    const int32_t* row = record + r * kRecordInts;
    if (row[kRecordBits] != 0 || row[kRecordOp] != record[kRecordOp] || row[kRecordHandle] != record[kRecordHandle]) {
      return true;
    }
  }
  return false;
}

// One thread: whether the record says the step failed; if so, poisons the
// step (`poison`) and keeps the record and its `step` in `sticky` unless an
// earlier one is kept. `sticky` is mapped host memory: the flag the host reads
// goes last, behind a system-wide fence.
__device__ bool keep_verdict(const int32_t* record, int64_t world, bool poison, CheckScan* scan, int32_t* sticky,
                             int64_t step) {
  if (!record_failed(record, world)) return false;
  if (poison) scan->poisoned = 1;
  volatile int32_t* kept = sticky;
  if (kept[kStickyFlag] != 0) return true;
  kept[kStickyStep] = static_cast<int32_t>(step);
  for (int64_t i = 0; i < world * kRecordInts; ++i) kept[kStickyRows + i] = record[i];
  __threadfence_system();
  kept[kStickyFlag] = 1;
  return true;
}

template <typename Index>
__global__ void apply_verdict_kernel(const int32_t* record, int64_t world, bool poison, CheckScan* scan, Index* idx,
                                     int64_t n, int32_t* sticky, int64_t step) {
  if (!record_failed(record, world)) return;
  if (poison && idx != nullptr) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      idx[i] = static_cast<Index>(-1);
    }
  }
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  (void)keep_verdict(record, world, poison, scan, sticky, step);
}

__global__ void zero_if_poisoned_kernel(const CheckScan* scan, uint4* data, int64_t vecs, int64_t tail_bytes) {
  if (scan->poisoned == 0) return;
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

void launch_finish_prepare(HandleState* state, const int32_t* raw_counts, int32_t* expert_counts,
                           int64_t num_local_experts, int32_t* total_out, int64_t capacity, CheckScan* scan,
                           const LocalVerdict& local, const RowsPast& zero, cudaStream_t stream) {
  const int64_t vecs_per_row = zero.row_bytes / static_cast<int64_t>(sizeof(uint4));
  const bool zeroes = (zero.rows != nullptr || zero.weights != nullptr) && capacity > 0;
  const int blocks = zeroes ? zero_fill_blocks(capacity * std::max<int64_t>(vecs_per_row, 1)) : 1;
  finish_kernel<<<blocks, zeroes ? 256 : kWarp, 0, stream>>>(
      state, raw_counts, expert_counts, num_local_experts, total_out, capacity, scan, local,
      zeroes ? static_cast<uint4*>(zero.rows) : nullptr, vecs_per_row, zeroes ? zero.weights : nullptr,
      zeroes ? zero.dirty : nullptr);
  check_launch("finish_kernel");
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

void launch_copy_used_rows(const HandleState* state, const void* src, void* dst, int64_t row_bytes, int64_t capacity,
                           cudaStream_t stream) {
  if (capacity == 0) return;
  const int64_t vecs_per_row = row_bytes / static_cast<int64_t>(sizeof(uint4));
  copy_used_rows_kernel<<<zero_fill_blocks(capacity * vecs_per_row), 256, 0, stream>>>(
      state, static_cast<const uint4*>(src), static_cast<uint4*>(dst), vecs_per_row, capacity);
  check_launch("copy_used_rows_kernel");
}

void launch_check_routing(const void* topk_idx, void* idx_out, bool is_int64, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts, CheckScan* scan, uint8_t* unrouted, cudaStream_t stream) {
  if (num_tokens == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>((num_tokens + threads - 1) / threads);
  if (is_int64) {
    check_routing_kernel<int64_t><<<blocks, threads, 0, stream>>>(static_cast<const int64_t*>(topk_idx),
                                                                  static_cast<int64_t*>(idx_out), num_tokens, top_k,
                                                                  num_experts, scan, unrouted);
  } else {
    check_routing_kernel<int32_t><<<blocks, threads, 0, stream>>>(static_cast<const int32_t*>(topk_idx),
                                                                  static_cast<int32_t*>(idx_out), num_tokens, top_k,
                                                                  num_experts, scan, unrouted);
  }
  check_launch("check_routing_kernel");
}

void launch_publish_row(CheckScan* scan, int64_t top_k, int64_t rank, int64_t world, int32_t op, int32_t handle,
                        bool argument_error, int32_t* record, cudaStream_t stream) {
  publish_row_kernel<<<1, 1, 0, stream>>>(scan, top_k, rank, world, op, handle, argument_error, record);
  check_launch("publish_row_kernel");
}

void launch_apply_verdict(const int32_t* record, int64_t world, bool poison, CheckScan* scan, void* idx, bool is_int64,
                          int64_t n, int32_t* sticky, int64_t step, cudaStream_t stream) {
  const int blocks = idx == nullptr ? 1 : zero_fill_blocks(std::max<int64_t>(n, 1));
  if (is_int64) {
    apply_verdict_kernel<int64_t><<<blocks, 256, 0, stream>>>(record, world, poison, scan, static_cast<int64_t*>(idx),
                                                              n, sticky, step);
  } else {
    apply_verdict_kernel<int32_t><<<blocks, 256, 0, stream>>>(record, world, poison, scan, static_cast<int32_t*>(idx),
                                                              n, sticky, step);
  }
  check_launch("apply_verdict_kernel");
}

void launch_zero_if_poisoned(const CheckScan* scan, void* ptr, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  const int64_t vecs = bytes / static_cast<int64_t>(sizeof(uint4));
  const int64_t tail = bytes - vecs * static_cast<int64_t>(sizeof(uint4));
  zero_if_poisoned_kernel<<<zero_fill_blocks(std::max<int64_t>(vecs, 1)), 256, 0, stream>>>(
      scan, static_cast<uint4*>(ptr), vecs, tail);
  check_launch("zero_if_poisoned_kernel");
}

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
