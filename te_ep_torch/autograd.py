"""Differentiable dispatch and combine over the ``te_ep`` ops.

The backward of dispatch is a combine of the gradient (plus the gradient of
``topk_weights``), the backward of combine is a dispatch of the gradient;
both call registered ops only, so they trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .group import EpHandle

__all__ = ["DispatchOutput", "ep_dispatch", "ep_combine"]


class DispatchOutput(NamedTuple):
    """What a grouped GEMM needs after dispatch.

    Attributes:
        tokens: ``[capacity, H]`` received tokens, expert-major zones, padding rows zero.
        weights: ``[capacity]`` float32 routing weight of each row, 0 on padding.
        expert_counts: ``[E_local]`` int32 rows per zone (padding included);
            ``expert_counts.cumsum(0)`` are the zone end offsets.
        total: ``[1]`` int32 rows in use.
    """

    tokens: Tensor
    weights: Tensor
    expert_counts: Tensor
    total: Tensor


def _check_generation(handle: EpHandle, generation: int, what: str) -> None:
    if handle.generation != generation:
        raise RuntimeError(
            f"te_ep: the backward of {what} ran after handle {handle.id} was prepared again; a handle holds only "
            "its latest routing, so give each call site its own handle (EpGroup.create_handle) or run backward "
            "before the next step of the same layer"
        )


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, topk_weights: Tensor, handle: EpHandle):
        recv, weights = ops.dispatch(
            tokens, topk_weights, handle.handle_mem, handle.group.group_name, handle.id, handle.config.capacity
        )
        ctx.handle = handle
        ctx.generation = handle.generation
        ctx.num_tokens = tokens.shape[0]
        ctx.save_for_backward(handle.handle_mem)
        return recv, weights

    @staticmethod
    def backward(ctx, grad_recv: Tensor, grad_weights: Tensor):
        handle: EpHandle = ctx.handle
        if not torch.compiler.is_compiling():
            _check_generation(handle, ctx.generation, "ep_dispatch")
        (handle_mem,) = ctx.saved_tensors
        grad_tokens, grad_topk_weights = ops.dispatch_bwd(
            grad_recv.contiguous(),
            grad_weights.contiguous(),
            handle_mem,
            handle.group.group_name,
            handle.id,
            ctx.num_tokens,
            handle.config.top_k,
        )
        return grad_tokens, grad_topk_weights, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out: Tensor, handle: EpHandle, num_tokens: int):
        out = ops.combine(expert_out, handle.handle_mem, handle.group.group_name, handle.id, num_tokens)
        ctx.handle = handle
        ctx.generation = handle.generation
        ctx.save_for_backward(handle.handle_mem)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        handle: EpHandle = ctx.handle
        if not torch.compiler.is_compiling():
            _check_generation(handle, ctx.generation, "ep_combine")
        (handle_mem,) = ctx.saved_tensors
        grad_expert_out = ops.combine_bwd(
            grad_out.contiguous(), handle_mem, handle.group.group_name, handle.id, handle.config.capacity
        )
        return grad_expert_out, None, None


def ep_dispatch(
    handle: EpHandle,
    tokens: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    prepared: Optional[Tuple[Tensor, Tensor]] = None,
) -> DispatchOutput:
    """Routes ``tokens [T, H]`` to their experts (collective; prepare + dispatch).

    Args:
        handle: the layer's handle.
        tokens: ``[T, H]`` in the handle's dtype, ``T <= max_tokens_per_rank``.
        topk_idx: ``[T, K]`` int64/int32 global expert ids, ``-1`` = dropped choice.
        topk_weights: ``[T, K]`` float32 routing weights (differentiable).
        prepared: the result of ``handle.prepare(topk_idx)`` when the caller started the
            routing exchange earlier (e.g. as soon as ``topk_idx`` was known); ``None``
            prepares here.

    Returns:
        :class:`DispatchOutput`; gradients flow back to ``tokens`` and ``topk_weights``.
    """
    counts, total = handle.prepare(topk_idx) if prepared is None else prepared
    recv, weights = _Dispatch.apply(tokens, topk_weights, handle)
    return DispatchOutput(recv, weights, counts, total)


def ep_combine(handle: EpHandle, expert_out: Tensor, num_tokens: int) -> Tensor:
    """Returns expert outputs ``[capacity, H]`` to their tokens and sums them (collective).

    The sum is unweighted: multiply by ``DispatchOutput.weights`` first.
    ``num_tokens`` is the ``T`` of the matching :func:`ep_dispatch`.
    """
    return _Combine.apply(expert_out, handle, num_tokens)
