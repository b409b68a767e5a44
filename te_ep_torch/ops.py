"""Typed wrappers of the ``te_ep`` communication ops, and the fake kernels of every ``te_ep`` op.

The ops themselves are declared in ``csrc/library.cpp``; their contract
is ``docs/ops.md`` (communication) and ``docs/permutation.md`` (permutation).
Fake kernels compute output shapes from input shapes and int arguments alone,
so ``torch.compile`` never needs the process group or routing values. This
module is the one home of the fakes; the autograd formulas of both op
families are in ``autograd.py``, the DTensor rules of the permutation ops in
``_dtensor_rules.py`` (docs/ops.md, "Per-op map").
"""

from __future__ import annotations

import functools
import inspect
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ._loader import load_library

load_library()

__all__ = [
    "create_handle",
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
    "quantize_fp8",
    "dequantize_fp8",
    "FP8_BLOCK",
]

# FP8 dispatch and the quantize ops scale blocks of this many values of a row.
FP8_BLOCK = 128

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


def watchdog_state() -> Tuple[str, int, int]:
    """The nccl_ep watchdog (docs/nccl_ep.md, "Timeouts"): ``(action, ops and markers
    pending, times fired)``; action is ``$TE_EP_WATCHDOG`` (``"exit"``, ``"warn"``,
    ``"off"``). Raises ``RuntimeError`` naming the variable for any other value of it."""
    action, pending, fired = torch.ops.te_ep._watchdog_state()
    return str(action), int(pending), int(fired)


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


def quantize_fp8(x: Tensor, pow2_scales: bool = False) -> Tuple[Tensor, Tensor]:
    """Block-scaled e4m3: ``x [T, H]`` -> ``(values [T, H] float8_e4m3fn, scales [T, H / 128] float32)``.

    ``x ~= values * scale`` per block of 128 values of a row; ``pow2_scales`` makes every
    scale a power of two. The exact rules (zero and non-finite blocks, rounding) are in
    docs/ops.md, "FP8", and :mod:`te_ep_torch.testing.fp8_reference`.
    """
    return torch.ops.te_ep.quantize_fp8(x, pow2_scales)


def dequantize_fp8(values: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values * scale`` per block of 128, computed in float32 and returned in ``dtype``."""
    return torch.ops.te_ep.dequantize_fp8(values, scales, dtype)


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


# ---- fake kernels: permutation ops -----------------------------------------------
# The Python API (argument defaults, PermuteMap) is te_ep_torch/permutation.py.

_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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


# ---- fake kernels: FP8 quantization ----------------------------------------------


def _check_fp8_rows(op: str, name: str, t: Tensor) -> None:
    _check(t.dim() == 2, f"{op}: {name} must be 2-D [T, H], got shape {tuple(t.shape)}")
    _check(t.shape[1] % FP8_BLOCK == 0,
           f"{op}: {name}.size(1) (H) must be a multiple of the block size {FP8_BLOCK}, got H = {t.shape[1]}")


@torch.library.register_fake("te_ep::quantize_fp8")
def _quantize_fp8_fake(x, pow2_scales=False):
    op = "te_ep.quantize_fp8"
    _check(x.dtype in _ROW_DTYPES, f"{op}: x must be torch.bfloat16, torch.float16 or torch.float32, got {x.dtype}")
    _check_fp8_rows(op, "x", x)
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], x.shape[1] // FP8_BLOCK), dtype=torch.float32))


@torch.library.register_fake("te_ep::dequantize_fp8")
def _dequantize_fp8_fake(values, scales, dtype):
    op = "te_ep.dequantize_fp8"
    _check(values.dtype == torch.float8_e4m3fn, f"{op}: values must be torch.float8_e4m3fn, got {values.dtype}")
    _check_fp8_rows(op, "values", values)
    _check(scales.dtype == torch.float32, f"{op}: scales must be torch.float32, got {scales.dtype}")
    _check(scales.dim() == 2 and scales.shape[0] == values.shape[0] and scales.shape[1] == values.shape[1] // FP8_BLOCK,
           f"{op}: scales must have shape [{values.shape[0]}, {values.shape[1] // FP8_BLOCK}], got {tuple(scales.shape)}")
    _check(dtype in _ROW_DTYPES, f"{op}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    return values.new_empty(values.shape, dtype=dtype)


# ---- fake kernels: zone ops ----------------------------------------------------------


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
