// The check policy of an nccl_ep handle (docs/ops.md, "Check modes"): how bad
// routing, capacity overflow, bad op arguments and ranks on different handles
// are caught. One detection kernel, one record format (nccl_ep_wrap.h) and one
// message builder serve the three modes, which differ only in when and where
// they raise:
//   local        each rank drops its own bad choices on the device and records
//                them and its overflow; that rank raises at its next prepare or
//                EpHandle.check(). No collective of its own, no host sync.
//   device       the ranks agree on every finding on the device (one small
//                all-reduce per op); a failed step moves nothing and returns
//                zeros on every rank, and every rank raises at check() or a
//                later prepare. No host sync.
//   synchronous  every op waits for its finding and agrees on the host; every
//                rank raises in the op itself. Debugging; not capturable.
#pragma once

#include "comm/backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cuda_runtime_api.h>

#include <initializer_list>
#include <memory>
#include <string>

#include "nccl_ep/core/nccl_ep_wrap.h"

namespace te_ep {

// Whether `stream` is capturing a CUDA graph.
bool stream_is_capturing(cudaStream_t stream);

class NcclEpChecks {
 public:
  NcclEpChecks(const HandleConfig& cfg, std::shared_ptr<nccl_ep::Communicator> comm);
  ~NcclEpChecks();
  NcclEpChecks(const NcclEpChecks&) = delete;
  NcclEpChecks& operator=(const NcclEpChecks&) = delete;

  Checks mode() const { return mode_; }

  // Before any op: agrees on this rank's argument error of `op` ("" if none)
  // and on the op and handle every rank runs. Throws where the mode raises in
  // the op; returns true when this rank must run the op on substitutes so
  // that the other ranks' collectives complete (the device mode).
  bool agree_on_arguments(const char* op, const std::string& error);

  // prepare, before NCCL EP sees the routing `idx` (contiguous, at most
  // max_tokens_per_rank rows of the handle's top_k): raises what an earlier
  // step recorded and is due now, runs the detection kernel (writing
  // `unrouted`) and agrees on its finding. Returns the ids NCCL EP gets, in
  // idx's shape and dtype, in a buffer of the handle that the next prepare
  // overwrites (NCCL EP copies them in ncclEpUpdateHandle). `capturing`:
  // whether `stream` is capturing a CUDA graph (asked once per prepare, by
  // the caller).
  void* check_routing(const at::Tensor& idx, uint8_t* unrouted, cudaStream_t stream, bool capturing);
  // prepare, after ncclEpUpdateHandle wrote its counts to `raw_counts`:
  // launch_finish_prepare (which writes expert_counts and total_out, records
  // any overflow in scan(); in the local mode it also keeps this rank's
  // verdict, in the same launch, and zeroes `zero`: the fused
  // prepare_dispatch's receive rows past those in use), then the mode's
  // agreement on the step.
  void finish_prepare(nccl_ep::HandleState* state, const int32_t* raw_counts, int32_t* expert_counts,
                      int64_t num_local_experts, int32_t* total_out, const nccl_ep::RowsPast& zero,
                      cudaStream_t stream, bool capturing);

  nccl_ep::CheckScan* scan() { return reinterpret_cast<nccl_ep::CheckScan*>(scan_.data_ptr()); }
  // The device mode: zeroes the outputs of a failed step.
  void zero_if_poisoned(std::initializer_list<at::Tensor> outputs, cudaStream_t stream);
  // EpHandle.check(): raises what the record holds now (waits for the GPU).
  void raise_pending(cudaStream_t stream);
  // From interpreter exit on: keep the device memory (freeing it would call
  // into CUDA while it unloads).
  void leak_at_exit();

 private:
  // The verdict on this rank's row (the device mode: every rank's) of the
  // current agreement.
  // `routed`: prepare's routed ids (check_routing's, `n` of them, int64 or
  // int32), which a failed step turns to -1; nullptr for the other ops.
  void agree_on_device(int32_t op, bool argument_error, void* routed, bool is_int64, int64_t n, cudaStream_t stream);
  // The synchronous mode: this rank's finding, on the host, agreed by every rank.
  void agree_on_scan_now(cudaStream_t stream);
  // Raises the kept record if it holds one. `wait` (the device mode, at
  // prepare, where every rank must raise in the same step): first waits for
  // the last prepare's verdict, and leaves a record of an op that came after
  // it for the next prepare. Else the record as it stands (the local mode; a
  // verdict the GPU has not reached yet is raised at a later prepare).
  void raise_due(bool wait);
  // The message of a kept record (its W rows).
  std::string message(const int32_t* record) const;
  std::string describe_row(const int32_t* row) const;

  HandleConfig cfg_;
  Checks mode_;
  std::shared_ptr<nccl_ep::Communicator> comm_;
  at::Tensor scan_;         // one CheckScan
  // [max_tokens_per_rank * top_k] int64: the routed ids of the last prepare
  // (check_routing), int32 ids packed at its start when idx is int32.
  at::Tensor routed_;
  at::Tensor record_;       // [W * kRecordInts] int32: the current agreement
  // [sticky_ints(W)] int32 in mapped pinned host memory: the first failing
  // step's record, written by the verdict kernels and read by the host
  // without a copy (flag at [0], set after the rows).
  int32_t* sticky_ = nullptr;
  int32_t* sticky_device_ = nullptr;  // the same memory, as the GPU addresses it
  // The device mode: recorded after each prepare's verdict, waited for by the next.
  cudaEvent_t verdict_done_ = nullptr;
  bool verdict_pending_ = false;
  // The handle's prepares so far: the number of the current step.
  int64_t steps_ = 0;
  // The local mode resets scan_ in its verdict; a prepare that did not get
  // that far (it threw) leaves it for the next one to clear.
  bool scan_dirty_ = true;
  // The device mode: this rank's first argument error not raised yet (its
  // message stays on this rank), a prepare argument error to publish with the
  // routing, and whether this rank runs the step's ops on substitutes.
  std::string own_error_;
  bool prepare_failed_ = false;
  bool failed_here_ = false;
};

}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
