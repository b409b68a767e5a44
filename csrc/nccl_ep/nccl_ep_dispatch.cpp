// NcclEpBackend (nccl_ep_backend.h), tokens to the experts: prepare (NCCL
// EP's routing exchange), dispatch and FP8 dispatch, alone or fused with
// prepare under the local check mode.
#include "nccl_ep/nccl_ep_backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <c10/cuda/CUDAGuard.h>

namespace te_ep {
namespace nccl_ep_backend {

std::tuple<at::Tensor, at::Tensor> NcclEpBackend::prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) {
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

std::tuple<at::Tensor, at::Tensor> NcclEpBackend::dispatch(const at::Tensor& tokens, const at::Tensor& topk_weights,
                                                           const at::Tensor& handle_mem) {
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
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> NcclEpBackend::prepare_dispatch(
    const at::Tensor& topk_idx, const at::Tensor& tokens, const at::Tensor& topk_weights,
    at::Tensor& handle_mem) {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> NcclEpBackend::dispatch_fp8(const at::Tensor& values,
                                                                           const at::Tensor& scales,
                                                                           const at::Tensor& topk_weights,
                                                                           const at::Tensor& handle_mem) {
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
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> NcclEpBackend::prepare_dispatch_fp8(
    const at::Tensor& topk_idx, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
    at::Tensor& handle_mem) {
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

// The first half of prepare: the check's guard on `topk_idx`, then NCCL
// EP's routing exchange, which writes its counts to raw_counts_ (the
// caller records the prepared tokens once finish_prepare returns). Nothing
// is allocated on the way to NCCL EP.
void NcclEpBackend::exchange_routing(const at::Tensor& topk_idx, cudaStream_t stream, bool capturing) {
  const at::Tensor idx = topk_idx.contiguous();
  void* routed = checks_.check_routing(idx, unrouted(), stream, capturing);
  handle_->update(routed, to_dtype(idx.scalar_type()), idx.size(0), idx.size(1),
                  raw_counts_.data_ptr<int32_t>(), cfg_.num_local_experts(), &state()->recv_total_raw, stream);
}

// The second half: prepare's outputs (expert_counts, total), written by the
// finish kernel from raw_counts_ (which also zeroes `zero`).
std::tuple<at::Tensor, at::Tensor> NcclEpBackend::finish_prepare(const ne::RowsPast& zero, cudaStream_t stream,
                                                                 bool capturing) {
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
std::tuple<at::Tensor, at::Tensor> NcclEpBackend::send_tokens(const at::Tensor& tokens, const at::Tensor& topk_weights,
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
std::tuple<at::Tensor, at::Tensor, at::Tensor> NcclEpBackend::send_fp8(const at::Tensor& values,
                                                                       const at::Tensor& scales,
                                                                       const at::Tensor& topk_weights,
                                                                       cudaStream_t stream) {
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
void NcclEpBackend::zero_fp8_past(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& out, cudaStream_t stream) {
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

ne::RowsPast NcclEpBackend::dispatch_rows_past(const at::Tensor& recv_tokens, const at::Tensor& recv_weights) {
  return rows_past(recv_tokens.data_ptr(), recv_weights.data_ptr<float>(),
                   zero_copy_ ? &state()->dirty_recv : nullptr);
}

}  // namespace nccl_ep_backend
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
