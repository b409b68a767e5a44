"""Token permutation for MoE layers: tokens to an expert-major buffer and back.

``permute`` moves each routed (token, expert) choice to a row of a buffer whose
rows are grouped by expert (the layout a grouped GEMM consumes), ``unpermute``
sums the expert outputs back into token order, and ``sort_chunks_by_index``
reorders chunks of rows (e.g. rank-major to expert-major after an
all-to-all). All three are ``torch.ops.te_ep`` ops with CPU and CUDA kernels,
fake kernels for ``torch.compile``, autograd formulas and DTensor sharding
rules; docs/permutation.md is the contract.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._loader import load_library

__all__ = [
    "PermuteMap",
    "permute",
    "permute_exact",
    "unpermute",
    "sort_chunks_by_index",
    "sort_chunks_by_map",
    "worst_case_capacity",
]


load_library()

_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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


def worst_case_capacity(num_tokens: int, num_choices: int, num_experts: int, alignment: int = 1) -> int:
    """Rows ``permute`` can need for ``num_tokens`` tokens with ``num_choices`` choices each.

    Every choice may take a row, and each expert that receives rows pads its zone by
    at most ``alignment - 1`` rows. Shape-only (no data), so it is safe under
    ``torch.compile``.
    """
    slots = num_tokens * num_choices
    return slots + min(num_experts, slots) * (alignment - 1)


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
        capacity: rows of the output. Default: ``worst_case_capacity``, which cannot
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
        capacity = worst_case_capacity(_local_num_tokens(tokens), routing.shape[1], num_experts, alignment)
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


# ---- fake kernels -----------------------------------------------------------------


def _check(cond, message: str) -> None:
    torch._check(cond, lambda: message)


def _check_rows(op: str, name: str, t: Tensor) -> None:
    _check(t.dim() == 2, f"{op}: {name} must be 2-D, got {t.dim()}-D (shape {tuple(t.shape)})")
    _check(t.dtype in _ROW_DTYPES, f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_int32_map(op: str, name: str, t: Tensor, dim: int) -> None:
    _check(t.dim() == dim, f"{op}: {name} must be {dim}-D, got {t.dim()}-D")
    _check(t.dtype == torch.int32, f"{op}: {name} must be int32, got {t.dtype}")


def _check_probs(op: str, name: str, p: Tensor, shape) -> None:
    _check(p.dtype == torch.float32, f"{op}: {name} must be float32, got {p.dtype}")
    _check(p.dim() == len(shape), f"{op}: {name} must have shape {tuple(shape)}, got {tuple(p.shape)}")
    for have, want in zip(p.shape, shape):
        _check(have == want, f"{op}: {name} must have shape {tuple(shape)}, got {tuple(p.shape)}")


def _probs_like(t: Tensor, n) -> Tensor:
    return t.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("te_ep::permute")
def _permute_fake(tokens, routing, probs, num_experts, capacity, alignment):
    op = "te_ep.permute"
    _check_rows(op, "tokens", tokens)
    _check(routing.dim() == 2, f"{op}: routing must be 2-D, got {routing.dim()}-D")
    _check(
        routing.dtype in (torch.bool, *_INDEX_DTYPES),
        f"{op}: routing must be int32 or int64 expert ids [T, K] or a bool routing map [T, E], got {routing.dtype}",
    )
    _check(routing.shape[0] == tokens.shape[0], f"{op}: routing.size(0) must equal tokens.size(0)")
    if routing.dtype == torch.bool:
        _check(routing.shape[1] == num_experts, f"{op}: routing.size(1) must equal num_experts for a routing map")
    _check(num_experts >= 1, f"{op}: num_experts must be >= 1, got {num_experts}")
    _check(capacity >= 0, f"{op}: capacity must be >= 0, got {capacity}")
    _check(alignment >= 1 and alignment & (alignment - 1) == 0, f"{op}: alignment must be a power of two >= 1")
    if probs is not None:
        _check_probs(op, "probs", probs, routing.shape)
    num_tokens, num_choices = routing.shape
    return (
        tokens.new_empty((capacity, tokens.shape[1])),
        _probs_like(tokens, capacity if probs is not None else 0),
        tokens.new_empty((num_tokens, num_choices), dtype=torch.int32),
        tokens.new_empty((capacity,), dtype=torch.int32),
        tokens.new_empty((num_experts,), dtype=torch.int32),
        tokens.new_empty((1,), dtype=torch.int64),
    )


@torch.library.register_fake("te_ep::permute_bwd")
def _permute_bwd_fake(row_id_map, grad_output, grad_permuted_probs):
    op = "te_ep.permute_bwd"
    _check_int32_map(op, "row_id_map", row_id_map, 2)
    _check(grad_output is not None or grad_permuted_probs is not None, f"{op}: needs grad_output or grad_permuted_probs")
    num_tokens, num_choices = row_id_map.shape
    if grad_output is not None:
        _check_rows(op, "grad_output", grad_output)
        grad_tokens = grad_output.new_empty((num_tokens, grad_output.shape[1]))
    else:
        grad_tokens = _probs_like(row_id_map, 0)
    if grad_permuted_probs is not None:
        capacity = grad_output.shape[0] if grad_output is not None else grad_permuted_probs.shape[0]
        _check_probs(op, "grad_permuted_probs", grad_permuted_probs, (capacity,))
        grad_probs = row_id_map.new_empty((num_tokens, num_choices), dtype=torch.float32)
    else:
        grad_probs = _probs_like(row_id_map, 0)
    return grad_tokens, grad_probs


@torch.library.register_fake("te_ep::unpermute")
def _unpermute_fake(input, row_id_map, src_slot, merging_probs):
    op = "te_ep.unpermute"
    _check_rows(op, "input", input)
    _check_int32_map(op, "row_id_map", row_id_map, 2)
    _check_int32_map(op, "src_slot", src_slot, 1)
    _check(src_slot.shape[0] == input.shape[0], f"{op}: src_slot.size(0) must equal input.size(0)")
    if merging_probs is not None:
        _check_probs(op, "merging_probs", merging_probs, row_id_map.shape)
    return input.new_empty((row_id_map.shape[0], input.shape[1]))


@torch.library.register_fake("te_ep::unpermute_bwd")
def _unpermute_bwd_fake(grad_output, row_id_map, src_slot, merging_probs, input):
    op = "te_ep.unpermute_bwd"
    _check_rows(op, "grad_output", grad_output)
    _check_int32_map(op, "row_id_map", row_id_map, 2)
    _check_int32_map(op, "src_slot", src_slot, 1)
    _check(row_id_map.shape[0] == grad_output.shape[0], f"{op}: row_id_map.size(0) must equal grad_output.size(0)")
    if merging_probs is not None:
        _check_probs(op, "merging_probs", merging_probs, row_id_map.shape)
    capacity = src_slot.shape[0]
    if input is not None:
        _check(merging_probs is not None, f"{op}: input is only needed for the gradient of merging_probs")
        _check(input.dtype == grad_output.dtype, f"{op}: input must have the dtype of grad_output")
        _check(input.shape[0] == capacity, f"{op}: input.size(0) must equal src_slot.size(0)")
        grad_probs = grad_output.new_empty(row_id_map.shape, dtype=torch.float32)
    else:
        grad_probs = _probs_like(grad_output, 0)
    return grad_output.new_empty((capacity, grad_output.shape[1])), grad_probs


@torch.library.register_fake("te_ep::sort_chunks_by_index")
def _sort_chunks_by_index_fake(input, split_sizes, sorted_index, probs):
    op = "te_ep.sort_chunks_by_index"
    _check_rows(op, "input", input)
    for name, t in (("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        _check(t.dim() == 1, f"{op}: {name} must be 1-D, got {t.dim()}-D")
        _check(t.dtype in _INDEX_DTYPES, f"{op}: {name} must be int32 or int64, got {t.dtype}")
    _check(sorted_index.shape[0] == split_sizes.shape[0], f"{op}: sorted_index.size(0) must equal split_sizes.size(0)")
    num_rows = input.shape[0]
    if probs is not None:
        _check_probs(op, "probs", probs, (num_rows,))
    return (
        torch.empty_like(input),
        _probs_like(input, num_rows if probs is not None else 0),
        input.new_empty((2, num_rows), dtype=torch.int32),
    )


@torch.library.register_fake("te_ep::sort_chunks_by_map")
def _sort_chunks_by_map_fake(input, row_map, probs, inverse):
    op = "te_ep.sort_chunks_by_map"
    _check_rows(op, "input", input)
    _check_int32_map(op, "row_map", row_map, 2)
    _check(row_map.shape[0] == 2 and row_map.shape[1] == input.shape[0], f"{op}: row_map must be [2, input.size(0)]")
    num_rows = input.shape[0]
    if probs is not None:
        _check_probs(op, "probs", probs, (num_rows,))
    return torch.empty_like(input), _probs_like(input, num_rows if probs is not None else 0)


# ---- autograd ----------------------------------------------------------------------
# Backward formulas call only te_ep ops (plus .contiguous() on incoming gradients,
# which autograd may hand over expanded or strided). Gradients are not
# materialized: an unused output's gradient arrives as None and is skipped rather
# than replaced by zeros (which autograd would create as plain tensors even for
# DTensor outputs). First-order only.


def _permute_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.has_probs = inputs[2] is not None
    ctx.save_for_backward(output[2])


def _permute_backward(ctx, grad_output, grad_permuted_probs, *_):
    (row_id_map,) = ctx.saved_tensors
    grad_pp = grad_permuted_probs.contiguous() if ctx.has_probs and grad_permuted_probs is not None else None
    if grad_output is None and grad_pp is None:
        return None, None, None, None, None, None
    grad_tokens, grad_probs = torch.ops.te_ep.permute_bwd(
        row_id_map, None if grad_output is None else grad_output.contiguous(), grad_pp
    )
    return (
        None if grad_output is None else grad_tokens,
        None,
        None if grad_pp is None else grad_probs,
        None,
        None,
        None,
    )


torch.library.register_autograd("te_ep::permute", _permute_backward, setup_context=_permute_setup)


def _unpermute_setup(ctx, inputs, output):
    input, row_id_map, src_slot, merging_probs = inputs
    ctx.probs_grad = merging_probs is not None and ctx.needs_input_grad[3]
    ctx.save_for_backward(row_id_map, src_slot, merging_probs, input if ctx.probs_grad else None)


def _unpermute_backward(ctx, grad_output):
    row_id_map, src_slot, merging_probs, input = ctx.saved_tensors
    grad_input, grad_probs = torch.ops.te_ep.unpermute_bwd(
        grad_output.contiguous(), row_id_map, src_slot, merging_probs, input
    )
    return grad_input, None, None, (grad_probs if ctx.probs_grad else None)


torch.library.register_autograd("te_ep::unpermute", _unpermute_backward, setup_context=_unpermute_setup)


def _sort_chunks_grads(row_map, grad_output, grad_permuted_probs, inverse):
    """Gradients of a chunk reordering: the reordering in the other direction."""
    if grad_output is not None:
        grad_pp = None if grad_permuted_probs is None else grad_permuted_probs.contiguous()
        return torch.ops.te_ep.sort_chunks_by_map(grad_output.contiguous(), row_map, grad_pp, inverse)
    if grad_permuted_probs is None:
        return None, None
    # Only the probabilities were used: move them as one-column float32 rows.
    rows, _ = torch.ops.te_ep.sort_chunks_by_map(grad_permuted_probs.unsqueeze(1).contiguous(), row_map, None, inverse)
    return None, rows.squeeze(1)


def _sort_chunks_by_index_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.has_probs = inputs[3] is not None
    ctx.save_for_backward(output[2])


def _sort_chunks_by_index_backward(ctx, grad_output, grad_permuted_probs, _):
    (row_map,) = ctx.saved_tensors
    grad_input, grad_probs = _sort_chunks_grads(
        row_map, grad_output, grad_permuted_probs if ctx.has_probs else None, inverse=True
    )
    return grad_input, None, None, (grad_probs if ctx.has_probs else None)


torch.library.register_autograd(
    "te_ep::sort_chunks_by_index", _sort_chunks_by_index_backward, setup_context=_sort_chunks_by_index_setup
)


def _sort_chunks_by_map_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.has_probs = inputs[2] is not None
    ctx.inverse = inputs[3]
    ctx.save_for_backward(inputs[1])


def _sort_chunks_by_map_backward(ctx, grad_output, grad_permuted_probs):
    (row_map,) = ctx.saved_tensors
    grad_input, grad_probs = _sort_chunks_grads(
        row_map, grad_output, grad_permuted_probs if ctx.has_probs else None, inverse=not ctx.inverse
    )
    return grad_input, None, (grad_probs if ctx.has_probs else None), None


torch.library.register_autograd(
    "te_ep::sort_chunks_by_map", _sort_chunks_by_map_backward, setup_context=_sort_chunks_by_map_setup
)


# ---- DTensor ---------------------------------------------------------------------------
# Placements per mesh dim: every tensor with a token/row dim is Shard(0) (each rank
# works on its shard, no communication) or all are Replicate(). Chunk maps [2, N]
# shard on dim 1. Output shapes of every op but `permute` follow from input shapes,
# so register_sharding (whose global shapes come from the fake kernels) covers them;
# `permute`'s row count is the per-shard `capacity`, so its global shape is
# `capacity` times the number of shards, which a sharding rule cannot express: it has
# a DTensor op handler instead.


def _register_dtensor_rules() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.te_ep

    def opt(t, placement):
        return None if t is None else placement

    @register_sharding(ops.permute_bwd.default)
    def _permute_bwd_rule(row_id_map, grad_output, grad_permuted_probs):
        return [([p, p], [p, opt(grad_output, p), opt(grad_permuted_probs, p)]) for p in (Replicate(), Shard(0))]

    @register_sharding(ops.unpermute.default)
    def _unpermute_rule(input, row_id_map, src_slot, merging_probs):
        return [([p], [p, p, p, opt(merging_probs, p)]) for p in (Replicate(), Shard(0))]

    @register_sharding(ops.unpermute_bwd.default)
    def _unpermute_bwd_rule(grad_output, row_id_map, src_slot, merging_probs, input):
        return [
            ([p, p], [p, p, p, opt(merging_probs, p), opt(input, p)])
            for p in (Replicate(), Shard(0))
        ]

    @register_sharding(ops.sort_chunks_by_index.default)
    def _sort_chunks_by_index_rule(input, split_sizes, sorted_index, probs):
        r, s = Replicate(), Shard(0)
        return [
            ([r, r, r], [r, r, r, opt(probs, r)]),
            # Each rank has its own chunk sizes and order (e.g. what it received),
            # stacked as Shard(0) DTensors of W * n entries ...
            ([s, s, Shard(1)], [s, s, s, opt(probs, s)]),
            # ... or all ranks share them.
            ([s, s, Shard(1)], [s, r, r, opt(probs, s)]),
        ]

    @register_sharding(ops.sort_chunks_by_map.default)
    def _sort_chunks_by_map_rule(input, row_map, probs, inverse):
        r, s = Replicate(), Shard(0)
        return [
            ([r, r], [r, r, opt(probs, r), None]),
            ([s, s], [s, Shard(1), opt(probs, s), None]),
        ]

    # A private DTensor hook; should a torch release drop it, DTensor permute fails
    # with DTensor's own "no sharding strategy" error instead of breaking the import.
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)
    if isinstance(handlers, dict):
        handlers[ops.permute.default] = _permute_dtensor_handler


def _permute_dtensor_handler(op_call, args, kwargs):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    op = "te_ep.permute"
    names = ("tokens", "routing", "probs", "num_experts", "capacity", "alignment")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    tokens, routing, probs = bound["tokens"], bound["routing"], bound["probs"]
    tensors = {n: t for n, t in (("tokens", tokens), ("routing", routing), ("probs", probs)) if t is not None}
    plain = [n for n, t in tensors.items() if not isinstance(t, DTensor)]
    if plain:
        raise RuntimeError(f"{op}: with DTensor inputs, tokens, routing and probs must all be DTensors; got plain {plain}")
    mesh, placements = tokens.device_mesh, tuple(tokens.placements)
    for name, t in tensors.items():
        if t.device_mesh != mesh or tuple(t.placements) != placements:
            raise RuntimeError(
                f"{op}: {name} must be on the mesh and placements of tokens ({placements}), got {tuple(t.placements)}"
            )
    for p in placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
            raise RuntimeError(
                f"{op}: DTensor inputs must be Shard(0) (token dim) or Replicate() on every mesh dim, got {placements}"
            )
    local = op_call(
        tokens._local_tensor,
        routing._local_tensor,
        None if probs is None else probs._local_tensor,
        bound["num_experts"],
        bound["capacity"],
        bound["alignment"],
    )
    shards = math.prod(mesh.size(d) for d, p in enumerate(placements) if isinstance(p, Shard))
    # Per-rank outputs stack along dim 0: block r is rank r's result. row_id_map
    # instead follows the tokens' own (possibly uneven) sharding.
    global_rows = [
        local[0].shape[0] * shards,
        local[1].shape[0] * shards,
        routing.shape[0],
        local[3].shape[0] * shards,
        local[4].shape[0] * shards,
        local[5].shape[0] * shards,
    ]
    outputs = []
    for t, rows in zip(local, global_rows):
        shape = torch.Size((rows, *t.shape[1:]))
        stride = make_contiguous_strides_for(shape)
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, t.dtype))
        outputs.append(DTensor(t, spec, requires_grad=False))
    return tuple(outputs)


if torch.distributed.is_available():
    _register_dtensor_rules()
