"""The communication step of one MoE layer, written once.

:class:`EpStep` owns what happens around a layer's experts when tokens travel over an
:class:`~te_ep_torch.EpGroup`: its handles (one per token dtype), the routing exchange
(``prepare``), the dispatch in the tokens' dtype or in block-scaled FP8, the glue between
the receive buffer and combine (:func:`te_ep_torch.ops.zones.scale_into_window`: the routing
weights applied to the rows in use, written into a zero-copy handle's window), the combine,
and the errors that a rank's bad batch defers until every rank has entered the op.

Its callers hold the layer's own parts (router, experts, shared expert) and nothing of the
communication: :class:`te_ep_torch.MoE`, the TorchTitan dispatcher, both transformers
entries and the testing blocks. Two ways to call it:

* :meth:`EpStep.run` -- dispatch, ``experts(rows, expert_counts)``, weighting, combine;
* the parts, for a caller that runs work between them (TorchTitan calls its experts between
  ``dispatch`` and ``combine``): :meth:`EpStep.handle_for`, :meth:`EpStep.prepare`,
  :meth:`EpStep.dispatch`, :meth:`EpStep.combine`, each taking an optional communication
  stream (:class:`te_ep_torch.overlap.CommStream`) and :meth:`EpStep.join`. (``MoE`` starts
  the routing exchange inside its router through :meth:`EpStep.run`'s ``routing`` hooks.)

The step owns where its work runs: with a communication stream, ``launch`` queues an op there
after the current stream's work and ``join`` makes the current stream wait for it
(:class:`~te_ep_torch.overlap.CommStream` holds the stream and its memory rules); without
one, the same calls in the same order run at once.

A chunked step (``EpOptions(chunks=N)``, :meth:`EpStep.run` only) splits the tokens into N
chunks, each with its own handles (a handle holds one routing, and backward needs each
chunk's) made on :meth:`EpGroup.with_max_tokens` ``(ceil(max_tokens_per_rank / N))``: every
chunk's dispatch is queued on the communication stream, then per chunk the experts run as
soon as its rows arrived and its combine is queued behind them, so chunk i+1's dispatch and
chunk i's combine run under chunk i's and i+1's experts; backward overlaps the same way (an
op's backward runs on the stream its forward ran on).

Everything it calls is an autograd Function over registered ops, each in its op family's
module (:mod:`te_ep_torch.ops.comm`: prepare, dispatch, combine; :mod:`te_ep_torch.ops.zones`:
the weighting), so a forward reads ``moe -> step -> ops.<family>`` and the step traces under ``torch.compile`` and captures in a CUDA graph; handles are made
eagerly (collective), never while tracing or capturing.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, TypeVar, Union

import torch
from torch import Tensor

from .group import EpGroup, EpHandle
from .ops.comm import Fp8DispatchOutput, ep_combine, ep_dispatch, ep_dispatch_fp8, ep_prepare
from .ops.zones import fits_window, scale_into_window
from .options import EpOptions
from .overlap import _tensors

if TYPE_CHECKING:
    from .overlap import CommStream

T = TypeVar("T")

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


class Launched(NamedTuple):
    """Work :func:`launch` queued on a communication stream: its ``result`` (not usable on the
    current stream before :func:`join`) and ``done``, the event recorded on that stream right
    behind it (:meth:`CommStream.record`)."""

    result: Any
    done: Any


def launch(comm: Optional["CommStream"], fn: Callable[[], T], inputs: Iterable[Optional[Tensor]]):
    """``fn()`` on ``comm`` (:meth:`CommStream.launch`: after the current stream's queued work;
    ``inputs``, the tensors ``fn`` reads, are recorded there) as a :class:`Launched`, or ``fn()``'s
    result at once where ``comm`` is ``None``. Pass what it returns to :func:`join`."""
    if comm is None:
        return fn()
    result = comm.launch(fn, inputs)
    return Launched(result, comm.record())


def join(comm: Optional["CommStream"], launched):
    """The join of :func:`launch`: the current stream waits for that work alone (its event: not
    for work launched on ``comm`` since, such as a chunked step's previous combine) and the
    tensors of its result are recorded there. Returns the result; where ``comm`` is ``None``,
    ``launched`` is the result."""
    if comm is None:
        return launched
    if not isinstance(launched, Launched):
        raise TypeError(f"te_ep_torch: join(comm, ...) takes what launch(comm, ...) returned, got {type(launched)}")
    comm.join(_tensors(launched.result), launched.done)
    return launched.result


def _deferred(bad: Optional[str], handle: EpHandle, op: Callable[[], T]) -> T:
    """``op()``; where it fails and this rank's tokens were bad (``EpStep.bad_input``), that
    message as a ``ValueError`` instead (the op failed on every rank: they agree on errors)."""
    try:
        return op()
    except (RuntimeError, ValueError) as exc:
        if bad is None:
            raise
        raise ValueError(f"{bad}\n(handle {handle.id} of group '{handle.group.group_name}')") from exc


class _SmCarveout:
    """torch's SM carveout for its persistent GEMMs (``torch._C._set_sm_carveout_experimental``),
    held while a chunked step's experts run beside its communication: a persistent GEMM holds
    every SM it is given until it ends, so a communication kernel queued behind it on another
    stream cannot start, and its peers on the other ranks wait for it. Holds nest (``depth``);
    the caller's own carveout comes back when the last one ends."""

    depth = 0
    saved: Optional[int] = None

    @classmethod
    def enter(cls, sms: int) -> None:
        if cls.depth == 0:
            cls.saved = torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(sms)
        cls.depth += 1

    @classmethod
    def exit(cls) -> None:
        if cls.depth == 0:
            return  # already ended by end_of_backward
        cls.depth -= 1
        if cls.depth == 0:
            torch._C._set_sm_carveout_experimental(cls.saved)

    @classmethod
    def end_of_backward(cls) -> None:
        """Every hold ends with the backward pass (a region whose input needs no gradient has
        no node to end its hold)."""
        while cls.depth:
            cls.exit()


class _CarveoutMark(torch.autograd.Function):
    """Identity; its backward starts (``start=True``: on a region's output) or ends (on its
    input) an :class:`_SmCarveout` hold, so the region's backward GEMMs leave ``sms`` free."""

    @staticmethod
    def forward(ctx, x: Tensor, sms: int, start: bool) -> Tensor:
        ctx.sms, ctx.start = sms, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.start:
            _SmCarveout.enter(ctx.sms)
            torch.autograd.Variable._execution_engine.queue_callback(_SmCarveout.end_of_backward)
        else:
            _SmCarveout.exit()
        return grad, None, None


def _carved(experts: Callable[[Tensor, Tensor], Tensor], sms: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``experts`` whose GEMMs, forward and backward, leave ``sms`` SMs free (``0``: as it is)."""
    if sms == 0:
        return experts

    def run(rows: Tensor, counts: Tensor) -> Tensor:
        _SmCarveout.enter(sms)
        try:
            out = experts(_CarveoutMark.apply(rows, sms, False), counts)
        finally:
            _SmCarveout.exit()
        return _CarveoutMark.apply(out, sms, True)

    return run


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
            timeout) and the step's ``chunks``.
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
        # The handles of each token dtype, one per chunk.
        self.chunk_handles: Dict[torch.dtype, List[EpHandle]] = {}

    def __repr__(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return (f"EpStep({self.name!r}, top_k={self.top_k}, hidden={self.hidden}, fp8={self.fp8}{chunks}, "
                f"handles={sorted(map(str, self.chunk_handles))}, group={self.group.group_name!r})")

    @property
    def chunks(self) -> int:
        """Chunks of a step (``options.chunks``; 1: unchunked)."""
        return self.options.chunks

    @property
    def handles(self) -> Dict[torch.dtype, EpHandle]:
        """The handle of each token dtype; of a chunked step, the first chunk's
        (:attr:`chunk_handles` has them all)."""
        return {dtype: handles[0] for dtype, handles in self.chunk_handles.items()}

    # ---- handles -----------------------------------------------------------------------

    def alignment(self, dtype: torch.dtype) -> int:
        """Zone alignment of the handle for tokens of ``dtype``."""
        return self._alignment(dtype) if callable(self._alignment) else self._alignment

    def add_handle(self, dtype: torch.dtype, options: Optional[EpOptions] = None,
                   checks: Optional[str] = None) -> EpHandle:
        """The handle for tokens of ``dtype``, made now if missing (collective over the group),
        with ``options``' capacity and overflow (default: the step's) and the check mode
        ``checks`` (``None``: the group's). An existing handle is returned as it is."""
        handles = self.chunk_handles.get(dtype)
        if handles is not None:
            return handles[0]
        opts = options if options is not None else self.options
        if opts.chunks != self.chunks:
            raise ValueError(f"{self.name}: options.chunks={opts.chunks}, but the layer's step has chunks={self.chunks} "
                             "(one chunk count per layer)")
        n = self.chunks
        kwargs = opts.handle_kwargs()
        group = self.group
        if n > 1:
            if n > group.max_tokens_per_rank:
                raise ValueError(f"{self.name}: chunks={n} is more than {self.max_tokens_option}="
                                 f"{group.max_tokens_per_rank}; chunks must be at most the tokens of a step")
            # Each chunk carries at most ceil(max / n) tokens; capacity stays the step's receive
            # rows, shared by the chunks (capacity_factor is a multiplier of a chunk's own load).
            group = group.with_max_tokens(-(-group.max_tokens_per_rank // n))
            if kwargs["capacity"] is not None:
                kwargs["capacity"] = -(-kwargs["capacity"] // n)
        handles = [group.create_handle(
            top_k=self.top_k, hidden=self.hidden, dtype=dtype, alignment=self.alignment(dtype),
            dispatch_dtype=torch.float8_e4m3fn if self.fp8 else None, checks=checks, **kwargs) for _ in range(n)]
        self.chunk_handles[dtype] = handles
        return handles[0]

    def handle_for(self, tokens: Tensor) -> EpHandle:
        """The handle for ``tokens``' dtype (of a chunked step, the first chunk's); made now where
        missing and ``lazy`` (eagerly only)."""
        return self.handles_for(tokens)[0]

    def handles_for(self, tokens: Tensor) -> List[EpHandle]:
        """The handles for ``tokens``' dtype, one per chunk; made now where missing and ``lazy``."""
        handles = self.chunk_handles.get(tokens.dtype)
        if handles is not None:
            return handles
        if not self.lazy:
            raise RuntimeError(f"{self.name}: no expert-parallel handle for {tokens.dtype} tokens (have "
                               f"{sorted(map(str, self.chunk_handles))}); {self.eager_hint}")
        check_eager(self.name, tokens.dtype, self.chunk_handles, self.eager_hint)
        self.add_handle(tokens.dtype)
        return self.chunk_handles[tokens.dtype]

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
        for handles in self.chunk_handles.values():
            for handle in handles:
                handle.destroy()
        self.chunk_handles = {}

    # ---- the step ----------------------------------------------------------------------

    def _whole(self, what: str) -> None:
        if self.chunks > 1:
            raise RuntimeError(f"{self.name}: {what} runs an unchunked step; a step with chunks={self.chunks} runs "
                               "through EpStep.run, which calls the experts of each chunk")

    def prepare(self, tokens: Tensor, topk_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """The routing exchange alone (collective) for the dispatch of ``tokens``, started before
        the routing weights are known: ``(expert_counts, total)`` for :meth:`dispatch`'s
        ``prepared``."""
        self._whole("EpStep.prepare")
        return ep_prepare(self.handle_for(tokens), topk_idx)

    def dispatch(self, tokens: Tensor, topk_idx: Tensor, topk_weights: Tensor, *,
                 prepared: Optional[Tuple[Tensor, Tensor]] = None, comm: Optional["CommStream"] = None):
        """Sends ``tokens [T, H]`` to the ranks of their experts (collective).

        ``topk_idx [T, K]`` global expert ids, ``topk_weights [T, K]`` (cast to float32,
        differentiable), on the handle of :meth:`handle_for`. ``prepared``: ``prepare``'s
        result where the routing was exchanged already. With ``comm`` the op is queued on the
        communication stream and the result is usable after :meth:`join`; without it, at once.
        A rank whose tokens do not fit (:meth:`bad_input`) raises that message (``ValueError``)
        once the op has failed on every rank.
        """
        self._whole("EpStep.dispatch")
        return self._dispatch(self.handle_for(tokens), self.bad_input(tokens), tokens, topk_idx, topk_weights,
                              prepared, comm)

    def _dispatch(self, handle: EpHandle, bad: Optional[str], tokens: Tensor, topk_idx: Tensor,
                  topk_weights: Tensor, prepared, comm: Optional["CommStream"], order: Optional[Tensor] = None):
        tokens = tokens.contiguous()
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        op = ep_dispatch_fp8 if self.fp8 else ep_dispatch
        return _deferred(bad, handle, lambda: launch(
            comm, lambda: op(handle, tokens, topk_idx, topk_weights, prepared=prepared, order=order),
            (tokens, topk_idx, topk_weights)))

    def join(self, comm: Optional["CommStream"], launched, tokens: Optional[Tensor] = None):
        """The current stream waits for ``launched`` (a :meth:`dispatch` or :meth:`combine`).

        A dispatch becomes a :class:`Dispatched` (``tokens``, the dispatched tokens, required
        then: their dtype and count); a combine's output is returned as it is."""
        if tokens is None:
            return join(comm, launched)
        return self._joined(comm, launched, tokens, self.handle_for(tokens))

    def _joined(self, comm: Optional["CommStream"], launched, tokens: Tensor, handle: EpHandle) -> Dispatched:
        out = join(comm, launched)
        rows = out.dequantize(tokens.dtype) if isinstance(out, Fp8DispatchOutput) else out.tokens
        return Dispatched(rows, out.expert_counts, out.weights, out.total, handle, tokens.shape[0])

    def combine(self, expert_out: Tensor, dispatched: Dispatched, comm: Optional["CommStream"] = None):
        """Weights the experts' rows by their routing weights (bounded by the rows in use; into
        a zero-copy handle's window) and sums them back to their tokens (collective): ``[T, H]``,
        on ``comm`` where given (usable after :meth:`join`)."""
        y = scale_into_window(expert_out, dispatched.weights, dispatched.expert_counts, dispatched.handle)
        return launch(comm, lambda: ep_combine(dispatched.handle, y, dispatched.num_tokens), (y,))

    def run(self, tokens: Tensor, routing, experts: Callable[[Tensor, Tensor], Tensor], *,
            comm: Optional["CommStream"] = None, behind_dispatch: Optional[Callable[[], object]] = None,
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
            experts: the layer's local experts on the received zones (called once per chunk). If
                they offer ``hold_weight_grads(tokens, comm_sms)`` (:class:`te_ep_torch.GroupedExperts`),
                its result for each chunk (made before that chunk's dispatch, which takes its
                ``order``) is passed as ``experts(rows, counts, held=..., grad_into=...)``: their
                weight gradients are then made after the dispatch's backward is queued, under
                its communication (:class:`te_ep_torch.zones.HeldWeightGrads`; with ``comm``,
                their GEMMs leave ``options.comm_sms`` SMs free), and on a zero-copy handle the
                rows' gradient is written into its combine window (``grad_into``), which the
                dispatch's backward reads without a copy.
            comm: the communication stream (:class:`~te_ep_torch.overlap.CommStream`), or
                ``None``: the same calls in the same order, at once.
            behind_dispatch, behind_combine: the caller's work on the current stream while the
                dispatch (``behind_dispatch()``) and the combine (``behind_combine(its
                result)``) run on ``comm``; ``side`` is the last one's result.

        Chunked (``chunks`` > 1): the tokens and their routing are split into ``chunks`` parts
        (``Tensor.tensor_split``: sizes differ by at most one), each dispatched on its own
        handles; every dispatch is queued first, then per chunk: join, experts, combine queued;
        the outputs are concatenated. Results equal the unchunked step's (the same rows meet
        the same experts) unless a handle drops choices (``overflow="drop"`` drops per chunk).
        """
        handles = self.handles_for(tokens)
        bad = self.bad_input(tokens)
        n = len(handles)
        parts = tokens.tensor_split(n) if n > 1 else (tokens,)
        prepared: List[Tuple[Tensor, Tensor]] = []
        launched: list = []
        hold = getattr(experts, "hold_weight_grads", None)
        held: list = []
        sms = self.options.comm_sms if comm is not None else 0

        def on_select(topk_idx: Tensor) -> None:
            idx = topk_idx.tensor_split(n) if n > 1 else (topk_idx,)
            prepared.extend(_deferred(bad, h, lambda: ep_prepare(h, i)) for h, i in zip(handles, idx))

        def on_weights(topk_idx: Tensor, topk_weights: Tensor) -> None:
            idx = topk_idx.tensor_split(n) if n > 1 else (topk_idx,)
            w = topk_weights.tensor_split(n) if n > 1 else (topk_weights,)
            for c in range(n):
                held.append(hold(parts[c], sms) if hold is not None else None)
                launched.append(self._dispatch(handles[c], bad, parts[c], idx[c], w[c],
                                               prepared[c] if prepared else None, comm,
                                               held[c].order if held[c] is not None else None))

        if callable(routing):
            routed = routing(on_select, on_weights)
        else:
            routed = None
            on_weights(*routing)
        if not launched:
            raise RuntimeError(f"{self.name}: the router returned without calling on_weights: nothing was dispatched")
        side = behind_dispatch() if behind_dispatch is not None else None
        combined = []
        for c in range(n):
            d = self._joined(comm, launched[c], parts[c], handles[c])
            run_experts = experts if held[c] is None else functools.partial(
                experts, held=held[c], grad_into=handles[c].combine_buffer() if fits_window(handles[c], d.rows) else None)
            if comm is not None and n > 1:
                run_experts = _carved(run_experts, self.options.comm_sms)
            combined.append(self.combine(run_experts(d.rows, d.expert_counts), d, comm))
        if behind_combine is not None:
            side = behind_combine(side)
        outs = [join(comm, y) for y in combined]
        return (outs[0] if n == 1 else torch.cat(outs)), side, routed
