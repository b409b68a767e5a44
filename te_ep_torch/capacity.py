"""Where the receive rows of a handle are decided, and what a step past them does.

One file for every capacity rule a user can reach (``EpGroup.create_handle``, ``te.MoE``,
``parallelize_moe_model``, the TorchTitan and transformers integrations all come here):

* :func:`worst_case` -- rows no routing can overflow (every token of every rank on this
  rank's experts), the default;
* :func:`capacity_for_factor` -- ``capacity_factor`` as Megatron, GShard and TorchTitan mean
  it, a multiplier of the mean receive load, and :func:`check_capacity_factor`, its one
  argument rule;
* :func:`nccl_ep_capacity_floor` -- the least capacity NCCL EP takes;
* :func:`expert_share` and :func:`drop_past_share` -- the drop rule of ``overflow="drop"``:
  each local expert's share of the rows, and which choices go past it.

The C++ side checks the resulting capacity against the same floor and worst case
(``handle_config`` of the communication ops); docs/ops.md, "Capacity", states the contract.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .ops.comm import worst_case_capacity as _worst_case_capacity

if TYPE_CHECKING:  # the group imports this module
    from .group import EpGroup

__all__ = [
    "capacity_for_factor",
    "check_capacity_factor",
    "drop_past_share",
    "expert_share",
    "nccl_ep_capacity_floor",
    "worst_case",
]


def worst_case(ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int, alignment: int = 1) -> int:
    """Receive rows that no routing can overflow: every token of every rank sends
    ``min(top_k, num_local_experts)`` choices to this rank's experts, plus every zone's padding
    (the default capacity; ``EpGroup.worst_case_capacity``)."""
    return _worst_case_capacity(ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment)


def nccl_ep_capacity_floor(max_tokens_per_rank: int) -> int:
    """The least capacity ``nccl_ep`` takes: NCCL EP's receive budget may not be below its send
    budget, ``max_tokens_per_rank`` rounded up to a multiple of :data:`NCCL_EP_EXPERT_MULTIPLE`.
    The rule is the C++ backend's (``nccl_ep_capacity_floor`` in csrc/comm/backend.h)."""
    return int(torch.ops.te_ep._nccl_ep_capacity_floor(max_tokens_per_rank))


def check_capacity_factor(factor: object, what: str, same_rows: str = "") -> None:
    """The one rule for a ``capacity_factor`` argument (``EpGroup.create_handle``, ``MoE``,
    ``parallelize_moe_model``, the TorchTitan and transformers integrations): ``None`` (the worst
    case) or a finite number >= 1.0, else ``ValueError`` naming ``what``. ``same_rows`` ends the
    message for a value of the removed fractional meaning (what gives its old rows).

    The factor multiplies the mean receive load of a rank (:meth:`EpGroup.capacity_for_factor`).
    Values below 1.0 are refused rather than taken: they size the buffer below what a balanced
    routing puts on every rank, so the ordinary step would raise (``overflow="raise"``, the
    default) or drop choices (``"drop"``; docs/ops.md, "Capacity"); and (0, 1) is the range of
    the old meaning (a fraction of the worst case), whose configurations would otherwise run
    with other rows."""
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor):
        raise ValueError(f"{what}: capacity_factor must be None (the worst case) or a finite number >= 1.0 (a "
                         f"multiplier of the mean receive load, typically 1.0 to 2.0), got {factor!r}")
    if 0 < factor < 1:
        raise ValueError(
            f"{what}: capacity_factor is now a multiplier of the mean receive load of a rank (the Megatron/GShard/"
            "TorchTitan meaning: capacity_factor x top_k x max_tokens_per_rank rows plus zone padding) and must be "
            f">= 1.0 (typically 1.0 to 2.0; None = the worst case), got {factor!r}. Its old meaning, a fraction of "
            "the worst case, was removed in te_ep_torch 0.3.0; "
            + (same_rows or "the old fraction f gives the rows of capacity_factor = f x EP size x min(top_k, experts "
                            "per rank) / top_k"))
    if factor < 1:
        raise ValueError(f"{what}: capacity_factor must be None (the worst case) or >= 1.0 (a multiplier of the mean "
                         f"receive load, typically 1.0 to 2.0), got {factor!r}")


def capacity_for_factor(ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int, alignment: int,
                        factor: float) -> int:
    """The receive rows of ``capacity_factor=factor`` for any sizes, with or without a group (e.g. a table of
    buffer sizes over EP sizes): ``ceil(factor * top_k * max_tokens_per_rank)`` plus every
    zone's padding, within [:func:`nccl_ep_capacity_floor`, the worst case]."""
    for name, value in (("ep_size", ep_size), ("max_tokens_per_rank", max_tokens_per_rank), ("top_k", top_k),
                        ("num_local_experts", num_local_experts), ("alignment", alignment)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"capacity_for_factor: {name} must be a positive int, got {value!r}")
    if not _is_power_of_two(alignment):
        raise ValueError(f"capacity_for_factor: alignment must be a power of two, got {alignment!r}")
    if factor is None:
        raise ValueError("capacity_for_factor: factor must be a number >= 1.0, got None (the worst case is "
                         "worst_case_capacity)")
    check_capacity_factor(factor, "capacity_for_factor", _old_fraction_rows(
        ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment, factor))
    rows = math.ceil(factor * top_k * max_tokens_per_rank) + num_local_experts * (alignment - 1)
    return _within_bounds(rows, ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment)


def _within_bounds(rows: int, ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int,
                   alignment: int) -> int:
    """``rows`` raised to NCCL EP's floor and lowered to the worst case (the floor wins where
    the worst case is below it: top_k=1 at EP size 1)."""
    floor = nccl_ep_capacity_floor(max_tokens_per_rank)
    worst = worst_case(ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment)
    return min(max(rows, floor), max(floor, worst))


def _old_fraction_rows(ep_size: int, max_tokens_per_rank: int, top_k: int, num_local_experts: int, alignment: int,
                       factor: object) -> str:
    """The end of the message that refuses a factor of the removed fractional meaning: the
    capacity that fraction gave (of the worst case's token rows, plus padding)."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor < 1:
        return ""
    rows = math.ceil(factor * ep_size * max_tokens_per_rank * min(top_k, num_local_experts))
    rows += num_local_experts * (alignment - 1)
    rows = _within_bounds(rows, ep_size, max_tokens_per_rank, top_k, num_local_experts, alignment)
    return f"for the receive rows it gave, pass capacity={rows} instead"


def _is_power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def expert_share(capacity: int, worst: int, num_local_experts: int, alignment: int, overflow: str) -> Optional[int]:
    """Receive rows each local expert may fill under ``overflow="drop"``: an equal share of the
    capacity, ``capacity // num_local_experts`` rounded down to ``alignment`` (GShard's expert
    capacity). ``None`` where nothing is dropped: ``overflow="raise"``, or a capacity at the
    worst case ``worst``, which no routing overflows."""
    if overflow != "drop" or capacity >= worst:
        return None
    return capacity // num_local_experts // alignment * alignment


def drop_past_share(group: "EpGroup", topk_idx: Tensor, share: int, dropped: Tensor) -> Tensor:
    """``topk_idx`` with the choices past their expert's ``share`` of receive rows set to -1
    (``overflow="drop"``; :func:`expert_share`), each dropped choice counted in ``dropped``
    (``[E]`` int64, on the device: ``EpHandle.dropped``). Collective over ``group`` when its EP
    size is above 1.

    The order is global: source rank, then token, then choice. A choice's place in its
    expert's queue is its place among this rank's choices of that expert plus the choices
    of that expert on the ranks before it (one all-gather of ``[E]`` counts, on the
    device). Ids outside ``[0, E)`` are left as they are, for the ops' checks."""
    num_experts = group.num_experts
    flat = topk_idx.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # invalid ids form a last group of their own
    expert = torch.where(valid, flat, 0)  # an index for every choice; `valid` masks what it reads
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).index_add_(
        0, key, torch.ones_like(key))
    order = torch.sort(key, stable=True).indices
    starts = counts.cumsum(0) - counts
    place = torch.empty_like(key)
    place[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    if group.ep_size > 1:
        from torch.distributed import _functional_collectives as funcol

        every = funcol.all_gather_tensor(counts[:num_experts].contiguous(), 0, group.group_name)
        before = every.view(group.ep_size, num_experts)[: group.rank].sum(0)
        place = place + before[expert]
    drop = valid & (place >= share)
    dropped.index_add_(0, expert, drop.to(torch.int64))
    return torch.where(drop.view(topk_idx.shape), torch.full_like(topk_idx, -1), topk_idx)
