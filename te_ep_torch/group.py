"""Expert-parallel groups and per-layer handles."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _agreement, _nccl_ep, capacity as _capacity
from .ops import comm, watchdog
# Moved to te_ep_torch.capacity (0.4.0); kept importable from here.
from .capacity import capacity_for_factor, check_capacity_factor, nccl_ep_capacity_floor  # noqa: F401
from .capacity import _is_power_of_two, _old_fraction_rows

__all__ = ["EpGroup", "EpHandle", "HandleConfig", "BACKENDS", "NCCL_EP_MODES", "DEFAULT_NCCL_EP_MODE", "CHECKS", "OVERFLOWS"]

BACKENDS = ("auto", "reference", "nccl_ep")
NCCL_EP_MODES = ("auto", "zero_copy", "staged")
# The nccl_ep transport a group runs where none is asked for, everywhere a user can reach it
# (EpGroup, te.MoE, parallelize_moe_model, the TorchTitan and transformers integrations);
# docs/nccl_ep.md, "Modes", names the run that decided it. EpGroup always passes the mode to
# the create_handle op, whose schema keeps 0.2.0's default (docs/ops.md, "create_handle").
DEFAULT_NCCL_EP_MODE = "zero_copy"
# How a handle catches bad input (docs/ops.md, "Check modes"); the first is the default.
CHECKS = ("local", "device", "synchronous")
# What a step whose routing needs more receive rows than the capacity does (docs/ops.md,
# "Capacity"): raise on every rank, or drop the choices past each expert's share.
OVERFLOWS = ("raise", "drop")

_log = logging.getLogger("te_ep_torch")
_modes_logged: set = set()

# NCCL EP moves per-expert routing weights in 16-byte units; create_handle refuses other
# expert counts (the constant lives in csrc/comm/backend.h).
NCCL_EP_EXPERT_MULTIPLE = _nccl_ep.expert_multiple()


def _auto_backend(device: torch.device, num_experts: int, hosts: Sequence[str]) -> str:
    """``nccl_ep`` where it loads and fits the group, else ``reference`` (saying why)."""
    if device.type != "cuda":
        return "reference"
    topology = nccl_ep_topology_error(hosts, num_experts)
    if num_experts % NCCL_EP_EXPERT_MULTIPLE != 0:
        reason = f"it needs num_experts to be a multiple of {NCCL_EP_EXPERT_MULTIPLE}, got {num_experts}"
    elif topology:
        reason = topology
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


def _host_name() -> str:
    """The host this rank runs on, as NCCL EP's teams see it (tests simulate hosts here)."""
    return socket.gethostname()


def nccl_ep_topology_error(hosts: Sequence[str], num_experts: int) -> str:
    """Why NCCL EP can't form its teams over ranks on ``hosts`` (rank ``r`` on ``hosts[r]``),
    or ``""``. NCCL EP splits the group into equal NVLink teams of consecutive ranks, one per
    host, and asserts (aborting the process) where it can't: every host must hold the same
    number of ranks, the ranks of a host must be consecutive (host-major order), and the
    experts must divide evenly over the ranks."""
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    layout = "; ".join(f"host {host!r}: ranks {ranks}" for host, ranks in by_host.items())
    sizes = {len(ranks) for ranks in by_host.values()}
    if len(sizes) > 1:
        return (f"NCCL EP needs the same number of ranks on every host (its NVLink teams are equal), got {layout}; "
                "launch as many ranks on every host, or use backend='reference'")
    if any(ranks != list(range(ranks[0], ranks[0] + len(ranks))) for ranks in by_host.values()):
        return (f"NCCL EP needs the ranks in host-major order (the ranks of each host consecutive: ranks 0..k-1 on "
                f"the first host, k..2k-1 on the next, ...), got {layout}; launch with torchrun's default rank "
                "assignment, or use backend='reference'")
    if num_experts % len(hosts):
        return f"NCCL EP needs num_experts divisible by the group size {len(hosts)}, got num_experts={num_experts}"
    return ""


def _default_device(pg: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(pg)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timeout_ms(timeout, pg: dist.ProcessGroup, device: torch.device) -> int:
    """NCCL EP's wait limit in ms: ``timeout``, else the process group's timeout, else 0
    (NCCL EP's default) where the group does not expose one."""
    if timeout is None:
        try:
            timeout = pg._get_backend(torch.device(device.type)).options._timeout
        except (AttributeError, RuntimeError):
            return 0
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"EpGroup: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return max(1, int(seconds * 1000))


@dataclasses.dataclass(frozen=True)
class HandleConfig:
    """What one MoE layer dispatches: fixed when its handle is created."""

    top_k: int
    hidden: int
    dtype: torch.dtype
    alignment: int
    capacity: int
    # torch.float8_e4m3fn for a handle that also dispatches block-scaled FP8
    # (ep_dispatch_fp8); combine and gradients stay in ``dtype``.
    dispatch_dtype: Optional[torch.dtype] = None
    # How the handle catches bad input: one of CHECKS (docs/ops.md, "Check modes").
    checks: str = "local"
    # What a step that overflows the capacity does: one of OVERFLOWS.
    overflow: str = "raise"


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
        nccl_ep_mode: how the ``nccl_ep`` backend moves tokens (docs/nccl_ep.md,
            "Modes"): ``"zero_copy"`` (the default, ``DEFAULT_NCCL_EP_MODE``: receive
            and combine rows in NCCL symmetric windows owned by each handle; the faster
            dispatch, ``prepare`` and combine, and less step memory), ``"staged"``
            (through NCCL EP's own buffers into tensors from the caching allocator) or
            ``"auto"`` (zero-copy where every rank can allocate window memory, else
            staged, with a warning). Each handle reports the mode it runs in
            (:attr:`EpHandle.mode`).
        timeout: ``nccl_ep`` only: how long an op may take, on the host and on the GPU (a
            ``datetime.timedelta`` or seconds). NCCL EP's kernels wait for the other
            ranks without a limit; te_ep's watchdog ends a process whose op has not
            returned, or whose op's GPU work has not finished, this long after the host
            entered the op (exit code 70, a message naming the op, handle, group and
            rank; ``$TE_EP_WATCHDOG``; docs/nccl_ep.md, "Timeouts").
            ``None``: the process group's own timeout, so a lost rank is detected no
            later than by torch's collectives.
        checks: how the group's handles catch bad routing, capacity overflow, bad op
            arguments and ranks running different handles (docs/ops.md, "Check modes"; a
            handle may override it, :meth:`create_handle`): ``"local"`` (the default: each
            rank drops its own bad expert ids on the device and raises at its next
            ``prepare`` or :meth:`EpHandle.check`; no host sync, no extra collective),
            ``"device"`` (the ranks agree on the device, one small all-reduce per op; a failed
            step moves nothing and returns zeros everywhere, and every rank raises at
            :meth:`EpHandle.check` or a later ``prepare``) or ``"synchronous"`` (every op
            waits and agrees on the host; every rank raises in the op; for debugging). The
            reference backend raises in the op on every rank whatever is chosen.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        num_experts: int,
        max_tokens_per_rank: int,
        backend: str = "auto",
        device: Optional[Union[torch.device, str]] = None,
        nccl_ep_mode: str = DEFAULT_NCCL_EP_MODE,
        timeout: Union[None, float, datetime.timedelta] = None,
        checks: str = "local",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("EpGroup: torch.distributed is not initialized; call init_process_group first")
        pg = process_group if process_group is not None else dist.group.WORLD
        ep_size = dist.get_world_size(pg)
        # Every rank's host, for the rules NCCL EP would otherwise assert on (collective,
        # before any argument is checked, so every rank runs it whatever it was passed).
        hosts: List[str] = [""] * ep_size
        dist.all_gather_object(hosts, _host_name(), group=pg)

        def validated() -> Tuple[str, str, torch.device]:
            mode = nccl_ep_mode
            if backend not in BACKENDS:
                raise ValueError(f"EpGroup: backend must be one of {BACKENDS}, got {backend!r}")
            if mode not in NCCL_EP_MODES:
                raise ValueError(f"EpGroup: nccl_ep_mode must be one of {NCCL_EP_MODES}, got {mode!r}")
            if checks not in CHECKS:
                raise ValueError(f"EpGroup: checks must be one of {CHECKS}, got {checks!r}")
            if not isinstance(num_experts, int) or num_experts <= 0:
                raise ValueError(f"EpGroup: num_experts must be a positive int, got {num_experts!r}")
            if num_experts % ep_size != 0:
                raise ValueError(
                    f"EpGroup: num_experts ({num_experts}) must be divisible by the EP size ({ep_size})"
                )
            if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank <= 0:
                raise ValueError(
                    f"EpGroup: max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}"
                )
            dev = torch.device(device) if device is not None else _default_device(pg)
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"EpGroup: device must be cpu or cuda, got {dev}")
            chosen = backend
            if chosen == "auto":
                chosen = _auto_backend(dev, num_experts, hosts)
            elif chosen == "nccl_ep" and nccl_ep_topology_error(hosts, num_experts):
                raise ValueError(f"EpGroup: backend 'nccl_ep': {nccl_ep_topology_error(hosts, num_experts)}")
            elif chosen == "nccl_ep" and dev.type != "cuda":
                raise ValueError(f"EpGroup: backend 'nccl_ep' needs a CUDA device, got {dev}")
            if chosen == "nccl_ep":
                _nccl_ep.load()
            return chosen, mode, dev, _timeout_ms(timeout, pg, dev)

        # Collective: every rank validates, then all agree (docs/ops.md, "Configuration
        # agreement"), so an error on one rank or a mismatch raises on every rank.
        result, error = _agreement.local_error(validated)
        backend, nccl_ep_mode, dev, timeout_ms = result if result is not None else (backend, nccl_ep_mode, None, None)
        _agreement.agree(pg, "EpGroup", {
            "num_experts": num_experts,
            "max_tokens_per_rank": max_tokens_per_rank,
            "backend": backend,
            "nccl_ep_mode": nccl_ep_mode,
            "device type": dev.type if dev is not None else None,
            "timeout_ms": timeout_ms,
            "checks": checks,
        }, error)

        # Held by name, like the ops hold it: a reference to the ProcessGroup itself would keep
        # it (and gloo's worker threads) alive after dist.destroy_process_group(), and a worker
        # still releasing a finished collective's tensors while Python finalizes aborts the
        # process ("terminate called without an active exception").
        self.group_name: str = pg.group_name
        self.rank: int = dist.get_rank(pg)
        self.ep_size: int = ep_size
        self.num_experts: int = num_experts
        self.num_local_experts: int = num_experts // ep_size
        self.max_tokens_per_rank: int = max_tokens_per_rank
        self.backend: str = backend
        self.device: torch.device = dev
        self.nccl_ep_mode: str = nccl_ep_mode
        # NCCL EP's wait limit in ms (0: NCCL EP's own default); see the `timeout` argument.
        self.timeout_ms: int = timeout_ms
        # The default check mode of the group's handles (the `checks` argument).
        self.checks: str = checks
        self._handles: "weakref.WeakValueDictionary[int, EpHandle]" = weakref.WeakValueDictionary()
        self._closed = False
        # Groups over the same ranks with another max_tokens_per_rank (with_max_tokens), and the
        # group whose sibling this is (None: a group the user made).
        self._timeout = timeout
        self._siblings: Dict[int, "EpGroup"] = {}
        self._parent: Optional["EpGroup"] = None

    def __repr__(self) -> str:
        return (
            f"EpGroup(group={self.group_name!r}, rank={self.rank}, ep_size={self.ep_size}, "
            f"num_experts={self.num_experts}, max_tokens_per_rank={self.max_tokens_per_rank}, "
            f"backend={self.backend!r}, device={self.device})"
        )

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group's ``torch.distributed`` process group, looked up by name (an ``EpGroup`` does
        not keep it alive); raises ``RuntimeError`` once it was destroyed."""
        try:
            return dist.distributed_c10d._resolve_process_group(self.group_name)
        except RuntimeError as exc:
            raise RuntimeError(
                f"EpGroup: process group {self.group_name!r} no longer exists (dist.destroy_process_group ran?)"
            ) from exc

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` ran."""
        return self._closed

    def with_max_tokens(self, max_tokens_per_rank: int) -> "EpGroup":
        """This group's ranks and options with another ``max_tokens_per_rank``: what the handles
        of a chunked step (:class:`~te_ep_torch.step.EpStep`, ``chunks``) are made on, each
        chunk carrying at most that many tokens. Collective the first time for a value; the
        group is kept, shared by the layers of this group, and shut down with it."""
        self.check_open()
        if max_tokens_per_rank == self.max_tokens_per_rank:
            return self
        sibling = self._siblings.get(max_tokens_per_rank)
        if sibling is None or sibling.closed:
            sibling = EpGroup(self.process_group, num_experts=self.num_experts, max_tokens_per_rank=max_tokens_per_rank,
                              backend=self.backend, device=self.device, nccl_ep_mode=self.nccl_ep_mode,
                              timeout=self._timeout, checks=self.checks)
            sibling._parent = self
            self._siblings[max_tokens_per_rank] = sibling
        return sibling

    def worst_case_capacity(self, top_k: int, alignment: int = 1) -> int:
        """Receive rows that no routing can overflow (the default capacity)."""
        return _capacity.worst_case(self.ep_size, self.max_tokens_per_rank, top_k, self.num_local_experts, alignment)

    def capacity_for_factor(self, top_k: int, alignment: int, factor: float) -> int:
        """Receive rows for ``capacity_factor=factor``: the one rule behind every
        ``capacity_factor`` argument (:meth:`create_handle`, ``MoE``, the integrations).

        ``factor`` multiplies the mean receive load of a rank, as ``capacity_factor`` does in
        Megatron, GShard and TorchTitan: every rank sends ``max_tokens_per_rank`` tokens with
        ``top_k`` choices each, so a rank receives ``top_k * max_tokens_per_rank`` rows on
        average. The capacity is ``ceil(factor * top_k * max_tokens_per_rank)`` plus every
        zone's padding (``num_local_experts * (alignment - 1)``), at least NCCL EP's floor
        (:func:`nccl_ep_capacity_floor`) and at most :meth:`worst_case_capacity`. E.g. 4096
        tokens per rank, top-8 of 256 experts, alignment 16, factor 1.25: at 4 ranks (64
        experts each) ``ceil(1.25 * 8 * 4096) + 64 * 15 = 41920`` rows, against a worst case
        of ``4 * 4096 * 8 + 960 = 132032``; at 64 ranks (4 experts each) ``40960 + 4 * 15 =
        41020`` against ``64 * 4096 * 4 + 60 = 1048636``: the mean load does not grow with
        the EP size, the worst case does.

        ``factor`` must be a number >= 1.0 (:func:`check_capacity_factor` says why). A step
        whose routing needs more rows than the capacity raises ``capacity overflow``: on every
        rank on the reference backend, on ``nccl_ep`` as the handle's check mode says
        (docs/ops.md, "Capacity").
        """
        return capacity_for_factor(self.ep_size, self.max_tokens_per_rank, top_k, self.num_local_experts, alignment,
                                   factor)

    def capacity_for(self, topk_idx: Tensor, alignment: int = 1, headroom: float = 0.1) -> int:
        """A capacity fitted to a measured routing (collective).

        Returns the receive rows the routing ``topk_idx [T, K]`` of this rank needs on the
        busiest rank, zone padding included, plus ``headroom`` (a fraction), at least
        NCCL EP's floor and at most :meth:`worst_case_capacity`. Measure it on a few
        representative batches (e.g. the largest of the first steps' values); a later step
        that needs more raises ``capacity overflow`` (docs/ops.md). A smaller capacity
        means smaller receive windows and buffers (:meth:`EpHandle.memory`). Bad arguments
        on any rank raise ``ValueError`` on every rank.
        """

        def validated() -> Tensor:
            if topk_idx.dim() != 2:
                raise ValueError(f"capacity_for: topk_idx must be 2-D [T, K], got shape {tuple(topk_idx.shape)}")
            if not _is_power_of_two(alignment):
                raise ValueError(f"capacity_for: alignment must be a power of two, got {alignment!r}")
            if headroom < 0:
                raise ValueError(f"capacity_for: headroom must be >= 0, got {headroom!r}")
            idx = topk_idx.to(self.device, torch.int64)
            if bool(((idx < -1) | (idx >= self.num_experts)).any()):
                raise ValueError(f"capacity_for: topk_idx holds expert ids outside [-1, {self.num_experts})")
            return idx

        # Every rank validates, then all agree before the all-reduce: a rank with bad input
        # raises together with the others instead of leaving them in the all-reduce.
        idx, error = _agreement.local_error(validated)
        _agreement.agree(self.process_group, "capacity_for", {
            "top_k": topk_idx.shape[-1] if topk_idx.dim() else None, "alignment": alignment, "headroom": headroom,
        }, error)
        top_k = idx.shape[1]
        valid = idx >= 0
        # A token counts once per distinct expert (the backends merge repeated ids).
        token = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)
        pairs = torch.unique(token[valid] * self.num_experts + idx[valid])
        counts = torch.bincount(pairs % self.num_experts, minlength=self.num_experts).to(torch.int64)
        dist.all_reduce(counts, group=self.process_group)
        padded = (counts + alignment - 1) // alignment * alignment
        need = int(padded.view(self.ep_size, self.num_local_experts).sum(dim=1).max())
        floor = nccl_ep_capacity_floor(self.max_tokens_per_rank)
        fitted = max(floor, int(need * (1.0 + headroom)) + 1)
        return min(fitted, max(floor, self.worst_case_capacity(top_k, alignment)))

    def create_handle(
        self,
        *,
        top_k: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        alignment: int = 1,
        capacity: Optional[int] = None,
        capacity_factor: Optional[float] = None,
        dispatch_dtype: Optional[torch.dtype] = None,
        checks: Optional[str] = None,
        overflow: str = "raise",
    ) -> "EpHandle":
        """Creates the handle of one MoE layer.

        Collective over the group's process group: the ranks agree on the arguments, the
        group's backend and NCCL EP mode, and the handle's check mode, and every rank raises
        the same ``ValueError`` if any differs (docs/ops.md, "Configuration agreement").

        Args:
            top_k: experts per token.
            hidden: token width.
            dtype: token dtype (bfloat16, float16 or float32).
            alignment: per-expert zone alignment in rows (power of two), e.g. what
                the grouped GEMM after dispatch needs.
            capacity: rows of the receive buffer; ``None`` means
                :meth:`worst_case_capacity` (on ``nccl_ep`` at least ``max_tokens_per_rank``
                rounded up to a multiple of 4, NCCL EP's floor, which the worst case of
                ``top_k=1`` at EP size 1 can fall below). A step that needs more raises on
                every rank.
            capacity_factor: the capacity as a multiplier (>= 1.0, typically 1.0 to 2.0) of
                the mean receive load of a rank, ``top_k * max_tokens_per_rank`` rows, plus
                zone padding (:meth:`capacity_for_factor`); at most one of ``capacity`` and
                ``capacity_factor``. Both ``None``: the worst case.
            dispatch_dtype: ``torch.float8_e4m3fn`` lets the handle dispatch block-scaled
                FP8 rows as well (:func:`te_ep_torch.ep_dispatch_fp8`; ``hidden`` a multiple
                of 128, of 512 on ``nccl_ep``); combine and all gradients stay in ``dtype``.
                ``None``: ``dtype`` dispatch only.
            checks: the handle's check mode (one of :data:`CHECKS`; see :class:`EpGroup`);
                ``None``: the group's.
            overflow: what a step whose routing needs more rows than the capacity does:
                ``"raise"`` (on every rank, nothing is dropped) or ``"drop"``: each local
                expert gets an equal share of the receive rows (``capacity // E_local``,
                rounded down to ``alignment``: GShard's expert capacity), and the choices
                past an expert's share, in the order (source rank, token, choice), are
                dropped before the exchange: they contribute nothing to the output, get a
                zero weight gradient, and are counted in :attr:`EpHandle.dropped`. The same
                choices on every backend. With the worst-case capacity nothing overflows,
                so nothing is dropped.
        """
        self.check_open()
        checks = self.checks if checks is None else checks

        def validated() -> int:
            # Python checks what the op schema can't express (types); the value rules are the C++
            # side's (handle_config in csrc/comm/comm_ops.cpp), asked before the ranks agree.
            for name, value in (("top_k", top_k), ("hidden", hidden), ("alignment", alignment)):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"create_handle: {name} must be an int, got {value!r}")
            if not isinstance(dtype, torch.dtype) or not (dispatch_dtype is None or isinstance(dispatch_dtype,
                                                                                               torch.dtype)):
                raise ValueError(f"create_handle: dtype and dispatch_dtype must be torch.dtypes, got {dtype!r} and "
                                 f"{dispatch_dtype!r}")
            if not isinstance(checks, str):
                raise ValueError(f"create_handle: checks must be one of {CHECKS}, got {checks!r}")
            if overflow not in OVERFLOWS:
                raise ValueError(f"create_handle: overflow must be one of {OVERFLOWS}, got {overflow!r}")
            if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)):
                raise ValueError(f"create_handle: capacity must be an int, got {capacity!r}")
            if capacity is not None and capacity_factor is not None:
                raise ValueError(f"create_handle: pass capacity (rows) or capacity_factor (a multiplier of the mean "
                                 f"load), not both; got capacity={capacity!r}, capacity_factor={capacity_factor!r}")
            fitted = capacity
            sized = top_k > 0 and _is_power_of_two(alignment)  # else handle_config_error names them
            if capacity_factor is not None:
                check_capacity_factor(capacity_factor, "create_handle", _old_fraction_rows(
                    self.ep_size, self.max_tokens_per_rank, top_k, self.num_local_experts, alignment,
                    capacity_factor) if sized else "")
                if sized:
                    fitted = self.capacity_for_factor(top_k, alignment, capacity_factor)
            elif capacity is None and sized:
                fitted = self.worst_case_capacity(top_k, alignment)
                if self.backend == "nccl_ep":
                    fitted = max(fitted, nccl_ep_capacity_floor(self.max_tokens_per_rank))
            error = comm.handle_config_error(
                self.group_name, self.backend, self.num_experts, self.max_tokens_per_rank, top_k, hidden,
                fitted if fitted is not None else 0, alignment, dtype, self.device, self.nccl_ep_mode,
                dispatch_dtype, self.timeout_ms, checks)
            if error:
                raise ValueError(error)
            if self.backend == "nccl_ep":
                watchdog.watchdog_state()  # a bad $TE_EP_WATCHDOG raises here, agreed like any argument error
            return fitted

        # Collective: every rank validates, then all agree on the handle's configuration, the
        # group's backend and NCCL EP mode included (agreed by EpGroup too, but two EpGroups over
        # one process group can differ, and a rank that called another group's create_handle
        # would enter NCCL EP's handle creation alone), and its check mode: ranks in different
        # modes would run different collectives in every op.
        fitted, error = _agreement.local_error(validated)
        _agreement.agree(self.process_group, "create_handle", {
            "top_k": top_k, "hidden": hidden, "dtype": dtype, "alignment": alignment,
            "capacity": fitted if fitted is not None else capacity, "dispatch_dtype": dispatch_dtype,
            "backend": self.backend, "nccl_ep_mode": self.nccl_ep_mode, "checks": checks, "overflow": overflow,
        }, error)
        capacity = fitted
        cfg = HandleConfig(top_k=top_k, hidden=hidden, dtype=dtype, alignment=alignment, capacity=capacity,
                           dispatch_dtype=dispatch_dtype, checks=checks, overflow=overflow)
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
        for sibling in self._siblings.values():
            sibling.shutdown()
        for handle in list(self._handles.values()):
            handle.destroy()
        # The NCCL EP groups of a torch group go together, a sibling's with its parent's.
        if self.backend == "nccl_ep" and self._parent is None:
            _nccl_ep.release_group(self.group_name)
        self._closed = True

    def check(self) -> None:
        """:meth:`EpHandle.check` of every live handle of the group (waits for the GPU)."""
        self.check_open()
        for handle in list(self._handles.values()):
            handle.check()

    def check_open(self) -> None:
        """Raises ``RuntimeError`` if :meth:`shutdown` ran (what the group's handles check too)."""
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
        self.id, self.handle_mem = comm.create_handle(
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
            group.nccl_ep_mode,
            config.dispatch_dtype,
            group.timeout_ms,
            config.checks,
        )
        # The id as a CPU tensor, which the ops take under torch.compile (see op_ids).
        self.key = torch.tensor([self.id], dtype=torch.int64)
        # overflow="drop": each local expert's share of the receive rows, None where nothing
        # can overflow (the worst-case capacity) or overflow raises.
        self.expert_share: Optional[int] = _capacity.expert_share(
            config.capacity, group.worst_case_capacity(config.top_k, config.alignment), group.num_local_experts,
            config.alignment, config.overflow)
        # Choices this rank dropped per global expert since the handle was made (int64 [E],
        # on the device, never read back by te_ep: no host sync).
        self.dropped = torch.zeros(group.num_experts, dtype=torch.int64, device=group.device)
        self._generation = 0
        self._alive = True
        self.mode, self.mode_reason, self._window_bytes, self._handle_mem_bytes = comm.handle_info(self.id)
        _log_mode_once(group, self)

    def __repr__(self) -> str:
        return f"EpHandle(id={self.id}, mode={self.mode!r}, {self.config}, group={self.group.group_name!r})"

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def generation(self) -> int:
        """How many times the handle was prepared (eagerly); autograd checks it in backward."""
        return self._generation

    def op_ids(self) -> Tuple[int, Optional[Tensor]]:
        """The ``(handle_id, handle_key)`` arguments of the communication ops.

        Eagerly ``(id, None)``. Under torch.compile ``(-1, key)``: the graph then takes the
        handle's id as an input tensor rather than a constant it guards on, so one compiled
        graph serves the MoE layers of every handle alike (docs/ops.md, "One graph for
        every layer"). ``key`` is a CPU int64 tensor holding ``id``; do not modify it.
        """
        if torch.compiler.is_compiling():
            return -1, self.key
        return self.id, None

    def memory(self) -> Dict[str, int]:
        """Device bytes this handle holds for its whole life.

        ``window_bytes``: NCCL symmetric windows (zero-copy mode: the receive rows and the
        combine rows, ``2 * capacity * hidden * element size``; 0 otherwise);
        ``handle_mem_bytes``: the routing state. Staged and reference handles allocate
        their receive buffers per call from the caching allocator instead. Not counted: an
        ``nccl_ep`` handle's small bookkeeping buffers (the routed ids of the last prepare,
        ``max_tokens_per_rank * top_k * 8`` bytes, a byte per token, an int per local expert,
        and the check records), from the caching allocator.
        """
        return {"window_bytes": self._window_bytes, "handle_mem_bytes": self._handle_mem_bytes}

    @property
    def check_mode(self) -> str:
        """The check mode the handle runs (docs/ops.md, "Check modes"): its ``checks``
        (``"local"``, ``"device"`` or ``"synchronous"``) on ``nccl_ep``; ``"synchronous"`` on the
        reference backend, which raises in the op on every rank whatever was asked."""
        return comm.check_mode(self.id)

    def check(self) -> None:
        """Raises an error an earlier step recorded that no op has raised yet: in the
        ``"device"`` check mode the one the ranks agreed on, alike on every rank; in the
        ``"local"`` mode this rank's own (bad routing it dropped, a capacity overflow); a
        no-op in the ``"synchronous"`` mode, which raises in the op. Waits for the GPU: call
        it where the training loop synchronizes anyway (e.g. when it reads the loss), or after
        a CUDA graph's replay."""
        if self._alive:
            comm.check_handle(self.id)

    def combine_buffer(self) -> Optional[Tensor]:
        """Zero-copy mode: the ``[capacity, hidden]`` tensor that combine reads from.

        Writing the (weighted) expert output into it, e.g. ``torch.mul(y, w, out=buf)``,
        makes :func:`ep_combine` of ``buf`` skip its copy into the window. Combine consumes
        the buffer's content (NCCL EP reduces inside it), and it is rewritten by this
        handle's next combine, ``combine_bwd`` and ``dispatch_bwd`` (docs/ops.md, "Lifetime
        of returned tensors"). ``None`` in the staged and reference modes, where combine
        reads any tensor directly.
        """
        self.group.check_open()
        return comm.combine_buffer(self.id)

    def prepare(self, topk_idx: Tensor) -> Tuple[Tensor, Tensor]:
        """Exchanges this step's routing (collective).

        Returns ``(expert_counts, total)``: rows per local expert zone (alignment
        padding included, int32 ``[E_local]``) and their sum (int32 ``[1]``), on device.
        :func:`te_ep_torch.ops.ep_prepare` of this handle.
        """
        return comm.ep_prepare(self, topk_idx)

    def begin_step(self, topk_idx: Tensor) -> Tensor:
        """What every prepare of a step does before its op (``prepare`` and ``ep_dispatch``
        alike): a new generation, and with an ``expert_share`` the choices past it dropped
        (:func:`te_ep_torch.capacity.drop_past_share`). Returns the routing the op gets."""
        # A prepare inside a running backward is activation checkpointing recomputing
        # this layer's forward: the same routing again, which the original graph's
        # backward nodes (made at the older generation) may use.
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1:
            self._generation += 1
        if self.expert_share is not None:
            topk_idx = _capacity.drop_past_share(self.group, topk_idx, self.expert_share, self.dropped)
        return topk_idx

    def destroy(self) -> None:
        """Releases the handle (idempotent)."""
        if self._alive:
            self._alive = False
            comm.destroy_handle(self.id)


def _log_mode_once(group: EpGroup, handle: EpHandle) -> None:
    """Says once per process and mode how nccl_ep handles move tokens; warns on a fallback."""
    if handle.mode == "reference" or (group.group_name, handle.mode) in _modes_logged:
        return
    _modes_logged.add((group.group_name, handle.mode))
    if handle.mode == "staged" and group.nccl_ep_mode == "auto":
        warnings.warn(f"te_ep_torch: nccl_ep handles of group {group.group_name!r} run staged: {handle.mode_reason}")
    else:
        _log.info("te_ep_torch: nccl_ep handles of group %r run %s (%s)", group.group_name, handle.mode,
                  handle.mode_reason)
