"""Token permutation for MoE layers: tokens to an expert-major buffer and back.

``permute`` moves each routed (token, expert) choice to a row of a buffer whose
rows are grouped by expert (the layout a grouped GEMM consumes), ``unpermute``
sums the expert outputs back into token order, and ``sort_chunks_by_index``
reorders chunks of rows (e.g. rank-major to expert-major after an
all-to-all). All three are ``torch.ops.te_ep`` ops with CPU and CUDA kernels,
fake kernels for ``torch.compile``, autograd formulas and DTensor sharding
rules; docs/permutation.md is the contract.

This module is the Python API (defaults, argument checks, :class:`PermuteMap`).
The ops' fake kernels and autograd formulas are in :mod:`te_ep_torch.ops.permute`
(the permutation family of :mod:`te_ep_torch.ops`), the DTensor rules in
``_dtensor_rules.py``; importing this module registers all of them.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

# Registrations of the permutation ops: fake kernels and autograd formulas (ops.permute;
# importing it loads the op library) and DTensor rules.
from . import _dtensor_rules  # noqa: F401
from .ops import permute as _permute_registrations  # noqa: F401
from ._loader import load_library  # noqa: F401  (importable from here before the split)

__all__ = [
    "PermuteMap",
    "permute",
    "permute_exact",
    "unpermute",
    "sort_chunks_by_index",
    "sort_chunks_by_map",
    "permute_capacity",
    "worst_case_capacity",  # deprecated alias of permute_capacity (removed in 0.4)
]


class PermuteMap(NamedTuple):
    """What ``permute`` records to undo itself (see docs/permutation.md).

    Attributes:
        row_id_map: ``[T, C] int32``, the output row of choice ``(t, c)``; -1 when the
            choice was dropped, not routed, or did not fit in ``capacity``.
        src_slot: ``[capacity] int32``, the choice ``t * C + c`` that owns each row;
            -1 on alignment padding and unused rows (which are zero).
        expert_counts: ``[E] int32``, rows of each expert's zone including alignment
            padding, clipped to ``capacity``; ``expert_counts.cumsum(0)`` is the
            ``offs`` of a grouped GEMM.
        required_rows: ``[1] int64``, rows the routing needs. More than ``capacity``
            means rows were dropped (the CUDA kernels never sync to raise).
    """

    row_id_map: Tensor
    src_slot: Tensor
    expert_counts: Tensor
    required_rows: Tensor


def permute_capacity(num_tokens: int, num_choices: int, num_experts: int, alignment: int = 1) -> int:
    """Rows ``permute`` can need for ``num_tokens`` tokens with ``num_choices`` choices each
    (its default ``capacity``, which no routing overflows).

    Every choice may take a row, and each expert that receives rows pads its zone by
    at most ``alignment - 1`` rows. Shape-only (no data), so it is safe under
    ``torch.compile``. Not the EP receive rows of a rank
    (:func:`te_ep_torch.ops.worst_case_capacity`, ``EpGroup.worst_case_capacity``).
    """
    slots = num_tokens * num_choices
    return slots + min(num_experts, slots) * (alignment - 1)


def worst_case_capacity(num_tokens: int, num_choices: int, num_experts: int, alignment: int = 1) -> int:
    """Deprecated (``FutureWarning``; removed in 0.4): :func:`permute_capacity`, renamed so
    that ``worst_case_capacity`` names one rule, the EP receive rows
    (:func:`te_ep_torch.ops.worst_case_capacity`)."""
    warnings.warn("te_ep_torch.permutation.worst_case_capacity is deprecated and will be removed in 0.4: use "
                  "te_ep_torch.permutation.permute_capacity (same arguments and result; "
                  "te_ep_torch.ops.worst_case_capacity is the EP receive rows, another rule)",
                  FutureWarning, stacklevel=2)
    return permute_capacity(num_tokens, num_choices, num_experts, alignment)


def _is_dtensor(t: object) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_num_tokens(tokens: Tensor) -> int:
    """Token rows each shard holds at most, so every rank picks the same capacity."""
    if not _is_dtensor(tokens):
        return tokens.shape[0]
    from torch.distributed.tensor import Shard

    shards = math.prod(
        tokens.device_mesh.size(d) for d, p in enumerate(tokens.placements) if isinstance(p, Shard) and p.dim == 0
    )
    return -(-tokens.shape[0] // shards)


def _resolve_num_experts(routing: Tensor, num_experts: int | None) -> int:
    if routing.dtype == torch.bool:
        return routing.shape[1] if num_experts is None else num_experts
    if num_experts is None:
        raise ValueError("te_ep.permute: num_experts is required with expert ids (routing of dtype int32/int64)")
    return num_experts


def permute(
    tokens: Tensor,
    routing: Tensor,
    probs: Tensor | None = None,
    *,
    num_experts: int | None = None,
    capacity: int | None = None,
    alignment: int = 1,
    check: bool = False,
) -> tuple[Tensor, Tensor | None, PermuteMap]:
    """Permutes ``tokens`` into an expert-major buffer of ``capacity`` rows.

    Args:
        tokens: ``[T, H]``, bfloat16, float16 or float32, contiguous.
        routing: either ``[T, K]`` int32/int64 expert ids in ``[0, E)`` with -1 for a
            dropped choice, or a ``[T, E]`` bool routing map.
        probs: optional ``[T, K]`` (or ``[T, E]`` with a routing map) float32
            probabilities, permuted alongside the tokens.
        num_experts: ``E``; required with expert ids, defaults to ``routing.shape[1]``
            with a routing map.
        capacity: rows of the output. Default: :func:`permute_capacity`, which cannot
            overflow. Output shapes never depend on routing values, so the op needs no
            host sync and traces under ``torch.compile(fullgraph=True)``.
        alignment: power of two; each expert's zone is padded with zero rows to a
            multiple of it.
        check: sync with the host and raise if the routing overflowed ``capacity``
            (eager only; with DTensors each rank checks its own shard). On CPU the op
            always raises on overflow; on CUDA, without
            ``check``, rows past ``capacity`` are dropped (their ``row_id_map`` entry is
            -1, so ``unpermute`` treats them as dropped choices) and
            ``perm_map.required_rows > capacity`` tells the caller.

    Returns:
        ``(output, permuted_probs, perm_map)``: ``output [capacity, H]`` holds expert
        ``e``'s rows at ``[start_e, start_e + count_e)`` with
        ``start_e = expert_counts[:e].sum()``, ordered by token index then choice, then
        zero padding; rows after the last zone are zero. ``permuted_probs
        [capacity] float32`` (``None`` without ``probs``) is 0 on padding rows.
        ``perm_map`` is a :class:`PermuteMap`.

    With DTensor inputs sharded on the token dim (``Shard(0)``) each rank permutes
    its own shard into its own buffer of ``capacity`` rows; ``output`` is then a
    ``Shard(0)`` DTensor of ``world * capacity`` rows whose block ``r`` is rank
    ``r``'s buffer (docs/permutation.md, "DTensor").
    """
    num_experts = _resolve_num_experts(routing, num_experts)
    if capacity is None:
        capacity = permute_capacity(_local_num_tokens(tokens), routing.shape[1], num_experts, alignment)
    output, permuted_probs, row_id_map, src_slot, expert_counts, required_rows = torch.ops.te_ep.permute(
        tokens, routing, probs, num_experts, capacity, alignment
    )
    perm_map = PermuteMap(row_id_map, src_slot, expert_counts, required_rows)
    if check:
        _raise_on_overflow(perm_map, capacity, alignment)
    return output, (permuted_probs if probs is not None else None), perm_map


def _raise_on_overflow(perm_map: PermuteMap, capacity: int, alignment: int) -> None:
    required = perm_map.required_rows
    if _is_dtensor(required):
        # Each rank checks its own shard, without communication: on CPU the op has
        # already raised on the ranks that overflowed, so a collective here would
        # leave the others waiting.
        required = required.to_local()
    needed = int(required.max())
    if needed > capacity:
        raise RuntimeError(
            f"te_ep.permute: capacity overflow: the routing needs {needed} rows (alignment {alignment}), "
            f"capacity is {capacity}"
        )


def permute_exact(
    tokens: Tensor,
    routing: Tensor,
    probs: Tensor | None = None,
    *,
    num_experts: int | None = None,
    alignment: int = 1,
) -> tuple[Tensor, Tensor | None, PermuteMap]:
    """``permute`` with ``capacity`` equal to the rows the routing needs.

    **Syncs with the host**: the per-expert counts are computed on the device and
    copied back to size the output, so this is eager-only (a graph break under
    ``torch.compile``) and not CUDA-graph capturable. Plain tensors only.
    """
    if any(_is_dtensor(t) for t in (tokens, routing, probs)):
        raise TypeError("te_ep.permute_exact: DTensor inputs are not supported; use permute with a capacity")
    num_experts = _resolve_num_experts(routing, num_experts)
    if routing.dtype == torch.bool:
        counts = routing.sum(dim=0, dtype=torch.int64)
    else:
        ids = routing.reshape(-1).to(torch.int64)
        routed = (ids >= 0) & (ids < num_experts)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=routing.device)
        counts.index_add_(0, torch.where(routed, ids, 0), routed.to(torch.int64))
    capacity = int(((counts + alignment - 1) // alignment * alignment).sum())
    return permute(tokens, routing, probs, num_experts=num_experts, capacity=capacity, alignment=alignment)


def unpermute(expert_output: Tensor, perm_map: PermuteMap, merging_probs: Tensor | None = None) -> Tensor:
    """Sums the rows of an expert-major buffer back into token order.

    ``out[t] = sum_c merging_probs[t, c] * expert_output[row_id_map[t, c]]`` over the
    choices that got a row (all weights 1 without ``merging_probs``), accumulated in
    float32 in choice order; tokens with no row get zeros.

    Args:
        expert_output: ``[capacity, H]`` in the layout ``permute`` produced.
        perm_map: the :class:`PermuteMap` of that ``permute`` call.
        merging_probs: optional ``[T, C]`` float32 weights (usually the routing
            probabilities). Differentiable: the backward returns their gradient.
    """
    return torch.ops.te_ep.unpermute(expert_output, perm_map.row_id_map, perm_map.src_slot, merging_probs)


def sort_chunks_by_index(
    input: Tensor, split_sizes: Tensor, sorted_index: Tensor, probs: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Reorders chunks of rows.

    The rows of ``input [N, H]`` are split into consecutive chunks of
    ``split_sizes[j]`` rows; the output holds chunk ``sorted_index[0]``, then chunk
    ``sorted_index[1]``, and so on. Rows after the last chunk
    (``split_sizes.sum() < N``) keep their position.

    Args:
        input: ``[N, H]`` bfloat16/float16/float32.
        split_sizes: ``[n]`` int32/int64 on ``input``'s device.
        sorted_index: ``[n]`` int32/int64, a permutation of ``range(n)``.
        probs: optional ``[N]`` float32, reordered alongside.

    Returns:
        ``(output, permuted_probs, row_map)``; ``row_map [2, N] int32`` holds the input
        row of each output row and the output row of each input row, for
        ``sort_chunks_by_map``. Invalid sizes or orders raise on CPU; on CUDA (no
        sync) they leave zero rows or an unspecified order, never an out-of-bounds
        access.
    """
    output, permuted_probs, row_map = torch.ops.te_ep.sort_chunks_by_index(input, split_sizes, sorted_index, probs)
    return output, (permuted_probs if probs is not None else None), row_map


def sort_chunks_by_map(
    input: Tensor, row_map: Tensor, probs: Tensor | None = None, *, inverse: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Applies the reordering recorded by ``sort_chunks_by_index`` (or undoes it with ``inverse=True``)."""
    output, permuted_probs = torch.ops.te_ep.sort_chunks_by_map(input, row_map, probs, inverse)
    return output, (permuted_probs if probs is not None else None)
