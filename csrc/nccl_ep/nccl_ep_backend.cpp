// NcclEpBackend (nccl_ep_backend.h): the handle's lifetime, each op's frame
// (agreement, watchdog, pending errors) and the row helpers that dispatch
// (nccl_ep_dispatch.cpp) and combine (nccl_ep_combine.cpp) share.
#include "nccl_ep/nccl_ep_backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>

#include "common/scalar_type.h"

namespace te_ep {
namespace nccl_ep_backend {

DType to_dtype(at::ScalarType type) {
  const std::optional<DType> dtype = dtype_of(type);
  TORCH_CHECK(dtype.has_value(), "te_ep nccl_ep backend: unsupported dtype ", type);
  return *dtype;
}

NcclEpBackend::NcclEpBackend(const HandleConfig& cfg, std::shared_ptr<ne::Group> group, std::string mode_reason)
    : cfg_(cfg),
      group_(std::move(group)),
      dtype_(to_dtype(cfg.dtype)),
      zero_copy_(group_->config().zero_copy),
      mode_reason_(std::move(mode_reason)),
      checks_(cfg, group_->comm()) {
  c10::cuda::CUDAGuard guard(cfg_.device);
  const auto ints = at::TensorOptions().dtype(at::kInt).device(cfg_.device);
  state_ = at::zeros({static_cast<int64_t>(sizeof(ne::HandleState) / sizeof(int32_t))}, ints);
  raw_counts_ = at::zeros({cfg_.num_local_experts()}, ints);
  // One byte per token of the last prepare: 1 if none of its choices is
  // valid (combine writes no row for it; zero_unrouted_rows zeroes it).
  unrouted_ = at::zeros({std::max<int64_t>(cfg_.max_tokens_per_rank, 1)},
                        at::TensorOptions().dtype(at::kByte).device(cfg_.device));
  if (zero_copy_) {
    // One registration holds both windows: the dispatch output, and the
    // combine side (combine input, combine_bwd output, dispatch_bwd input),
    // whose uses never overlap in time within one layer's step.
    const int64_t window_bytes = cfg_.capacity * row_bytes();
    const auto window = group_->comm()->register_window(static_cast<size_t>(2 * window_bytes));
    const auto options = at::TensorOptions().dtype(cfg_.dtype).device(cfg_.device);
    recv_window_ = WindowRows(window, 0, cfg_.capacity, cfg_.hidden, options);
    combine_window_ = WindowRows(window, static_cast<uint64_t>(window_bytes), cfg_.capacity, cfg_.hidden, options);
    window_bytes_ = static_cast<int64_t>(window.bytes);
  }
}

NcclEpBackend::~NcclEpBackend() {
  if (ne::process_exiting()) {
    // Leak: freeing now would call into NCCL EP / CUDA during exit.
    (void)handle_.release();
    new at::Tensor(std::move(handle_mem_));
    new at::Tensor(std::move(state_));
    new at::Tensor(std::move(raw_counts_));
    new at::Tensor(std::move(unrouted_));
    checks_.leak_at_exit();
    return;
  }
  handle_.reset();
}

at::Tensor NcclEpBackend::allocate_handle_mem() {
  TORCH_CHECK(handle_ == nullptr, "te_ep nccl_ep backend: allocate_handle_mem called twice for one handle");
  c10::cuda::CUDAGuard guard(cfg_.device);
  const size_t bytes = group_->handle_mem_size(cfg_.alignment, cfg_.top_k);
  handle_mem_ = at::zeros({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(cfg_.device));
  // NCCL EP binds the handle to this memory for its lifetime; we keep a
  // reference so it outlives any copy the caller drops. The handle_mem
  // tensor the ops receive only orders them in a traced graph (under
  // functionalization it may even be a copy), so the ops do not read it.
  handle_ = std::make_unique<ne::Handle>(group_, cfg_.alignment, cfg_.top_k, handle_mem_.data_ptr(), bytes);
  return handle_mem_;
}

at::Tensor NcclEpBackend::combine_buffer() {
  if (!zero_copy_) return at::Tensor();
  return combine_window_.hand_out();
}

bool NcclEpBackend::agree_on_arguments(const char* op, const std::string& local_error) {
  // Without a routing on this rank there is no step to join; raised here
  // in every mode (every rank that skipped prepare does the same).
  if (!opens_step(op) && prepared_num_tokens_ < 0) {
    TORCH_CHECK(local_error.empty(), local_error);
    require_prepared(op);
  }
  return checks_.agree_on_arguments(op, local_error);
}

int64_t NcclEpBackend::prepared_num_tokens(const at::Tensor& handle_mem) {
  (void)handle_mem;
  return prepared_num_tokens_;
}

std::unique_ptr<watchdog::Op> NcclEpBackend::watch(const char* op, int64_t handle_id) {
  return watched_ops_.enter(cfg_, op, handle_id);
}

void NcclEpBackend::watch_launched(watchdog::Op& op) {
  // The marker's event must belong to the handle's device, whatever device
  // the caller has current (the op's own guard is gone by now).
  c10::cuda::CUDAGuard guard(cfg_.device);
  op.watch_stream(current_stream(), cfg_.device.index());
}

void NcclEpBackend::raise_pending_errors() {
  c10::cuda::CUDAGuard guard(cfg_.device);
  checks_.raise_pending(current_stream());
}

// The ops that start a step (a new routing) rather than need one.
bool NcclEpBackend::opens_step(const char* op) {
  return std::strcmp(op, "prepare") == 0 || std::strcmp(op, "prepare_dispatch") == 0 ||
         std::strcmp(op, "prepare_dispatch_fp8") == 0;
}

// The [capacity, hidden] rows an NCCL EP call writes: `window` (zero-copy;
// its earlier tensors go stale) or a new tensor of `options` (staged).
std::tuple<at::Tensor, ne::Rows> NcclEpBackend::output_rows(WindowRows& window, const at::TensorOptions& options) {
  if (zero_copy_) {
    window.invalidate();
    return {window.hand_out(), window.rows()};
  }
  at::Tensor rows = at::empty({cfg_.capacity, cfg_.hidden}, options);
  return {rows, ne::Rows::plain(rows.data_ptr())};
}

// What of a dispatch-like output needs zeroing past the rows in use: its
// rows [capacity, hidden] and their weights (or nullptr). Zero-copy (`dirty`:
// the window's record): rows past this step's total keep data of a longer
// earlier step; only those (tracked on the device) need it. Staged: under
// DROP NCCL EP zero-fills the whole receive buffer of every dispatch (its
// permute path cannot tell dropped rows from holes), so nothing; under TRAP
// the rows past the last zone and their weights.
ne::RowsPast NcclEpBackend::rows_past(void* rows, float* weights, ne::DirtyRows* dirty) const {
  if (dirty == nullptr && group_->config().can_overflow) return ne::RowsPast{};
  return ne::RowsPast{rows, row_bytes(), weights, dirty};
}

void NcclEpBackend::zero_past(const ne::RowsPast& past, cudaStream_t stream) {
  if (past.rows == nullptr) return;
  ne::launch_zero_unused_rows(state(), past.rows, past.row_bytes, past.weights, cfg_.capacity, past.dirty, stream);
}

void NcclEpBackend::require_handle(const char* op) const {
  TORCH_CHECK(handle_ != nullptr, "te_ep.", op, ": the nccl_ep handle has no handle memory yet (create_handle "
              "allocates it)");
}

void NcclEpBackend::require_prepared(const char* op) const {
  require_handle(op);
  TORCH_CHECK(prepared_num_tokens_ >= 0, "te_ep.", op, ": call prepare on this handle first");
}

// at::zeros through one cudaMemsetAsync: the combine outputs are tens of MB,
// and this keeps their zeroing to one cheap launch on the op's path.
at::Tensor NcclEpBackend::zeros_on(cudaStream_t stream, at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (t.numel() > 0) C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), stream));
  return t;
}

}  // namespace nccl_ep_backend
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
