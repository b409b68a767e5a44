// NcclEpBackend (nccl_ep_backend.h), back from the experts: combine and the
// two backward ops (dispatch_bwd, a combine of the gradient; combine_bwd, a
// dispatch of it), whose zero-copy rows live in the combine window.
#include "nccl_ep/nccl_ep_backend.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <c10/cuda/CUDAGuard.h>

namespace te_ep {
namespace nccl_ep_backend {

at::Tensor NcclEpBackend::combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) {
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

std::tuple<at::Tensor, at::Tensor> NcclEpBackend::dispatch_bwd(const at::Tensor& grad_recv_tokens,
                                                               const at::Tensor& grad_recv_weights,
                                                               const at::Tensor& handle_mem, int64_t num_tokens) {
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

at::Tensor NcclEpBackend::combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) {
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

// Zero-copy mode: NCCL EP reads a combine input (forward or backward) only
// from the combine window and reduces inside it. A caller's tensor is
// copied in (only the rows in use); the window itself, handed out by
// combine_buffer(), is used as it is (returns true). Either way the window's
// earlier tensors (combine_buffer(), combine_bwd's output) go stale. The
// caller then zeroes the unrouted rows of the combine's token output after
// NCCL EP's launch, in the launch that records the window's dirty rows
// (whole: in place, the caller may have written every row).
bool NcclEpBackend::fill_combine_window(const at::Tensor& input, cudaStream_t stream) {
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
void NcclEpBackend::zero_unrouted(const at::Tensor& out, ne::DirtyRows* dirty, bool whole, cudaStream_t stream) {
  ne::launch_zero_unrouted_rows(unrouted(), out.size(0), out.data_ptr(), row_bytes(), state(), dirty, cfg_.capacity,
                                whole, stream);
}

}  // namespace nccl_ep_backend
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
