"""Multi-rank test bodies for te_ep dispatch / combine, shared by every launcher.

Each case is a module-level function ``case_x(ctx, *args)`` run on every rank of a
group (``ctx`` is a `Ctx`: rank, world_size, device, backend). It raises
(AssertionError / RuntimeError) on failure and returns nothing useful. No pytest
here: tests/test_ep_cases.py runs the bodies listed in `CASES` through the suite's
launcher (tests/_dist.py), on CPU (gloo, backend "reference") and on GPUs (NCCL, backend
"reference", and "nccl_ep" in each mode and check mode).

How correctness is established (docs/ops.md is the contract):
* Dispatch is checked exactly: every token row is a fingerprint of (source rank,
  token index) made of small integers that bf16/fp16/fp32 all represent exactly,
  so each receive row tells where it came from. Each rank rebuilds every rank's
  inputs from (seed, rank), computes the expected expert-major layout by itself
  and compares zones, order within a zone (reference backend: source rank, then
  token index; other backends: same rows, any order), weights, padding, counts
  and total.
* Combine and both backward ops are checked exactly too, by scaling each zone by
  a power of two (exact in every dtype) and summing at most 8 such terms, which
  float32 accumulation does without rounding; the result is rounded to the
  token dtype once, exactly like the expected value.
* The full MoE step (dispatch -> per-expert linear -> weighted combine, forward
  and backward) is compared against a dense single-process float64 reference
  with the per-dtype tolerances in `TOLERANCES`.

Sizes: a case that runs on nccl_ep uses sizes it accepts at any world size
(docs/ops.md, last table), so ``experts_per_rank`` is a multiple of 4; sizes only the
reference backend takes live in cases marked `Case.reference_only`.

Modules: `common` (config, routing, fingerprints, expected layout), `exact`, `dense`,
`errors`, `lifecycle`, `compile_graphs`, `lifetime`, `fp8`; and two bodies outside `CASES`
that tests/test_ep_cases.py runs on their own: `raw_ops` (the ops driven directly, without
EpGroup, against a torch reference) and `soak` (many training steps: no memory growth, no
hang).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .common import Step
from .compile_graphs import (
    case_backend_agreement,
    case_compile,
    case_compile_many_layers,
    case_cuda_graph,
    case_opcheck,
)
from .dense import MOE_LAYERS, case_moe_dense
from .errors import (
    BAD_INPUTS,
    case_bad_inputs,
    case_capacity_overflow,
    case_check_modes,
    case_config_errors,
    case_config_mismatch,
    case_destroyed_handle,
    case_destroyed_handle_one_rank,
    case_device_checks,
    case_device_checks_arguments,
    case_device_checks_op_arguments,
    case_routing_guard,
    case_handle_mismatch,
    case_nccl_ep_topology,
    case_dispatch_before_prepare,
    case_stale_backward,
)
from .exact import (
    ALIGNMENT_STEPS,
    ANY_EXPERTS_STEPS,
    CAPACITY_STEPS,
    ROUTING_STEPS,
    case_exact_steps,
    case_no_grad_path,
    case_two_layers_raw,
)
from .fp8 import (
    FP8_STEPS,
    case_fp8_dispatch_exact,
    case_fp8_dispatch_grads,
    case_fp8_errors,
    case_fp8_tokens_dtype_one_rank,
)
from .lifecycle import (case_capacity_factor, case_capacity_for, case_group_api, case_overflow_drop, case_shutdown_reinit,
                        case_subgroups)
from .lifetime import (
    case_handle_mode_and_memory,
    case_lifetime_checkpoint,
    case_lifetime_expert_out_after_combine,
    case_lifetime_microbatches,
    case_lifetime_recv_overwritten,
)

__all__ = ["CASES", "Case"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    args: tuple = ()
    world_sizes: tuple = (2, 4)  # where the CPU suite runs it (on GPUs it runs at each --world-size that fits)
    min_world: int = 2
    only_non_reference: bool = False  # needs a backend other than "reference"
    timeout: float = 60.0
    # Expects every rank to raise in the op when one rank's input is bad: the nccl_ep
    # backend does so only with checks='synchronous' (docs/ops.md, "Check modes").
    needs_agreement: bool = False
    # Non-empty: why only the reference backend runs the case.
    reference_only: str = ""
    # Its checks hold at one rank (one GPU, where the faulty rank is the only rank): it proves
    # that rank's side, not agreement across ranks. The others need a second rank by
    # construction (a value that differs on the last rank, 8 experts for a top-8 step, a tight
    # capacity below NCCL EP's floor, ...).
    one_rank: bool = False
    # In the quick GPU selection (pytest -m "gpu and quick"): every path once, bf16 and FP8,
    # eager, compiled and CUDA graph, and their errors.
    quick: bool = False


_BAD_NAMES = sorted(BAD_INPUTS)

CASES = [
    Case("group_api", case_group_api),
    Case("routing_exact", case_exact_steps, (ROUTING_STEPS,), timeout=120, quick=True),
    Case("routing_exact_any_num_experts", case_exact_steps, (ANY_EXPERTS_STEPS,), timeout=120,
         reference_only="num_experts that are not multiples of 4, which nccl_ep refuses (docs/ops.md)"),
    Case("alignment_exact", case_exact_steps, (ALIGNMENT_STEPS,), timeout=120, one_rank=True),
    Case("capacity_exact", case_exact_steps, (CAPACITY_STEPS,)),
    *[Case(f"moe_dense_{k}", case_moe_dense, (v,)) for k, v in MOE_LAYERS.items()],
    Case("two_layers_raw_ops", case_two_layers_raw, one_rank=True),
    Case("no_grad_path", case_no_grad_path, world_sizes=(3,), one_rank=True),
    # one case per bad input: a library failure on one (a crash, a hang) must not hide the others
    *[Case(f"bad_input_{n}", case_bad_inputs, ([n],), needs_agreement=True, quick=n == "tokens_dtype")
      for n in _BAD_NAMES],
    Case("bad_inputs_in_a_row", case_bad_inputs, (["weights_bf16", "expert_id_too_large", "combine_num_tokens",
                                                   "hidden_mismatch"],), needs_agreement=True),
    Case("capacity_overflow", case_capacity_overflow, needs_agreement=True, quick=True),
    Case("check_modes", case_check_modes, timeout=120, one_rank=True, quick=True),
    Case("handle_mismatch", case_handle_mismatch),
    Case("nccl_ep_topology", case_nccl_ep_topology, world_sizes=(4,), min_world=4),
    Case("destroyed_handle", case_destroyed_handle),
    Case("destroyed_handle_one_rank", case_destroyed_handle_one_rank,
         reference_only="error agreement for a handle destroyed on some ranks only is a reference-backend feature"),
    Case("dispatch_before_prepare", case_dispatch_before_prepare),
    Case("config_errors", case_config_errors),
    Case("config_mismatch", case_config_mismatch),
    Case("stale_backward", case_stale_backward),
    Case("shutdown_reinit", case_shutdown_reinit),
    Case("capacity_for", case_capacity_for),
    Case("capacity_factor", case_capacity_factor, world_sizes=(2,)),
    Case("overflow_drop", case_overflow_drop),
    Case("subgroups", case_subgroups),
    Case("opcheck", case_opcheck, (0,), timeout=120, one_rank=True),
    Case("opcheck_empty_rank", case_opcheck, (1,), timeout=120, one_rank=True),
    Case("compile_aot_eager", case_compile, ("aot_eager",), world_sizes=(2,), timeout=300, one_rank=True),
    Case("compile_inductor", case_compile, ("inductor",), world_sizes=(2,), timeout=600),
    Case("compile_many_layers", case_compile_many_layers, ("aot_eager",), world_sizes=(2,), timeout=300,
         one_rank=True),
    Case("handle_mode_and_memory", case_handle_mode_and_memory, one_rank=True),
    Case("fp8_dispatch_exact", case_fp8_dispatch_exact, (FP8_STEPS,), timeout=120, one_rank=True, quick=True),
    Case("fp8_dispatch_exact_pow2", case_fp8_dispatch_exact, (FP8_STEPS[:2], True), timeout=120, quick=True),
    Case("fp8_dispatch_grads", case_fp8_dispatch_grads, (Step(hidden=512, top_k=2, drop=0.2),), one_rank=True),
    Case("fp8_errors", case_fp8_errors, needs_agreement=True),
    Case("fp8_tokens_dtype_one_rank", case_fp8_tokens_dtype_one_rank, needs_agreement=True),
    Case("lifetime_microbatches", case_lifetime_microbatches, one_rank=True),
    Case("lifetime_checkpoint", case_lifetime_checkpoint, one_rank=True),
    Case("lifetime_expert_out_after_combine", case_lifetime_expert_out_after_combine),
    Case("lifetime_recv_overwritten", case_lifetime_recv_overwritten),
    # nothing may assume <= 4 ranks
    Case("smoke_8_ranks", case_exact_steps, ([ROUTING_STEPS[0], ROUTING_STEPS[3], ALIGNMENT_STEPS[-1]],),
         world_sizes=(8,), min_world=8, timeout=120),
    Case("smoke_8_ranks_moe", case_moe_dense, (MOE_LAYERS["two_layers"],), world_sizes=(8,), min_world=8,
         timeout=120),
    Case("cuda_graph", case_cuda_graph, world_sizes=(), only_non_reference=True, timeout=180, one_rank=True,
         quick=True),
    Case("device_checks", case_device_checks, world_sizes=(), only_non_reference=True, timeout=180, one_rank=True),
    Case("device_checks_arguments", case_device_checks_arguments, world_sizes=(), only_non_reference=True,
         timeout=180, one_rank=True),
    Case("device_checks_op_arguments", case_device_checks_op_arguments, world_sizes=(), only_non_reference=True,
         timeout=180, one_rank=True, quick=True),
    Case("routing_guard", case_routing_guard, world_sizes=(), only_non_reference=True, timeout=180, one_rank=True),
    Case("backend_agreement", case_backend_agreement,
         ([Step(top_k=2, hidden=64, dtype="bf16"), Step(top_k=4, hidden=32, dtype="fp32", alignment=16,
                                                         drop=0.2, tokens=(13, 0, 7))],),
         world_sizes=(), only_non_reference=True),
]
