// The one schema block of the te_ep library. Every op of the package is
// declared here; implementations register per dispatch key in the *_ops.cpp
// files of the family folders (csrc/README.md). Schemas are a public
// contract (docs/ops.md): change them only with a version bump and a note in
// the changelog.
#include <torch/library.h>

TORCH_LIBRARY(te_ep, m) {
  // ---- handle management (eager, host side; never traced) -----------------
  // Registers a per-layer handle and returns its id and the device buffer
  // that holds the routing state written by `prepare`.
  m.def(
      "create_handle(str group_name, str backend, int num_experts, int max_tokens_per_rank, "
      "int top_k, int hidden, int capacity, int alignment, ScalarType dtype, Device device, "
      "str nccl_ep_mode=\"staged\", ScalarType? dispatch_dtype=None, int timeout_ms=0, "
      "str checks=\"local\") -> (int, Tensor)");
  // The first rule create_handle's arguments break ("" if none), without creating anything.
  m.def(
      "_handle_config_error(str group_name, str backend, int num_experts, int max_tokens_per_rank, "
      "int top_k, int hidden, int capacity, int alignment, ScalarType dtype, Device device, "
      "str nccl_ep_mode=\"staged\", ScalarType? dispatch_dtype=None, int timeout_ms=0, "
      "str checks=\"local\") -> str");
  m.def("destroy_handle(int handle_id) -> ()");
  m.def("live_handles() -> int[]");
  // How a handle moves tokens ("reference", "staged", "zero_copy"), why, and
  // the device bytes it holds: communication windows and handle memory.
  m.def("handle_info(int handle_id) -> (str mode, str mode_reason, int window_bytes, int handle_mem_bytes)");
  // How the handle catches bad input ("local", "device" or "synchronous", as
  // create_handle's `checks`; "synchronous" on the reference backend whatever
  // was asked: docs/ops.md, "Check modes"), and raise an error an earlier step
  // recorded that no op has raised yet (waits for the GPU).
  m.def("check_mode(int handle_id) -> str");
  m.def("check_handle(int handle_id) -> ()");
  // Zero-copy mode: the [capacity, hidden] window combine reads from; None otherwise.
  m.def("combine_buffer(int handle_id) -> Tensor?");
  // Receive rows no routing can exceed (the default capacity).
  m.def("worst_case_capacity(int ep_size, int max_tokens_per_rank, int top_k, int num_local_experts, "
        "int alignment) -> int");

  // ---- expert-parallel communication ---------------------------------------
  // handle_key (added in 0.3.0): None, or a CPU int64 tensor of one element
  // holding the handle's id (EpHandle.key), with handle_id -1. torch.compile
  // passes it so that one graph serves every layer's handle (docs/ops.md).
  m.def(
      "prepare(Tensor topk_idx, Tensor(a!) handle_mem, str group_name, int handle_id, "
      "int num_local_experts, Tensor? handle_key=None) -> (Tensor expert_counts, Tensor total)");
  m.def(
      "dispatch(Tensor tokens, Tensor topk_weights, Tensor handle_mem, str group_name, "
      "int handle_id, int capacity, Tensor? handle_key=None) -> (Tensor recv_tokens, Tensor recv_weights)");
  // prepare, then dispatch of the routing it prepared, in one call (added in
  // 0.3.0): ep_dispatch without a prepared routing calls it. Under
  // checks="local" it runs as one op (on nccl_ep with fewer launches);
  // otherwise as prepare then dispatch, each agreed as on its own.
  m.def(
      "prepare_dispatch(Tensor tokens, Tensor topk_idx, Tensor topk_weights, Tensor(a!) handle_mem, str group_name, "
      "int handle_id, int num_local_experts, int capacity, Tensor? handle_key=None) "
      "-> (Tensor recv_tokens, Tensor recv_weights, Tensor expert_counts, Tensor total)");
  // FP8 dispatch (handles created with dispatch_dtype=float8_e4m3fn): e4m3
  // values [T, H] and their float32 scales [T, H / 128] move as bytes into
  // the same expert-major rows; padding rows hold zero values and scale 0.
  m.def(
      "dispatch_fp8(Tensor values, Tensor scales, Tensor topk_weights, Tensor handle_mem, str group_name, "
      "int handle_id, int capacity, Tensor? handle_key=None) -> (Tensor recv_values, Tensor recv_scales, Tensor recv_weights)");
  // prepare, then dispatch_fp8 of the routing it prepared (added in 0.3.0):
  // ep_dispatch_fp8 without a prepared routing calls it, as prepare_dispatch
  // is called for a bfloat16 dispatch.
  m.def(
      "prepare_dispatch_fp8(Tensor values, Tensor scales, Tensor topk_idx, Tensor topk_weights, "
      "Tensor(a!) handle_mem, str group_name, int handle_id, int num_local_experts, int capacity, "
      "Tensor? handle_key=None) -> (Tensor recv_values, Tensor recv_scales, Tensor recv_weights, "
      "Tensor expert_counts, Tensor total)");
  m.def(
      "combine(Tensor expert_out, Tensor handle_mem, str group_name, int handle_id, "
      "int num_tokens, Tensor? handle_key=None) -> Tensor");
  m.def(
      "dispatch_bwd(Tensor grad_recv_tokens, Tensor grad_recv_weights, Tensor handle_mem, "
      "str group_name, int handle_id, int num_tokens, int top_k, Tensor? handle_key=None) "
      "-> (Tensor grad_tokens, Tensor grad_topk_weights)");
  m.def(
      "combine_bwd(Tensor grad_out, Tensor handle_mem, str group_name, int handle_id, "
      "int capacity, Tensor? handle_key=None) -> Tensor");

  // ---- block-scaled FP8 (local; csrc/fp8/core/fp8.h states the rules) ----
  // x [T, H] bfloat16/float16/float32, H a multiple of 128 -> values [T, H]
  // float8_e4m3fn and scales [T, H / 128] float32, x ~= values * scale.
  m.def("quantize_fp8(Tensor x, bool pow2_scales=False) -> (Tensor values, Tensor scales)");
  m.def("dequantize_fp8(Tensor values, Tensor scales, ScalarType dtype) -> Tensor");

  // ---- zone ops (local): the glue between dispatch and combine --------------
  // Row-wise work on an expert-major buffer bounded by the rows in use
  // (counts [E_local] int32 zone sizes summed on the device); rows past them
  // are not written (docs/ops.md, "Zone ops"). Added in 0.3.0.
  // h = gate(g, u) [rows, F]: gate "swiglu" (silu(g) * u) or
  // "clamped_swiglu" (gpt-oss: alpha, limit). g and u are the halves of
  // gate_up [rows, 2F], its interleaved columns, or gate_up [rows, F] and up.
  // The backward returns the gradient of gate_up and that of up ([0] without up).
  m.def(
      "zone_glu(Tensor gate_up, Tensor counts, str gate=\"swiglu\", bool interleaved=False, float alpha=1.0, "
      "float limit=0.0, Tensor? up=None) -> Tensor");
  m.def(
      "zone_glu_bwd(Tensor grad_h, Tensor gate_up, Tensor counts, str gate=\"swiglu\", bool interleaved=False, "
      "float alpha=1.0, float limit=0.0, Tensor? up=None) -> (Tensor grad_gate_up, Tensor grad_up)");
  // y [rows, N] + bias [E_local, N] of each row's zone; its backward's bias gradient.
  m.def("zone_bias(Tensor y, Tensor bias, Tensor counts) -> Tensor");
  m.def("zone_bias_bwd(Tensor grad, Tensor counts) -> Tensor");
  // a + b on the rows in use: the gradient of a tensor two ops read; _into writes it
  // into `out` (a combine window, which dispatch_bwd then reads in place).
  m.def("zone_add(Tensor a, Tensor b, Tensor counts) -> Tensor");
  m.def("zone_add_into(Tensor a, Tensor b, Tensor counts, Tensor(a!) out) -> ()");
  // y * weights[:, None] in float32, rounded to y's dtype (the routing-score
  // weighting before combine); _into writes it into `out` (a combine window).
  m.def("zone_scale(Tensor y, Tensor weights, Tensor counts) -> Tensor");
  m.def("zone_scale_into(Tensor y, Tensor weights, Tensor counts, Tensor(a!) out) -> ()");
  m.def("zone_scale_bwd(Tensor grad, Tensor y, Tensor weights, Tensor counts) -> (Tensor grad_y, Tensor grad_weights)");

  // ---- permutation (local, no communication) --------------------------------
  // BEGIN permutation schemas
  // Expert-major permutation of tokens [T, H] by routing (int [T, K] expert
  // ids with -1 = dropped, or a bool [T, E] routing map) into `capacity` rows.
  // Outputs: the rows, the probabilities moved alongside ([capacity], or [0]
  // without probs), row_id_map [T, C] (row of each choice, -1 = none),
  // src_slot [capacity] (choice t * C + c owning each row, -1 = zero row),
  // expert_counts [E] (zone sizes with padding, clipped to capacity) and
  // required_rows [1] int64 (rows the routing needs; > capacity = overflow).
  m.def(
      "permute(Tensor tokens, Tensor routing, Tensor? probs, int num_experts, SymInt capacity, int alignment) "
      "-> (Tensor output, Tensor permuted_probs, Tensor row_id_map, Tensor src_slot, Tensor expert_counts, "
      "Tensor required_rows)");
  m.def(
      "permute_bwd(Tensor row_id_map, Tensor? grad_output, Tensor? grad_permuted_probs) "
      "-> (Tensor grad_tokens, Tensor grad_probs)");
  // Token order again: out[t] = sum_c merging_probs[t, c] * input[row_id_map[t, c]].
  m.def("unpermute(Tensor input, Tensor row_id_map, Tensor src_slot, Tensor? merging_probs) -> Tensor");
  // grad_merging_probs is computed only when `input` (the forward input) is given.
  m.def(
      "unpermute_bwd(Tensor grad_output, Tensor row_id_map, Tensor src_slot, Tensor? merging_probs, "
      "Tensor? input) -> (Tensor grad_input, Tensor grad_merging_probs)");
  // Reorders chunks of rows; row_map [2, N] holds the forward and inverse row maps.
  m.def(
      "sort_chunks_by_index(Tensor input, Tensor split_sizes, Tensor sorted_index, Tensor? probs) "
      "-> (Tensor output, Tensor permuted_probs, Tensor row_map)");
  m.def(
      "sort_chunks_by_map(Tensor input, Tensor row_map, Tensor? probs, bool inverse) "
      "-> (Tensor output, Tensor permuted_probs)");
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
  // num_experts must be a multiple of this on nccl_ep.
  m.def("_nccl_ep_expert_multiple() -> int");
  // The least capacity nccl_ep takes for a max_tokens_per_rank (comm/backend.h).
  m.def("_nccl_ep_capacity_floor(int max_tokens_per_rank) -> int");
  // The watchdog of the nccl_ep ops (csrc/watchdog/core/watchdog.h): its action
  // (TE_EP_WATCHDOG: "exit", "warn", "off"), ops and markers pending now and
  // how often it fired in this process.
  m.def("_watchdog_state() -> (str action, int pending, int fired)");
  // Tests only: holds the host `seconds` inside a watched op `op` of a handle.
  m.def("_watchdog_test_hold(int handle_id, str op, float seconds) -> ()");
  // END nccl_ep schemas
}
