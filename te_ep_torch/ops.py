"""Typed wrappers and fake kernels of the ``te_ep`` communication ops.

The ops themselves are declared in ``csrc/torch/library.cpp``; their contract
is ``docs/ops.md``. Fake kernels compute output shapes from the int
arguments alone, so ``torch.compile`` never needs the process group.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ._loader import load_library

load_library()

__all__ = [
    "create_handle",
    "destroy_handle",
    "live_handles",
    "handle_info",
    "combine_buffer",
    "worst_case_capacity",
    "prepare",
    "dispatch",
    "combine",
    "dispatch_bwd",
    "combine_bwd",
]


def create_handle(
    group_name: str,
    backend: str,
    num_experts: int,
    max_tokens_per_rank: int,
    top_k: int,
    hidden: int,
    capacity: int,
    alignment: int,
    dtype: torch.dtype,
    device: torch.device,
    nccl_ep_mode: str = "staged",
) -> Tuple[int, Tensor]:
    """Registers a per-layer handle; returns ``(handle_id, handle_mem)``."""
    return torch.ops.te_ep.create_handle(
        group_name, backend, num_experts, max_tokens_per_rank, top_k, hidden, capacity, alignment, dtype, device,
        nccl_ep_mode,
    )


def destroy_handle(handle_id: int) -> None:
    """Releases a handle; later use of its id is an error."""
    torch.ops.te_ep.destroy_handle(handle_id)


def live_handles() -> List[int]:
    """Ids of the handles alive in this process."""
    return list(torch.ops.te_ep.live_handles())


def handle_info(handle_id: int) -> Tuple[str, str, int, int]:
    """``(mode, mode_reason, window_bytes, handle_mem_bytes)`` of a live handle."""
    mode, reason, window_bytes, handle_mem_bytes = torch.ops.te_ep.handle_info(handle_id)
    return mode, reason, int(window_bytes), int(handle_mem_bytes)


def combine_buffer(handle_id: int) -> Optional[Tensor]:
    """The zero-copy combine window of a handle, ``None`` in the other modes."""
    return torch.ops.te_ep.combine_buffer(handle_id)


def worst_case_capacity(ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int,
                        alignment: int) -> int:
    """Receive rows that no routing can overflow (one formula, in csrc/common/routing.cpp)."""
    return int(torch.ops.te_ep.worst_case_capacity(ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment))


def prepare(
    topk_idx: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, num_local_experts: int
) -> Tuple[Tensor, Tensor]:
    """Exchanges routing; returns ``(expert_counts [E_local] int32, total [1] int32)``."""
    return torch.ops.te_ep.prepare(topk_idx, handle_mem, group_name, handle_id, num_local_experts)


def dispatch(
    tokens: Tensor, topk_weights: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, capacity: int
) -> Tuple[Tensor, Tensor]:
    """Sends tokens to experts; returns ``(recv_tokens [capacity, H], recv_weights [capacity])``."""
    return torch.ops.te_ep.dispatch(tokens, topk_weights, handle_mem, group_name, handle_id, capacity)


def combine(expert_out: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, num_tokens: int) -> Tensor:
    """Returns expert outputs to their tokens and sums them: ``[num_tokens, H]``."""
    return torch.ops.te_ep.combine(expert_out, handle_mem, group_name, handle_id, num_tokens)


def dispatch_bwd(
    grad_recv_tokens: Tensor,
    grad_recv_weights: Tensor,
    handle_mem: Tensor,
    group_name: str,
    handle_id: int,
    num_tokens: int,
    top_k: int,
) -> Tuple[Tensor, Tensor]:
    """Backward of dispatch: ``(grad_tokens [T, H], grad_topk_weights [T, K])``."""
    return torch.ops.te_ep.dispatch_bwd(
        grad_recv_tokens, grad_recv_weights, handle_mem, group_name, handle_id, num_tokens, top_k
    )


def combine_bwd(grad_out: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, capacity: int) -> Tensor:
    """Backward of combine: ``[capacity, H]``, each slot receiving its token's gradient."""
    return torch.ops.te_ep.combine_bwd(grad_out, handle_mem, group_name, handle_id, capacity)


def _misrouted(handle_mem: Tensor) -> bool:
    """True when real tensors reached a fake kernel.

    That happens when an argument is on the meta device: the dispatcher then
    picks the Meta kernel although the handle is real. Running the real kernel
    instead lets it reject the device mismatch on every rank.
    """
    return not is_fake(handle_mem) and handle_mem.device.type != "meta"


def _real_kernel(op, handle_mem: Tensor, *args):
    key = torch._C.DispatchKey.CUDA if handle_mem.is_cuda else torch._C.DispatchKey.CPU
    return op.default.redispatch(torch._C.DispatchKeySet(key), *args)


@torch.library.register_fake("te_ep::prepare")
def _prepare_fake(topk_idx, handle_mem, group_name, handle_id, num_local_experts):
    if _misrouted(handle_mem):
        return _real_kernel(torch.ops.te_ep.prepare, handle_mem, topk_idx, handle_mem, group_name, handle_id,
                            num_local_experts)
    torch._check(topk_idx.dim() == 2, lambda: f"te_ep.prepare: topk_idx must be 2-D, got {topk_idx.dim()}-D")
    counts = handle_mem.new_empty((num_local_experts,), dtype=torch.int32)
    total = handle_mem.new_empty((1,), dtype=torch.int32)
    return counts, total


@torch.library.register_fake("te_ep::dispatch")
def _dispatch_fake(tokens, topk_weights, handle_mem, group_name, handle_id, capacity):
    if _misrouted(handle_mem):
        return _real_kernel(torch.ops.te_ep.dispatch, handle_mem, tokens, topk_weights, handle_mem, group_name,
                            handle_id, capacity)
    torch._check(tokens.dim() == 2, lambda: f"te_ep.dispatch: tokens must be 2-D, got {tokens.dim()}-D")
    torch._check(
        topk_weights.dtype == torch.float32,
        lambda: f"te_ep.dispatch: topk_weights must be float32, got {topk_weights.dtype}",
    )
    recv = tokens.new_empty((capacity, tokens.shape[1]))
    weights = tokens.new_empty((capacity,), dtype=torch.float32)
    return recv, weights


@torch.library.register_fake("te_ep::combine")
def _combine_fake(expert_out, handle_mem, group_name, handle_id, num_tokens):
    if _misrouted(handle_mem):
        return _real_kernel(torch.ops.te_ep.combine, handle_mem, expert_out, handle_mem, group_name, handle_id,
                            num_tokens)
    torch._check(expert_out.dim() == 2, lambda: f"te_ep.combine: expert_out must be 2-D, got {expert_out.dim()}-D")
    return expert_out.new_empty((num_tokens, expert_out.shape[1]))


@torch.library.register_fake("te_ep::dispatch_bwd")
def _dispatch_bwd_fake(grad_recv_tokens, grad_recv_weights, handle_mem, group_name, handle_id, num_tokens, top_k):
    if _misrouted(handle_mem):
        return _real_kernel(torch.ops.te_ep.dispatch_bwd, handle_mem, grad_recv_tokens, grad_recv_weights,
                            handle_mem, group_name, handle_id, num_tokens, top_k)
    grad_tokens = grad_recv_tokens.new_empty((num_tokens, grad_recv_tokens.shape[1]))
    grad_weights = grad_recv_weights.new_empty((num_tokens, top_k))
    return grad_tokens, grad_weights


@torch.library.register_fake("te_ep::combine_bwd")
def _combine_bwd_fake(grad_out, handle_mem, group_name, handle_id, capacity):
    if _misrouted(handle_mem):
        return _real_kernel(torch.ops.te_ep.combine_bwd, handle_mem, grad_out, handle_mem, group_name, handle_id,
                            capacity)
    return grad_out.new_empty((capacity, grad_out.shape[1]))
