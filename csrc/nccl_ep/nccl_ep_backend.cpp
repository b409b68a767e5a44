// The nccl_ep backend: the at::Tensor adapter over csrc/nccl_ep/core/nccl_ep_*.
//
// Per step it launches NCCL EP and a few small kernels on the current CUDA
// stream, allocates only through the torch caching allocator, and never waits
// for the GPU, so prepare/dispatch/combine can be captured in a CUDA graph
// (handles, their windows and ncclEpInitHandle are created before capture).
// In the zero-copy mode the receive rows live in NCCL symmetric windows owned
// by the handle; the tensors over them that the ops return stay valid as
// docs/ops.md says. How bad input is caught is the handle's check policy
// (nccl_ep_checks.h). Builds without NCCL EP get the stand-ins of
// nccl_ep_private_ops.cpp instead.
#include <string>

#include "comm/backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <ATen/cuda/CUDAContext.h>
#include <cuda.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "nccl_ep/core/nccl_ep_runtime.h"
#include "nccl_ep/core/nccl_ep_wrap.h"
#include "watchdog/core/watchdog.h"
#include "common/scalar_type.h"
#include "comm/core/routing.h"
#include "nccl_ep/nccl_ep_checks.h"

namespace te_ep {

namespace {

namespace ne = nccl_ep;

constexpr int64_t kRowAlignmentBytes = 16;

DType to_dtype(at::ScalarType type) {
  const std::optional<DType> dtype = dtype_of(type);
  TORCH_CHECK(dtype.has_value(), "te_ep nccl_ep backend: unsupported dtype ", type);
  return *dtype;
}

// The bootstrap of our NCCL communicator runs through the torch process group:
// on its CUDA backend when it has one (NCCL), else on its CPU backend.
at::Device collective_device(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Device& cuda_device) {
  for (const auto& device : pg->getDeviceTypes()) {
    if (device.is_cuda()) return cuda_device;
  }
  return at::Device(at::kCPU);
}

ne::UniqueId broadcast_unique_id(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Device& device) {
  ne::UniqueId id{};
  if (pg->getRank() == 0) id = ne::make_unique_id();
  at::Tensor host = at::empty({static_cast<int64_t>(id.size())}, at::kByte);
  std::memcpy(host.data_ptr(), id.data(), id.size());
  std::vector<at::Tensor> buffers{host.to(collective_device(pg, device))};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  pg->broadcast(buffers, options)->wait();
  at::Tensor received = buffers[0].cpu();
  std::memcpy(id.data(), received.data_ptr(), id.size());
  return id;
}

// Groups with the same key share one ncclEpGroup. NCCL EP sizes its receive
// budget and staging buffers per group (max_recv_tokens_per_rank,
// max_token_bytes), while our handles each choose capacity, hidden and dtype.
// One group per distinct key gives every handle exactly its own capacity, and
// layers of one model (which almost always agree on these) share a group.
struct GroupKey {
  int64_t num_experts;
  int64_t max_tokens_per_rank;
  int64_t capacity;
  int64_t max_token_bytes;
  bool can_overflow;
  bool zero_copy;
  int64_t timeout_ms;

  bool operator<(const GroupKey& other) const {
    return std::tie(num_experts, max_tokens_per_rank, capacity, max_token_bytes, can_overflow, zero_copy, timeout_ms) <
           std::tie(other.num_experts, other.max_tokens_per_rank, other.capacity, other.max_token_bytes,
                    other.can_overflow, other.zero_copy, other.timeout_ms);
  }
};

// What the backend created for one torch process group: one NCCL
// communicator, shared by all its EP groups.
struct TorchGroupEntry {
  int64_t process_group_id = 0;
  std::shared_ptr<ne::Communicator> comm;
  std::map<GroupKey, std::shared_ptr<ne::Group>> groups;
};

class Registry {
 public:
  // Collective on first use of a (torch group, key): creates the
  // communicator and/or the EP group.
  std::shared_ptr<ne::Group> group_for(const HandleConfig& cfg, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       const GroupKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(cfg.group_name);
    // Process-group names can be reused after a group is destroyed; an entry
    // made for an earlier group of the same name must not be picked up.
    if (it != entries_.end() && it->second.process_group_id != pg->getID()) {
      entries_.erase(it);
      it = entries_.end();
    }
    if (it == entries_.end()) {
      TorchGroupEntry entry;
      entry.process_group_id = pg->getID();
      const auto id = broadcast_unique_id(pg, cfg.device);
      entry.comm = std::make_shared<ne::Communicator>(id, pg->getSize(), pg->getRank(), cfg.device.index());
      it = entries_.emplace(cfg.group_name, std::move(entry)).first;
    }
    TorchGroupEntry& entry = it->second;
    TORCH_CHECK(entry.comm->device() == cfg.device.index(), "te_ep.create_handle: the nccl_ep backend of group '",
                cfg.group_name, "' runs on cuda:", entry.comm->device(), ", got a handle on ", cfg.device);
    auto group = entry.groups.find(key);
    if (group == entry.groups.end()) {
      ne::GroupConfig config;
      config.num_experts = key.num_experts;
      config.max_tokens_per_rank = key.max_tokens_per_rank;
      config.capacity = key.capacity;
      config.max_token_bytes = key.max_token_bytes;
      config.can_overflow = key.can_overflow;
      config.zero_copy = key.zero_copy;
      config.timeout_ms = key.timeout_ms;
      group = entry.groups.emplace(key, std::make_shared<ne::Group>(entry.comm, config)).first;
    }
    return group->second;
  }

  void release(const std::string& group_name) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Dropping our references destroys what no handle holds; live handles
    // keep their group, and groups their communicator, until they go.
    entries_.erase(group_name);
  }

 private:
  std::mutex mutex_;
  std::map<std::string, TorchGroupEntry> entries_;
};

// Never destroyed: at exit NCCL and the CUDA driver may be gone before a
// static destructor would run.
Registry& registry() {
  static auto* instance = new Registry();
  return *instance;
}

// Tensors over memory the backend owns (a window): returned to the caller as
// ordinary tensors. The backend remembers the last one handed out for each
// window and bumps its version counter before the window is written again, so
// a tensor that autograd saved and that the window no longer holds makes
// backward raise ("modified by an inplace operation") instead of reading
// another step's rows.
class WindowRows {
 public:
  WindowRows() = default;
  WindowRows(const ne::Communicator::Window& window, uint64_t offset, int64_t rows, int64_t hidden,
             const at::TensorOptions& options)
      : win_(window.win),
        offset_(offset),
        ptr_(static_cast<char*>(window.ptr) + offset),
        rows_(rows),
        hidden_(hidden),
        options_(options) {}

  ne::Rows rows() const { return ne::Rows{ptr_, win_, offset_}; }
  void* ptr() const { return ptr_; }
  bool holds(const at::Tensor& t) const {
    return t.data_ptr() == ptr_ && t.size(0) == rows_ && t.size(1) == hidden_;
  }

  // Call before anything writes the window: earlier tensors over it go stale.
  void invalidate() {
    for (auto& weak : handed_out_) {
      if (auto impl = weak.lock()) impl->bump_version();
    }
    handed_out_.clear();
  }

  at::Tensor hand_out() { return hand_out_view(0, {rows_, hidden_}, options_.dtype().toScalarType()); }

  // A tensor of another shape and dtype over the window, `byte_offset` in
  // (FP8 dispatch puts its values and scales there).
  at::Tensor hand_out_view(uint64_t byte_offset, at::IntArrayRef sizes, at::ScalarType dtype) {
    // target_device: the device is known, so torch need not ask the driver
    // (cudaPointerGetAttributes) on every op that hands the window out.
    at::Tensor t = at::for_blob(static_cast<char*>(ptr_) + byte_offset, sizes)
                       .options(options_.dtype(dtype))
                       .target_device(options_.device())
                       .make_tensor();
    handed_out_.emplace_back(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
    return t;
  }

 private:
  ncclWindow_t win_ = nullptr;
  uint64_t offset_ = 0;
  void* ptr_ = nullptr;
  int64_t rows_ = 0;
  int64_t hidden_ = 0;
  at::TensorOptions options_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> handed_out_;
};

class NcclEpBackend final : public Backend {
 public:
  NcclEpBackend(const HandleConfig& cfg, std::shared_ptr<ne::Group> group, std::string mode_reason)
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

  ~NcclEpBackend() override {
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

  at::Tensor allocate_handle_mem() override {
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

  std::string mode() const override { return zero_copy_ ? "zero_copy" : "staged"; }
  std::string mode_reason() const override { return mode_reason_; }
  int64_t window_bytes() const override { return window_bytes_; }
  Checks checks() const override { return checks_.mode(); }

  at::Tensor combine_buffer() override {
    if (!zero_copy_) return at::Tensor();
    return combine_window_.hand_out();
  }

  bool agree_on_arguments(const char* op, const std::string& local_error) override {
    // Without a routing on this rank there is no step to join; raised here
    // in every mode (every rank that skipped prepare does the same).
    if (!opens_step(op) && prepared_num_tokens_ < 0) {
      TORCH_CHECK(local_error.empty(), local_error);
      require_prepared(op);
    }
    return checks_.agree_on_arguments(op, local_error);
  }

  std::tuple<at::Tensor, at::Tensor> prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) override {
    (void)handle_mem;
    require_handle("prepare");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const bool capturing = stream_is_capturing(stream);
    exchange_routing(topk_idx, stream, capturing);
    auto [expert_counts, total] = finish_prepare(ne::RowsPast{}, stream, capturing);
    prepared_num_tokens_ = topk_idx.size(0);
    return {expert_counts, total};
  }

  std::tuple<at::Tensor, at::Tensor> dispatch(const at::Tensor& tokens, const at::Tensor& topk_weights,
                                              const at::Tensor& handle_mem) override {
    (void)handle_mem;
    require_prepared("dispatch");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    auto [recv_tokens, recv_weights] = send_tokens(tokens, topk_weights, stream);
    zero_past(dispatch_rows_past(recv_tokens, recv_weights), stream);
    checks_.zero_if_poisoned({recv_tokens, recv_weights}, stream);
    return {recv_tokens, recv_weights};
  }

  // The local check mode (the only one run_op fuses the two in): prepare's
  // guard and NCCL EP's routing exchange, NCCL EP's dispatch right behind
  // them, then one kernel that finishes the prepare and zeroes the receive
  // rows past those in use. What dispatch's own zeroing kernel and prepare's
  // finish would do in two launches, between the two NCCL EP calls, is done
  // after both; NCCL EP's dispatch needs neither, nor prepare's outputs,
  // which are allocated after it.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch(
      const at::Tensor& topk_idx, const at::Tensor& tokens, const at::Tensor& topk_weights,
      at::Tensor& handle_mem) override {
    (void)handle_mem;
    TORCH_INTERNAL_ASSERT(checks_.mode() == Checks::kLocal, "te_ep: prepare_dispatch fuses the local check mode only");
    require_handle("prepare_dispatch");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const bool capturing = stream_is_capturing(stream);
    exchange_routing(topk_idx, stream, capturing);
    auto [recv_tokens, recv_weights] = send_tokens(tokens, topk_weights, stream);
    auto [expert_counts, total] =
        finish_prepare(dispatch_rows_past(recv_tokens, recv_weights), stream, capturing);
    prepared_num_tokens_ = topk_idx.size(0);
    return {recv_tokens, recv_weights, expert_counts, total};
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(const at::Tensor& values, const at::Tensor& scales,
                                                              const at::Tensor& topk_weights,
                                                              const at::Tensor& handle_mem) override {
    (void)handle_mem;
    require_prepared("dispatch_fp8");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    auto out = send_fp8(values, scales, topk_weights, stream);
    zero_fp8_past(out, stream);
    return out;
  }

  // prepare_dispatch's order for an FP8 dispatch (the local check mode): the
  // guard, NCCL EP's routing exchange and FP8 dispatch back to back, then
  // prepare's finish and the zeroing of the rows past those in use.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch_fp8(
      const at::Tensor& topk_idx, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      at::Tensor& handle_mem) override {
    (void)handle_mem;
    TORCH_INTERNAL_ASSERT(checks_.mode() == Checks::kLocal,
                          "te_ep: prepare_dispatch_fp8 fuses the local check mode only");
    require_handle("prepare_dispatch_fp8");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const bool capturing = stream_is_capturing(stream);
    exchange_routing(topk_idx, stream, capturing);
    auto out = send_fp8(values, scales, topk_weights, stream);
    auto [expert_counts, total] = finish_prepare(ne::RowsPast{}, stream, capturing);
    zero_fp8_past(out, stream);
    prepared_num_tokens_ = topk_idx.size(0);
    auto [recv_values, recv_scales, recv_weights] = out;
    return {recv_values, recv_scales, recv_weights, expert_counts, total};
  }

  at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) override {
    (void)handle_mem;
    require_prepared("combine");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const at::Tensor y = expert_out.contiguous();
    at::Tensor out = at::empty({num_tokens, cfg_.hidden}, y.options());
    if (zero_copy_) {
      const bool in_place = fill_combine_window(y, stream);
      handle_->combine_forward(combine_window_.rows(), dtype_, cfg_.hidden, out.data_ptr(), num_tokens, stream);
      zero_unrouted(out, &state()->dirty_combine, /*whole=*/in_place, stream);
    } else {
      handle_->combine_forward(ne::Rows::plain(y.data_ptr()), dtype_, cfg_.hidden, out.data_ptr(), num_tokens,
                               stream);
      zero_unrouted(out, nullptr, false, stream);
    }
    checks_.zero_if_poisoned({out}, stream);
    return out;
  }

  std::tuple<at::Tensor, at::Tensor> dispatch_bwd(const at::Tensor& grad_recv_tokens,
                                                  const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
                                                  int64_t num_tokens) override {
    (void)handle_mem;
    require_prepared("dispatch_bwd");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const at::Tensor g = grad_recv_tokens.contiguous();
    const at::Tensor gw = grad_recv_weights.contiguous();
    at::Tensor grad_tokens = at::empty({num_tokens, cfg_.hidden}, g.options());
    // Zeros: dropped choices (-1) own no slot and get no gradient.
    at::Tensor grad_weights = zeros_on(stream, {num_tokens, cfg_.top_k}, gw.options());
    ne::Rows rows = ne::Rows::plain(g.data_ptr());
    const bool in_place = zero_copy_ && fill_combine_window(g, stream);
    if (zero_copy_) rows = combine_window_.rows();
    handle_->combine_backward(rows, gw.data_ptr<float>(), dtype_, cfg_.hidden, grad_tokens.data_ptr(),
                              grad_weights.data_ptr<float>(), num_tokens, cfg_.top_k, stream);
    zero_unrouted(grad_tokens, zero_copy_ ? &state()->dirty_combine : nullptr, in_place, stream);
    checks_.zero_if_poisoned({grad_tokens, grad_weights}, stream);
    return {grad_tokens, grad_weights};
  }

  at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) override {
    (void)handle_mem;
    require_prepared("combine_bwd");
    c10::cuda::CUDAGuard guard(cfg_.device);
    cudaStream_t stream = current_stream();
    const at::Tensor g = grad_out.contiguous();
    auto [recv, rows] = output_rows(combine_window_, g.options());
    handle_->dispatch_backward(g.data_ptr(), dtype_, g.size(0), cfg_.hidden, rows, stream);
    zero_past(rows_past(recv.data_ptr(), nullptr, zero_copy_ ? &state()->dirty_combine : nullptr), stream);
    checks_.zero_if_poisoned({recv}, stream);
    return recv;
  }

  int64_t prepared_num_tokens(const at::Tensor& handle_mem) override {
    (void)handle_mem;
    return prepared_num_tokens_;
  }

  std::unique_ptr<watchdog::Op> watch(const char* op, int64_t handle_id) override {
    return watched_ops_.enter(cfg_, op, handle_id);
  }

  void watch_launched(watchdog::Op& op) override {
    // The marker's event must belong to the handle's device, whatever device
    // the caller has current (the op's own guard is gone by now).
    c10::cuda::CUDAGuard guard(cfg_.device);
    op.watch_stream(current_stream(), cfg_.device.index());
  }

  void raise_pending_errors() override {
    c10::cuda::CUDAGuard guard(cfg_.device);
    checks_.raise_pending(current_stream());
  }

 private:
  ne::HandleState* state() { return reinterpret_cast<ne::HandleState*>(state_.data_ptr<int32_t>()); }
  uint8_t* unrouted() { return unrouted_.data_ptr<uint8_t>(); }

  cudaStream_t current_stream() const { return at::cuda::getCurrentCUDAStream(cfg_.device.index()).stream(); }

  // The ops that start a step (a new routing) rather than need one.
  static bool opens_step(const char* op) {
    return std::strcmp(op, "prepare") == 0 || std::strcmp(op, "prepare_dispatch") == 0 ||
           std::strcmp(op, "prepare_dispatch_fp8") == 0;
  }

  // The first half of prepare: the check's guard on `topk_idx`, then NCCL
  // EP's routing exchange, which writes its counts to raw_counts_ (the
  // caller records the prepared tokens once finish_prepare returns). Nothing
  // is allocated on the way to NCCL EP.
  void exchange_routing(const at::Tensor& topk_idx, cudaStream_t stream, bool capturing) {
    const at::Tensor idx = topk_idx.contiguous();
    void* routed = checks_.check_routing(idx, unrouted(), stream, capturing);
    handle_->update(routed, to_dtype(idx.scalar_type()), idx.size(0), idx.size(1),
                    raw_counts_.data_ptr<int32_t>(), cfg_.num_local_experts(), &state()->recv_total_raw, stream);
  }

  // The second half: prepare's outputs (expert_counts, total), written by the
  // finish kernel from raw_counts_ (which also zeroes `zero`).
  std::tuple<at::Tensor, at::Tensor> finish_prepare(const ne::RowsPast& zero, cudaStream_t stream, bool capturing) {
    const auto int_options = at::TensorOptions().dtype(at::kInt).device(cfg_.device);
    at::Tensor expert_counts = at::empty({cfg_.num_local_experts()}, int_options);
    at::Tensor total = at::empty({1}, int_options);
    checks_.finish_prepare(state(), raw_counts_.data_ptr<int32_t>(), expert_counts.data_ptr<int32_t>(),
                           cfg_.num_local_experts(), total.data_ptr<int32_t>(), zero, stream, capturing);
    return {expert_counts, total};
  }

  // NCCL EP's dispatch of `tokens` into the receive window (zero-copy) or a
  // new buffer (staged); the rows past those in use are the caller's to zero
  // (dispatch_rows_past).
  std::tuple<at::Tensor, at::Tensor> send_tokens(const at::Tensor& tokens, const at::Tensor& topk_weights,
                                                 cudaStream_t stream) {
    const at::Tensor x = tokens.contiguous();
    const at::Tensor w = topk_weights.contiguous();
    at::Tensor recv_weights = at::empty({cfg_.capacity}, w.options());
    auto [recv_tokens, rows] = output_rows(recv_window_, x.options());
    handle_->dispatch_forward(x.data_ptr(), dtype_, x.size(0), cfg_.hidden, w.data_ptr<float>(), w.size(1), rows,
                              recv_weights.data_ptr<float>(), stream);
    return {recv_tokens, recv_weights};
  }

  // NCCL EP's FP8 dispatch of values and scales into the receive window
  // (zero-copy: the values, capacity * hidden bytes, then the scales, which
  // the handle's dtype makes at least twice as wide as the values) or new
  // buffers (staged); zero_fp8_past then zeroes the rows past those in use.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> send_fp8(const at::Tensor& values, const at::Tensor& scales,
                                                          const at::Tensor& topk_weights, cudaStream_t stream) {
    const at::Tensor q = values.contiguous();
    const at::Tensor s = scales.contiguous();
    const at::Tensor w = topk_weights.contiguous();
    const int64_t num_scales = cfg_.hidden / kFp8Block;
    const uint64_t scales_offset = static_cast<uint64_t>(cfg_.capacity * cfg_.hidden);
    at::Tensor recv_weights = at::empty({cfg_.capacity}, w.options());
    at::Tensor recv_values;
    at::Tensor recv_scales;
    ne::Rows value_rows;
    ne::Rows scale_rows;
    if (zero_copy_) {
      recv_window_.invalidate();
      value_rows = recv_window_.rows();
      scale_rows = value_rows.at_offset(scales_offset);
      recv_values = recv_window_.hand_out_view(0, {cfg_.capacity, cfg_.hidden}, at::kFloat8_e4m3fn);
      recv_scales = recv_window_.hand_out_view(scales_offset, {cfg_.capacity, num_scales}, at::kFloat);
    } else {
      recv_values = at::empty({cfg_.capacity, cfg_.hidden}, q.options());
      recv_scales = at::empty({cfg_.capacity, num_scales}, s.options());
      value_rows = ne::Rows::plain(recv_values.data_ptr());
      scale_rows = ne::Rows::plain(recv_scales.data_ptr());
    }
    handle_->dispatch_forward_fp8(q.data_ptr(), s.data_ptr<float>(), q.size(0), cfg_.hidden, num_scales,
                                  w.data_ptr<float>(), w.size(1), value_rows, scale_rows,
                                  recv_weights.data_ptr<float>(), stream);
    return {recv_values, recv_scales, recv_weights};
  }

  // Rows past the total are zeroed whatever NCCL EP left there: values and
  // scales do not follow the bf16 row bookkeeping of the window (dirty_recv),
  // which is therefore marked wholly dirty for the next bf16 dispatch.
  void zero_fp8_past(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& out, cudaStream_t stream) {
    const auto& [recv_values, recv_scales, recv_weights] = out;
    const int64_t scale_row_bytes = cfg_.hidden / kFp8Block * static_cast<int64_t>(sizeof(float));
    ne::launch_zero_unused_rows(state(), recv_values.data_ptr(), cfg_.hidden, recv_weights.data_ptr<float>(),
                                cfg_.capacity, nullptr, stream);
    ne::launch_zero_unused_rows(state(), recv_scales.data_ptr(), scale_row_bytes, nullptr, cfg_.capacity, nullptr,
                                stream);
    if (zero_copy_) {
      ne::launch_mark_dirty_rows(state(), &state()->dirty_recv, cfg_.capacity, /*whole=*/true, stream);
    }
    checks_.zero_if_poisoned({recv_values, recv_scales, recv_weights}, stream);
  }

  // The [capacity, hidden] rows an NCCL EP call writes: `window` (zero-copy;
  // its earlier tensors go stale) or a new tensor of `options` (staged).
  std::tuple<at::Tensor, ne::Rows> output_rows(WindowRows& window, const at::TensorOptions& options) {
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
  ne::RowsPast rows_past(void* rows, float* weights, ne::DirtyRows* dirty) const {
    if (dirty == nullptr && group_->config().can_overflow) return ne::RowsPast{};
    return ne::RowsPast{rows, row_bytes(), weights, dirty};
  }

  ne::RowsPast dispatch_rows_past(const at::Tensor& recv_tokens, const at::Tensor& recv_weights) {
    return rows_past(recv_tokens.data_ptr(), recv_weights.data_ptr<float>(),
                     zero_copy_ ? &state()->dirty_recv : nullptr);
  }

  void zero_past(const ne::RowsPast& past, cudaStream_t stream) {
    if (past.rows == nullptr) return;
    ne::launch_zero_unused_rows(state(), past.rows, past.row_bytes, past.weights, cfg_.capacity, past.dirty, stream);
  }

  int64_t row_bytes() const {
    return cfg_.hidden * static_cast<int64_t>(ne::dtype_size(dtype_));
  }

  // Zero-copy mode: NCCL EP reads a combine input (forward or backward) only
  // from the combine window and reduces inside it. A caller's tensor is
  // copied in (only the rows in use); the window itself, handed out by
  // combine_buffer(), is used as it is (returns true). Either way the window's
  // earlier tensors (combine_buffer(), combine_bwd's output) go stale. The
  // caller then zeroes the unrouted rows of the combine's token output after
  // NCCL EP's launch, in the launch that records the window's dirty rows
  // (whole: in place, the caller may have written every row).
  bool fill_combine_window(const at::Tensor& input, cudaStream_t stream) {
    const bool in_place = combine_window_.holds(input);
    combine_window_.invalidate();
    if (!in_place) {
      ne::launch_copy_used_rows(state(), input.data_ptr(), combine_window_.ptr(), row_bytes(), cfg_.capacity, stream);
    }
    return in_place;
  }

  // The rows of a combine-like output [prepared tokens, hidden] whose token
  // had no valid choice: NCCL EP writes every other row, so these are zeroed
  // after its launch, off the path to it. (`dirty`: see
  // launch_zero_unrouted_rows.)
  void zero_unrouted(const at::Tensor& out, ne::DirtyRows* dirty, bool whole, cudaStream_t stream) {
    ne::launch_zero_unrouted_rows(unrouted(), out.size(0), out.data_ptr(), row_bytes(), state(), dirty, cfg_.capacity,
                                  whole, stream);
  }

  void require_handle(const char* op) const {
    TORCH_CHECK(handle_ != nullptr, "te_ep.", op, ": the nccl_ep handle has no handle memory yet (create_handle "
                "allocates it)");
  }

  void require_prepared(const char* op) const {
    require_handle(op);
    TORCH_CHECK(prepared_num_tokens_ >= 0, "te_ep.", op, ": call prepare on this handle first");
  }

  // at::zeros through one cudaMemsetAsync: the combine outputs are tens of MB,
  // and this keeps their zeroing to one cheap launch on the op's path.
  static at::Tensor zeros_on(cudaStream_t stream, at::IntArrayRef sizes, const at::TensorOptions& options) {
    at::Tensor t = at::empty(sizes, options);
    if (t.numel() > 0) C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), stream));
    return t;
  }

  HandleConfig cfg_;
  std::shared_ptr<ne::Group> group_;
  ne::DType dtype_;
  bool zero_copy_;
  std::string mode_reason_;
  NcclEpChecks checks_;
  int64_t window_bytes_ = 0;
  WindowRows recv_window_;
  WindowRows combine_window_;
  std::unique_ptr<ne::Handle> handle_;
  at::Tensor handle_mem_;
  at::Tensor state_;
  // [num_local_experts] int32: NCCL EP's counts of the last prepare, before
  // the finish kernel writes the op's own (clipped) copy.
  at::Tensor raw_counts_;
  at::Tensor unrouted_;
  int64_t prepared_num_tokens_ = -1;
  WatchedOps watched_ops_;
};

// "" if `ptr` is CUDA VMM (cuMem) memory, the kind symmetric windows are made of; else why
// not. Asked through the driver API (cuMemRetainAllocationHandle succeeds only on VMM
// memory), fetched from the runtime so that nothing links libcuda.
std::string not_vmm_memory(void* ptr) {
  using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  void* retain = nullptr;
  void* release = nullptr;
  cudaDriverEntryPointQueryResult found_retain{}, found_release{};
  if (cudaGetDriverEntryPointByVersion("cuMemRetainAllocationHandle", &retain, 12000, cudaEnableDefault,
                                       &found_retain) != cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuMemRelease", &release, 12000, cudaEnableDefault, &found_release) !=
          cudaSuccess ||
      found_retain != cudaDriverEntryPointSuccess || found_release != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return "the CUDA driver does not offer cuMemRetainAllocationHandle (no CUDA VMM)";
  }
  CUmemGenericAllocationHandle handle{};
  if (reinterpret_cast<Retain>(retain)(&handle, ptr) != CUDA_SUCCESS) {
    return "ncclMemAlloc returned memory that is not CUDA VMM (cuMem) memory, as NCCL does with "
           "NCCL_CUMEM_ENABLE=0 or where the driver lacks cuMem";
  }
  reinterpret_cast<Release>(release)(handle);
  return "";
}

// Whether this process can allocate window memory ("" if so, else why).
// Probed once: windows need CUDA VMM (cuMem) memory from ncclMemAlloc, which some
// drivers, containers and NCCL_CUMEM_ENABLE=0 take away (ncclMemAlloc then falls back to
// cudaMalloc, and NCCL EP's zero-copy group creation fails with "invalid usage").
std::string window_memory_unavailable() {
  static const std::string reason = [] {
    void* ptr = nullptr;
    const ncclResult_t result = ne::api().MemAlloc(&ptr, 1 << 21);
    if (result != ncclSuccess) return std::string("ncclMemAlloc failed: ") + ne::api().GetErrorString(result);
    std::string why = not_vmm_memory(ptr);
    ne::api().MemFree(ptr);
    return why;
  }();
  return reason;
}

// Collective (create_handle is): every rank picks the same mode, or every rank raises.
// NCCL EP runs on NCCL's device API in both modes, and that needs CUDA VMM (cuMem) memory:
// where a rank has none (NCCL_CUMEM_ENABLE=0, a driver or container without cuMem) NCCL EP's
// group creation fails with "invalid usage" even staged, so every rank raises here instead,
// saying why. Where every rank has it, windows can be made: `auto` runs zero-copy.
std::pair<bool, std::string> choose_zero_copy(const HandleConfig& cfg) {
  const auto messages = gather_messages(cfg, window_memory_unavailable());
  for (size_t r = 0; r < messages.size(); ++r) {
    TORCH_CHECK(messages[r].empty(), "te_ep.create_handle: backend 'nccl_ep' cannot run on rank ", r, ": ",
                messages[r], ". NCCL EP needs NCCL's device API in every mode (staged too), and that needs CUDA "
                "VMM (cuMem) memory; use backend='reference', or leave NCCL_CUMEM_ENABLE unset");
  }
  if (cfg.nccl_ep_mode == "staged") return {false, "nccl_ep_mode='staged' was requested"};
  return {true, cfg.nccl_ep_mode == "zero_copy" ? "nccl_ep_mode='zero_copy' was requested"
                                                : "symmetric windows are available on every rank"};
}

}  // namespace

std::string load_nccl_ep(const std::string& nccl_ep_lib, const std::string& nccl_lib) {
  const auto& info = ne::load(nccl_ep_lib, nccl_lib);
  return "NCCL EP " + ne::format_version(info.nccl_ep_version) + " (" + info.nccl_ep_path + ") on NCCL " +
         ne::format_version(info.nccl_version) + " (" + info.nccl_path + ", JIT headers in " + info.nccl_home +
         "/include)";
}

bool nccl_ep_built() { return true; }

void nccl_ep_mark_exiting() {
  ne::mark_process_exiting();
  watchdog::stop();
}

std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg) {
  TORCH_CHECK(ne::is_loaded(), "te_ep.create_handle: backend 'nccl_ep' needs NCCL EP loaded; call "
              "te_ep_torch._nccl_ep.load() first (te_ep_torch.EpGroup does this for backend='nccl_ep' and 'auto')");
  TORCH_CHECK(cfg.device.is_cuda() && cfg.device.has_index(),
              "te_ep.create_handle: backend 'nccl_ep' needs a CUDA device with an index, got ", cfg.device);
  const auto* props = at::cuda::getDeviceProperties(cfg.device.index());
  TORCH_CHECK(props->major >= 9, "te_ep.create_handle: backend 'nccl_ep' needs a GPU of compute capability 9.0 "
              "(Hopper) or newer, got ", props->name, " (", props->major, ".", props->minor,
              "); use backend='reference'");
  TORCH_CHECK(cfg.dtype == at::kBFloat16 || cfg.dtype == at::kHalf || cfg.dtype == at::kFloat,
              "te_ep.create_handle: backend 'nccl_ep' supports bfloat16, float16 and float32 tokens, got ", cfg.dtype);
  const int64_t row_bytes = cfg.hidden * static_cast<int64_t>(c10::elementSize(cfg.dtype));
  TORCH_CHECK(row_bytes % kRowAlignmentBytes == 0, "te_ep.create_handle: backend 'nccl_ep' moves token rows in "
              "16-byte units, so hidden * element size must be a multiple of 16, got hidden=", cfg.hidden, " (",
              row_bytes, " bytes of ", cfg.dtype, ")");
  // NCCL EP moves expert weights with 16-byte TMA copies, one float per expert
  // of the node, and asserts (aborting the process) when they are misaligned.
  TORCH_CHECK(cfg.num_experts % kNcclEpExpertMultiple == 0, "te_ep.create_handle: backend 'nccl_ep' needs num_experts "
              "to be a multiple of ", kNcclEpExpertMultiple, " (NCCL EP copies routing weights in 16-byte units), got "
              "num_experts=", cfg.num_experts, "; use backend='reference' for this layer");
  // QUANT_FWD moves rows of scales too, and those must be 16-byte aligned:
  // hidden / 128 floats, a multiple of 4.
  TORCH_CHECK(!cfg.dispatch_dtype.has_value() || cfg.hidden % (kFp8Block * 4) == 0, "te_ep.create_handle: FP8 "
              "dispatch on backend 'nccl_ep' moves rows of hidden / ", kFp8Block, " float32 scales in 16-byte units, "
              "so hidden must be a multiple of ", kFp8Block * 4, ", got hidden=", cfg.hidden,
              "; use backend='reference' or a bfloat16 dispatch for this layer");
  // NCCL EP's send budget per rank (see nccl_ep_capacity_floor).
  const int64_t send_budget = nccl_ep_capacity_floor(cfg.max_tokens_per_rank);
  TORCH_CHECK(cfg.capacity >= send_budget, "te_ep.create_handle: backend 'nccl_ep' needs capacity >= "
              "max_tokens_per_rank rounded up to a multiple of ", kNcclEpExpertMultiple, " (NCCL EP's receive budget "
              "may not be smaller than its send budget), got capacity=", cfg.capacity, " and max_tokens_per_rank=",
              cfg.max_tokens_per_rank, " (rounded: ", send_budget, ")");
  TORCH_CHECK(cfg.capacity <= INT32_MAX && cfg.num_experts <= INT32_MAX && row_bytes <= INT32_MAX,
              "te_ep.create_handle: backend 'nccl_ep' needs capacity, num_experts and hidden row bytes below 2^31, "
              "got capacity=", cfg.capacity, ", num_experts=", cfg.num_experts, ", row bytes=", row_bytes);

  try {
    (void)watchdog::action();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "te_ep.create_handle: ", e.what());
  }

  // Creating the first handle of a group runs collectives (the NCCL
  // communicator, the NCCL EP group) that a lost rank would leave waiting.
  const std::unique_ptr<watchdog::Op> watched = enter_watched_op(cfg, "create_handle", -1);
  auto pg = c10d::resolve_process_group(cfg.group_name);
  TORCH_INTERNAL_ASSERT(pg->getSize() == cfg.ep_size && pg->getRank() == cfg.rank);
  c10::cuda::CUDAGuard guard(cfg.device);
  const int64_t worst_case = common::worst_case_capacity(cfg.ep_size, cfg.max_tokens_per_rank, cfg.top_k,
                                                         cfg.num_local_experts(), cfg.alignment);
  const auto [zero_copy, mode_reason] = choose_zero_copy(cfg);
  const GroupKey key{cfg.num_experts, send_budget, cfg.capacity, row_bytes, cfg.capacity < worst_case, zero_copy,
                     cfg.timeout_ms};
  auto group = registry().group_for(cfg, pg, key);
  return std::make_unique<NcclEpBackend>(cfg, std::move(group), mode_reason);
}

void release_nccl_ep_group(const std::string& group_name) { registry().release(group_name); }

}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
