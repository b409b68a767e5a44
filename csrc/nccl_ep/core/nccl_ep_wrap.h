// Framework-free wrappers over the NCCL EP C API: a communicator, an EP group
// and a per-layer handle, on raw device pointers and cudaStream_t.
//
// Mapping of the te_ep op contract (docs/ops.md) onto NCCL EP, high-throughput
// mode, expert-major layout:
//   prepare      = ncclEpUpdateHandle        (padded per-expert counts, total)
//   dispatch     = ncclEpDispatch FWD        (tokens + weights -> slots)
//   combine      = ncclEpCombine FWD         (unweighted sum back to tokens)
//   combine_bwd  = ncclEpDispatch BWD        (grad of combine is a dispatch)
//   dispatch_bwd = ncclEpCombine BWD         (grad of dispatch is a combine,
//                                             plus the topk_weights gradient)
#pragma once

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/core/dtype.h"
#include "nccl_ep/core/nccl_ep_runtime.h"

namespace te_ep {
namespace nccl_ep {

using te_ep::DType;
using te_ep::dtype_size;

using UniqueId = std::array<char, NCCL_UNIQUE_ID_BYTES>;

// A new NCCL unique id; only rank 0 of a communicator calls this.
UniqueId make_unique_id();

// Our own NCCL communicator over the ranks of one torch process group. It is
// created next to torch's (not borrowed from it: ProcessGroupNCCL's ncclComm_t
// is not a stable public API, and NCCL EP registers memory windows on the
// communicator it is given, which we do not want to do on torch's).
class Communicator {
 public:
  // Collective over the `nranks` processes that pass the same `id`. `device`
  // must be the current CUDA device.
  Communicator(const UniqueId& id, int nranks, int rank, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  ncclComm_t get() const { return comm_; }
  int device() const { return device_; }

  // Collective: `bytes` of ncclMemAlloc memory registered as a symmetric
  // window, so NCCL EP's kernels on every rank can write into it. Kept until
  // the communicator is destroyed (deregistration is collective, and the
  // communicator goes only in the collective group shutdown), so a handle
  // destroyed on one rank never leaves another rank waiting.
  struct Window {
    void* ptr = nullptr;
    ncclWindow_t win = nullptr;
    size_t bytes = 0;
  };
  Window register_window(size_t bytes);

  // Sum all-reduce of `count` int32 in place, on `stream` (device checks).
  void all_reduce_sum(int32_t* data, size_t count, cudaStream_t stream);

 private:
  ncclComm_t comm_ = nullptr;
  int device_ = -1;
  std::mutex mutex_;
  std::vector<Window> windows_;
};

// Rows of a 2-D tensor argument: a plain device pointer, or (zero-copy mode)
// a slice of a registered window, which NCCL EP addresses on every rank.
struct Rows {
  void* data = nullptr;
  ncclWindow_t win = nullptr;
  uint64_t offset = 0;

  static Rows plain(const void* p) { return Rows{const_cast<void*>(p), nullptr, 0}; }
  // The rows `bytes` further on in the same memory (or window).
  Rows at_offset(uint64_t bytes) const { return Rows{static_cast<char*>(data) + bytes, win, offset + bytes}; }
};

struct GroupConfig {
  int64_t num_experts = 0;
  int64_t max_tokens_per_rank = 0;
  // Receive slots of every handle on this group (NCCL EP's
  // max_recv_tokens_per_rank): the contract's `capacity`.
  int64_t capacity = 0;
  // Widest token row (bytes) of the handles on this group; a multiple of 16.
  int64_t max_token_bytes = 0;
  // False when capacity holds the worst case of every handle on the group, so
  // no routing can overflow: NCCL EP then skips the receive-buffer memset that
  // its DROP overflow policy costs on every dispatch.
  bool can_overflow = true;
  // Zero-copy mode (ncclEpZeroCopyMode ON): NCCL EP writes dispatch outputs
  // straight into the handles' windows and reduces combine inputs in place
  // there; every dispatch output and combine input must then be a window.
  bool zero_copy = false;
  // How long NCCL EP's kernels wait for a peer before they trap, in ms; 0:
  // NCCL EP's default. NCCL_EP_TIMEOUT_MS overrides it.
  int64_t timeout_ms = 0;
};

// One ncclEpGroup: NCCL EP's receive budget and staging buffers are sized per
// group, so every distinct (capacity, row width) needs its own.
class Group {
 public:
  // Collective over the communicator.
  Group(std::shared_ptr<Communicator> comm, const GroupConfig& config);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  ncclEpGroup_t get() const { return group_; }
  const GroupConfig& config() const { return config_; }
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

  // Bytes of handle memory for a handle with this alignment and top_k.
  size_t handle_mem_size(int64_t alignment, int64_t top_k) const;

 private:
  std::shared_ptr<Communicator> comm_;
  GroupConfig config_;
  ncclEpGroup_t group_ = nullptr;
};

// One ncclEpHandle bound to caller-owned handle memory. Pointers passed to the
// calls below are device pointers; `rows` of a receive buffer is always the
// group's capacity.
class Handle {
 public:
  Handle(std::shared_ptr<Group> group, int64_t alignment, int64_t top_k, void* handle_mem, size_t handle_mem_bytes);
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  const std::shared_ptr<Group>& group() const { return group_; }

  // topk_idx [num_tokens, top_k] -> expert_counts [num_local_experts] int32
  // (padded) and recv_total [1] int32 (padded slot total, before any drop).
  void update(const void* topk_idx, DType idx_dtype, int64_t num_tokens, int64_t top_k, int32_t* expert_counts,
              int64_t num_local_experts, int32_t* recv_total, cudaStream_t stream);

  // tokens [num_tokens, hidden], weights [num_tokens, top_k] f32
  //   -> recv_tokens [capacity, hidden], recv_weights [capacity] f32.
  void dispatch_forward(const void* tokens, DType dtype, int64_t num_tokens, int64_t hidden, const float* weights,
                        int64_t top_k, const Rows& recv_tokens, float* recv_weights, cudaStream_t stream);

  // QUANT_FWD: values [num_tokens, hidden] e4m3 and scales [num_tokens,
  // num_scales] f32 travel as bytes, weights as in dispatch_forward ->
  // recv_values [capacity, hidden], recv_scales [capacity, num_scales],
  // recv_weights [capacity]. Rows (and window offsets) 16-byte aligned.
  void dispatch_forward_fp8(const void* values, const float* scales, int64_t num_tokens, int64_t hidden,
                            int64_t num_scales, const float* weights, int64_t top_k, const Rows& recv_values,
                            const Rows& recv_scales, float* recv_weights, cudaStream_t stream);

  // grad_out [num_tokens, hidden] -> recv_tokens [capacity, hidden]; no weights.
  void dispatch_backward(const void* grad_out, DType dtype, int64_t num_tokens, int64_t hidden,
                         const Rows& recv_tokens, cudaStream_t stream);

  // expert_out [capacity, hidden] -> out [num_tokens, hidden]. In zero-copy
  // mode NCCL EP reduces inside expert_out's window: its rows are consumed.
  void combine_forward(const Rows& expert_out, DType dtype, int64_t hidden, void* out, int64_t num_tokens,
                       cudaStream_t stream);

  // grad_recv [capacity, hidden], grad_recv_weights [capacity] f32
  //   -> grad_tokens [num_tokens, hidden], grad_weights [num_tokens, top_k] f32.
  void combine_backward(const Rows& grad_recv, const float* grad_recv_weights, DType dtype, int64_t hidden,
                        void* grad_tokens, float* grad_weights, int64_t num_tokens, int64_t top_k,
                        cudaStream_t stream);

 private:
  std::shared_ptr<Group> group_;
  ncclEpHandle_t handle_ = nullptr;
};

// ---- small kernels (nccl_ep_kernels.cu) ------------------------------------

// Zero-copy: the rows of a persistent window that may hold data of an earlier
// step, and the finished-block count launch_zero_unused_rows uses to lower
// `rows` once every block of its grid has read it (0 between launches).
struct DirtyRows {
  int32_t rows;
  uint32_t blocks_done;
};

// Per-handle device words written by the kernels below.
struct HandleState {
  int32_t recv_total_raw;  // NCCL EP's padded total of the last prepare, before any drop
  int32_t total;           // rows in use after the last prepare (<= capacity)
  DirtyRows dirty_recv;    // zero-copy: the dispatch window
  DirtyRows dirty_combine; // zero-copy: the combine window
};

// ---- the check policy's device side (csrc/nccl_ep/nccl_ep_checks.cpp owns it)
// What this rank found in the current step, in every check mode: filled by
// launch_check_routing and launch_finish_prepare, moved into a record row (and
// reset, `poisoned` excepted) by launch_publish_row. prepare clears it first in
// the device and synchronous modes, and in the local mode after a prepare that
// did not reach its verdict.
struct CheckScan {
  // The first bad choice: (INT32_MAX - (t * top_k + k)) << 32 | (uint32) its id;
  // atomicMax keeps the lowest key.
  unsigned long long first;
  int32_t bits;      // kBit* below
  int32_t needed;    // receive rows the step needed, when it overflowed
  int32_t poisoned;  // the device mode's verdict: this step's outputs are zeros
  int32_t pad;
};
static_assert(offsetof(CheckScan, first) == 0, "first needs 8-byte alignment (atomicMax)");

// A record: one row of kRecordInts int32 per rank. A rank fills only its own
// row, so a sum all-reduce of records is an all-gather (the device mode); the
// local mode keeps its own row alone, the synchronous mode formats it.
constexpr int kRecordInts = 8;
enum RecordField : int {
  kRecordBits = 0,
  kRecordToken = 1,   // the first bad choice: token,
  kRecordChoice = 2,  // choice
  kRecordValue = 3,   // and expert id
  kRecordNeeded = 4,  // receive rows needed (kBitOverflow)
  kRecordOp = 5,      // the op the row was published by (OpCode)
  kRecordHandle = 6,  // the handle's number in its group (HandleConfig::seq); rows that differ: mismatch
};
constexpr int32_t kBitOutOfRange = 1;  // an expert id outside [-1, E)
constexpr int32_t kBitRepeated = 2;    // an expert named twice in a token's row
constexpr int32_t kBitOverflow = 4;    // more receive rows than capacity
constexpr int32_t kBitArgument = 8;    // the op's arguments were bad on that rank (its message stays there)
enum OpCode : int32_t {
  kOpPrepare = 1,
  kOpDispatch = 2,
  kOpDispatchFp8 = 3,
  kOpCombine = 4,
  kOpDispatchBwd = 5,
  kOpCombineBwd = 6,
};
// A kept record: a flag (set by the first failing step), the number of the
// step (the handle's prepares so far, counted on the host), then W rows.
enum StickyField : int { kStickyFlag = 0, kStickyStep = 1, kStickyRows = 2 };
inline int64_t sticky_ints(int64_t world) { return kStickyRows + world * kRecordInts; }

// The one detection kernel of every check mode: copies topk_idx [num_tokens,
// top_k] to idx_out with every choice out of range ([-1, E)) or repeating an
// expert earlier in its row replaced by -1 (NCCL EP never sees it), records
// the kind and the first such choice in `scan`, and writes unrouted[t] = 1 for
// a token left without a valid choice.
void launch_check_routing(const void* topk_idx, void* idx_out, bool is_int64, int64_t num_tokens, int64_t top_k,
                          int64_t num_experts, CheckScan* scan, uint8_t* unrouted, cudaStream_t stream);

// Writes `record` ([world] rows): zeros, and in this rank's row what `scan`
// holds (then cleared, poisoned excepted), `op`, `handle`, and kBitArgument
// when `argument_error`.
void launch_publish_row(CheckScan* scan, int64_t top_k, int64_t rank, int64_t world, int32_t op, int32_t handle,
                        bool argument_error, int32_t* record, cudaStream_t stream);

// The verdict on a record: a step failed when a row has bits set or two rows
// name different ops or handles. Then the first failing step's record and
// `step` are kept in `sticky` ([sticky_ints(world)], mapped host memory that
// the host reads without a copy: the flag is written last), and with `poison` the step's outputs are zeroed from now on
// (scan->poisoned) and the `n` ids of idx (if given) become -1, so every rank
// sends nothing.
void launch_apply_verdict(const int32_t* record, int64_t world, bool poison, CheckScan* scan, void* idx, bool is_int64,
                          int64_t n, int32_t* sticky, int64_t step, cudaStream_t stream);

// Zeroes `bytes` at `ptr` (16-byte aligned) if the step is poisoned.
void launch_zero_if_poisoned(const CheckScan* scan, void* ptr, int64_t bytes, cudaStream_t stream);

// The local check mode's agreement of one rank, run by launch_finish_prepare
// in its own launch: launch_publish_row(scan, top_k, 0, 1, kOpPrepare,
// handle, false, record) and launch_apply_verdict(record, 1, false, scan,
// nullptr, ..., sticky, step). A null `record`: none (the other modes agree
// after).
struct LocalVerdict {
  int32_t* record = nullptr;
  int32_t* sticky = nullptr;
  int64_t top_k = 1;
  int32_t handle = 0;
  int64_t step = 0;
};

// Receive rows the finish of a prepare zeroes past the rows in use, in its
// own launch (the fused prepare_dispatch: after NCCL EP's dispatch): as
// launch_zero_unused_rows' arguments. All null: none.
struct RowsPast {
  void* rows = nullptr;
  int64_t row_bytes = 0;
  float* weights = nullptr;
  DirtyRows* dirty = nullptr;
};

// After ncclEpUpdateHandle, which wrote its per-expert counts to `raw_counts`
// (a buffer of the handle): records an overflow in `scan`, writes the rows in
// use to state->total and total_out, and writes the counts to expert_counts
// (the op's output), clipped so that their prefix sums stay within capacity
// (keeps a grouped GEMM in bounds on an overflowing step); then `local`'s
// agreement, if any; and, in the same launch, launch_zero_unused_rows' work
// on `zero` (the fused prepare_dispatch, whose dispatch was launched before
// it).
void launch_finish_prepare(HandleState* state, const int32_t* raw_counts, int32_t* expert_counts,
                           int64_t num_local_experts, int32_t* total_out, int64_t capacity, CheckScan* scan,
                           const LocalVerdict& local, const RowsPast& zero, cudaStream_t stream);

// Zeroes rows [state->total, end) of `rows` (row_bytes each, a multiple of
// 16) and [state->total, capacity) of recv_weights when given. `end` is
// capacity, or with `dirty` (a persistent window) the rows that may still
// hold data of an earlier step: dirty->rows then becomes state->total (set
// by the grid's last block when rows were zeroed, else by one thread), so a
// window that was already clean costs nothing. One launch.
void launch_zero_unused_rows(const HandleState* state, void* rows, int64_t row_bytes, float* recv_weights,
                             int64_t capacity, DirtyRows* dirty, cudaStream_t stream);

// Records rows of a window written outside launch_zero_unused_rows' view:
// all of them (`whole`, e.g. the caller filled the window) or [0, total).
void launch_mark_dirty_rows(const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole,
                            cudaStream_t stream);

// Zeroes the rows (row_bytes each, a multiple of 16) of `rows` ([num_tokens]
// rows: a combine output or dispatch_bwd's token gradient)
// whose token had no valid choice in the last prepare (`unrouted`, one byte
// per token, written by prepare). NCCL EP's combine writes every routed
// token's row and skips the others, so this replaces zero-filling the whole
// output. With `dirty`, also does launch_mark_dirty_rows(state, dirty,
// capacity, whole) in the same launch.
void launch_zero_unrouted_rows(const uint8_t* unrouted, int64_t num_tokens, void* rows, int64_t row_bytes,
                               const HandleState* state, DirtyRows* dirty, int64_t capacity, bool whole,
                               cudaStream_t stream);

// dst[0, state->total) = src[0, state->total), rows of row_bytes: brings a
// combine input into its window, reading the row count on the device.
void launch_copy_used_rows(const HandleState* state, const void* src, void* dst, int64_t row_bytes, int64_t capacity,
                           cudaStream_t stream);

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
