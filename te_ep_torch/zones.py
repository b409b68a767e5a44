"""The work between dispatch and combine, written once: experts on the zones of a receive buffer.

After :func:`~te_ep_torch.ep_dispatch` a rank holds ``rows [capacity, H]``: the zones of
its local experts (``expert_counts [E_local]`` rows each, padding included), then rows
nothing was routed to. The capacity is sized for the worst case, which grows with every
GPU; the rows in use follow the routing. Everything here does work bounded by the rows
in use, summed from the counts on the device (no host sync; capturable; traceable by
``torch.compile``):

* :func:`grouped_linear`: ``x @ w[e]`` for the rows of each zone (``torch._grouped_mm``,
  which stops at the last zone, or a masked loop where it has no fast kernel);
* :func:`zone_bias`, :func:`zone_glu` (the gated activation: SwiGLU, or gpt-oss's
  clamped one), :func:`zone_scale` (the routing-score weighting before combine): ``te_ep``
  zone ops, CUDA kernels that stop at the rows in use, their backward too;
* :func:`expert_ffn`: the expert FFN of ``te_ep_torch.MoE``, the TorchTitan experts and the
  transformers experts, built from those;
* :func:`weighted_for_combine`: the weighting, written straight into the combine window
  of a zero-copy handle (:func:`te_ep_torch.ops.scale_into_window`);
* :class:`HeldWeightGrads`: the experts' weight gradients held back in backward until the
  dispatch's backward is queued, so that they run under that communication.

Rows past the zones are never read or written: their content is unspecified, in the
outputs and in the gradients. The ops that consume these buffers (``combine``,
``dispatch``'s backward, ``unpermute``) read only rows that routing filled. docs/ops.md,
"Zone ops", has the contract. The zone ops' fake kernels and autograd formulas are in
:mod:`te_ep_torch.ops.zones`.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

# Loads the op library and registers the zone ops' fake kernels and autograd formulas.
from .ops.zones import scale_into_window

__all__ = ["GATES", "HeldWeightGrads", "expert_ffn", "grouped_linear", "weighted_for_combine", "zone_bias", "zone_glu",
           "zone_scale"]

# The gated activations the zone kernels compute (docs/ops.md, "Zone ops").
GATES = ("swiglu", "clamped_swiglu")
IMPLS = ("grouped_mm", "loop")


def zone_glu(gate_up: Tensor, counts: Tensor, gate: str = "swiglu", interleaved: bool = False,
             alpha: float = 1.0, limit: float = 0.0, up: Optional[Tensor] = None) -> Tensor:
    """``[R, F]`` gated activation on the zones' rows.

    ``gate="swiglu"``: ``silu(g) * u``; ``"clamped_swiglu"`` (gpt-oss):
    ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``.
    ``g``/``u`` are the halves of ``gate_up [R, 2F]``, its even/odd columns with
    ``interleaved``, or ``gate_up [R, F]`` (the gate) and ``up [R, F]``.
    Each step is rounded to ``gate_up``'s dtype as the eager expression (and its autograd)
    would round it, so the experts of a model give the results of its own implementation."""
    return torch.ops.te_ep.zone_glu(gate_up, counts, gate, interleaved, alpha, limit, up)


def zone_bias(y: Tensor, bias: Tensor, counts: Tensor) -> Tensor:
    """``y [R, N] + bias[e]`` for the rows of each zone ``e`` (``bias [E_local, N]``)."""
    return torch.ops.te_ep.zone_bias(y, bias, counts)


def zone_scale(y: Tensor, weights: Tensor, counts: Tensor) -> Tensor:
    """``(y.float() * weights[:, None]).to(y.dtype)`` on the zones' rows (``weights [R]`` float32)."""
    return torch.ops.te_ep.zone_scale(y, weights, counts)


class _Fork(torch.autograd.Function):
    """``x`` twice, for two ops that read it: autograd would sum their gradients over every
    row of the buffer; this sums them on the zones' rows (``te_ep.zone_add``, rounded once,
    as autograd's sum is), into ``grad_into`` where given (``te_ep.zone_add_into``: a
    zero-copy handle's combine window, which ``dispatch_bwd`` then reads without a copy)."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: Tensor, grad_into: Optional[Tensor] = None):
        ctx.save_for_backward(counts)
        ctx.grad_into = grad_into
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, g1: Optional[Tensor], g2: Optional[Tensor]):
        (counts,) = ctx.saved_tensors
        if g1 is None or g2 is None:
            return (g1 if g2 is None else g2), None, None
        if ctx.grad_into is not None:
            torch.ops.te_ep.zone_add_into(g1.contiguous(), g2.contiguous(), counts, ctx.grad_into)
            return ctx.grad_into, None, None
        return torch.ops.te_ep.zone_add(g1.contiguous(), g2.contiguous(), counts), None, None


def grouped_linear(x: Tensor, w: Tensor, counts: Tensor, impl: str = "grouped_mm",
                   held: Optional["HeldWeightGrads"] = None) -> Tensor:
    """``x @ w[e]`` for the rows of zone ``e``; ``x [R, in]``, ``w [E_local, in, out]`` -> ``[R, out]``.

    ``impl="grouped_mm"``: one ``torch._grouped_mm`` (bf16, Hopper+), which leaves the rows
    past the last zone unwritten, in its output and in its input's gradient.
    ``"loop"``: a dense GEMM per local expert over the whole buffer, each row kept from its
    own expert (static shapes, any device and dtype; ``E_local`` times the FLOPs, the
    fallback where there is no grouped GEMM); rows past the zones come out zero.
    ``held``: ``w`` is one of its :attr:`HeldWeightGrads.weights` and ``w``'s gradient is
    taken there (``impl="grouped_mm"`` only)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_linear: impl must be one of {IMPLS}, got {impl!r}")
    x = x.to(w.dtype)
    if held is not None:
        if impl != "grouped_mm":
            raise ValueError(f"grouped_linear: held weight gradients need impl='grouped_mm', got {impl!r}")
        return held.linear(x, w, counts)
    if impl == "grouped_mm":
        return torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    ends = counts.cumsum(0)
    starts = ends - counts
    rows = torch.arange(x.shape[0], device=x.device)
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e in range(w.shape[0]):
        mine = ((rows >= starts[e]) & (rows < ends[e])).unsqueeze(1)
        out = torch.where(mine, torch.where(mine, x, 0) @ w[e], out)
    return out


class HeldWeightGrads:
    """The experts' weight gradients of one dispatch, held back in backward until that
    dispatch's backward is queued.

    A grouped GEMM's backward makes two gradients: its input's (what the dispatch's backward
    sends back to the tokens' ranks) and its weight's (what only the optimizer reads). Held,
    the experts' backward makes the input gradients alone; the dispatch's backward is queued
    next (on the communication stream when the step has one), and the weight gradients
    after it, on the current stream: they run while the dispatch's backward communicates.

    Made before the dispatch, from the weights the experts will use: run the experts with
    :attr:`weights` (views of them, through :func:`grouped_linear`'s ``held``), and give
    :attr:`order` (a zero-size tensor) to the dispatch (``ep_dispatch(..., order=)``), whose
    backward then comes first: autograd runs this object's backward, which makes the weight
    gradients, only after every node that took an output of it. Gradients are those of
    ``torch._grouped_mm``'s own backward (the same GEMMs); memory: each GEMM's output
    gradient lives on until the weight gradients are made, right after the dispatch's backward
    is queued. ``comm_sms``: the weight-gradient GEMMs leave that many SMs free (torch's SM
    carveout for its persistent GEMMs, as ``EpOptions.comm_sms``), so that the communication
    kernels beside them can start; ``0``: every SM. Eager only (:meth:`EpStep.run <te_ep_torch.step.EpStep.run>` holds them where
    the experts offer it: :meth:`te_ep_torch.GroupedExperts.hold_weight_grads`)."""

    __slots__ = ("weights", "order", "_inputs")

    def __init__(self, weights: Sequence[Tensor], comm_sms: int = 0) -> None:
        # What each GEMM's backward leaves for its weight's gradient: {weight index: (x, dy, offs)}.
        self._inputs: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
        *views, self.order = _Hold.apply(self._inputs, comm_sms, *weights)
        self.weights: Tuple[Tensor, ...] = tuple(views)

    def linear(self, x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
        """``grouped_linear(x, w, counts)`` for ``w`` one of :attr:`weights`."""
        index = next((i for i, v in enumerate(self.weights) if v is w), None)
        if index is None:
            raise ValueError("HeldWeightGrads.linear: w must be one of its weights (the views it made)")
        return _HeldGroupedMm.apply(x, w, counts.cumsum(0, dtype=torch.int32), self._inputs, index)


class _Hold(torch.autograd.Function):
    """The weights, viewed (the experts run on the views) and a zero-size ``order`` tensor; in
    backward, the weights' gradients from what the GEMMs left."""

    @staticmethod
    def forward(ctx, inputs: Dict[int, Tuple[Tensor, Tensor, Tensor]], comm_sms: int, *weights: Tensor):
        ctx.inputs, ctx.comm_sms = inputs, comm_sms
        ctx.set_materialize_grads(False)
        return (*(w.view_as(w) for w in weights), weights[0].new_empty(0))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        inputs = ctx.inputs
        grads_w = []
        caller = torch._C._get_sm_carveout_experimental()
        if ctx.comm_sms:
            torch._C._set_sm_carveout_experimental(ctx.comm_sms)
        try:
            for i in range(len(grads) - 1):
                got = inputs.pop(i, None)
                # torch._grouped_mm's own weight gradient: x^T @ dy, zone by zone.
                grads_w.append(None if got is None else torch._grouped_mm(got[0].t(), got[1], offs=got[2]))
        finally:
            if ctx.comm_sms:
                torch._C._set_sm_carveout_experimental(caller)
        return (None, None, *grads_w)


class _HeldGroupedMm(torch.autograd.Function):
    """``torch._grouped_mm(x, w, offs)`` whose backward makes ``x``'s gradient and leaves
    ``(x, dy, offs)`` for ``w``'s (:class:`_Hold`), giving ``w`` a zero that costs nothing."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, inputs: Dict[int, Tuple[Tensor, Tensor, Tensor]],
                index: int) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.inputs, ctx.index = inputs, index
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offs = ctx.saved_tensors
        dx = torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None
        ctx.inputs[ctx.index] = (x, dy, offs)
        return dx, torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape), None, None, None


def expert_ffn(
    rows: Tensor,
    counts: Tensor,
    w1: Union[Tensor, Tuple[Tensor, Tensor]],
    w2: Tensor,
    *,
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    gate: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float = 0.0,
    activation: Optional[Callable[[Tensor], Tensor]] = None,
    impl: str = "grouped_mm",
    held: Optional[HeldWeightGrads] = None,
    grad_into: Optional[Tensor] = None,
) -> Tensor:
    """The local experts on the zones of ``rows [R, H]``: ``gate(rows @ w1[e] + b1[e]) @ w2[e] + b2[e]``.

    ``w1 [E_local, H, 2F]`` holds the gate and up projections (halves, or interleaved
    columns), or is the pair ``(w_gate, w_up)`` of ``[E_local, H, F]`` weights (two grouped
    GEMMs, as TorchTitan's and te_ep_torch's own experts keep them: no copy of the
    weights, and the numerics of running them apart); ``w2 [E_local, F, H_out]``; biases
    ``[E_local, 2F]`` (one ``w1`` only) / ``[E_local, H_out]``.
    ``activation``: a model's own function of the first projection, used instead of the
    gate kernel (for activations the zone kernels do not compute). It runs over every row
    of the buffer, so its cost follows the capacity: the one part here that does.
    ``held``: the weights are views of a :class:`HeldWeightGrads`, which takes their gradients.
    ``grad_into``: ``[R, H]`` (``rows``' shape and dtype) that ``rows``' gradient is written into
    and returned as, on the rows in use (with ``w1=(w_gate, w_up)``; a zero-copy handle's combine
    window, which the dispatch's backward reads in place: :meth:`te_ep_torch.EpHandle.combine_buffer`;
    :func:`te_ep_torch.ops.zones.fits_window` says when a window fits); any other ``grad_into``
    raises ``ValueError``. Returns ``[R, H_out]`` in ``w2``'s dtype; rows past the zones unspecified."""
    if activation is None and gate not in GATES:
        raise ValueError(f"expert_ffn: gate must be one of {GATES}, got {gate!r}")
    if grad_into is not None:
        if not isinstance(w1, (tuple, list)):
            raise ValueError("expert_ffn: grad_into needs w1=(w_gate, w_up) (the gradient written there is "
                             "the sum of the two GEMMs' input gradients); got one w1")
        if grad_into.shape != rows.shape or grad_into.dtype != rows.dtype or grad_into.device != rows.device:
            raise ValueError(f"expert_ffn: grad_into must be {rows.dtype} of shape {tuple(rows.shape)} on "
                             f"{rows.device} (rows'), got {grad_into.dtype} of shape {tuple(grad_into.shape)} "
                             f"on {grad_into.device}")
    if isinstance(w1, (tuple, list)):
        if b1 is not None or activation is not None or interleaved:
            raise ValueError("expert_ffn: w1=(w_gate, w_up) takes no b1, activation or interleaved (one w1 does)")
        w_gate, w_up = w1
        for_gate, for_up = _Fork.apply(rows, counts, grad_into) if rows.requires_grad else (rows, rows)
        h = zone_glu(grouped_linear(for_gate, w_gate, counts, impl, held), counts, gate, False, alpha, limit,
                     up=grouped_linear(for_up, w_up, counts, impl, held))
    else:
        h = grouped_linear(rows, w1, counts, impl, held)
        if b1 is not None:
            h = zone_bias(h, b1, counts)
        h = activation(h) if activation is not None else zone_glu(h, counts, gate, interleaved, alpha, limit)
    y = grouped_linear(h, w2, counts, impl, held)
    if b2 is not None:
        y = zone_bias(y, b2, counts)
    return y


def weighted_for_combine(y: Tensor, weights: Tensor, counts: Tensor, handle=None) -> Tensor:
    """The expert rows weighted by their routing scores, ready for :func:`~te_ep_torch.ep_combine`.

    With a zero-copy ``handle`` (eager) and rows of the window's shape and dtype, written
    into its combine window, which combine then reads without a copy; otherwise (other
    modes, under ``torch.compile``) a new tensor, which combine checks as any input.
    One call of :func:`te_ep_torch.ops.scale_into_window`."""
    return scale_into_window(y, weights, counts, handle)
