"""te_ep_torch: expert-parallel token dispatch and combine for PyTorch MoE training.

Quick start::

    import te_ep_torch as te
    group = te.EpGroup(num_experts=64, max_tokens_per_rank=4096)
    handle = group.create_handle(top_k=8, hidden=4096, dtype=torch.bfloat16, alignment=16)
    out = te.ep_dispatch(handle, tokens, topk_idx, topk_weights)
    y = te.ep_combine(handle, expert_fn(out.tokens, out.expert_counts) * out.weights[:, None], tokens.shape[0])
"""

from ._version import __version__
from . import ops
from .ops import (
    DispatchOutput,
    Fp8DispatchOutput,
    dequantize_fp8,
    ep_combine,
    ep_dispatch,
    ep_dispatch_fp8,
    quantize_fp8,
)
from .group import BACKENDS, CHECKS, DEFAULT_NCCL_EP_MODE, NCCL_EP_MODES, OVERFLOWS, EpGroup, EpHandle, HandleConfig
from . import autograd  # noqa: F401  (the compatibility module: te_ep_torch.autograd.ep_dispatch etc.)
from . import permutation
from . import capacity, moe, options, overlap, parallel, step, zones
from .options import EpOptions
from .step import EpStep
from .moe import GroupedExperts, MoE, RouterOutput, SwiGLU, TopKRouter
from .parallel import (
    ExpertParallel,
    apply_fsdp,
    ep_group_for,
    init_moe_mesh,
    load_checkpoint,
    parallelize_moe_model,
    save_checkpoint,
    shutdown_ep_groups,
)
from .permutation import (
    PermuteMap,
    permute,
    permute_exact,
    sort_chunks_by_index,
    sort_chunks_by_map,
    unpermute,
)

__all__ = [
    "__version__",
    "ops",
    "BACKENDS",
    "CHECKS",
    "OVERFLOWS",
    "NCCL_EP_MODES",
    "DEFAULT_NCCL_EP_MODE",
    "EpGroup",
    "EpHandle",
    "HandleConfig",
    "EpOptions",
    "EpStep",
    "capacity",
    "options",
    "step",
    "DispatchOutput",
    "ep_dispatch",
    "ep_combine",
    "Fp8DispatchOutput",
    "ep_dispatch_fp8",
    "quantize_fp8",
    "dequantize_fp8",
    "permutation",
    "PermuteMap",
    "permute",
    "permute_exact",
    "unpermute",
    "sort_chunks_by_index",
    "sort_chunks_by_map",
    "moe",
    "zones",
    "parallel",
    "overlap",
    "MoE",
    "TopKRouter",
    "RouterOutput",
    "GroupedExperts",
    "SwiGLU",
    "ExpertParallel",
    "apply_fsdp",
    "parallelize_moe_model",
    "init_moe_mesh",
    "save_checkpoint",
    "load_checkpoint",
    "ep_group_for",
    "shutdown_ep_groups",
]
