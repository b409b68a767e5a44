// Backend interface shared by the op adapters (comm_ops.cpp) and the two
// backends: the torch.distributed reference backend and the NCCL EP backend.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
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
  // nccl_ep only: "staged", "zero_copy" or "auto" (zero-copy where symmetric
  // windows can be had); docs/nccl_ep.md.
  std::string nccl_ep_mode = "staged";
  // Set to float8_e4m3fn for a handle that also dispatches block-scaled FP8
  // rows (dispatch_fp8); combine and the backward ops stay in `dtype`.
  std::optional<at::ScalarType> dispatch_dtype;
  // nccl_ep only: how long NCCL EP's kernels wait for the other ranks, in ms
  // (0: NCCL EP's default); EpGroup passes the process group's timeout.
  int64_t timeout_ms = 0;

  int64_t num_local_experts() const { return num_experts / ep_size; }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Device buffer that holds the routing state of the handle.
  virtual at::Tensor allocate_handle_mem() = 0;

  // How the handle moves tokens: "reference", "staged" or "zero_copy", and why.
  virtual std::string mode() const = 0;
  virtual std::string mode_reason() const { return ""; }
  // Bytes of communication windows the handle holds (zero-copy mode).
  virtual int64_t window_bytes() const { return 0; }
  // Zero-copy mode: the window combine reads its input from ([capacity,
  // hidden]); an expert output written there is combined without a copy.
  // Undefined in the other modes.
  virtual at::Tensor combine_buffer() { return at::Tensor(); }

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
  // values [T, H] e4m3 and scales [T, H / 128] f32 -> the same rows in the
  // expert-major layout of dispatch (padding rows: zero bytes), plus weights.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(
      const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      const at::Tensor& handle_mem) = 0;
  virtual at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) = 0;
  virtual std::tuple<at::Tensor, at::Tensor> dispatch_bwd(
      const at::Tensor& grad_recv_tokens, const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
      int64_t num_tokens) = 0;
  virtual at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) = 0;

  // How bad routing and capacity overflow are caught: "synchronous" (every op,
  // host sync; the reference backend and TE_EP_CHECK_ROUTING=1), "device"
  // (nccl_ep with TE_EP_DEVICE_CHECKS=1: agreed on the device, raised at the
  // next prepare or raise_pending_errors) or "local" (nccl_ep's default: each
  // rank drops its own bad choices and records them and its overflow on the
  // device, raised on that rank by its next prepare or raise_pending_errors).
  virtual std::string check_mode() const { return "synchronous"; }
  // Raises an error the device checks agreed on and the host has not raised
  // yet (waits for the GPU); a no-op where errors are raised in the op.
  virtual void raise_pending_errors() {}
  // The "device" check mode's argument errors (comm_ops.cpp). A prepare whose
  // arguments are bad on this rank runs on a substitute routing (no tokens)
  // and marks the step failed in the routing agreement, so every rank sends
  // nothing, zeroes the step's outputs and raises at its next prepare or
  // raise_pending_errors, this rank with `error` itself.
  virtual std::tuple<at::Tensor, at::Tensor> prepare_failed(const std::string& error) {
    TORCH_CHECK(false, error);
    return {};
  }
  // Every op after prepare (dispatch .. combine_bwd) first agrees on its
  // arguments on the device: each rank passes its own argument error of `op`
  // ("" if none), one small all-reduce tells every rank whether any rank's
  // were bad, and if so the rest of the step is poisoned on every rank (its
  // outputs are zeros) and the error is kept for raise_pending_errors (now)
  // or the handle's prepare after next (the next one's host copy of the
  // record is made before this op's verdict is known; waiting for it would
  // be a host sync). Returns true when this rank must run the op on
  // substitutes of the prepared shapes, so that the others' collective
  // completes: its arguments are bad now, or its step already failed here.
  virtual bool agree_on_op(const char* op, const std::string& local_error) {
    TORCH_CHECK(false, "te_ep.", op, ": the device check mode needs the nccl_ep backend");
    return false;
  }
  // Called after each op of `handle_id` was launched: the nccl_ep backend
  // hands a completion marker to the watchdog (csrc/common/watchdog.h), whose
  // kernels would otherwise wait for a lost rank forever. A no-op where the
  // transport has its own time limit (the reference backend's torch
  // collectives).
  virtual void watch(const char* op, int64_t handle_id) {
    (void)op;
    (void)handle_id;
  }

  // Number of tokens of the last successful `prepare` (host-side record),
  // -1 before the first. Used to reject shape mismatches.
  virtual int64_t prepared_num_tokens(const at::Tensor& handle_mem) = 0;
};

std::unique_ptr<Backend> make_reference_backend(const HandleConfig& cfg);

// NCCL EP's high-throughput kernels fetch routing rows and per-expert
// weights with 16-byte copies and assert (aborting the process) that
// max_tokens * top_k and num_experts are multiples of 4 entries.
constexpr int64_t kNcclEpExpertMultiple = 4;

// FP8 dispatch: one float32 scale per this many values of a row.
constexpr int64_t kFp8Block = 128;

// ---- the nccl_ep backend (nccl_ep_backend.cpp; stubs in builds without it,
// nccl_ep_private_ops.cpp) ---------------------------------------------------

// Throws a clear error when the package was built without CUDA or NCCL EP
// can't be loaded.
std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg);

// Opens libnccl_ep and NCCL (see nccl_ep_runtime.h); a one-line description.
std::string load_nccl_ep(const std::string& nccl_ep_lib, const std::string& nccl_lib);
bool nccl_ep_built();
// From interpreter exit on, destructors skip NCCL and CUDA calls.
void nccl_ep_mark_exiting();

// Drops the NCCL EP groups and the NCCL communicator that the nccl_ep backend
// created for the torch process group `group_name`. Groups that no handle uses
// are destroyed now; a group still used by a live handle is destroyed when
// its last handle is, and the communicator (with its windows) after its last
// group. Collective (ncclEpGroupDestroy, window deregistration and
// ncclCommDestroy are): call it on every rank of the group, from the group
// shutdown path, before the process group itself is destroyed. A no-op for
// groups the backend never saw, and in builds without NCCL EP.
void release_nccl_ep_group(const std::string& group_name);

}  // namespace te_ep
