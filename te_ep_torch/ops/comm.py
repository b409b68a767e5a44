"""The communication family (``te_ep::create_handle`` ... ``combine_bwd``; C++ in ``csrc/comm/``
and ``csrc/nccl_ep/``): typed wrappers of the handle and communication ops, their fake kernels,
and their autograd: :func:`ep_prepare`, :func:`ep_dispatch`, :func:`ep_dispatch_fp8` and
:func:`ep_combine`, the differentiable API over the ops that carries the :class:`EpHandle`.

The ops are declared in ``csrc/library.cpp``; their contract is ``docs/ops.md``. Fake kernels
compute output shapes from input shapes and int arguments alone, so ``torch.compile`` never
needs the process group or routing values. The autograd Functions call registered ops only,
so they trace under ``torch.compile``: the backward of dispatch is a combine of the gradient
(plus the gradient of ``topk_weights``), the backward of combine is a dispatch of the gradient.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ._library import _check
from .fp8 import FP8_BLOCK, dequantize_fp8, quantize_fp8

if TYPE_CHECKING:  # group.py imports this package: the handle's type for annotations only
    from ..group import EpHandle

__all__ = [
    "create_handle",
    "handle_config_error",
    "destroy_handle",
    "live_handles",
    "handle_info",
    "combine_buffer",
    "check_mode",
    "check_handle",
    "worst_case_capacity",
    "prepare",
    "dispatch",
    "prepare_dispatch",
    "dispatch_fp8",
    "prepare_dispatch_fp8",
    "combine",
    "dispatch_bwd",
    "combine_bwd",
    "DispatchOutput",
    "Fp8DispatchOutput",
    "ep_prepare",
    "ep_dispatch",
    "ep_dispatch_fp8",
    "ep_combine",
]

# The communication ops' overloads, looked up once: the wrappers below run on every step, and
# resolving ``torch.ops.te_ep.<name>`` costs about 0.3 us a call (measured on a CPU).
_te_ep = torch.ops.te_ep
_PREPARE = _te_ep.prepare.default
_DISPATCH = _te_ep.dispatch.default
_PREPARE_DISPATCH = _te_ep.prepare_dispatch.default
_DISPATCH_FP8 = _te_ep.dispatch_fp8.default
_PREPARE_DISPATCH_FP8 = _te_ep.prepare_dispatch_fp8.default
_COMBINE = _te_ep.combine.default
_DISPATCH_BWD = _te_ep.dispatch_bwd.default
_COMBINE_BWD = _te_ep.combine_bwd.default


# ---- typed wrappers: communication ops ---------------------------------------------


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
    dispatch_dtype: Optional[torch.dtype] = None,
    timeout_ms: int = 0,
    checks: str = "local",
) -> Tuple[int, Tensor]:
    """Registers a per-layer handle; returns ``(handle_id, handle_mem)``."""
    return torch.ops.te_ep.create_handle(
        group_name, backend, num_experts, max_tokens_per_rank, top_k, hidden, capacity, alignment, dtype, device,
        nccl_ep_mode, dispatch_dtype, timeout_ms, checks,
    )


def handle_config_error(
    group_name: str, backend: str, num_experts: int, max_tokens_per_rank: int, top_k: int, hidden: int,
    capacity: int, alignment: int, dtype: torch.dtype, device: torch.device, nccl_ep_mode: str = "staged",
    dispatch_dtype: Optional[torch.dtype] = None, timeout_ms: int = 0, checks: str = "local",
) -> str:
    """The first rule :func:`create_handle`'s arguments break (``""`` if none), creating nothing."""
    return str(torch.ops.te_ep._handle_config_error(
        group_name, backend, num_experts, max_tokens_per_rank, top_k, hidden, capacity, alignment, dtype, device,
        nccl_ep_mode, dispatch_dtype, timeout_ms, checks,
    ))


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


def check_mode(handle_id: int) -> str:
    """How a handle catches bad input: ``"local"``, ``"device"`` or ``"synchronous"`` (docs/ops.md, "Check modes")."""
    return str(torch.ops.te_ep.check_mode(handle_id))


def check_handle(handle_id: int) -> None:
    """Raises an error the ranks agreed on (device checks) that no op raised yet; waits for the GPU."""
    torch.ops.te_ep.check_handle(handle_id)


def combine_buffer(handle_id: int) -> Optional[Tensor]:
    """The zero-copy combine window of a handle, ``None`` in the other modes."""
    return torch.ops.te_ep.combine_buffer(handle_id)


def worst_case_capacity(ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int,
                        alignment: int) -> int:
    """Receive rows that no routing can overflow (one formula, in csrc/comm/core/routing.cpp)."""
    return int(torch.ops.te_ep.worst_case_capacity(ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment))


def prepare(
    topk_idx: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, num_local_experts: int,
    handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exchanges routing; returns ``(expert_counts [E_local] int32, total [1] int32)``.

    ``handle_key`` (every communication op takes it): ``None``, or the handle's
    :attr:`~te_ep_torch.EpHandle.key` with ``handle_id=-1``, which torch.compile treats as
    data rather than a constant (docs/ops.md, "One graph for every layer").
    """
    return _PREPARE(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key)


def dispatch(
    tokens: Tensor, topk_weights: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, capacity: int,
    handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Sends tokens to experts; returns ``(recv_tokens [capacity, H], recv_weights [capacity])``."""
    return _DISPATCH(tokens, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key)


def prepare_dispatch(
    tokens: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle_mem: Tensor, group_name: str, handle_id: int,
    num_local_experts: int, capacity: int, handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``prepare`` then ``dispatch`` in one call: ``(recv_tokens, recv_weights, expert_counts, total)``.

    Under ``checks="local"`` one op (on ``nccl_ep``, NCCL EP's two calls back to back);
    otherwise the two ops, each agreed on across ranks as on its own (docs/ops.md).
    """
    return _PREPARE_DISPATCH(tokens, topk_idx, topk_weights, handle_mem, group_name, handle_id, num_local_experts,
                             capacity, handle_key)


def dispatch_fp8(
    values: Tensor, scales: Tensor, topk_weights: Tensor, handle_mem: Tensor, group_name: str, handle_id: int,
    capacity: int, handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """FP8 dispatch: ``(recv_values [capacity, H] e4m3, recv_scales [capacity, H / 128] f32, recv_weights)``."""
    return _DISPATCH_FP8(values, scales, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key)


def prepare_dispatch_fp8(
    values: Tensor, scales: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle_mem: Tensor, group_name: str,
    handle_id: int, num_local_experts: int, capacity: int, handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``prepare`` then ``dispatch_fp8`` in one call, as :func:`prepare_dispatch` for bfloat16:
    ``(recv_values, recv_scales, recv_weights, expert_counts, total)``."""
    return _PREPARE_DISPATCH_FP8(values, scales, topk_idx, topk_weights, handle_mem, group_name, handle_id,
                                 num_local_experts, capacity, handle_key)


def combine(expert_out: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, num_tokens: int,
            handle_key: Optional[Tensor] = None) -> Tensor:
    """Returns expert outputs to their tokens and sums them: ``[num_tokens, H]``."""
    return _COMBINE(expert_out, handle_mem, group_name, handle_id, num_tokens, handle_key)


def dispatch_bwd(
    grad_recv_tokens: Tensor,
    grad_recv_weights: Tensor,
    handle_mem: Tensor,
    group_name: str,
    handle_id: int,
    num_tokens: int,
    top_k: int,
    handle_key: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Backward of dispatch: ``(grad_tokens [T, H], grad_topk_weights [T, K])``."""
    return _DISPATCH_BWD(
        grad_recv_tokens, grad_recv_weights, handle_mem, group_name, handle_id, num_tokens, top_k, handle_key
    )


def combine_bwd(grad_out: Tensor, handle_mem: Tensor, group_name: str, handle_id: int, capacity: int,
                handle_key: Optional[Tensor] = None) -> Tensor:
    """Backward of combine: ``[capacity, H]``, each slot receiving its token's gradient."""
    return _COMBINE_BWD(grad_out, handle_mem, group_name, handle_id, capacity, handle_key)


# ---- fake kernels: communication ops ----------------------------------------------


def _misrouted(handle_mem: Tensor) -> bool:
    """True when real tensors reached a fake kernel.

    That happens when an argument is on the meta device: the dispatcher then
    picks the Meta kernel although the handle is real. Running the real kernel
    instead lets it reject the device mismatch on every rank.
    """
    return not is_fake(handle_mem) and handle_mem.device.type != "meta"


def _comm_fake(name: str):
    """Registers the fake kernel of communication op ``te_ep::<name>``. Every such fake
    first hands real tensors that reached it (``_misrouted``) to the real kernel of the
    handle's device, with the arguments as the op received them."""
    op = getattr(torch.ops.te_ep, name)

    def register(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            handle_mem = bound.arguments["handle_mem"]
            if _misrouted(handle_mem):
                key = torch._C.DispatchKey.CUDA if handle_mem.is_cuda else torch._C.DispatchKey.CPU
                return op.default.redispatch(torch._C.DispatchKeySet(key), *bound.args)
            return fake(*args, **kwargs)

        torch.library.register_fake(f"te_ep::{name}")(checked)
        return checked

    return register


@_comm_fake("prepare")
def _prepare_fake(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key=None):
    torch._check(topk_idx.dim() == 2, lambda: f"te_ep.prepare: topk_idx must be 2-D, got {topk_idx.dim()}-D")
    counts = handle_mem.new_empty((num_local_experts,), dtype=torch.int32)
    total = handle_mem.new_empty((1,), dtype=torch.int32)
    return counts, total


@_comm_fake("dispatch")
def _dispatch_fake(tokens, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key=None):
    torch._check(tokens.dim() == 2, lambda: f"te_ep.dispatch: tokens must be 2-D, got {tokens.dim()}-D")
    torch._check(
        topk_weights.dtype == torch.float32,
        lambda: f"te_ep.dispatch: topk_weights must be float32, got {topk_weights.dtype}",
    )
    recv = tokens.new_empty((capacity, tokens.shape[1]))
    weights = tokens.new_empty((capacity,), dtype=torch.float32)
    return recv, weights


@_comm_fake("prepare_dispatch")
def _prepare_dispatch_fake(tokens, topk_idx, topk_weights, handle_mem, group_name, handle_id, num_local_experts,
                           capacity, handle_key=None):
    counts, total = _prepare_fake(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key)
    recv, weights = _dispatch_fake(tokens, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key)
    return recv, weights, counts, total


@_comm_fake("dispatch_fp8")
def _dispatch_fp8_fake(values, scales, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key=None):
    op = "te_ep.dispatch_fp8"
    _check(values.dim() == 2, f"{op}: values must be 2-D, got {values.dim()}-D")
    _check(values.dtype == torch.float8_e4m3fn, f"{op}: values must be torch.float8_e4m3fn, got {values.dtype}")
    _check(scales.dim() == 2 and scales.dtype == torch.float32, f"{op}: scales must be float32 [T, H / {FP8_BLOCK}]")
    _check(topk_weights.dtype == torch.float32, f"{op}: topk_weights must be float32, got {topk_weights.dtype}")
    return (
        values.new_empty((capacity, values.shape[1])),
        scales.new_empty((capacity, scales.shape[1])),
        scales.new_empty((capacity,)),
    )


@_comm_fake("prepare_dispatch_fp8")
def _prepare_dispatch_fp8_fake(values, scales, topk_idx, topk_weights, handle_mem, group_name, handle_id,
                               num_local_experts, capacity, handle_key=None):
    counts, total = _prepare_fake(topk_idx, handle_mem, group_name, handle_id, num_local_experts, handle_key)
    recv = _dispatch_fp8_fake(values, scales, topk_weights, handle_mem, group_name, handle_id, capacity, handle_key)
    return (*recv, counts, total)


@_comm_fake("combine")
def _combine_fake(expert_out, handle_mem, group_name, handle_id, num_tokens, handle_key=None):
    torch._check(expert_out.dim() == 2, lambda: f"te_ep.combine: expert_out must be 2-D, got {expert_out.dim()}-D")
    return expert_out.new_empty((num_tokens, expert_out.shape[1]))


@_comm_fake("dispatch_bwd")
def _dispatch_bwd_fake(grad_recv_tokens, grad_recv_weights, handle_mem, group_name, handle_id, num_tokens, top_k,
                       handle_key=None):
    grad_tokens = grad_recv_tokens.new_empty((num_tokens, grad_recv_tokens.shape[1]))
    grad_weights = grad_recv_weights.new_empty((num_tokens, top_k))
    return grad_tokens, grad_weights


@_comm_fake("combine_bwd")
def _combine_bwd_fake(grad_out, handle_mem, group_name, handle_id, capacity, handle_key=None):
    return grad_out.new_empty((capacity, grad_out.shape[1]))


# ---- autograd: ep_prepare / ep_dispatch / ep_dispatch_fp8 / ep_combine ---------------


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
    return dispatch_bwd(
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
        return (*dispatch(tokens, topk_weights, handle.handle_mem, group_name, handle_id,
                          handle.config.capacity, key), None, None)
    return prepare_dispatch(tokens, topk_idx, topk_weights, handle.handle_mem, group_name, handle_id,
                            handle.group.num_local_experts, handle.config.capacity, key)


def _combine_op(handle: EpHandle, expert_out: Tensor, num_tokens: int) -> Tensor:
    handle_id, key = handle.op_ids()
    return combine(expert_out, handle.handle_mem, handle.group.group_name, handle_id, num_tokens, key)


def ep_prepare(handle: EpHandle, topk_idx: Tensor) -> Tuple[Tensor, Tensor]:
    """Exchanges this step's routing on ``handle`` (collective): the ``prepare`` op, after
    :meth:`EpHandle.begin_step` (a new generation; with an ``expert_share``, the choices past
    it dropped). :meth:`EpHandle.prepare` calls it.

    Returns ``(expert_counts, total)``: rows per local expert zone (alignment
    padding included, int32 ``[E_local]``) and their sum (int32 ``[1]``), on device; pass
    them as ``prepared`` to :func:`ep_dispatch` / :func:`ep_dispatch_fp8`.
    """
    handle_id, key = handle.op_ids()
    return prepare(handle.begin_step(topk_idx), handle.handle_mem, handle.group.group_name, handle_id,
                   handle.group.num_local_experts, key)

class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, topk_weights: Tensor, handle: EpHandle, topk_idx: Optional[Tensor],
                order: Optional[Tensor]):
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
        return grad_tokens, grad_topk_weights, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out: Tensor, handle: EpHandle, num_tokens: int):
        out = _combine_op(handle, expert_out, num_tokens)
        _save_handle(ctx, handle)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        handle, handle_mem, handle_id, key = _saved_handle(ctx, "ep_combine")
        grad_expert_out = combine_bwd(
            grad_out.contiguous(), handle_mem, handle.group.group_name, handle_id, handle.config.capacity, key
        )
        return grad_expert_out, None, None


def ep_dispatch(
    handle: EpHandle,
    tokens: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    prepared: Optional[Tuple[Tensor, Tensor]] = None,
    *,
    order: Optional[Tensor] = None,
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
        order: a tensor whose autograd node must run its backward after this dispatch's
            backward has been queued (:attr:`te_ep_torch.zones.HeldWeightGrads.order`); never
            read, and it gets no gradient.

    Returns:
        :class:`DispatchOutput`; gradients flow back to ``tokens`` and ``topk_weights``.
    """
    # Without a prepared routing, one op prepares and dispatches (prepare_dispatch).
    topk_idx = handle.begin_step(topk_idx) if prepared is None else None
    if _needs_graph(tokens, topk_weights):
        out = _Dispatch.apply(tokens, topk_weights, handle, topk_idx, order)
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
        values, scales = quantize_fp8(tokens, pow2_scales)
    cfg = handle.config
    handle_id, key = handle.op_ids()
    group_name = handle.group.group_name
    if topk_idx is None:
        out = (*dispatch_fp8(values, scales, topk_weights, handle.handle_mem, group_name, handle_id, cfg.capacity,
                             key), None, None)
    else:
        out = prepare_dispatch_fp8(values, scales, topk_idx, topk_weights, handle.handle_mem, group_name,
                                   handle_id, handle.group.num_local_experts, cfg.capacity, key)
    recv_values, recv_scales, recv_weights, counts, total = out
    sink = recv_weights.new_zeros((), dtype=cfg.dtype).expand(cfg.capacity, cfg.hidden)
    return recv_values, recv_scales, recv_weights, sink, counts, total


class _DispatchFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, scales: Optional[Tensor], topk_weights: Tensor, handle: EpHandle,
                pow2_scales: bool, unchecked: bool, topk_idx: Optional[Tensor], order: Optional[Tensor]):
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
            return None, None, None, None, None, None, None, None
        cfg = ctx.handle.config
        handle_mem = ctx.saved_tensors[0]
        if grad_rows is None:
            grad_rows = handle_mem.new_zeros((cfg.capacity, cfg.hidden), dtype=cfg.dtype)
        if grad_weights is None:
            grad_weights = handle_mem.new_zeros((cfg.capacity,), dtype=torch.float32)
        grad_tokens, grad_topk_weights = _dispatch_backward(ctx, grad_rows, grad_weights, "ep_dispatch_fp8")
        return grad_tokens, None, grad_topk_weights, None, None, None, None, None


class _DequantizeRows(torch.autograd.Function):
    """``dequantize_fp8(values, scales)`` whose gradient is handed to ``sink``."""

    @staticmethod
    def forward(ctx, values: Tensor, scales: Tensor, sink: Tensor, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(values, scales, dtype)

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
    order: Optional[Tensor] = None,
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
        order: as in :func:`ep_dispatch`.

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
            out = _DispatchFp8.apply(tokens, scales, topk_weights, handle, pow2_scales, bad is not None, topk_idx,
                                      order)
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
