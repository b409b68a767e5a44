"""Two expert-parallel MoE blocks with the same parameters and the same math.

* :class:`NativeMoEBlock` is the plain PyTorch way (as TorchTitan writes it):
  count the rows per expert, exchange the counts with ``all_to_all_single``,
  copy them to the host (``.tolist()``) to get split sizes, sort the
  (token, expert) pairs by expert, ``all_to_all_single`` the rows, regroup
  them by local expert, run the experts, and undo everything in reverse,
  ending with a weighted sum over each token's k expert outputs.
* :class:`TeEpMoEBlock` does the same with te_ep_torch: ``ep_dispatch``
  returns a fixed-size expert-major buffer with on-device zone sizes, the
  grouped GEMM runs straight on it, and ``ep_combine`` brings the rows back.

Both blocks: a replicated float32 router (softmax, top-k; with
``MoEConfig.normalize_weights``, the default, the k weights are normalised to sum 1,
without it they are the softmax scores themselves, as in ``te_ep_torch.moe.TopKRouter``'s
softmax default), ``E / W`` SwiGLU experts per rank with stacked
weights ``w_gate, w_up [E_local, H, F]`` and ``w_down [E_local, F, H]``, and
``y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])``, where the weighting is a
multiply in the token dtype and the sum accumulates in float32. Expert ``e``'s
weights are drawn from a generator seeded with ``(seed, e)``, so the model is
the same whatever the EP size; :func:`copy_parameters` copies a block's
parameters into the other.

Experts run either through ``torch._grouped_mm`` (one kernel per projection,
offsets read on the device) or through a loop over the local experts (host-side
sizes; any device and dtype); ``gemm="auto"`` picks the grouped GEMM where
:func:`te_ep_torch.moe.grouped_mm_supported` says it has a fast kernel, the
decision :class:`te_ep_torch.moe.MoE` makes too.

Used by docs/tutorial.md, benchmarks/timeline.py and tests/test_moe_blocks.py:
``from te_ep_torch.testing.moe_blocks import NativeMoEBlock, TeEpMoEBlock`` (and
``ComputeOnlyMoEBlock``, the EP block's compute-only stand-in).
benchmarks/bench_moe_layer.py times :class:`te_ep_torch.moe.MoE` itself against
:class:`NativeMoEBlock`: :func:`copy_parameters_to_moe` and :func:`moe_gradients` map the
native block's parameters onto the layer's (:data:`MOE_PARAMETERS`), and
:class:`ComputeOnlyMoE` is the layer's compute-only stand-in.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..group import EpGroup, EpHandle
from ..moe import EXPERT_IMPLS, grouped_mm_supported
from ..options import EpOptions
from ..overlap import comm_stream_for
from ..permutation import permute, unpermute
from ..step import EpStep
from ..zones import expert_ffn, zone_scale

__all__ = [
    "ComputeOnlyMoE",
    "ComputeOnlyMoEBlock",
    "MOE_PARAMETERS",
    "copy_parameters_to_moe",
    "fwd_bwd",
    "moe_gradients",
    "GEMMS",
    "MoEConfig",
    "NativeMoEBlock",
    "TeEpMoEBlock",
    "copy_parameters",
    "resolve_gemm",
]

# The choices of GroupedExperts(impl=...): "auto", "grouped_mm", "loop".
GEMMS = EXPERT_IMPLS


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """What both blocks agree on."""

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16
    # Inner width of a dense SwiGLU shared expert every token also goes through
    # (its output is added unweighted); 0 = none.
    shared_ffn: int = 0
    # Rescale each token's k routing weights to sum to 1. te_ep_torch.moe.TopKRouter's
    # default for softmax scores is False (the weights are the scores): pass
    # normalize_weights=moe.router.normalize_weights to compute what a MoE computes.
    normalize_weights: bool = True


def resolve_gemm(gemm: str, device: torch.device, dtype: torch.dtype, *dims: int) -> str:
    """``"auto"`` -> ``"grouped_mm"`` where it has a fast kernel, else ``"loop"``.

    ``dims`` are the feature dims of the operands (hidden, FFN size); the decision is
    :func:`te_ep_torch.moe.grouped_mm_supported`'s.
    """
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    if gemm == "auto":
        return "grouped_mm" if grouped_mm_supported(device, dtype, *dims) else "loop"
    if gemm == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"gemm='grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks")
    return gemm


def swiglu_grouped_mm(x: Tensor, offs: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """SwiGLU experts over the zones of ``x [M, H]`` ending at ``offs [E_local]`` (int32).

    Rows at and after ``offs[-1]`` are not computed: their output is whatever
    the allocator held (``torch._grouped_mm`` leaves them unwritten).
    """
    gate = torch._grouped_mm(x, w_gate, offs=offs)
    up = torch._grouped_mm(x, w_up, offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down, offs=offs)


def swiglu_loop(x: Tensor, counts: List[int], w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """SwiGLU experts over consecutive zones of ``counts[e]`` rows; rows after the last zone give zeros."""
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = x[start : start + n]
            outs.append((F.silu(h @ w_gate[e]) * (h @ w_up[e])) @ w_down[e])
        start += n
    if start < x.shape[0] or not outs:
        outs.append(x.new_zeros(x.shape[0] - start, w_down.shape[-1]))
    return torch.cat(outs)


class _MoEBase(torch.nn.Module):
    """Parameters, router and expert math shared by both blocks."""

    def __init__(
        self, config: MoEConfig, ep_rank: int, ep_size: int, device: torch.device, gemm: str, seed: int
    ) -> None:
        super().__init__()
        if config.num_experts % ep_size:
            raise ValueError(f"num_experts ({config.num_experts}) must be divisible by the EP size ({ep_size})")
        if not 0 < config.top_k <= config.num_experts:
            raise ValueError(f"top_k must be in [1, {config.num_experts}], got {config.top_k}")
        self.config = config
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_local_experts = config.num_experts // ep_size
        self.device = torch.device(device)
        self.gemm = resolve_gemm(gemm, self.device, config.dtype, config.hidden, config.ffn)
        h, f, e_local = config.hidden, config.ffn, self.num_local_experts
        kw = dict(device=self.device)
        # The router is replicated: every rank holds the same [E, H] float32 weights.
        self.router = torch.nn.Parameter(torch.empty(config.num_experts, h, dtype=torch.float32, **kw))
        self.w_gate = torch.nn.Parameter(torch.empty(e_local, h, f, dtype=config.dtype, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(e_local, h, f, dtype=config.dtype, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(e_local, f, h, dtype=config.dtype, **kw))
        if config.shared_ffn:
            fs = config.shared_ffn
            self.shared_gate = torch.nn.Parameter(torch.empty(h, fs, dtype=config.dtype, **kw))
            self.shared_up = torch.nn.Parameter(torch.empty(h, fs, dtype=config.dtype, **kw))
            self.shared_down = torch.nn.Parameter(torch.empty(fs, h, dtype=config.dtype, **kw))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draws every expert from its global id, so the model does not depend on the EP size."""
        cfg = self.config
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.router.copy_(torch.randn(cfg.num_experts, cfg.hidden, generator=gen) * cfg.hidden**-0.5)
        first = self.ep_rank * self.num_local_experts
        for e in range(self.num_local_experts):
            gen.manual_seed(seed * 1_000_003 + 1 + first + e)
            self.w_gate[e].copy_(torch.randn(cfg.hidden, cfg.ffn, generator=gen) * cfg.hidden**-0.5)
            self.w_up[e].copy_(torch.randn(cfg.hidden, cfg.ffn, generator=gen) * cfg.hidden**-0.5)
            self.w_down[e].copy_(torch.randn(cfg.ffn, cfg.hidden, generator=gen) * cfg.ffn**-0.5)
        if cfg.shared_ffn:
            gen.manual_seed(seed * 1_000_003 + 1 + cfg.num_experts)
            self.shared_gate.copy_(torch.randn(cfg.hidden, cfg.shared_ffn, generator=gen) * cfg.hidden**-0.5)
            self.shared_up.copy_(torch.randn(cfg.hidden, cfg.shared_ffn, generator=gen) * cfg.hidden**-0.5)
            self.shared_down.copy_(torch.randn(cfg.shared_ffn, cfg.hidden, generator=gen) * cfg.shared_ffn**-0.5)

    def route(self, x: Tensor):
        """``(topk_weights [T, K] float32, topk_idx [T, K] int64)``."""
        scores = F.linear(x.float(), self.router).softmax(dim=-1)
        topk_weights, topk_idx = scores.topk(self.config.top_k, dim=-1)
        if self.config.normalize_weights:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_idx

    def _zone_experts(self, tokens: Tensor, expert_counts: Tensor) -> Tensor:
        """The experts on expert-major rows in ``E_local`` zones of ``expert_counts`` rows:
        te_ep_torch.zones' expert FFN (work bounded by the rows in use) with the grouped GEMM."""
        if self.gemm == "grouped_mm":
            return expert_ffn(tokens, expert_counts, (self.w_gate, self.w_up), self.w_down, impl="grouped_mm")
        # The loop needs the zone sizes on the host: a sync the grouped GEMM avoids.
        return swiglu_loop(tokens, expert_counts.tolist(), self.w_gate, self.w_up, self.w_down)

    def shared(self, x: Tensor) -> Optional[Tensor]:
        """The shared expert's output for ``x``, ``None`` without one."""
        return self._shared_down(self._shared_gate_up(x))

    def _shared_gate_up(self, x: Tensor) -> Optional[Tensor]:
        """The shared expert's first half, ``silu(x @ gate) * (x @ up)``; ``None`` without one."""
        if not self.config.shared_ffn:
            return None
        return F.silu(x @ self.shared_gate) * (x @ self.shared_up)

    def _shared_down(self, h: Optional[Tensor]) -> Optional[Tensor]:
        """The shared expert's second half, ``h @ down``; ``None`` without one."""
        return None if h is None else h @ self.shared_down

    def _with_shared(self, y: Tensor, x: Tensor) -> Tensor:
        shared = self.shared(x)
        return y if shared is None else y + shared

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.config.hidden:
            raise ValueError(f"x must be [T, {self.config.hidden}], got {list(x.shape)}")
        if x.dtype != self.config.dtype:
            raise ValueError(f"x must be {self.config.dtype}, got {x.dtype}")


class NativeMoEBlock(_MoEBase):
    """Expert parallelism written with ``all_to_all_single`` and index ops.

    Args:
        config: sizes and dtype.
        process_group: the EP group (``None``: WORLD).
        device: where parameters live (the group's device).
        alignment: each local expert's zone is padded with zero rows to a
            multiple of this (what a grouped GEMM may want); 1 = no padding.
        gemm: ``"grouped_mm"``, ``"loop"`` or ``"auto"``.
        seed: parameter seed (see :meth:`reset_parameters`).
    """

    def __init__(
        self,
        config: MoEConfig,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        device: torch.device,
        alignment: int = 1,
        gemm: str = "auto",
        seed: int = 0,
    ) -> None:
        pg = process_group if process_group is not None else dist.group.WORLD
        super().__init__(config, dist.get_rank(pg), dist.get_world_size(pg), device, gemm, seed)
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        self.process_group = pg
        self.alignment = alignment

    @property
    def process_group(self) -> dist.ProcessGroup:
        # Kept by name, as EpGroup and te.Router keep theirs: a block alive at exit must not keep
        # the process group (and gloo's worker threads) alive past dist.destroy_process_group().
        return dist.distributed_c10d._resolve_process_group(self._group_name)

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup) -> None:
        self._group_name = group.group_name

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        cfg, world, local = self.config, self.ep_size, self.num_local_experts
        num_tokens, top_k = x.shape[0], cfg.top_k
        topk_weights, topk_idx = self.route(x)
        expert_of_pair = topk_idx.reshape(-1)

        # 1. Rows per global expert; after the exchange, recv_counts[r * L + e] is
        #    how many rows rank r sends to our local expert e.
        counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.process_group)

        # 2. all_to_all_single takes split sizes as host ints: the host waits for the GPU here.
        host = torch.cat([counts, recv_counts]).tolist()
        send_splits = [sum(host[r * local : (r + 1) * local]) for r in range(world)]
        recv_host = host[cfg.num_experts :]
        recv_splits = [sum(recv_host[r * local : (r + 1) * local]) for r in range(world)]

        # 3. Sort the (token, expert) pairs by expert, which also groups them by
        #    destination rank, copy their tokens and send them.
        order = torch.argsort(expert_of_pair, stable=True)
        token_of_pair = order // top_k
        send = x.index_select(0, token_of_pair)
        recv = _AllToAll.apply(send, recv_splits, send_splits, self._group_name)

        # 4. Rows arrive ordered by (source rank, local expert); move each to its
        #    expert's zone of the expert-major buffer, zones padded to `alignment`.
        zone_rows = [sum(recv_host[r * local + e] for r in range(world)) for e in range(local)]
        zone_rows = [-(-n // self.alignment) * self.alignment for n in zone_rows]
        slots, zone_rows_dev = self._zone_slots(recv_counts.view(world, local), recv.shape[0])
        expert_major = recv.new_zeros(sum(zone_rows), cfg.hidden).index_copy(0, slots, recv)

        y = self._experts(expert_major, zone_rows, zone_rows_dev)

        # 5. Reverse: back to arrival order and to the source ranks, then undo the
        #    sort so that row t * K + k is choice k of token t, weight, sum over k
        #    (the reduction accumulates in float32).
        back = _AllToAll.apply(y.index_select(0, slots), send_splits, recv_splits, self._group_name)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        per_choice = back.index_select(0, unsort)
        per_choice = per_choice * topk_weights.reshape(-1, 1).to(per_choice.dtype)
        return self._with_shared(per_choice.view(num_tokens, top_k, cfg.hidden).sum(dim=1), x)

    def _zone_slots(self, recv_counts: Tensor, num_rows: int):
        """``(slot of every received row in the expert-major buffer, padded zone sizes)``, on the device."""
        world, local, a = self.ep_size, self.num_local_experts, self.alignment
        padded = (recv_counts.sum(0) + a - 1) // a * a
        zone_start = padded.cumsum(0) - padded
        # Segment (r, e): the rows rank r sent to local expert e, consecutive on arrival.
        seg_slot = (zone_start[None, :] + recv_counts.cumsum(0) - recv_counts).reshape(-1)
        seg_len = recv_counts.reshape(-1)
        seg_first_row = seg_len.cumsum(0) - seg_len
        seg_of_row = torch.repeat_interleave(
            torch.arange(world * local, device=seg_len.device), seg_len, output_size=num_rows
        )
        rows = torch.arange(num_rows, device=seg_len.device)
        return seg_slot[seg_of_row] + rows - seg_first_row[seg_of_row], padded

    def _experts(self, x: Tensor, zone_rows: List[int], zone_rows_dev: Tensor) -> Tensor:
        if self.gemm == "grouped_mm":
            offs = zone_rows_dev.cumsum(0, dtype=torch.int32)
            return swiglu_grouped_mm(x, offs, self.w_gate, self.w_up, self.w_down)
        return swiglu_loop(x, zone_rows, self.w_gate, self.w_up, self.w_down)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: List[int], in_splits: List[int], group_name: str) -> Tensor:
        # The group by name: an output's autograd graph must not keep the process group alive.
        ctx.splits, ctx.group_name = (out_splits, in_splits), group_name
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                               group=dist.distributed_c10d._resolve_process_group(group_name))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        grad_x = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_x, grad.contiguous(), in_splits, out_splits,
                               group=dist.distributed_c10d._resolve_process_group(ctx.group_name))
        return grad_x, None, None, None


class TeEpMoEBlock(_MoEBase):
    """The same block on te_ep_torch: dispatch, grouped experts, combine.

    Args:
        config: sizes and dtype.
        group: the :class:`~te_ep_torch.EpGroup` (its process group is the EP group).
        alignment: zone alignment of the handle (rows), e.g. what the grouped GEMM wants.
        capacity: receive rows of the handle; ``None``: the worst case.
        gemm: ``"grouped_mm"``, ``"loop"`` or ``"auto"``.
        seed: parameter seed (see :meth:`reset_parameters`).
        dispatch_dtype: ``torch.float8_e4m3fn`` dispatches block-scaled FP8
            (:func:`~te_ep_torch.ep_dispatch_fp8`) and dequantizes the received rows
            before the experts; ``None`` dispatches in ``config.dtype``.
        overlap: dispatch and combine on the communication stream
            (:mod:`te_ep_torch.overlap`), and on the current stream meanwhile the shared
            expert's gate/up projections (behind the dispatch) and its down projection
            (behind the combine); as ``te_ep_torch.moe.MoE(overlap=True)``. The same ops in
            the same order either way.
    """

    def __init__(
        self,
        config: MoEConfig,
        group: EpGroup,
        *,
        alignment: int = 16,
        capacity: Optional[int] = None,
        gemm: str = "auto",
        seed: int = 0,
        dispatch_dtype: Optional[torch.dtype] = None,
        overlap: bool = False,
    ) -> None:
        if group.num_experts != config.num_experts:
            raise ValueError(f"group has {group.num_experts} experts, config {config.num_experts}")
        super().__init__(config, group.rank, group.ep_size, group.device, gemm, seed)
        self.group = group
        self.step = EpStep(group, top_k=config.top_k, hidden=config.hidden, alignment=alignment,
                           options=EpOptions(capacity=capacity), fp8=dispatch_dtype is not None,
                           name="TeEpMoEBlock", tokens_arg="x", lazy=False, eager_hint="the block has one dtype")
        self.step.add_handle(config.dtype)
        self.fp8 = dispatch_dtype is not None
        self.overlap = overlap

    @property
    def handle(self) -> EpHandle:
        """The block's handle (one dtype)."""
        return self.step.handles[self.config.dtype]

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        topk_weights, topk_idx = self.route(x)
        comm = comm_stream_for(x.device) if self.overlap else None
        # comm None (no overlap): the same calls, run in place. Padding rows have weight 0;
        # rows after the last zone are never read by combine.
        combined, shared, _ = self.step.run(x, (topk_idx, topk_weights), self._zone_experts, comm=comm,
                                         behind_dispatch=lambda: self._shared_gate_up(x),
                                         behind_combine=self._shared_down)
        return combined if shared is None else combined + shared



class ComputeOnlyMoEBlock(_MoEBase):
    """:class:`TeEpMoEBlock` with no communication: its compute-only time.

    Dispatch and combine are replaced by local stand-ins of the same shapes: each choice
    goes to local expert ``topk_idx % num_local_experts`` of this rank (``te.permute``
    into ``capacity`` expert-major rows with the same zone alignment, so the grouped GEMM
    sees ``[capacity, H]`` rows in ``num_local_experts`` zones, as after dispatch), the
    same experts and weighting, and ``te.unpermute`` back to the tokens. The router, the
    experts and the weighting are those of the EP block, forward and backward; what is
    missing is the token exchange. ``layer time - this block's time`` is the exposed
    communication. Its outputs are not the EP block's (the experts differ), so it is timed,
    not verified.

    Args:
        config: sizes and dtype.
        ep_rank, ep_size: which experts this rank holds (as in the EP block).
        device: where the parameters live.
        alignment: zone alignment (rows).
        capacity: rows of the expert-major buffer; raised to this rank's ``T * top_k`` rows
            plus the worst-case padding where smaller (``None``: exactly that).
        gemm: ``"grouped_mm"``, ``"loop"`` or ``"auto"``.
        seed: parameter seed.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_rank: int,
        ep_size: int,
        device: torch.device,
        alignment: int = 16,
        capacity: Optional[int] = None,
        gemm: str = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__(config, ep_rank, ep_size, device, gemm, seed)
        self.alignment = alignment
        self.capacity = capacity

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        topk_weights, topk_idx = self.route(x)
        e_local = self.num_local_experts
        need = x.shape[0] * self.config.top_k + e_local * (self.alignment - 1)
        capacity = need if self.capacity is None else max(self.capacity, need)
        rows, row_weights, perm_map = permute(
            x, topk_idx % e_local, topk_weights, num_experts=e_local, capacity=capacity, alignment=self.alignment
        )
        y = zone_scale(self._zone_experts(rows, perm_map.expert_counts), row_weights, perm_map.expert_counts)
        return self._with_shared(unpermute(y, perm_map), x)


# NativeMoEBlock / TeEpMoEBlock parameter -> (the te_ep_torch.moe.MoE parameter holding the
# same values, whether it holds them transposed: the shared expert's nn.Linear weights are
# [out, in], the blocks' matrices [in, out]). The experts are this rank's in both.
MOE_PARAMETERS = {
    "router": ("router.weight", False),
    "w_gate": ("experts.w_gate", False),
    "w_up": ("experts.w_up", False),
    "w_down": ("experts.w_down", False),
    "shared_gate": ("shared_expert.gate.weight", True),
    "shared_up": ("shared_expert.up.weight", True),
    "shared_down": ("shared_expert.down.weight", True),
}


def _moe_parameter_pairs(block: torch.nn.Module, moe: torch.nn.Module):
    """``(block name, block parameter, MoE parameter, transposed)`` for every parameter of ``block``."""
    theirs = dict(moe.named_parameters())
    pairs = []
    for name, p in block.named_parameters():
        if name not in MOE_PARAMETERS:
            raise ValueError(f"{name}: not a parameter MOE_PARAMETERS maps onto te_ep_torch.moe.MoE")
        target, transposed = MOE_PARAMETERS[name]
        if target not in theirs:
            raise ValueError(f"{name}: the MoE has no parameter {target} (shared expert on one side only?)")
        pairs.append((name, p, theirs[target], transposed))
    extra = set(theirs) - {MOE_PARAMETERS[name][0] for name, _ in block.named_parameters()}
    if extra:
        raise ValueError(f"the MoE has parameters the block lacks: {sorted(extra)}")
    return pairs


@torch.no_grad()
def copy_parameters_to_moe(src: torch.nn.Module, moe: torch.nn.Module) -> None:
    """Copies a native block's parameters into a :class:`te_ep_torch.moe.MoE` with the same
    sizes and this rank's experts (plain local tensors, as ``enable_expert_parallel`` takes
    them), so that the two compute the same function (with ``config.normalize_weights`` equal
    to the MoE router's ``normalize_weights``)."""
    for name, p, q, transposed in _moe_parameter_pairs(src, moe):
        value = p.t() if transposed else p
        if q.shape != value.shape:
            raise ValueError(f"{name} -> {MOE_PARAMETERS[name][0]}: shape {list(value.shape)} vs {list(q.shape)}")
        q.copy_(value)


def moe_gradients(moe: torch.nn.Module, block: torch.nn.Module) -> Dict[str, Tensor]:
    """The MoE's parameter gradients under ``block``'s names and layouts (``"grad router"``,
    ...; None -> zeros): what :func:`fwd_bwd` of ``block`` returns for its own."""
    result = {}
    for name, p, q, transposed in _moe_parameter_pairs(block, moe):
        grad = q.grad if q.grad is not None else torch.zeros_like(q)
        result[f"grad {name}"] = grad.t() if transposed else grad
    return result


class ComputeOnlyMoE(torch.nn.Module):
    """A :class:`te_ep_torch.moe.MoE` with expert parallelism and no communication: its
    compute-only time.

    The layer's own router, experts (this rank's), weighting (``zone_scale``) and shared
    expert, forward and backward, with ``ep_dispatch`` / ``ep_combine`` replaced by local
    stand-ins of the same shapes: each choice goes to local expert ``topk_idx %
    num_local_experts`` (``te.permute`` into ``capacity`` expert-major rows with the layer's
    zone alignment, so the experts see ``[capacity, H]`` rows in ``num_local_experts`` zones,
    as after dispatch) and ``te.unpermute`` brings the rows back. It shares the layer's
    parameters. Its outputs are not the layer's (the experts differ): timed, not verified.

    Args:
        moe: the layer (expert weights: this rank's experts).
        capacity: rows of the expert-major buffer (the layer's handle capacity); raised to
            this rank's ``T * top_k`` rows plus the worst-case padding where smaller.
    """

    def __init__(self, moe: torch.nn.Module, capacity: Optional[int] = None) -> None:
        super().__init__()
        self.moe = moe
        self.capacity = capacity

    def forward(self, x: Tensor) -> Tensor:
        moe = self.moe
        tokens = x.reshape(-1, moe.hidden)
        routing = moe.router(tokens)
        e_local = moe.experts.w_gate.shape[0]
        alignment = moe.zone_alignment(tokens.device, tokens.dtype)
        need = tokens.shape[0] * moe.top_k + e_local * (alignment - 1)
        capacity = need if self.capacity is None else max(self.capacity, need)
        rows, row_weights, perm_map = permute(tokens, routing.topk_idx % e_local, routing.topk_weights,
                                              num_experts=e_local, capacity=capacity, alignment=alignment)
        y = unpermute(moe._weighted_experts(rows, row_weights, perm_map.expert_counts), perm_map)
        if moe.shared_expert is not None:
            y = y + moe.shared_expert(tokens)
        return y.reshape(x.shape)


@torch.no_grad()
def copy_parameters(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copies every parameter of ``src`` into the parameter of the same name in ``dst``."""
    theirs = dict(src.named_parameters())
    mine = dict(dst.named_parameters())
    if theirs.keys() != mine.keys():
        raise ValueError(f"parameter names differ: {sorted(theirs)} vs {sorted(mine)}")
    for name, p in mine.items():
        if p.shape != theirs[name].shape:
            raise ValueError(f"{name}: shape {list(theirs[name].shape)} vs {list(p.shape)}")
        p.copy_(theirs[name])


def fwd_bwd(block: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One step; returns the output and every gradient (None -> zeros)."""
    for p in block.parameters():
        p.grad = None
    leaf = x.detach().requires_grad_()
    out = block(leaf)
    out.backward(grad_out)
    result = {"output": out.detach(), "grad x": leaf.grad}
    for name, p in block.named_parameters():
        result[f"grad {name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return result
