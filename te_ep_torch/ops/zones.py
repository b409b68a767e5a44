"""The zone family (``te_ep::zone_glu``, ``zone_bias``, ``zone_add``, ``zone_add_into``,
``zone_scale``, ``zone_scale_into`` and their backward ops; C++ in ``csrc/zones/``): fake kernels, the
registered autograd formulas, :func:`scale_into_window`, the routing-score weighting
written into a zero-copy handle's combine window, and :func:`fits_window`, when rows may be.

The zone API (:func:`~te_ep_torch.zones.zone_glu`, :func:`~te_ep_torch.zones.expert_ffn`, ...)
is te_ep_torch/zones.py; docs/ops.md, "Zone ops", is the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import _check, _check_probs, _check_rows

__all__ = ["fits_window", "scale_into_window"]


# ---- fake kernels --------------------------------------------------------------------


def _check_zone_counts(op: str, counts: Tensor) -> None:
    _check(counts.dim() == 1 and counts.dtype == torch.int32,
           f"{op}: counts must be a 1-D torch.int32 tensor of zone sizes, got {counts.dtype} of shape "
           f"{tuple(counts.shape)}")


def _glu_width(op: str, gate_up: Tensor, counts: Tensor, up) -> int:
    """F of the gate's operands (checked as the op checks them)."""
    _check_rows(op, "gate_up", gate_up)
    _check_zone_counts(op, counts)
    if up is not None:
        _check(up.shape == gate_up.shape and up.dtype == gate_up.dtype,
               f"{op}: up must be {gate_up.dtype} of shape {tuple(gate_up.shape)}, got {up.dtype} of shape "
               f"{tuple(up.shape)}")
        return gate_up.shape[1]
    _check(gate_up.shape[1] % 2 == 0,
           f"{op}: gate_up must have an even number of columns (gate and up), got shape {tuple(gate_up.shape)}")
    return gate_up.shape[1] // 2


@torch.library.register_fake("te_ep::zone_glu")
def _zone_glu_fake(gate_up, counts, gate="swiglu", interleaved=False, alpha=1.0, limit=0.0, up=None):
    return gate_up.new_empty((gate_up.shape[0], _glu_width("te_ep.zone_glu", gate_up, counts, up)))


@torch.library.register_fake("te_ep::zone_glu_bwd")
def _zone_glu_bwd_fake(grad_h, gate_up, counts, gate="swiglu", interleaved=False, alpha=1.0, limit=0.0, up=None):
    op = "te_ep.zone_glu_bwd"
    ffn = _glu_width(op, gate_up, counts, up)
    _check(grad_h.shape == (gate_up.shape[0], ffn) and grad_h.dtype == gate_up.dtype,
           f"{op}: grad_h must be {gate_up.dtype} of shape {(gate_up.shape[0], ffn)}, got "
           f"{grad_h.dtype} of shape {tuple(grad_h.shape)}")
    return gate_up.new_empty(gate_up.shape), gate_up.new_empty(gate_up.shape if up is not None else (0,))


@torch.library.register_fake("te_ep::zone_bias")
def _zone_bias_fake(y, bias, counts):
    op = "te_ep.zone_bias"
    _check_rows(op, "y", y)
    _check_zone_counts(op, counts)
    _check(bias.shape == (counts.shape[0], y.shape[1]) and bias.dtype == y.dtype,
           f"{op}: bias must be {y.dtype} of shape {(counts.shape[0], y.shape[1])}, got {bias.dtype} of shape "
           f"{tuple(bias.shape)}")
    return y.new_empty(y.shape)


@torch.library.register_fake("te_ep::zone_bias_bwd")
def _zone_bias_bwd_fake(grad, counts):
    _check_rows("te_ep.zone_bias_bwd", "grad", grad)
    _check_zone_counts("te_ep.zone_bias_bwd", counts)
    return grad.new_empty((counts.shape[0], grad.shape[1]))


@torch.library.register_fake("te_ep::zone_add")
def _zone_add_fake(a, b, counts):
    op = "te_ep.zone_add"
    _check_rows(op, "a", a)
    _check_zone_counts(op, counts)
    _check(b.shape == a.shape and b.dtype == a.dtype,
           f"{op}: b must be {a.dtype} of shape {tuple(a.shape)}, got {b.dtype} of shape {tuple(b.shape)}")
    return a.new_empty(a.shape)


@torch.library.register_fake("te_ep::zone_add_into")
def _zone_add_into_fake(a, b, counts, out):
    _zone_add_fake(a, b, counts)
    _check(out.shape == a.shape and out.dtype == a.dtype,
           f"te_ep.zone_add_into: out must be {a.dtype} of shape {tuple(a.shape)}, got {out.dtype} of shape "
           f"{tuple(out.shape)}")


def _check_zone_scale(op: str, y: Tensor, weights: Tensor, counts: Tensor) -> None:
    _check_rows(op, "y", y)
    _check_probs(op, "weights", weights, (y.shape[0],))
    _check_zone_counts(op, counts)


@torch.library.register_fake("te_ep::zone_scale")
def _zone_scale_fake(y, weights, counts):
    _check_zone_scale("te_ep.zone_scale", y, weights, counts)
    return y.new_empty(y.shape)


@torch.library.register_fake("te_ep::zone_scale_into")
def _zone_scale_into_fake(y, weights, counts, out):
    _check_zone_scale("te_ep.zone_scale_into", y, weights, counts)


@torch.library.register_fake("te_ep::zone_scale_bwd")
def _zone_scale_bwd_fake(grad, y, weights, counts):
    _check_zone_scale("te_ep.zone_scale_bwd", y, weights, counts)
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


# ---- registered autograd formulas ---------------------------------------------------
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


# ---- the weighting before combine, into the combine window -----------------------------


class _ScaleIntoWindow(torch.autograd.Function):
    """``te_ep.zone_scale`` written into a zero-copy handle's combine window (which combine
    reads in place). Same values and gradients; combine consumes the window, so the
    product is not saved."""

    @staticmethod
    def forward(ctx, y: Tensor, weights: Tensor, counts: Tensor, handle) -> Tensor:
        window = handle.combine_buffer()
        torch.ops.te_ep.zone_scale_into(y, weights, counts, window)
        ctx.save_for_backward(y, weights, counts)
        return window

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, weights, counts = ctx.saved_tensors
        grad_y, grad_w = torch.ops.te_ep.zone_scale_bwd(grad.contiguous(), y, weights, counts)
        return grad_y, grad_w, None, None


def fits_window(handle, rows: Tensor) -> bool:
    """Whether rows like ``rows`` may be written into ``handle``'s combine window
    (:meth:`te_ep_torch.EpHandle.combine_buffer`, which combine and ``dispatch_bwd`` read in
    place, without a copy). The one rule for both writers, the weighting before combine
    (:func:`scale_into_window`) and the experts' input gradient before ``dispatch_bwd``
    (:meth:`EpStep.run <te_ep_torch.step.EpStep.run>`'s ``grad_into``): the handle is in the
    zero-copy mode, the code runs eagerly (not under ``torch.compile``), and ``rows`` is
    ``[capacity, hidden]`` of the handle's dtype."""
    if handle is None or handle.mode != "zero_copy" or torch.compiler.is_compiling():
        return False
    cfg = handle.config
    return tuple(rows.shape) == (cfg.capacity, cfg.hidden) and rows.dtype == cfg.dtype


def scale_into_window(y: Tensor, weights: Tensor, counts: Tensor, handle=None) -> Tensor:
    """The expert rows weighted by their routing scores, ready for :func:`~te_ep_torch.ep_combine`:
    ``te_ep.zone_scale(y, weights, counts)`` (:func:`te_ep_torch.zones.zone_scale`).

    Written into the handle's combine window where :func:`fits_window` allows (combine then
    reads it without a copy); otherwise a new tensor, which combine checks as any input."""
    if fits_window(handle, y):
        return _ScaleIntoWindow.apply(y, weights, counts, handle)
    return torch.ops.te_ep.zone_scale(y, weights, counts)
