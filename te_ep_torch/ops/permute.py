"""The permutation family (``te_ep::permute``, ``unpermute``, ``sort_chunks_by_index``,
``sort_chunks_by_map`` and their backward ops; C++ in ``csrc/permute/``): fake kernels and
the registered autograd formulas.

The Python API (argument defaults, :class:`~te_ep_torch.PermuteMap`) is
te_ep_torch/permutation.py, the DTensor rules te_ep_torch/_dtensor_rules.py; docs/permutation.md
is the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import _check, _check_probs, _check_rows

__all__: list = []

_INDEX_DTYPES = (torch.int32, torch.int64)


# ---- fake kernels --------------------------------------------------------------------


def _check_int32_map(op: str, name: str, t: Tensor, dim: int) -> None:
    _check(t.dim() == dim, f"{op}: {name} must be {dim}-D, got {t.dim()}-D")
    _check(t.dtype == torch.int32, f"{op}: {name} must be int32, got {t.dtype}")


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


def _check_unpermute_args(op, rows_name, rows, row_id_map, src_slot, merging_probs, same_rows, what) -> None:
    """The checks unpermute and its backward share; ``same_rows`` must have ``rows``' row count."""
    _check_rows(op, rows_name, rows)
    _check_int32_map(op, "row_id_map", row_id_map, 2)
    _check_int32_map(op, "src_slot", src_slot, 1)
    _check(same_rows.shape[0] == rows.shape[0], f"{op}: {what}.size(0) must equal {rows_name}.size(0)")
    if merging_probs is not None:
        _check_probs(op, "merging_probs", merging_probs, row_id_map.shape)


@torch.library.register_fake("te_ep::unpermute")
def _unpermute_fake(input, row_id_map, src_slot, merging_probs):
    _check_unpermute_args("te_ep.unpermute", "input", input, row_id_map, src_slot, merging_probs, src_slot,
                          "src_slot")
    return input.new_empty((row_id_map.shape[0], input.shape[1]))


@torch.library.register_fake("te_ep::unpermute_bwd")
def _unpermute_bwd_fake(grad_output, row_id_map, src_slot, merging_probs, input):
    op = "te_ep.unpermute_bwd"
    _check_unpermute_args(op, "grad_output", grad_output, row_id_map, src_slot, merging_probs, row_id_map,
                          "row_id_map")
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


# ---- registered autograd formulas ---------------------------------------------------
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
