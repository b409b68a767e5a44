"""Expert-parallel groups and per-layer handles."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops

__all__ = ["EpGroup", "EpHandle", "HandleConfig", "BACKENDS"]

BACKENDS = ("auto", "reference", "nccl_ep")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# NCCL EP moves per-expert routing weights in 16-byte units (create_handle refuses others;
# kNcclEpCountMultiple in csrc/torch/nccl_ep_ops.cpp).
NCCL_EP_EXPERT_MULTIPLE = 4


def _auto_backend(device: torch.device, num_experts: int) -> str:
    """``nccl_ep`` where it loads and fits the group, else ``reference`` (saying why)."""
    if device.type != "cuda":
        return "reference"
    from . import _nccl_ep

    if num_experts % NCCL_EP_EXPERT_MULTIPLE != 0:
        reason = f"it needs num_experts to be a multiple of {NCCL_EP_EXPERT_MULTIPLE}, got {num_experts}"
    else:
        reason = _nccl_ep.availability()
    if not reason:
        try:
            _nccl_ep.load()
            return "nccl_ep"
        except RuntimeError as exc:
            reason = str(exc)
    warnings.warn(f"te_ep_torch: backend='auto' uses 'reference' because nccl_ep can't serve this group: {reason}")
    return "reference"


def _default_device(pg: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(pg)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class HandleConfig:
    """What one MoE layer dispatches: fixed when its handle is created."""

    top_k: int
    hidden: int
    dtype: torch.dtype
    alignment: int
    capacity: int


class EpGroup:
    """An expert-parallel group over a ``torch.distributed`` process group.

    The EP size is the group's size; rank ``r`` owns experts
    ``[r * num_local_experts, (r + 1) * num_local_experts)``. The group is the
    only thing shared between layers: each MoE layer gets its own
    :class:`EpHandle` from :meth:`create_handle`.

    Args:
        process_group: the group to run on; ``None`` means the default (WORLD) group.
        num_experts: global number of experts, divisible by the group size.
        max_tokens_per_rank: most tokens any rank passes in one step (same on all ranks).
        backend: ``"reference"`` (torch.distributed collectives, any device),
            ``"nccl_ep"`` (NVIDIA NCCL EP, CUDA Hopper+) or ``"auto"`` (``nccl_ep``
            where it is usable, else ``reference``).
        device: device of the handles' buffers; defaults to the current CUDA
            device for an NCCL group and to CPU otherwise.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        num_experts: int,
        max_tokens_per_rank: int,
        backend: str = "auto",
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("EpGroup: torch.distributed is not initialized; call init_process_group first")
        pg = process_group if process_group is not None else dist.group.WORLD
        if backend not in BACKENDS:
            raise ValueError(f"EpGroup: backend must be one of {BACKENDS}, got {backend!r}")
        ep_size = dist.get_world_size(pg)
        if not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"EpGroup: num_experts must be a positive int, got {num_experts!r}")
        if num_experts % ep_size != 0:
            raise ValueError(
                f"EpGroup: num_experts ({num_experts}) must be divisible by the EP size ({ep_size})"
            )
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank <= 0:
            raise ValueError(f"EpGroup: max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        dev = torch.device(device) if device is not None else _default_device(pg)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"EpGroup: device must be cpu or cuda, got {dev}")
        if backend == "auto":
            backend = _auto_backend(dev, num_experts)
        elif backend == "nccl_ep" and dev.type != "cuda":
            raise ValueError(f"EpGroup: backend 'nccl_ep' needs a CUDA device, got {dev}")
        if backend == "nccl_ep":
            from . import _nccl_ep

            _nccl_ep.load()

        self.process_group = pg
        self.group_name: str = pg.group_name
        self.rank: int = dist.get_rank(pg)
        self.ep_size: int = ep_size
        self.num_experts: int = num_experts
        self.num_local_experts: int = num_experts // ep_size
        self.max_tokens_per_rank: int = max_tokens_per_rank
        self.backend: str = backend
        self.device: torch.device = dev
        self._handles: "weakref.WeakValueDictionary[int, EpHandle]" = weakref.WeakValueDictionary()
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"EpGroup(group={self.group_name!r}, rank={self.rank}, ep_size={self.ep_size}, "
            f"num_experts={self.num_experts}, max_tokens_per_rank={self.max_tokens_per_rank}, "
            f"backend={self.backend!r}, device={self.device})"
        )

    def worst_case_capacity(self, top_k: int, alignment: int = 1) -> int:
        """Receive rows that no routing can overflow (the default capacity)."""
        # Mirrored by worst_case_rows in csrc/torch/nccl_ep_ops.cpp (picks NCCL EP's overflow policy).
        return self.ep_size * self.max_tokens_per_rank * min(top_k, self.num_local_experts) + self.num_local_experts * (
            alignment - 1
        )

    def create_handle(
        self,
        *,
        top_k: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        alignment: int = 1,
        capacity: Optional[int] = None,
    ) -> "EpHandle":
        """Creates the handle of one MoE layer.

        Args:
            top_k: experts per token.
            hidden: token width.
            dtype: token dtype (bfloat16, float16 or float32).
            alignment: per-expert zone alignment in rows (power of two), e.g. what
                the grouped GEMM after dispatch needs.
            capacity: rows of the receive buffer; ``None`` means
                :meth:`worst_case_capacity`. A step that needs more raises on every rank.
        """
        self._check_open()
        if not isinstance(top_k, int) or not 0 < top_k <= self.num_experts:
            raise ValueError(f"create_handle: top_k must be an int in [1, {self.num_experts}], got {top_k!r}")
        if not isinstance(hidden, int) or hidden <= 0:
            raise ValueError(f"create_handle: hidden must be a positive int, got {hidden!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"create_handle: dtype must be one of {_DTYPES}, got {dtype}")
        if not isinstance(alignment, int) or not _is_power_of_two(alignment):
            raise ValueError(f"create_handle: alignment must be a power of two, got {alignment!r}")
        if capacity is None:
            capacity = self.worst_case_capacity(top_k, alignment)
        elif not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"create_handle: capacity must be a positive int, got {capacity!r}")
        cfg = HandleConfig(top_k=top_k, hidden=hidden, dtype=dtype, alignment=alignment, capacity=capacity)
        handle = EpHandle(self, cfg)
        self._handles[handle.id] = handle
        return handle

    def shutdown(self) -> None:
        """Destroys every handle of the group; the group can't be used afterwards.

        Collective. Destroy CUDA graphs that captured this group's ops first: on the
        ``nccl_ep`` backend they hold NCCL resources that teardown waits for.
        """
        if self._closed:
            return
        for handle in list(self._handles.values()):
            handle.destroy()
        if self.backend == "nccl_ep":
            from . import _nccl_ep

            _nccl_ep.release_group(self.group_name)
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EpGroup: the group was shut down; create a new EpGroup")

    def __enter__(self) -> "EpGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class EpHandle:
    """The routing state of one MoE layer (created by :meth:`EpGroup.create_handle`).

    A handle holds the routing of its most recent :meth:`prepare`; dispatch,
    combine and their backward use it, so a layer's backward must run before
    its handle is prepared again. Layers with different ``top_k``, ``hidden``,
    ``dtype``, ``alignment`` or ``capacity`` each have their own handle.
    """

    def __init__(self, group: EpGroup, config: HandleConfig) -> None:
        self.group = group
        self.config = config
        self.id, self.handle_mem = ops.create_handle(
            group.group_name,
            group.backend,
            group.num_experts,
            group.max_tokens_per_rank,
            config.top_k,
            config.hidden,
            config.capacity,
            config.alignment,
            config.dtype,
            group.device,
        )
        self._generation = 0
        self._alive = True

    def __repr__(self) -> str:
        return f"EpHandle(id={self.id}, {self.config}, group={self.group.group_name!r})"

    @property
    def alive(self) -> bool:
        return self._alive

    def prepare(self, topk_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """Exchanges this step's routing (collective).

        Returns ``(expert_counts, total)``: rows per local expert zone (alignment
        padding included, int32 ``[E_local]``) and their sum (int32 ``[1]``), on device.
        """
        if not torch.compiler.is_compiling():
            self._generation += 1
        return ops.prepare(topk_idx, self.handle_mem, self.group.group_name, self.id, self.group.num_local_experts)

    def destroy(self) -> None:
        """Releases the handle (idempotent)."""
        if self._alive:
            self._alive = False
            ops.destroy_handle(self.id)


