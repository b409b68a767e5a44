// Backend interface shared by the op adapters (comm_ops.cpp) and the two
// backends: the torch.distributed reference backend and the NCCL EP backend.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "watchdog/core/watchdog.h"

namespace te_ep {

// How a handle catches bad routing, capacity overflow, bad op arguments and
// ranks on different handles (docs/ops.md, "Check modes"; the nccl_ep side
// lives in nccl_ep/nccl_ep_checks.h). The reference backend raises in the op
// on every rank whatever is asked.
enum class Checks { kLocal, kDevice, kSynchronous };
// "local", "device" or "synchronous"; nullopt for anything else.
std::optional<Checks> parse_checks(const std::string& name);
const char* checks_name(Checks checks);

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
  Checks checks = Checks::kLocal;
  // The handle's number among the handles created on its process group (from
  // 1): the same on every rank, since create_handle is collective. The ops
  // agree on it, so ranks running different handles raise instead of moving
  // mismatched data.
  int64_t seq = 0;

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

  // Collective, before every op: agrees on this rank's argument error of `op`
  // ("" if none) and on the op and handle each rank runs, as the handle's
  // check mode says. Throws where the error is raised in the op; returns true
  // when this rank must run the op on substitutes (zero rows of the prepared
  // shapes) so that the other ranks' collectives complete.
  virtual bool agree_on_arguments(const char* op, const std::string& local_error) = 0;

  // Checks the values of `topk_idx` where the backend can do so without a
  // device sync; returns the error message or "".
  virtual std::string validate_routing(const at::Tensor& topk_idx) { return ""; }

  virtual std::tuple<at::Tensor, at::Tensor> prepare(const at::Tensor& topk_idx, at::Tensor& handle_mem) = 0;
  virtual std::tuple<at::Tensor, at::Tensor> dispatch(
      const at::Tensor& tokens, const at::Tensor& topk_weights, const at::Tensor& handle_mem) = 0;
  // prepare, then dispatch of the routing it prepared: the op prepare_dispatch
  // in the local check mode (comm_ops.cpp), where neither half agrees with
  // the other ranks. Returns (recv_tokens, recv_weights, expert_counts,
  // total). A backend may launch the two halves' work in a better order.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch(
      const at::Tensor& topk_idx, const at::Tensor& tokens, const at::Tensor& topk_weights, at::Tensor& handle_mem) {
    auto [expert_counts, total] = prepare(topk_idx, handle_mem);
    auto [recv_tokens, recv_weights] = dispatch(tokens, topk_weights, handle_mem);
    return {recv_tokens, recv_weights, expert_counts, total};
  }
  // values [T, H] e4m3 and scales [T, H / 128] f32 -> the same rows in the
  // expert-major layout of dispatch (padding rows: zero bytes), plus weights.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_fp8(
      const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      const at::Tensor& handle_mem) = 0;
  // prepare, then dispatch_fp8, as prepare_dispatch is for dispatch (the op
  // prepare_dispatch_fp8). Returns (recv_values, recv_scales, recv_weights,
  // expert_counts, total).
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prepare_dispatch_fp8(
      const at::Tensor& topk_idx, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& topk_weights,
      at::Tensor& handle_mem) {
    auto [expert_counts, total] = prepare(topk_idx, handle_mem);
    auto [recv_values, recv_scales, recv_weights] = dispatch_fp8(values, scales, topk_weights, handle_mem);
    return {recv_values, recv_scales, recv_weights, expert_counts, total};
  }
  virtual at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& handle_mem, int64_t num_tokens) = 0;
  virtual std::tuple<at::Tensor, at::Tensor> dispatch_bwd(
      const at::Tensor& grad_recv_tokens, const at::Tensor& grad_recv_weights, const at::Tensor& handle_mem,
      int64_t num_tokens) = 0;
  virtual at::Tensor combine_bwd(const at::Tensor& grad_out, const at::Tensor& handle_mem) = 0;

  virtual Checks checks() const { return Checks::kSynchronous; }
  // EpHandle.check(): raises an error an earlier step recorded and no op has
  // raised yet (waits for the GPU); a no-op where errors are raised in the op.
  virtual void raise_pending_errors() {}
  // Called when the host enters op `op` of `handle_id`, before anything in it
  // can wait: the nccl_ep backend registers the op with the watchdog
  // (csrc/watchdog/core/watchdog.h), whose limit then covers every wait inside the
  // op (agreements, NCCL EP's host calls, CUDA calls) and, through
  // `watch_launched`, the GPU work it queued, whose kernels would otherwise
  // wait for a lost rank forever. nullptr where the transport has its own
  // time limit (the reference backend's torch collectives).
  virtual std::unique_ptr<watchdog::Op> watch(const char* op, int64_t handle_id) {
    (void)op;
    (void)handle_id;
    return nullptr;
  }
  // Called when op `op` (from `watch`) has queued its GPU work.
  virtual void watch_launched(watchdog::Op& op) { (void)op; }

  // Number of tokens of the last successful `prepare` (host-side record),
  // -1 before the first. Used to reject shape mismatches.
  virtual int64_t prepared_num_tokens(const at::Tensor& handle_mem) = 0;
};

std::unique_ptr<Backend> make_reference_backend(const HandleConfig& cfg);

// The watchdog's record of op `op` on handle `handle_id` (-1: the handle being
// created) of a handle with config `cfg`, entered now (csrc/watchdog/core/watchdog.h).
// The one place that names a watched op ("te_ep.dispatch on handle 3 of group
// 'ep' (rank 1 of 2)") and picks its limit: the handle's timeout (EpGroup
// passes the process group's), else torch's default process-group timeout.
// nullptr under TE_EP_WATCHDOG=off. (comm_ops.cpp)
std::unique_ptr<watchdog::Op> enter_watched_op(const HandleConfig& cfg, const char* op, int64_t handle_id);

// enter_watched_op for the ops a handle runs on every step: each op's name is
// built on its first call and shared by the later ones (comm_ops.cpp).
class WatchedOps {
 public:
  std::unique_ptr<watchdog::Op> enter(const HandleConfig& cfg, const char* op, int64_t handle_id);

 private:
  struct Name {
    std::string op;
    int64_t handle_id;
    std::shared_ptr<const std::string> text;
  };
  std::mutex mutex_;
  std::vector<Name> names_;
};

// ---- agreement on the host (agreement.cpp), over the handle's process group -----
// Every rank's `local` message, in rank order (truncated to 1023 bytes).
// Collective on any process group: a sum all-reduce of int32 rows that only
// their owner fills.
std::vector<std::string> gather_messages(const HandleConfig& cfg, const std::string& local);
// Collective: every rank passes its argument error of `op` ("" if none); the
// op and the handle each rank runs are folded into the same exchange. If a
// rank has an error, or the ranks run different ops or handles, every rank
// throws, naming the ranks and what each ran.
void agree_on_host(const HandleConfig& cfg, const std::string& op, const std::string& local_error);

// NCCL EP's high-throughput kernels fetch routing rows and per-expert
// weights with 16-byte copies and assert (aborting the process) that
// max_tokens * top_k and num_experts are multiples of 4 entries.
constexpr int64_t kNcclEpExpertMultiple = 4;

// The least capacity the nccl_ep backend takes, and the send budget it gives NCCL
// EP: max_tokens_per_rank rounded up to a multiple of kNcclEpExpertMultiple, so
// that max_tokens * top_k is a multiple of 4 entries for every top_k (NCCL EP's
// receive budget may not be below its send budget). A rank still passes at most
// max_tokens_per_rank tokens; the extra rows are never used. Python asks it
// through te_ep._nccl_ep_capacity_floor.
constexpr int64_t nccl_ep_capacity_floor(int64_t max_tokens_per_rank) {
  return (max_tokens_per_rank + kNcclEpExpertMultiple - 1) / kNcclEpExpertMultiple * kNcclEpExpertMultiple;
}

// FP8 dispatch: one float32 scale per this many values of a row.
constexpr int64_t kFp8Block = 128;

// ---- the nccl_ep backend (csrc/nccl_ep/; stubs in builds without it,
// nccl_ep/nccl_ep_private_ops.cpp) -------------------------------------------

// Throws a clear error when the package was built without CUDA or NCCL EP
// can't be loaded.
std::unique_ptr<Backend> make_nccl_ep_backend(const HandleConfig& cfg);

// Opens libnccl_ep and NCCL (see nccl_ep/core/nccl_ep_runtime.h); a one-line
// description.
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
