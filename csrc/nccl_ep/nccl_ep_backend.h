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
//
// NcclEpBackend is one handle's backend. Its members are defined in
//   nccl_ep_backend.cpp   the handle's lifetime, each op's frame (agreement,
//                         watchdog, pending errors), the row helpers both
//                         directions use
//   nccl_ep_dispatch.cpp  prepare, dispatch and FP8 dispatch (alone or fused
//                         with prepare)
//   nccl_ep_combine.cpp   combine and the two backward ops
// and nccl_ep_setup.cpp creates it (make_nccl_ep_backend: NCCL EP loaded, the
// NCCL communicator and NCCL EP group a handle runs on, its mode). Only these
// files include this header.
#pragma once

#include <string>

#include "comm/backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <ATen/cuda/CUDAContext.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "nccl_ep/core/nccl_ep_wrap.h"
#include "nccl_ep/nccl_ep_checks.h"

namespace te_ep {
namespace nccl_ep_backend {

namespace ne = nccl_ep;

DType to_dtype(at::ScalarType type);

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
  // nccl_ep_backend.cpp
  NcclEpBackend(const HandleConfig& cfg, std::shared_ptr<ne::Group> group, std::string mode_reason);
  ~NcclEpBackend() override;
  at::Tensor allocate_handle_mem() override;
  std::string mode() const override { return zero_copy_ ? "zero_copy" : "staged"; }
  std::string mode_reason() const override { return mode_reason_; }
  int64_t window_bytes() const override { return window_bytes_; }
  Checks checks() const override { return checks_.mode(); }
  at::Tensor combine_buffer() override;
  bool agree_on_arguments(const char* op, const std::string& local_error) override;
  int64_t prepared_num_tokens(const at::Tensor& handle_mem) override;
  std::unique_ptr<watchdog::Op> watch(const char* op, int64_t handle_id) override;
  void watch_launched(watchdog::Op& op) override;
  void raise_pending_errors() override;

  // nccl_ep_dispatch.cpp
  std::tuple<at::Tensor, at::Tensor> prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) override;
  std::tuple<at::Tensor, at::Tensor> dispatch(const at::Tensor& tokens, const at::Tensor& topk_weights,
                                              const at::Tensor& handle_mem) override;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch(
      const at::Tensor& topk_idx, const at::Tensor& tokens, const at::Tensor& topk_weights,
      at::Tensor& handle_mem) override;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(const at::Tensor& values, const at::Tensor& scales,
                                                              const at::Tensor& topk_weights,
                                                              const at::Tensor& handle_mem) override;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch_fp8(
      const at::Tensor& topk_idx, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      at::Tensor& handle_mem) override;

  // nccl_ep_combine.cpp
  at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) override;
  std::tuple<at::Tensor, at::Tensor> dispatch_bwd(const at::Tensor& grad_recv_tokens,
                                                  const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
                                                  int64_t num_tokens) override;
  at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) override;

 private:
  ne::HandleState* state() { return reinterpret_cast<ne::HandleState*>(state_.data_ptr<int32_t>()); }
  uint8_t* unrouted() { return unrouted_.data_ptr<uint8_t>(); }

  cudaStream_t current_stream() const { return at::cuda::getCurrentCUDAStream(cfg_.device.index()).stream(); }

  int64_t row_bytes() const {
    return cfg_.hidden * static_cast<int64_t>(ne::dtype_size(dtype_));
  }

  // nccl_ep_backend.cpp
  static bool opens_step(const char* op);
  std::tuple<at::Tensor, ne::Rows> output_rows(WindowRows& window, const at::TensorOptions& options);
  ne::RowsPast rows_past(void* rows, float* weights, ne::DirtyRows* dirty) const;
  void zero_past(const ne::RowsPast& past, cudaStream_t stream);
  void require_handle(const char* op) const;
  void require_prepared(const char* op) const;
  static at::Tensor zeros_on(cudaStream_t stream, at::IntArrayRef sizes, const at::TensorOptions& options);

  // nccl_ep_dispatch.cpp
  void exchange_routing(const at::Tensor& topk_idx, cudaStream_t stream, bool capturing);
  std::tuple<at::Tensor, at::Tensor> finish_prepare(const ne::RowsPast& zero, cudaStream_t stream, bool capturing);
  std::tuple<at::Tensor, at::Tensor> send_tokens(const at::Tensor& tokens, const at::Tensor& topk_weights,
                                                 cudaStream_t stream);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> send_fp8(const at::Tensor& values, const at::Tensor& scales,
                                                          const at::Tensor& topk_weights, cudaStream_t stream);
  void zero_fp8_past(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& out, cudaStream_t stream);
  ne::RowsPast dispatch_rows_past(const at::Tensor& recv_tokens, const at::Tensor& recv_weights);

  // nccl_ep_combine.cpp
  bool fill_combine_window(const at::Tensor& input, cudaStream_t stream);
  void zero_unrouted(const at::Tensor& out, ne::DirtyRows* dirty, bool whole, cudaStream_t stream);

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

}  // namespace nccl_ep_backend
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
