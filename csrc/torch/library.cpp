// The one schema block of the te_ep library. Every op of the package is
// declared here; implementations register per dispatch key in the other
// files of csrc/torch/. Schemas are a public contract (docs/ops.md): change
// them only with a version bump and a note in the changelog.
#include <torch/library.h>

TORCH_LIBRARY(te_ep, m) {
  // ---- handle management (eager, host side; never traced) -----------------
  // Registers a per-layer handle and returns its id and the device buffer
  // that holds the routing state written by `prepare`.
  m.def(
      "create_handle(str group_name, str backend, int num_experts, int max_tokens_per_rank, "
      "int top_k, int hidden, int capacity, int alignment, ScalarType dtype, Device device) "
      "-> (int, Tensor)");
  m.def("destroy_handle(int handle_id) -> ()");
  m.def("live_handles() -> int[]");

  // ---- expert-parallel communication ---------------------------------------
  m.def(
      "prepare(Tensor topk_idx, Tensor(a!) handle_mem, str group_name, int handle_id, "
      "int num_local_experts) -> (Tensor expert_counts, Tensor total)");
  m.def(
      "dispatch(Tensor tokens, Tensor topk_weights, Tensor handle_mem, str group_name, "
      "int handle_id, int capacity) -> (Tensor recv_tokens, Tensor recv_weights)");
  m.def(
      "combine(Tensor expert_out, Tensor handle_mem, str group_name, int handle_id, "
      "int num_tokens) -> Tensor");
  m.def(
      "dispatch_bwd(Tensor grad_recv_tokens, Tensor grad_recv_weights, Tensor handle_mem, "
      "str group_name, int handle_id, int num_tokens, int top_k) "
      "-> (Tensor grad_tokens, Tensor grad_topk_weights)");
  m.def(
      "combine_bwd(Tensor grad_out, Tensor handle_mem, str group_name, int handle_id, "
      "int capacity) -> Tensor");

  // ---- permutation (local, no communication) --------------------------------
  // BEGIN permutation schemas
  // END permutation schemas

  // ---- nccl_ep backend plumbing (private; te_ep_torch._nccl_ep calls them) --
  // BEGIN nccl_ep schemas
  // Opens libnccl_ep (absolute path) and, if torch has not loaded one, the
  // given libnccl.so.2; checks versions; returns a one-line description.
  m.def("_nccl_ep_load(str nccl_ep_lib, str nccl_lib) -> str");
  // Whether this build contains the nccl_ep backend.
  m.def("_nccl_ep_built() -> bool");
  // Called at interpreter exit: later destructors skip NCCL and CUDA calls.
  m.def("_nccl_ep_at_exit() -> ()");
  // Collective: drops the NCCL EP groups and communicator of a torch group.
  m.def("_nccl_ep_release_group(str group_name) -> ()");
  // END nccl_ep schemas
}
