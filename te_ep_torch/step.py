"""The communication step of one MoE layer, written once.

:class:`EpStep` owns what happens around a layer's experts when tokens travel over an
:class:`~te_ep_torch.EpGroup`: its handles (one per token dtype), the routing exchange
(``prepare``), the dispatch in the tokens' dtype or in block-scaled FP8, the glue between
the receive buffer and combine (:func:`te_ep_torch.zones.weighted_for_combine`: the routing
weights applied to the rows in use, written into a zero-copy handle's window), the combine,
and the errors that a rank's bad batch defers until every rank has entered the op.

Its callers hold the layer's own parts (router, experts, shared expert) and nothing of the
communication: :class:`te_ep_torch.MoE`, the TorchTitan dispatcher, both transformers
entries and the testing blocks. Two ways to call it:

* :meth:`EpStep.run` -- dispatch, ``experts(rows, expert_counts)``, weighting, combine;
* the parts, for a caller that runs work between them (``MoE`` starts the routing exchange
  inside its router, TorchTitan calls its experts between ``dispatch`` and ``combine``):
  :meth:`EpStep.handle_for`, :meth:`EpStep.prepare`, :meth:`EpStep.dispatch`,
  :meth:`EpStep.combine`, each taking an optional communication stream
  (:mod:`te_ep_torch.overlap`) and :meth:`EpStep.join`.

Everything it calls is an autograd Function over registered ops (:mod:`te_ep_torch.autograd`),
so the step traces under ``torch.compile`` and captures in a CUDA graph; handles are made
eagerly (collective), never while tracing or capturing.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .ops.comm import Fp8DispatchOutput, ep_combine, ep_dispatch, ep_dispatch_fp8
from .group import EpGroup, EpHandle
from .options import EpOptions
from .overlap import CommStream, join, launch
from .zones import weighted_for_combine

__all__ = ["Dispatched", "EpStep", "check_eager"]


def check_eager(name: str, dtype: torch.dtype, have, hint: str) -> None:
    """Raises ``RuntimeError`` where a handle for ``dtype`` tokens would be made inside a CUDA-graph
    capture or while torch.compile traces: making one is collective and allocates its buffers,
    so it happens eagerly, before (``hint`` says how, ``have`` lists the dtypes that have one)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name}: no te_ep handle for {dtype} tokens while a CUDA graph is being captured "
                           f"(have {sorted(map(str, have))}); {hint}")
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name}: no te_ep handle for {dtype} tokens while torch.compile traces the layer "
                           f"(have {sorted(map(str, have))}); {hint}")


class Dispatched(NamedTuple):
    """One dispatch of an :class:`EpStep`, what its experts and its combine need.

    Attributes:
        rows: ``[capacity, H]`` received rows in the tokens' dtype, expert-major zones, padding
            rows zero (FP8 dispatch: dequantized).
        expert_counts: ``[E_local]`` int32 rows per zone, padding included.
        weights: ``[capacity]`` float32 routing weight of each row, 0 on padding.
        total: ``[1]`` int32 rows in use.
        handle: the handle the step ran on.
        num_tokens: ``T`` of the dispatch (what combine returns).
    """

    rows: Tensor
    expert_counts: Tensor
    weights: Tensor
    total: Tensor
    handle: EpHandle
    num_tokens: int


class EpStep:
    """The communication step of one MoE layer on ``group`` (see the module docstring).

    Args:
        group: the :class:`~te_ep_torch.EpGroup` the layer's tokens travel over.
        top_k: experts per token.
        hidden: token width.
        alignment: zone alignment in rows (power of two), or a function of the token dtype
            giving it (where the experts' GEMM, hence its alignment, depends on the dtype).
        options: the handles' :class:`~te_ep_torch.options.EpOptions` (capacity,
            ``capacity_factor``, overflow, checks; the group carries backend, NCCL EP mode and
            timeout).
        fp8: dispatch block-scaled FP8 (:func:`~te_ep_torch.ep_dispatch_fp8`) and dequantize
            the received rows to the tokens' dtype; combine and gradients stay in that dtype.
        name: how messages name the layer (e.g. ``"TeEpTokenDispatcher.dispatch"``).
        tokens_arg: how messages name the tokens argument.
        max_tokens_option: how messages name the option bounding the tokens per rank.
        hidden_option: how messages name the option giving the token width, if any.
        eager_hint: what a message says to do when a handle would be made while tracing or
            capturing (how the caller makes its handles beforehand).
        lazy: make a missing dtype's handle on first (eager) use; ``False``: only
            :meth:`add_handle` makes handles, and tokens of another dtype raise.
    """

    def __init__(
        self,
        group: EpGroup,
        *,
        top_k: int,
        hidden: int,
        alignment: Union[int, Callable[[torch.dtype], int]],
        options: Optional[EpOptions] = None,
        fp8: bool = False,
        name: str = "te_ep",
        tokens_arg: str = "tokens",
        max_tokens_option: str = "max_tokens_per_rank",
        hidden_option: Optional[str] = None,
        eager_hint: str = "",
        lazy: bool = True,
    ) -> None:
        self.group = group
        self.top_k = top_k
        self.hidden = hidden
        self._alignment = alignment
        self.options = options if options is not None else EpOptions()
        self.fp8 = fp8
        self.name = name
        self.tokens_arg = tokens_arg
        self.max_tokens_option = max_tokens_option
        self.hidden_option = hidden_option
        self.eager_hint = eager_hint
        self.lazy = lazy
        self.handles: Dict[torch.dtype, EpHandle] = {}

    def __repr__(self) -> str:
        return (f"EpStep({self.name!r}, top_k={self.top_k}, hidden={self.hidden}, fp8={self.fp8}, "
                f"handles={sorted(map(str, self.handles))}, group={self.group.group_name!r})")

    # ---- handles -----------------------------------------------------------------------

    def alignment(self, dtype: torch.dtype) -> int:
        """Zone alignment of the handle for tokens of ``dtype``."""
        return self._alignment(dtype) if callable(self._alignment) else self._alignment

    def add_handle(self, dtype: torch.dtype, options: Optional[EpOptions] = None,
                   checks: Optional[str] = None) -> EpHandle:
        """The handle for tokens of ``dtype``, made now if missing (collective over the group),
        with ``options``' capacity and overflow (default: the step's) and the check mode
        ``checks`` (``None``: the group's). An existing handle is returned as it is."""
        handle = self.handles.get(dtype)
        if handle is not None:
            return handle
        opts = options if options is not None else self.options
        handle = self.group.create_handle(
            top_k=self.top_k, hidden=self.hidden, dtype=dtype, alignment=self.alignment(dtype),
            dispatch_dtype=torch.float8_e4m3fn if self.fp8 else None, checks=checks, **opts.handle_kwargs())
        self.handles[dtype] = handle
        return handle

    def handle_for(self, tokens: Tensor) -> EpHandle:
        """The handle for ``tokens``' dtype; made now where missing and ``lazy`` (eagerly only)."""
        handle = self.handles.get(tokens.dtype)
        if handle is not None:
            return handle
        if not self.lazy:
            raise RuntimeError(f"{self.name}: no expert-parallel handle for {tokens.dtype} tokens (have "
                               f"{sorted(map(str, self.handles))}); {self.eager_hint}")
        check_eager(self.name, tokens.dtype, self.handles, self.eager_hint)
        return self.add_handle(tokens.dtype)

    def bad_input(self, tokens: Tensor) -> Optional[str]:
        """What is wrong with ``tokens [T, H]`` for this step, or ``None``.

        Not raised before the op: it may hold on this rank only (a larger batch), and raising
        before the step's collectives would leave the other ranks waiting in them. The ops'
        own checks see it and the ranks agree on it; :meth:`dispatch` then raises this message
        on this rank (docs/ops.md, "Faults and bad input")."""
        num_tokens, hidden = tokens.shape
        if hidden != self.hidden:
            option = f" ({self.hidden_option})" if self.hidden_option else ""
            return (f"{self.name}: {self.tokens_arg} must have {self.hidden} columns{option}, got shape "
                    f"{tuple(tokens.shape)}")
        if num_tokens > self.group.max_tokens_per_rank:
            return (f"{self.name}: {self.tokens_arg} has {num_tokens} tokens, more than {self.max_tokens_option}="
                    f"{self.group.max_tokens_per_rank}; set {self.max_tokens_option} to the largest per-rank batch "
                    "(batch size * sequence length)")
        return None

    def destroy(self) -> None:
        """Releases the step's handles (the group stays)."""
        for handle in self.handles.values():
            handle.destroy()
        self.handles = {}

    # ---- the step ----------------------------------------------------------------------

    def prepare(self, tokens: Tensor, topk_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """The routing exchange alone (collective) for the dispatch of ``tokens``, started before
        the routing weights are known: ``(expert_counts, total)`` for :meth:`dispatch`'s
        ``prepared``."""
        return self.handle_for(tokens).prepare(topk_idx)

    def dispatch(self, tokens: Tensor, topk_idx: Tensor, topk_weights: Tensor, *,
                 prepared: Optional[Tuple[Tensor, Tensor]] = None, comm: Optional[CommStream] = None):
        """Sends ``tokens [T, H]`` to the ranks of their experts (collective).

        ``topk_idx [T, K]`` global expert ids, ``topk_weights [T, K]`` (cast to float32,
        differentiable), on the handle of :meth:`handle_for`. ``prepared``: ``prepare``'s
        result where the routing was exchanged already. With ``comm`` the op is queued on the
        communication stream and the result is usable after :meth:`join`; without it, at once.
        A rank whose tokens do not fit (:meth:`bad_input`) raises that message (``ValueError``)
        once the op has failed on every rank.
        """
        handle = self.handle_for(tokens)
        bad = self.bad_input(tokens)
        tokens = tokens.contiguous()
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        op = ep_dispatch_fp8 if self.fp8 else ep_dispatch
        try:
            return launch(comm, lambda: op(handle, tokens, topk_idx, topk_weights, prepared=prepared),
                          (tokens, topk_idx, topk_weights))
        except (RuntimeError, ValueError) as exc:
            if bad is None:
                raise
            raise ValueError(f"{bad}\n(handle {handle.id} of group '{handle.group.group_name}')") from exc

    def join(self, comm: Optional[CommStream], launched, tokens: Optional[Tensor] = None):
        """The current stream waits for ``launched`` (a :meth:`dispatch` or :meth:`combine`).

        A dispatch becomes a :class:`Dispatched` (``tokens``, the dispatched tokens, required
        then: their dtype and count); a combine's output is returned as it is."""
        out = join(comm, launched)
        if tokens is None:
            return out
        if isinstance(out, Fp8DispatchOutput):
            rows = out.dequantize(tokens.dtype)
        else:
            rows = out.tokens
        handle = self.handles[tokens.dtype]
        return Dispatched(rows, out.expert_counts, out.weights, out.total, handle, tokens.shape[0])

    def combine(self, expert_out: Tensor, dispatched: Dispatched, comm: Optional[CommStream] = None):
        """Weights the experts' rows by their routing weights (bounded by the rows in use; into
        a zero-copy handle's window) and sums them back to their tokens (collective): ``[T, H]``,
        on ``comm`` where given (usable after :meth:`join`)."""
        y = weighted_for_combine(expert_out, dispatched.weights, dispatched.expert_counts, dispatched.handle)
        return launch(comm, lambda: ep_combine(dispatched.handle, y, dispatched.num_tokens), (y,))

    def run(self, tokens: Tensor, routing, experts: Callable[[Tensor, Tensor], Tensor], *,
            comm: Optional[CommStream] = None, behind_dispatch: Optional[Callable[[], object]] = None,
            behind_combine: Optional[Callable[[object], object]] = None) -> Tuple[Tensor, object, object]:
        """The whole step: routing exchange, dispatch, ``experts(rows, expert_counts)``, weighting,
        combine. Returns ``(combined [T, H], side, routed)``.

        Args:
            tokens: ``[T, H]``.
            routing: ``(topk_idx, topk_weights)``; or the layer's router as a function
                ``routing(on_select, on_weights) -> routed`` that calls ``on_select(topk_idx)``
                as soon as the choice is known (the routing exchange starts there, behind the
                rest of the router) and ``on_weights(topk_idx, topk_weights)`` once the weights
                are (the dispatch is launched there); its result comes back as ``routed``
                (``None`` for a tuple).
            experts: the layer's local experts on the received zones.
            comm: the communication stream (:mod:`te_ep_torch.overlap`), or ``None``: the same
                calls in the same order, at once.
            behind_dispatch, behind_combine: the caller's work on the current stream while the
                dispatch (``behind_dispatch()``) and the combine (``behind_combine(its
                result)``) run on ``comm``; ``side`` is the last one's result.
        """
        prepared, launched = [], []

        def on_select(topk_idx: Tensor) -> None:
            prepared.append(self.prepare(tokens, topk_idx))

        def on_weights(topk_idx: Tensor, topk_weights: Tensor) -> None:
            launched.append(self.dispatch(tokens, topk_idx, topk_weights, prepared=prepared[0] if prepared else None,
                                          comm=comm))

        if callable(routing):
            routed = routing(on_select, on_weights)
        else:
            routed = None
            on_weights(*routing)
        if not launched:
            raise RuntimeError(f"{self.name}: the router returned without calling on_weights: nothing was dispatched")
        side = behind_dispatch() if behind_dispatch is not None else None
        d = self.join(comm, launched[0], tokens)
        combined = self.combine(experts(d.rows, d.expert_counts), d, comm)
        if behind_combine is not None:
            side = behind_combine(side)
        return self.join(comm, combined), side, routed
