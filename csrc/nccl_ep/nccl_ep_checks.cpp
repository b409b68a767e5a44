// The check policy of an nccl_ep handle; see nccl_ep_checks.h.
#include "nccl_ep/nccl_ep_checks.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <sstream>
#include <vector>

namespace te_ep {

namespace ne = nccl_ep;

namespace {

int32_t op_code(const std::string& op) {
  if (op == "prepare") return ne::kOpPrepare;
  if (op == "dispatch") return ne::kOpDispatch;
  if (op == "dispatch_fp8") return ne::kOpDispatchFp8;
  if (op == "combine") return ne::kOpCombine;
  if (op == "dispatch_bwd") return ne::kOpDispatchBwd;
  if (op == "combine_bwd") return ne::kOpCombineBwd;
  TORCH_INTERNAL_ASSERT(false, "te_ep: no op code for '", op, "'");
  return 0;
}

std::string op_name(int32_t code) {
  switch (code) {
    case ne::kOpPrepare: return "prepare";
    case ne::kOpDispatch: return "dispatch";
    case ne::kOpDispatchFp8: return "dispatch_fp8";
    case ne::kOpCombine: return "combine";
    case ne::kOpDispatchBwd: return "dispatch_bwd";
    case ne::kOpCombineBwd: return "combine_bwd";
    default: return "op " + std::to_string(code);
  }
}

cudaStream_t current_stream(const HandleConfig& cfg) {
  return at::cuda::getCurrentCUDAStream(cfg.device.index()).stream();
}

}  // namespace

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

NcclEpChecks::NcclEpChecks(const HandleConfig& cfg, std::shared_ptr<ne::Communicator> comm)
    : cfg_(cfg), mode_(cfg.checks), comm_(std::move(comm)) {
  c10::cuda::CUDAGuard guard(cfg_.device);
  const auto ints = at::TensorOptions().dtype(at::kInt).device(cfg_.device);
  scan_ = at::zeros({static_cast<int64_t>(sizeof(ne::CheckScan) / sizeof(int32_t))}, ints);
  routed_ = at::empty({std::max<int64_t>(cfg_.max_tokens_per_rank * cfg_.top_k, 1)},
                      at::TensorOptions().dtype(at::kLong).device(cfg_.device));
  if (mode_ == Checks::kSynchronous) return;
  record_ = at::zeros({cfg_.ep_size * ne::kRecordInts}, ints);
  const size_t sticky_bytes = static_cast<size_t>(ne::sticky_ints(cfg_.ep_size)) * sizeof(int32_t);
  void* sticky = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&sticky, sticky_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(sticky, 0, sticky_bytes);
  sticky_ = static_cast<int32_t*>(sticky);
  void* on_device = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&on_device, sticky, 0));
  sticky_device_ = static_cast<int32_t*>(on_device);
  if (mode_ == Checks::kDevice) C10_CUDA_CHECK(cudaEventCreateWithFlags(&verdict_done_, cudaEventDisableTiming));
}

NcclEpChecks::~NcclEpChecks() {
  if (verdict_done_ != nullptr) cudaEventDestroy(verdict_done_);
  if (sticky_ != nullptr) cudaFreeHost(sticky_);
}

void NcclEpChecks::leak_at_exit() {
  new at::Tensor(std::move(scan_));
  new at::Tensor(std::move(routed_));
  new at::Tensor(std::move(record_));
  sticky_ = nullptr;
  verdict_done_ = nullptr;
}

bool NcclEpChecks::agree_on_arguments(const char* op, const std::string& error) {
  if (mode_ == Checks::kSynchronous) {
    agree_on_host(cfg_, op, error);
    return false;
  }
  if (mode_ == Checks::kLocal) {
    TORCH_CHECK(error.empty(), error);
    return false;
  }
  const bool prepare = std::strcmp(op, "prepare") == 0;
  // A rank whose step already failed publishes nothing new: that step is
  // poisoned everywhere, and its arguments no longer match the prepared rows.
  const bool fails_now = (prepare || !failed_here_) && !error.empty();
  if (fails_now && own_error_.empty()) own_error_ = error;
  if (prepare) {
    // Published with the routing (check_routing), which the substitute
    // prepare of no tokens runs.
    prepare_failed_ = fails_now;
    return fails_now;
  }
  failed_here_ = failed_here_ || fails_now;
  c10::cuda::CUDAGuard guard(cfg_.device);
  agree_on_device(op_code(op), fails_now, nullptr, false, 0, current_stream(cfg_));
  return failed_here_;
}

void* NcclEpChecks::check_routing(const at::Tensor& idx, uint8_t* unrouted, cudaStream_t stream, bool capturing) {
  TORCH_INTERNAL_ASSERT(idx.is_contiguous() && idx.dim() == 2 && idx.numel() <= routed_.numel(),
                        "te_ep: check_routing takes at most max_tokens_per_rank rows of top_k ids");
  TORCH_CHECK(!(capturing && mode_ == Checks::kSynchronous), "te_ep.prepare: checks='synchronous' waits for the GPU "
              "in every op and cannot run under CUDA graph capture; create the handle with checks='device' or 'local'");
  // This step's argument error goes with the step: an earlier error raised
  // below leaves nothing behind for the next one.
  const bool argument_error = prepare_failed_;
  prepare_failed_ = false;
  if (!capturing && mode_ != Checks::kSynchronous) raise_due(/*wait=*/mode_ == Checks::kDevice);
  ++steps_;
  failed_here_ = argument_error;
  // The local mode's verdict resets the scan; the device mode's poisoned flag
  // and the synchronous mode's findings are reset here.
  if (mode_ != Checks::kLocal || scan_dirty_) {
    C10_CUDA_CHECK(cudaMemsetAsync(scan_.data_ptr(), 0, scan_.nbytes(), stream));
  }
  scan_dirty_ = true;
  void* routed = routed_.data_ptr();
  const bool is_int64 = idx.scalar_type() == at::kLong;
  ne::launch_check_routing(idx.data_ptr(), routed, is_int64, idx.size(0), idx.size(1), cfg_.num_experts, scan(),
                           unrouted, stream);
  if (mode_ == Checks::kSynchronous) {
    agree_on_scan_now(stream);
  } else if (mode_ == Checks::kDevice) {
    agree_on_device(ne::kOpPrepare, argument_error, routed, is_int64, idx.numel(), stream);
  }
  return routed;
}

void NcclEpChecks::finish_prepare(ne::HandleState* state, const int32_t* raw_counts, int32_t* expert_counts,
                                  int64_t num_local_experts, int32_t* total_out, const ne::RowsPast& zero,
                                  cudaStream_t stream, bool capturing) {
  // Only the local mode's agreement fits in the finish's launch; the others
  // agree after it, before a dispatch may run.
  TORCH_INTERNAL_ASSERT(mode_ == Checks::kLocal || (zero.rows == nullptr && zero.weights == nullptr));
  ne::LocalVerdict local;
  if (mode_ == Checks::kLocal) {
    // The local mode's verdict covers the routing and the overflow of the step.
    local.record = record_.data_ptr<int32_t>();
    local.sticky = sticky_device_;
    local.top_k = cfg_.top_k;
    local.handle = static_cast<int32_t>(cfg_.seq);
    local.step = steps_;
  }
  ne::launch_finish_prepare(state, raw_counts, expert_counts, num_local_experts, total_out, cfg_.capacity, scan(),
                            local, zero, stream);
  if (mode_ == Checks::kLocal) {
    scan_dirty_ = false;
    return;
  }
  if (mode_ == Checks::kSynchronous) {
    agree_on_scan_now(stream);
    return;
  }
  agree_on_device(ne::kOpPrepare, false, nullptr, false, 0, stream);
  if (!capturing) {
    C10_CUDA_CHECK(cudaEventRecord(verdict_done_, stream));
    verdict_pending_ = true;
  }
}

void NcclEpChecks::agree_on_device(int32_t op, bool argument_error, void* routed, bool is_int64, int64_t n,
                                   cudaStream_t stream) {
  // The local mode keeps its own row alone, as a record of one rank.
  const bool agreed = mode_ == Checks::kDevice;
  const int64_t rows = agreed ? cfg_.ep_size : 1;
  int32_t* record = record_.data_ptr<int32_t>();
  ne::launch_publish_row(scan(), cfg_.top_k, agreed ? cfg_.rank : 0, rows, op, static_cast<int32_t>(cfg_.seq),
                         argument_error, record, stream);
  if (agreed) comm_->all_reduce_sum(record, static_cast<size_t>(rows * ne::kRecordInts), stream);
  ne::launch_apply_verdict(record, rows, agreed, scan(), routed, is_int64, routed != nullptr ? n : 0, sticky_device_,
                           steps_, stream);
}

void NcclEpChecks::agree_on_scan_now(cudaStream_t stream) {
  ne::CheckScan host{};
  C10_CUDA_CHECK(cudaMemcpyAsync(&host, scan(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string error;
  if (host.bits != 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(scan_.data_ptr(), 0, scan_.nbytes(), stream));
    int32_t row[ne::kRecordInts] = {};
    row[ne::kRecordBits] = host.bits;
    const int64_t key = INT_MAX - static_cast<int64_t>(host.first >> 32);
    row[ne::kRecordToken] = static_cast<int32_t>(key / cfg_.top_k);
    row[ne::kRecordChoice] = static_cast<int32_t>(key % cfg_.top_k);
    row[ne::kRecordValue] = static_cast<int32_t>(static_cast<uint32_t>(host.first & 0xffffffffULL));
    row[ne::kRecordNeeded] = host.needed;
    error = "te_ep.prepare: " + describe_row(row);
  }
  agree_on_host(cfg_, "prepare", error);
}

void NcclEpChecks::raise_due(bool wait) {
  const bool waited = wait && verdict_pending_;
  if (waited) {
    C10_CUDA_CHECK(cudaEventSynchronize(verdict_done_));
    verdict_pending_ = false;
  }
  // Written by the GPU: the flag is read first, the rest only once it is set.
  const volatile int32_t* kept = sticky_;
  if (kept[ne::kStickyFlag] == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  if (waited) {
    // The last prepare's verdict is in; the ops of its step that came after
    // it may have run on one rank's GPU and not yet on another's, so their
    // record waits for the next prepare: every rank raises in the same one.
    const bool by_prepare = kept[ne::kStickyRows + cfg_.rank * ne::kRecordInts + ne::kRecordOp] == ne::kOpPrepare;
    if (kept[ne::kStickyStep] == static_cast<int32_t>(steps_) && !by_prepare) return;
  }
  const int64_t ints = ne::sticky_ints(cfg_.ep_size);
  std::vector<int32_t> record(static_cast<size_t>(ints - ne::kStickyRows));
  for (int64_t i = ne::kStickyRows; i < ints; ++i) record[static_cast<size_t>(i - ne::kStickyRows)] = kept[i];
  const std::string text = message(record.data());
  own_error_.clear();
  // The flag last: a verdict kernel keeps a new record only once it is clear.
  volatile int32_t* clear = sticky_;
  for (int64_t i = 1; i < ints; ++i) clear[i] = 0;
  std::atomic_thread_fence(std::memory_order_release);
  clear[ne::kStickyFlag] = 0;
  TORCH_CHECK(false, text);
}

void NcclEpChecks::raise_pending(cudaStream_t stream) {
  if (mode_ == Checks::kSynchronous) return;  // raised in the op itself
  TORCH_CHECK(!stream_is_capturing(stream), "te_ep: EpHandle.check() waits for the GPU and cannot run under CUDA "
              "graph capture; call it after the graph's replay");
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  verdict_pending_ = false;
  raise_due(/*wait=*/false);
}

void NcclEpChecks::zero_if_poisoned(std::initializer_list<at::Tensor> outputs, cudaStream_t stream) {
  if (mode_ != Checks::kDevice) return;
  for (const at::Tensor& t : outputs) ne::launch_zero_if_poisoned(scan(), t.data_ptr(), t.nbytes(), stream);
}

// The one message builder: a finding of one rank's row.
std::string NcclEpChecks::describe_row(const int32_t* row) const {
  const int32_t bits = row[ne::kRecordBits];
  std::ostringstream msg;
  if (bits & ne::kBitArgument) {
    msg << "bad arguments to te_ep." << op_name(row[ne::kRecordOp]);
    return msg.str();
  }
  const char* sep = "";
  if (bits & (ne::kBitOutOfRange | ne::kBitRepeated)) {
    msg << "topk_idx[" << row[ne::kRecordToken] << ", " << row[ne::kRecordChoice] << "] = " << row[ne::kRecordValue]
        << " (";
    if (bits & ne::kBitOutOfRange) msg << "an expert id outside [-1, " << cfg_.num_experts << ")";
    if ((bits & ne::kBitOutOfRange) && (bits & ne::kBitRepeated)) msg << "; ";
    if (bits & ne::kBitRepeated) msg << "an expert named twice in a token's row";
    msg << ")";
    sep = "; ";
  }
  if (bits & ne::kBitOverflow) {
    msg << sep << "capacity overflow: the routing needs " << row[ne::kRecordNeeded]
        << " receive rows but the handle's capacity is " << cfg_.capacity
        << " (create the handle with a larger capacity, at most EpGroup.worst_case_capacity)";
  }
  return msg.str();
}

std::string NcclEpChecks::message(const int32_t* record) const {
  std::ostringstream msg;
  if (mode_ == Checks::kLocal) {
    const int32_t* row = record;
    msg << "te_ep.prepare: an earlier step of this handle on rank " << cfg_.rank << " had " << describe_row(row);
    if (row[ne::kRecordBits] & (ne::kBitOutOfRange | ne::kBitRepeated)) {
      msg << ". te_ep dropped every such choice before NCCL EP saw it, so that step's outputs lack them";
    }
    if (row[ne::kRecordBits] & ne::kBitOverflow) msg << ". NCCL EP dropped the rows that did not fit";
    msg << ". checks='device' makes a failed step move nothing on every rank and raises it on every rank; "
           "checks='synchronous' raises in the step itself";
    return msg.str();
  }
  msg << "te_ep.prepare: an earlier step of this handle failed on the device checks of every rank "
         "(checks='device'); that step sent nothing or returned zeros (from the failing op on), and no rank used "
         "its outputs as valid:";
  for (int64_t r = 0; r < cfg_.ep_size; ++r) {
    const int32_t* row = record + r * ne::kRecordInts;
    if (row[ne::kRecordOp] != record[ne::kRecordOp] || row[ne::kRecordHandle] != record[ne::kRecordHandle]) {
      msg << "\n  the ranks ran different ops or handles: rank 0 te_ep." << op_name(record[ne::kRecordOp])
          << " on the group's handle #" << record[ne::kRecordHandle] << ", rank " << r << " te_ep."
          << op_name(row[ne::kRecordOp]) << " on the group's handle #" << row[ne::kRecordHandle];
      break;
    }
  }
  for (int64_t r = 0; r < cfg_.ep_size; ++r) {
    const int32_t* row = record + r * ne::kRecordInts;
    if (row[ne::kRecordBits] == 0) continue;
    msg << "\n  rank " << r << ": " << describe_row(row);
    if (!(row[ne::kRecordBits] & ne::kBitArgument)) continue;
    if (r == cfg_.rank && !own_error_.empty()) {
      const std::string prefix = "te_ep." + op_name(row[ne::kRecordOp]) + ": ";
      const bool named = own_error_.rfind(prefix, 0) == 0;
      msg << ": " << own_error_.substr(named ? prefix.size() : 0);
    } else {
      msg << " (that rank's error names them)";
    }
  }
  return msg.str();
}

}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
