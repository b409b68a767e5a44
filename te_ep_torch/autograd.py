"""Autograd of the ``te_ep`` ops: differentiable dispatch and combine, and the permutation ops' formulas.

Communication ops: :func:`ep_dispatch` / :func:`ep_combine` are autograd
Functions over the ops, because they carry the :class:`EpHandle`. The backward
of dispatch is a combine of the gradient (plus the gradient of
``topk_weights``), the backward of combine is a dispatch of the gradient.

Permutation ops: formulas registered on the ops themselves
(``torch.library.register_autograd``), so the ``torch.ops.te_ep`` ops and the
``te_ep_torch.permutation`` API are differentiable alike.

Both call registered ops only, so they trace under ``torch.compile``. The fake
kernels are in ``ops.py``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .group import EpHandle

__all__ = ["DispatchOutput", "Fp8DispatchOutput", "ep_dispatch", "ep_dispatch_fp8", "ep_combine"]


# ---- communication ops: ep_dispatch / ep_combine -----------------------------------


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


def _needs_graph(first: Tensor, second: Optional[Tensor] = None) -> bool:
    """Whether a communication op must go through its autograd Function: grad mode is on and
    an input requires grad. Otherwise (inference, ``torch.no_grad()``, inputs without grad) the
    op is called directly, which saves the Function's host time (tens of us per call). Two plain
    arguments: with grad mode on, a generator over ``*inputs`` cost most of this test's time."""
    return torch.is_grad_enabled() and (first.requires_grad or (second is not None and second.requires_grad))


def _check_generation(handle: EpHandle, generation: int, what: str) -> None:
    if handle.generation != generation:
        raise RuntimeError(
            f"te_ep: the backward of {what} ran after handle {handle.id} was prepared again; a handle holds only "
            "its latest routing, so give each call site its own handle (EpGroup.create_handle) or run backward "
            "before the next step of the same layer"
        )


def _save_handle(ctx, handle: EpHandle) -> None:
    """What the backward ops need of the handle. Its memory and (under torch.compile) its
    key are saved as tensors, so a compiled backward takes them as inputs, like the forward.
    The generation is checked eagerly only: read under compile, it would be a guard."""
    ctx.handle = handle
    ctx.generation = None if torch.compiler.is_compiling() else handle.generation
    ctx.handle_id, key = handle.op_ids()
    ctx.save_for_backward(handle.handle_mem, key)


def _saved_handle(ctx, what: str) -> Tuple[EpHandle, Tensor, int, Optional[Tensor]]:
    """``(handle, handle_mem, handle_id, handle_key)`` saved by :func:`_save_handle`."""
    handle: EpHandle = ctx.handle
    if not torch.compiler.is_compiling():
        _check_generation(handle, ctx.generation, what)
    handle_mem, key = ctx.saved_tensors
    return handle, handle_mem, ctx.handle_id, key


def _dispatch_backward(ctx, grad_recv: Tensor, grad_weights: Tensor, what: str) -> Tuple[Tensor, Tensor]:
    """The backward of a dispatch (bf16 or FP8): ``dispatch_bwd`` of the received rows'
    gradient in the handle's dtype; ``(grad_tokens, grad_topk_weights)``."""
    handle, handle_mem, handle_id, key = _saved_handle(ctx, what)
    return ops.dispatch_bwd(
        grad_recv.to(handle.config.dtype).contiguous(),
        grad_weights.contiguous(),
        handle_mem,
        handle.group.group_name,
        handle_id,
        ctx.num_tokens,
        handle.config.top_k,
        key,
    )


def _dispatch_op(handle: EpHandle, tokens: Tensor, topk_weights: Tensor,
                 topk_idx: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(recv, weights, counts, total)``: ``dispatch`` on the prepared routing (``topk_idx``
    None; counts and total None), or ``prepare_dispatch`` of ``topk_idx``."""
    handle_id, key = handle.op_ids()
    group_name = handle.group.group_name
    if topk_idx is None:
        return (*ops.dispatch(tokens, topk_weights, handle.handle_mem, group_name, handle_id,
                              handle.config.capacity, key), None, None)
    return ops.prepare_dispatch(tokens, topk_idx, topk_weights, handle.handle_mem, group_name, handle_id,
                                handle.group.num_local_experts, handle.config.capacity, key)


def _combine_op(handle: EpHandle, expert_out: Tensor, num_tokens: int) -> Tensor:
    handle_id, key = handle.op_ids()
    return ops.combine(expert_out, handle.handle_mem, handle.group.group_name, handle_id, num_tokens, key)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, topk_weights: Tensor, handle: EpHandle, topk_idx: Optional[Tensor]):
        recv, weights, counts, total = _dispatch_op(handle, tokens, topk_weights, topk_idx)
        _save_handle(ctx, handle)
        ctx.num_tokens = tokens.shape[0]
        if counts is None:
            return recv, weights
        ctx.mark_non_differentiable(counts, total)
        return recv, weights, counts, total

    @staticmethod
    def backward(ctx, grad_recv: Tensor, grad_weights: Tensor, *_counts_total):
        grad_tokens, grad_topk_weights = _dispatch_backward(ctx, grad_recv, grad_weights, "ep_dispatch")
        return grad_tokens, grad_topk_weights, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out: Tensor, handle: EpHandle, num_tokens: int):
        out = _combine_op(handle, expert_out, num_tokens)
        _save_handle(ctx, handle)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        handle, handle_mem, handle_id, key = _saved_handle(ctx, "ep_combine")
        grad_expert_out = ops.combine_bwd(
            grad_out.contiguous(), handle_mem, handle.group.group_name, handle_id, handle.config.capacity, key
        )
        return grad_expert_out, None, None


def ep_dispatch(
    handle: EpHandle,
    tokens: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    prepared: Optional[Tuple[Tensor, Tensor]] = None,
) -> DispatchOutput:
    """Routes ``tokens [T, H]`` to their experts (collective; prepare and dispatch, one op).

    Args:
        handle: the layer's handle.
        tokens: ``[T, H]`` in the handle's dtype, ``T <= max_tokens_per_rank``.
        topk_idx: ``[T, K]`` int64/int32 global expert ids, ``-1`` = dropped choice.
        topk_weights: ``[T, K]`` float32 routing weights (differentiable).
        prepared: the result of ``handle.prepare(topk_idx)`` when the caller started the
            routing exchange earlier (e.g. as soon as ``topk_idx`` was known); ``None``
            prepares here, in the dispatch's own op (``prepare_dispatch``: under
            ``checks="local"`` one op, which on ``nccl_ep`` queues less between NCCL EP's
            two calls than ``prepare`` and ``dispatch`` apart).

    Returns:
        :class:`DispatchOutput`; gradients flow back to ``tokens`` and ``topk_weights``.
    """
    # Without a prepared routing, one op prepares and dispatches (prepare_dispatch).
    topk_idx = handle.begin_step(topk_idx) if prepared is None else None
    if _needs_graph(tokens, topk_weights):
        out = _Dispatch.apply(tokens, topk_weights, handle, topk_idx)
    else:  # nothing to differentiate: the op alone, without the autograd Function's host cost
        out = _dispatch_op(handle, tokens, topk_weights, topk_idx)
    recv, weights = out[0], out[1]
    counts, total = prepared if prepared is not None else out[2:]
    return DispatchOutput(recv, weights, counts, total)


class Fp8DispatchOutput(NamedTuple):
    """What FP8 dispatch delivers: the received rows still quantized, and the way back.

    Attributes:
        values: ``[capacity, H]`` ``float8_e4m3fn`` received values, expert-major zones;
            padding rows are zero.
        scales: ``[capacity, H / 128]`` float32 scales of those rows (one per block of 128
            values; ``row ~= values * scale``); 0 on padding rows.
        weights, expert_counts, total: as in :class:`DispatchOutput`.
        grad_sink: ``[capacity, H]`` of the handle's dtype, zero stride (no memory): the
            path of the received rows' gradient back to the tokens. :meth:`dequantize`
            uses it; an expert that consumes ``values`` and ``scales`` itself returns the
            gradient of its input rows as the gradient of ``grad_sink``.
    """

    values: Tensor
    scales: Tensor
    weights: Tensor
    expert_counts: Tensor
    total: Tensor
    grad_sink: Tensor

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The received rows, ``values * scale`` in ``dtype`` (default: the handle's dtype).

        Differentiable: the gradient goes back to the dispatched tokens through the
        handle's high-precision dispatch backward (straight through the quantization).
        """
        return _DequantizeRows.apply(self.values, self.scales, self.grad_sink,
                                     self.grad_sink.dtype if dtype is None else dtype)


def _dispatch_fp8_op(handle: EpHandle, tokens: Tensor, scales: Optional[Tensor], topk_weights: Tensor,
                     topk_idx: Optional[Tensor], pow2_scales: bool, unchecked: bool) -> Tuple[Tensor, ...]:
    """``(recv_values, recv_scales, recv_weights, sink, counts, total)``: ``tokens`` quantized
    (``scales`` None) or taken as values, then ``dispatch_fp8`` on the prepared routing
    (``topk_idx`` None; counts and total None) or ``prepare_dispatch_fp8`` of ``topk_idx``.
    ``sink``: the zero-stride ``grad_sink`` of :class:`Fp8DispatchOutput`."""
    values = tokens
    if scales is None and unchecked:
        # tokens that ep_dispatch_fp8 found bad: the op's own check rejects them (values of
        # another dtype, or no scales for float8 values), and the ranks agree on that
        scales = tokens.new_zeros((tokens.shape[0] if tokens.dim() else 0, 0), dtype=torch.float32)
    elif scales is None:
        values, scales = ops.quantize_fp8(tokens, pow2_scales)
    cfg = handle.config
    handle_id, key = handle.op_ids()
    group_name = handle.group.group_name
    if topk_idx is None:
        out = (*ops.dispatch_fp8(values, scales, topk_weights, handle.handle_mem, group_name, handle_id, cfg.capacity,
                                 key), None, None)
    else:
        out = ops.prepare_dispatch_fp8(values, scales, topk_idx, topk_weights, handle.handle_mem, group_name,
                                       handle_id, handle.group.num_local_experts, cfg.capacity, key)
    recv_values, recv_scales, recv_weights, counts, total = out
    sink = recv_weights.new_zeros((), dtype=cfg.dtype).expand(cfg.capacity, cfg.hidden)
    return recv_values, recv_scales, recv_weights, sink, counts, total


class _DispatchFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, scales: Optional[Tensor], topk_weights: Tensor, handle: EpHandle,
                pow2_scales: bool, unchecked: bool, topk_idx: Optional[Tensor]):
        recv_values, recv_scales, recv_weights, sink, counts, total = _dispatch_fp8_op(
            handle, tokens, scales, topk_weights, topk_idx, pow2_scales, unchecked)
        ctx.mark_non_differentiable(recv_values, recv_scales)
        ctx.set_materialize_grads(False)
        _save_handle(ctx, handle)
        ctx.num_tokens = tokens.shape[0]
        if counts is None:
            return recv_values, recv_scales, recv_weights, sink
        ctx.mark_non_differentiable(counts, total)
        return recv_values, recv_scales, recv_weights, sink, counts, total

    @staticmethod
    def backward(ctx, _grad_values, _grad_scales, grad_weights: Optional[Tensor], grad_rows: Optional[Tensor],
                 *_counts_total):
        if grad_weights is None and grad_rows is None:
            return None, None, None, None, None, None, None
        cfg = ctx.handle.config
        handle_mem = ctx.saved_tensors[0]
        if grad_rows is None:
            grad_rows = handle_mem.new_zeros((cfg.capacity, cfg.hidden), dtype=cfg.dtype)
        if grad_weights is None:
            grad_weights = handle_mem.new_zeros((cfg.capacity,), dtype=torch.float32)
        grad_tokens, grad_topk_weights = _dispatch_backward(ctx, grad_rows, grad_weights, "ep_dispatch_fp8")
        return grad_tokens, None, grad_topk_weights, None, None, None, None


class _DequantizeRows(torch.autograd.Function):
    """``dequantize_fp8(values, scales)`` whose gradient is handed to ``sink``."""

    @staticmethod
    def forward(ctx, values: Tensor, scales: Tensor, sink: Tensor, dtype: torch.dtype) -> Tensor:
        return ops.dequantize_fp8(values, scales, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, None, grad, None


def ep_dispatch_fp8(
    handle: EpHandle,
    tokens: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    prepared: Optional[Tuple[Tensor, Tensor]] = None,
    *,
    scales: Optional[Tensor] = None,
    pow2_scales: bool = False,
) -> Fp8DispatchOutput:
    """Routes ``tokens [T, H]`` to their experts as block-scaled FP8 (collective).

    Half the bytes of a bfloat16 dispatch cross the link. The handle must have been
    created with ``dispatch_dtype=torch.float8_e4m3fn``.

    Args:
        handle: the layer's handle.
        tokens: ``[T, H]`` in the handle's dtype, quantized here with
            :func:`te_ep_torch.ops.quantize_fp8`; or, with ``scales``, values the caller
            quantized already (``float8_e4m3fn``).
        topk_idx, topk_weights, prepared: as in :func:`ep_dispatch` (``prepared=None``: one op,
            ``prepare_dispatch_fp8``, after the quantization).
        scales: ``[T, H / 128]`` float32 scales of pre-quantized ``tokens``; ``None``
            quantizes here.
        pow2_scales: quantize with power-of-two scales.

    Returns:
        :class:`Fp8DispatchOutput`. Gradients: ``topk_weights`` gets its gradient as with
        :func:`ep_dispatch`; ``tokens`` (when not pre-quantized) gets the gradient of the
        received rows (through :meth:`Fp8DispatchOutput.dequantize` or ``grad_sink``),
        sent back in the handle's dtype.
    """
    cfg = handle.config
    if cfg.dispatch_dtype != torch.float8_e4m3fn:  # the same on every rank: create_handle agrees on it
        raise ValueError(
            f"ep_dispatch_fp8: handle {handle.id} was created without FP8 dispatch; create it with "
            "create_handle(..., dispatch_dtype=torch.float8_e4m3fn)"
        )
    # Tokens of a wrong dtype may be wrong on this rank only: raising here, before the step's
    # collectives, would leave the other ranks waiting in them. They go to the dispatch_fp8 op
    # as they are, whose argument check the ranks agree on (docs/ops.md, "Faults and bad
    # input"); where it raises here, it raises this message.
    bad = None
    if scales is None and tokens.dtype != cfg.dtype:
        bad = (f"ep_dispatch_fp8: tokens must be {cfg.dtype} (the handle's dtype; they are quantized here) or "
               f"torch.float8_e4m3fn with scales, got {tokens.dtype}")
    elif scales is not None and tokens.dtype != torch.float8_e4m3fn:
        bad = f"ep_dispatch_fp8: tokens given with scales must be torch.float8_e4m3fn, got {tokens.dtype}"
    # Without a prepared routing, one op prepares and dispatches (prepare_dispatch_fp8).
    topk_idx = handle.begin_step(topk_idx) if prepared is None else None
    try:
        if _needs_graph(tokens, topk_weights):
            out = _DispatchFp8.apply(tokens, scales, topk_weights, handle, pow2_scales, bad is not None, topk_idx)
        else:  # nothing to differentiate: the ops alone, without the autograd Function's host cost
            out = _dispatch_fp8_op(handle, tokens, scales, topk_weights, topk_idx, pow2_scales, bad is not None)
    except RuntimeError as exc:
        if bad is None:
            raise
        raise ValueError(f"{bad}\n(handle {handle.id} of group '{handle.group.group_name}')") from exc
    values, recv_scales, weights, sink = out[:4]
    counts, total = prepared if prepared is not None else out[4:6]
    return Fp8DispatchOutput(values, recv_scales, weights, counts, total, sink)


def ep_combine(handle: EpHandle, expert_out: Tensor, num_tokens: int) -> Tensor:
    """Returns expert outputs ``[capacity, H]`` to their tokens and sums them (collective).

    The sum is unweighted: multiply by ``DispatchOutput.weights`` first.
    ``num_tokens`` is the ``T`` of the matching :func:`ep_dispatch`.
    """
    if _needs_graph(expert_out):
        return _Combine.apply(expert_out, handle, num_tokens)
    return _combine_op(handle, expert_out, num_tokens)


# ---- permutation ops: registered autograd formulas ---------------------------------
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


# ---- zone ops: registered autograd formulas ------------------------------------------
# The backward of each zone op is a zone op too, so it is bounded by the rows in use as
# well; the zone counts get no gradient.


def _zone_glu_setup(ctx, inputs, output):
    gate_up, counts, gate, interleaved, alpha, limit, up = inputs
    ctx.spec = (gate, interleaved, alpha, limit)
    ctx.save_for_backward(gate_up, counts, up)


def _zone_glu_backward(ctx, grad_h):
    gate_up, counts, up = ctx.saved_tensors
    grad, grad_up = torch.ops.te_ep.zone_glu_bwd(grad_h.contiguous(), gate_up, counts, *ctx.spec, up)
    return grad, None, None, None, None, None, (grad_up if up is not None else None)


torch.library.register_autograd("te_ep::zone_glu", _zone_glu_backward, setup_context=_zone_glu_setup)


def _zone_bias_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _zone_bias_backward(ctx, grad):
    (counts,) = ctx.saved_tensors
    return grad, torch.ops.te_ep.zone_bias_bwd(grad.contiguous(), counts), None


torch.library.register_autograd("te_ep::zone_bias", _zone_bias_backward, setup_context=_zone_bias_setup)


def _zone_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _zone_scale_backward(ctx, grad):
    y, weights, counts = ctx.saved_tensors
    grad_y, grad_w = torch.ops.te_ep.zone_scale_bwd(grad.contiguous(), y, weights, counts)
    return grad_y, grad_w, None


torch.library.register_autograd("te_ep::zone_scale", _zone_scale_backward, setup_context=_zone_scale_setup)
