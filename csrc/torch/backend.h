// Backend interface shared by the op adapters (ops.cpp) and the two
// backends: the torch.distributed reference backend and the NCCL EP backend.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <tuple>

namespace te_ep {

// Everything a handle was created with. The op adapters check every call's
// arguments against it, so a mismatch is an error naming the argument rather
// than a wrong result.
struct HandleConfig {
  std::string group_name;
  std::string backend;
  int64_t num_experts = 0;
  int64_t max_tokens_per_rank = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
  int64_t capacity = 0;
  int64_t alignment = 1;
  at::ScalarType dtype = at::kBFloat16;
  at::Device device = at::Device(at::kCPU);
  int64_t ep_size = 0;
  int64_t rank = 0;

  int64_t num_local_experts() const { return num_experts / ep_size; }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Device buffer that holds the routing state of the handle.
  virtual at::Tensor allocate_handle_mem() = 0;

  // Collective: every rank passes its own local argument error ("" if none);
  // if any rank has one, every rank throws a message naming the failing
  // rank(s). Runs before any data collective so no rank is left waiting.
  virtual void agree_on_errors(const std::string& op, const std::string& local_error) = 0;

  // Checks the values of `topk_idx` where the backend can do so without a
  // device sync; returns the error message or "".
  virtual std::string validate_routing(const at::Tensor& topk_idx) { return ""; }

  virtual std::tuple<at::Tensor, at::Tensor> prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) = 0;
  virtual std::tuple<at::Tensor, at::Tensor> dispatch(
      const at::Tensor& tokens, const at::Tensor& topk_weights, const at::Tensor& handle_mem) = 0;
  virtual at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) = 0;
  virtual std::tuple<at::Tensor, at::Tensor> dispatch_bwd(
      const at::Tensor& grad_recv_tokens, const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
      int64_t num_tokens) = 0;
  virtual at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) = 0;

  // Number of tokens of the last successful `prepare` (host-side record),
  // -1 before the first. Used to reject shape mismatches.
  virtual int64_t prepared_num_tokens(const at::Tensor& handle_mem) = 0;
};

std::unique_ptr<Backend> make_reference_backend(const HandleConfig& cfg);

// Defined by the NCCL EP adapter; throws a clear error when the package was
// built without CUDA or NCCL EP can't be loaded.
std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg);

}  // namespace te_ep
