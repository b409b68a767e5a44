"""A ready Mixture-of-Experts layer: router -> dispatch -> grouped SwiGLU experts -> combine.

:class:`MoE` routes each token to ``top_k`` of ``num_experts`` SwiGLU experts and sums
their outputs weighted by the routing weights. Without expert parallelism it permutes
tokens locally (``te_ep_torch.permutation``); once :meth:`MoE.enable_expert_parallel`
has given it an :class:`~te_ep_torch.EpGroup` (``te_ep_torch.parallel.ExpertParallel``
does that under ``parallelize_module``), each rank keeps ``num_experts / ep_size``
experts and tokens travel with :func:`~te_ep_torch.ep_dispatch` /
:func:`~te_ep_torch.ep_combine`. Both paths produce the same expert-major buffer
(zones padded to ``alignment``), so the experts see the same input either way.
Output shapes never depend on routing values: the layer traces under
``torch.compile(fullgraph=True)``. docs/moe.md has the details.
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._dtensor_rules import local_tensor as _local
from .group import EpGroup, EpHandle
from .ops.fp8 import FP8_BLOCK, dequantize_fp8, quantize_fp8
from .options import UNSET, EpOptions
from .overlap import comm_stream_for
from .permutation import permute, permute_capacity, unpermute
from .step import EpStep
from .zones import HeldWeightGrads, expert_ffn, zone_scale

__all__ = [
    "EXPERT_IMPLS",
    "GROUPED_MM_ALIGNMENT",
    "SCORE_FUNCS",
    "GroupedExperts",
    "MoE",
    "RouterOutput",
    "SwiGLU",
    "TopKRouter",
    "expert_load_stats",
    "grouped_mm_supported",
]

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_IMPLS = ("auto", "grouped_mm", "loop")
# torch._grouped_mm (CUTLASS, bf16) wants 16-byte aligned group starts in every
# operand, its backward included (where the groups split the contraction dim); 16
# rows keeps that true for bf16 and for 8-bit types alike.
GROUPED_MM_ALIGNMENT = 16


@torch.compiler.assume_constant_result
def _cuda_capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` has a fast kernel for these operands.

    That is CUDA compute capability 9.0 or newer, bfloat16, and every feature dim a
    multiple of 8 (16-byte row strides). Elsewhere :class:`GroupedExperts` uses its
    loop fallback under ``impl="auto"``.
    """
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if any(d % 8 for d in dims):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability_major(index) >= 9


class RouterOutput(NamedTuple):
    """What :class:`TopKRouter` returns for ``T`` tokens and ``E`` experts.

    Attributes:
        topk_idx: ``[T, K]`` int64 chosen experts (global ids).
        topk_weights: ``[T, K]`` float32 routing weights (differentiable).
        scores: ``[T, E]`` float32 softmax or sigmoid scores (no bias).
        tokens_per_expert: ``[E]`` float32 choices per expert in this call (no grad).
        aux_loss: scalar load-balancing loss (already times its coefficient), or
            ``None`` when the router has none.
    """

    topk_idx: Tensor
    topk_weights: Tensor
    scores: Tensor
    tokens_per_expert: Tensor
    aux_loss: Optional[Tensor]


class TopKRouter(nn.Module):
    """Top-k router over softmax or sigmoid scores, computed in float32.

    Args:
        hidden: token width.
        num_experts: ``E``.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        normalize_weights: rescale the ``top_k`` weights of a token to sum to 1;
            default ``True`` for sigmoid scores, ``False`` for softmax.
        route_scale: constant factor on the routing weights.
        expert_bias: keep a score bias per expert for auxiliary-loss-free balancing:
            it is added to the scores to *select* experts only (the weights stay the
            unbiased scores), and :meth:`update_expert_bias` moves it toward balance.
        bias_update_rate: step of :meth:`update_expert_bias`.
        aux_loss_coef: coefficient of the switch-style load-balancing loss
            ``coef * E * sum_e f_e * P_e`` (``f_e``: fraction of the choices that picked
            ``e``; ``P_e``: mean over tokens of ``e``'s normalized score); 0 = none.
        dtype, device: of the gate weight ``[E, hidden]``.

    ``process_group`` (attribute, default ``None``): when set, ``f_e`` and the load
    counted for the bias update are summed over this group, so that with equal token
    counts per rank the mean of the ranks' aux losses is the aux loss of the global
    batch and every rank updates the bias identically.
    ``te_ep_torch.parallel.apply_fsdp`` sets it to the data-parallel group.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        normalize_weights: Optional[bool] = None,
        route_scale: float = 1.0,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        aux_loss_coef: float = 0.0,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"TopKRouter: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if aux_loss_coef < 0:
            raise ValueError(f"TopKRouter: aux_loss_coef must be >= 0, got {aux_loss_coef}")
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.normalize_weights = (score_func == "sigmoid") if normalize_weights is None else normalize_weights
        self.route_scale = route_scale
        self.bias_update_rate = bias_update_rate
        self.aux_loss_coef = aux_loss_coef
        self._group_name: Optional[str] = None
        self._group_size = 1
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        # Choices per expert counted by this rank's training forwards since the last reset
        # (int64: exact over any number of steps). Updated on the device, never read back
        # by the layer itself: no host sync (docs/moe.md, "Expert-load statistics").
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.hidden**-0.5)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func!r}, expert_bias={self.expert_bias is not None}, "
            f"aux_loss_coef={self.aux_loss_coef}"
        )

    @property
    def process_group(self) -> Optional[torch.distributed.ProcessGroup]:
        # Kept by name, as EpGroup keeps its group: a model alive at exit must not keep the
        # process group (and gloo's worker threads) alive past dist.destroy_process_group().
        if self._group_name is None:
            return None
        return torch.distributed.distributed_c10d._resolve_process_group(self._group_name)

    @process_group.setter
    def process_group(self, group: Optional[torch.distributed.ProcessGroup]) -> None:
        self._group_name = None if group is None else group.group_name
        self._group_size = 1 if group is None else torch.distributed.get_world_size(group)

    def _sum_over_group(self, t: Tensor) -> Tensor:
        if self._group_size == 1:
            return t
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(t, "sum", self._group_name)

    def _choice_counts(self, topk_idx: Tensor) -> Tensor:
        """``[E]`` int64: how many of this call's choices picked each expert."""
        flat = topk_idx.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=topk_idx.device)
        return counts.index_add(0, flat, torch.ones_like(flat))

    def _choice_fractions(self, tokens_per_expert: Tensor) -> Tensor:
        """``f``: the fraction of the choices (over ``process_group``) that picked each expert."""
        # f is a count (no gradient), so summing it over ranks needs no autograd;
        # P stays local and differentiable, and averaging the ranks' losses (what
        # data-parallel gradient reduction does) averages P over the global batch.
        counts = self._sum_over_group(tokens_per_expert)
        return counts / counts.sum().clamp_min(1.0)

    def forward(
        self,
        x: Tensor,
        on_select: Optional[Callable[[Tensor], None]] = None,
        on_weights: Optional[Callable[[Tensor, Tensor], None]] = None,
    ) -> RouterOutput:
        """Routes ``x [T, hidden]``.

        ``on_select(topk_idx)`` runs as soon as the expert choice is known, before the
        weights, the load statistics and the auxiliary loss: the MoE layer starts the
        routing exchange (``prepare``) there so that the rest of the router runs behind it.
        ``on_weights(topk_idx, topk_weights)`` runs once the routing weights are known too,
        before the load statistics and the auxiliary loss (which nothing of the token
        exchange reads): the MoE layer launches the dispatch there, so that they run
        behind it. One exception: with an aux loss and a ``process_group`` of more than one
        rank, the choice counts and their sum over the group (a collective on another
        communicator) come before ``on_weights``, so that collective has completed on the
        current stream before a dispatch is launched, never running alongside it.
        """
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        select = scores if self.expert_bias is None else scores + self.expert_bias
        topk_idx = select.detach().topk(self.top_k, dim=-1).indices
        if on_select is not None:
            on_select(topk_idx)
        counts = f = None
        if self.aux_loss_coef > 0 and self._group_size > 1:
            counts = self._choice_counts(topk_idx)
            tokens_per_expert = counts.float()
            # Reading the sum (counts.sum() in there) makes the current stream wait for the
            # all-reduce, and on_weights' launch orders the dispatch after the current stream.
            f = self._choice_fractions(tokens_per_expert)
        topk_weights = scores.gather(1, topk_idx)
        if self.normalize_weights:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if self.route_scale != 1.0:
            topk_weights = topk_weights * self.route_scale
        if on_weights is not None:
            on_weights(topk_idx, topk_weights)

        if counts is None:
            counts = self._choice_counts(topk_idx)
            tokens_per_expert = counts.float()
        if self.training:
            self.expert_load.add_(counts)

        aux_loss = None
        if self.aux_loss_coef > 0:
            if f is None:
                f = self._choice_fractions(tokens_per_expert)
            probs = scores if self.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
            p = probs.mean(dim=0)
            aux_loss = self.aux_loss_coef * self.num_experts * (f * p).sum()
        return RouterOutput(topk_idx, topk_weights, scores, tokens_per_expert, aux_loss)

    @torch.no_grad()
    def read_expert_load(self, global_sum: bool = False) -> Tensor:
        """``[E]`` int64 choices per expert counted by training forwards since the last reset.

        A copy on the layer's device; nothing waits for the GPU. ``global_sum=True`` sums
        the counts over ``router.process_group`` (a collective: every rank of the group
        calls it; an all-reduce queued on the device, still no host sync); without a
        group it is this rank's count.
        """
        load = self.expert_load.clone()
        if global_sum and self._group_size > 1:
            torch.distributed.all_reduce(load, group=self.process_group)
        return load

    @torch.no_grad()
    def reset_expert_load(self) -> None:
        """Zeroes the expert-load counter (on the device)."""
        self.expert_load.zero_()

    @torch.no_grad()
    def update_expert_bias(self) -> Optional[Tensor]:
        """Moves the selection bias toward balanced load and resets the load counter.

        Experts that got fewer choices than average since the last update gain
        ``bias_update_rate``, busier ones lose it. The load (:meth:`read_expert_load`) is
        summed over ``process_group`` (collective then) so all ranks keep the same bias.
        Call it after the optimizer step. Returns the load it used as float32 (``None``
        without a bias; the counter is then left alone).
        """
        if self.expert_bias is None:
            return None
        load = self.read_expert_load(global_sum=True).float()
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
        self.reset_expert_load()
        return load


# The keyword arguments MoE passes on to its TopKRouter: the router's keyword-only
# options, read from its signature so that they are declared once (there). dtype and
# device are not among them: the layer sets those itself.
_ROUTER_OPTIONS: Tuple[str, ...] = tuple(
    name
    for name, param in inspect.signature(TopKRouter.__init__).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("dtype", "device")
)


def _check_router_options(options: Dict[str, object]) -> None:
    unknown = [name for name in options if name not in _ROUTER_OPTIONS]
    if unknown:
        raise TypeError(
            f"MoE.__init__() got an unexpected keyword argument {unknown[0]!r}; besides its own arguments, "
            f"MoE takes the TopKRouter options {', '.join(_ROUTER_OPTIONS)}"
        )


class SwiGLU(nn.Module):
    """``down(silu(x @ gate) * (x @ up))``: the dense (shared) expert.

    ``forward(x)`` is ``self.down(self.gate_up(x))``; the overlapped MoE layer calls the two
    halves apart (the first while the dispatch runs, the second while the combine runs).
    """

    def __init__(self, hidden: int, ffn_hidden: int, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype, device=device)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False, dtype=dtype, device=device)

    def gate_up(self, x: Tensor) -> Tensor:
        """``silu(x @ gate) * (x @ up)``: the input of ``down``."""
        return F.silu(self.gate(x)) * self.up(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.gate_up(x))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights, run on an expert-major buffer.

    Parameters (global shapes; with expert parallelism each is a ``Shard(0)`` DTensor
    whose local shard holds the rank's experts): ``w_gate [E, hidden, ffn_hidden]``,
    ``w_up [E, hidden, ffn_hidden]``, ``w_down [E, ffn_hidden, hidden]``.

    Args:
        impl: ``"grouped_mm"`` (``torch._grouped_mm``: one grouped GEMM per weight),
            ``"loop"`` (one dense GEMM per local expert over the whole buffer with the
            rows of other experts masked to zero: static shapes, any device and dtype,
            ``E_local`` times the FLOPs) or ``"auto"`` (``grouped_mm`` where
            :func:`grouped_mm_supported`, else ``loop``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        *,
        impl: str = "auto",
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"GroupedExperts: impl must be one of {EXPERT_IMPLS}, got {impl!r}")
        if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            raise ValueError(f"GroupedExperts: impl='grouped_mm' needs torch._grouped_mm (torch {torch.__version__})")
        self.num_experts = num_experts
        self.hidden = hidden
        self.ffn_hidden = ffn_hidden
        self.impl = impl
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden), (self.w_down, self.ffn_hidden)):
                _local(w).normal_(std=fan_in**-0.5)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, impl={self.impl!r}"

    def resolved_impl(self, device: torch.device, dtype: torch.dtype) -> str:
        """The implementation ``forward`` uses for inputs on ``device`` of ``dtype``."""
        if self.impl != "auto":
            return self.impl
        return "grouped_mm" if grouped_mm_supported(device, dtype, self.hidden, self.ffn_hidden) else "loop"

    def hold_weight_grads(self, tokens: Tensor, comm_sms: int = 0) -> Optional[HeldWeightGrads]:
        """A :class:`~te_ep_torch.zones.HeldWeightGrads` of this rank's expert weights, for
        :meth:`forward`'s ``held``, where it applies: in eager autograd (grad mode on, not
        compiling), weights that take gradients, and ``torch._grouped_mm`` for rows like
        ``tokens``; else ``None``. :meth:`EpStep.run <te_ep_torch.step.EpStep.run>` calls it
        before each dispatch; ``comm_sms``: SMs the weight-gradient GEMMs leave to the
        communication beside them."""
        weights = (_local(self.w_gate), _local(self.w_up), _local(self.w_down))
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling() or not any(w.requires_grad for w in weights)
                or self.resolved_impl(tokens.device, tokens.dtype) != "grouped_mm"):
            return None
        return HeldWeightGrads(weights, comm_sms)

    def forward(self, x: Tensor, expert_counts: Tensor, held: Optional[HeldWeightGrads] = None,
                grad_into: Optional[Tensor] = None) -> Tensor:
        """Runs the local experts (:func:`te_ep_torch.zones.expert_ffn`).

        Args:
            x: ``[rows, hidden]`` expert-major zones (zone ``e`` starts at
                ``expert_counts[:e].sum()``), padding rows zero.
            expert_counts: ``[E_local]`` int32 rows per zone, padding included.
            held: what :meth:`hold_weight_grads` made for this call: the experts run on its
                weights, which take their gradients after the dispatch's backward.
            grad_into: where ``x``'s gradient is written (:func:`~te_ep_torch.zones.expert_ffn`).

        Returns:
            ``[rows, hidden]``; padding rows zero, rows past the zones unspecified (never
            computed: the work follows the rows in use, not ``rows``).
        """
        if held is not None:
            w_gate, w_up, w_down = held.weights
        else:
            w_gate, w_up, w_down = _local(self.w_gate), _local(self.w_up), _local(self.w_down)
        if expert_counts.shape[0] != w_gate.shape[0]:
            raise ValueError(
                f"GroupedExperts: expert_counts has {expert_counts.shape[0]} zones, "
                f"this rank holds {w_gate.shape[0]} experts"
            )
        return expert_ffn(x, expert_counts, (w_gate, w_up), w_down, gate="swiglu",
                          impl=self.resolved_impl(x.device, x.dtype), held=held, grad_into=grad_into)


class MoE(nn.Module):
    """Router -> dispatch -> grouped SwiGLU experts -> weighted combine (+ shared expert).

    Args:
        hidden: token width ``H``.
        ffn_hidden: inner width of each expert.
        num_experts: ``E`` (global).
        top_k: experts per token.
        shared_expert_ffn_hidden: inner width of a dense SwiGLU expert every token
            also goes through (its output is added unweighted); 0 = none.
        expert_impl: see :class:`GroupedExperts`.
        alignment: per-expert zone alignment in rows (power of two); ``None`` picks
            :data:`GROUPED_MM_ALIGNMENT` where the experts run ``torch._grouped_mm``
            and 1 elsewhere.
        dispatch_dtype: ``None`` dispatches tokens in their own dtype; ``"fp8"`` (or
            ``torch.float8_e4m3fn``) sends them as block-scaled e4m3 with float32 scales
            (:func:`te_ep_torch.ep_dispatch_fp8`, half the bytes of bfloat16). Only the
            forward dispatch is quantized: the experts dequantize the received rows into
            their bfloat16 grouped GEMM (torch 2.11's FP8 grouped GEMM takes one scale per
            row on Hopper, not one per 128 values), and combine and every gradient stay in
            the tokens' dtype. Without expert parallelism nothing is dispatched, but the
            experts see the same FP8 round trip of the tokens, so results do not depend
            on the EP size. ``hidden`` must be a multiple of 128 (512 on ``nccl_ep``).
        overlap: with expert parallelism on CUDA, run dispatch and combine on a
            communication stream (:mod:`te_ep_torch.overlap`) and, on the current stream
            meanwhile, the router's load statistics and aux loss and the shared expert's
            gate/up projections (behind the dispatch) and its down projection (behind the
            combine); in backward, ``combine_bwd`` and ``dispatch_bwd`` run on the
            communication stream next to those parts' gradients. Same results as without it,
            bit for bit (the same kernels on the same data in the same order; only their
            timing changes). Sequential under ``torch.compile`` and on CPU; a CUDA graph
            captures the overlap. Off by default until measured on GPUs (docs/moe.md,
            "Overlap").
        dtype, device: of the expert and shared-expert weights; the router weight is
            float32.
        **router_options: the router's options, passed to :class:`TopKRouter`: any of
            its keyword-only arguments but ``dtype`` and ``device`` (``score_func``,
            ``normalize_weights``, ``aux_loss_coef``, ...). A keyword that neither
            ``MoE`` nor ``TopKRouter`` takes raises ``TypeError`` naming it.

    ``forward(x [..., H]) -> [..., H]`` in ``x``'s dtype; the last aux loss is kept in
    :attr:`aux_loss` (``None`` without one) and also returned by
    ``forward(x, return_aux_loss=True)``.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        *,
        shared_expert_ffn_hidden: int = 0,
        expert_impl: str = "auto",
        alignment: Optional[int] = None,
        dispatch_dtype: Union[None, str, torch.dtype] = None,
        overlap: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        **router_options,
    ) -> None:
        super().__init__()
        _check_router_options(router_options)
        if dispatch_dtype not in (None, "fp8", torch.float8_e4m3fn):
            raise ValueError(f"MoE: dispatch_dtype must be None, 'fp8' or torch.float8_e4m3fn, got {dispatch_dtype!r}")
        if dispatch_dtype is not None and hidden % FP8_BLOCK:
            raise ValueError(f"MoE: FP8 dispatch needs hidden to be a multiple of {FP8_BLOCK}, got hidden={hidden}")
        self.dispatch_dtype: Optional[torch.dtype] = None if dispatch_dtype is None else torch.float8_e4m3fn
        self.overlap = bool(overlap)
        if alignment is not None and (alignment <= 0 or alignment & (alignment - 1)):
            raise ValueError(f"MoE: alignment must be a power of two, got {alignment}")
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.alignment = alignment
        # The router weight stays float32 whatever `dtype` the experts use.
        self.router = TopKRouter(hidden, num_experts, top_k, device=device, **router_options)
        self.experts = GroupedExperts(num_experts, hidden, ffn_hidden, impl=expert_impl, dtype=dtype, device=device)
        self.shared_expert = (
            SwiGLU(hidden, shared_expert_ffn_hidden, dtype=dtype, device=device) if shared_expert_ffn_hidden else None
        )
        self.aux_loss: Optional[Tensor] = None
        self._step: Optional[EpStep] = None

    @property
    def ep_group(self) -> Optional[EpGroup]:
        """The :class:`EpGroup` tokens are dispatched over, ``None`` without expert parallelism."""
        return None if self._step is None else self._step.group

    @property
    def ep_step(self) -> Optional[EpStep]:
        """The layer's communication step (:class:`~te_ep_torch.step.EpStep`), ``None`` without
        expert parallelism."""
        return self._step

    @property
    def handles(self) -> Dict[torch.dtype, EpHandle]:
        """The layer's handles by token dtype (empty without expert parallelism)."""
        return {} if self._step is None else dict(self._step.handles)

    @property
    def ep_size(self) -> int:
        return 1 if self._step is None else self._step.group.ep_size

    def zone_alignment(self, device: torch.device, dtype: torch.dtype) -> int:
        """Rows each expert's zone is padded to for tokens on ``device`` of ``dtype``."""
        if self.alignment is not None:
            return self.alignment
        return GROUPED_MM_ALIGNMENT if self.experts.resolved_impl(device, dtype) == "grouped_mm" else 1

    def enable_expert_parallel(
        self,
        ep_group: EpGroup,
        *,
        dtype: Optional[torch.dtype] = None,
        capacity: Optional[int] = UNSET,
        capacity_factor: Optional[float] = UNSET,
        checks: Optional[str] = None,
        overflow: str = UNSET,
        options: Optional[EpOptions] = None,
    ) -> None:
        """Dispatches tokens over ``ep_group`` from now on (collective: creates a handle).

        The expert parameters must already hold this rank's experts only (plain
        tensors of ``E / ep_size`` experts, or ``Shard(0)`` DTensors over the group,
        as :class:`~te_ep_torch.parallel.ExpertParallel` makes them).

        Args:
            ep_group: the expert-parallel group; its ``num_experts`` must be this
                layer's.
            dtype: dtype of the tokens this layer will see (the compute dtype, e.g.
                bfloat16 under an FSDP mixed-precision policy); default: the experts'
                parameter dtype. Call again with another dtype to add a handle.
            checks: the handle's check mode (``EpGroup``'s ``checks``); ``None``: the
                group's. The group carries ``nccl_ep_mode`` and ``timeout``.
            options: the handle options as one :class:`~te_ep_torch.options.EpOptions`, e.g.
                ``options=te.EpOptions(capacity_factor=1.25, overflow="drop")``: its ``capacity``
                (receive rows per rank; ``None`` with no ``capacity_factor``: the worst case,
                ``EpGroup.worst_case_capacity``, which no routing can overflow),
                ``capacity_factor`` (the receive rows as a multiplier >= 1.0, typically 1.0 to
                2.0, of a rank's mean load ``top_k * max_tokens_per_rank``, plus zone padding;
                ``EpGroup.capacity_for_factor``) and ``overflow`` (what a step that needs more
                rows than the capacity does: ``"raise"``, ``capacity overflow`` on every rank, or
                ``"drop"``, the choices past each expert's share dropped and counted;
                ``EpGroup.create_handle``); and the step's ``chunks`` (set by the first call: the
                layer's forward then runs N chunks, whose communication overlaps the other
                chunks' experts on CUDA; docs/moe.md, "Chunked step"). Its group fields
                (``backend``, ...) are not read here (``ep_group`` has its own), and ``checks``
                stays the argument above.
            capacity, capacity_factor, overflow: deprecated (``FutureWarning``; removed in 0.4):
                the same fields of ``options``, one keyword each.
        """
        if ep_group.num_experts != self.num_experts:
            raise ValueError(
                f"MoE.enable_expert_parallel: ep_group has num_experts={ep_group.num_experts}, "
                f"the layer has {self.num_experts}"
            )
        local_experts = _local(self.experts.w_gate).shape[0]
        if local_experts != ep_group.num_local_experts:
            raise ValueError(
                f"MoE.enable_expert_parallel: this rank holds {local_experts} experts, ep_group expects "
                f"{ep_group.num_local_experts} (num_experts / ep_size); shard the expert weights first "
                "(te_ep_torch.parallel.ExpertParallel)"
            )
        if self._step is not None and self._step.group is not ep_group:
            raise RuntimeError("MoE.enable_expert_parallel: the layer already uses another EpGroup")
        options = EpOptions.resolve("MoE.enable_expert_parallel", options, capacity=capacity,
                                    capacity_factor=capacity_factor, overflow=overflow)
        dtype = dtype if dtype is not None else self.experts.w_gate.dtype
        if self._step is None:
            self._step = EpStep(
                ep_group, top_k=self.top_k, hidden=self.hidden,
                alignment=lambda dt: self.zone_alignment(ep_group.device, dt), options=options,
                fp8=self.dispatch_dtype is not None, name="MoE", tokens_arg="x", lazy=False,
                eager_hint="call enable_expert_parallel(ep_group, dtype=...) for that dtype first")
        self._step.add_handle(dtype, options, checks=checks)

    def forward(self, x: Tensor, return_aux_loss: bool = False):
        shape = x.shape
        tokens = x.reshape(-1, self.hidden)
        if self._step is None:
            routing = self.router(tokens)
            y = self._experts_local(tokens, routing)
            if self.shared_expert is not None:
                y = y + self.shared_expert(tokens)
        else:
            routing, y, shared = self._experts_ep(tokens)
            if shared is not None:
                y = y + shared
        self.aux_loss = routing.aux_loss
        y = y.reshape(shape)
        return (y, routing.aux_loss) if return_aux_loss else y

    def _weighted_experts(self, rows: Tensor, row_weights: Tensor, counts: Tensor) -> Tensor:
        return zone_scale(self.experts(rows, counts), row_weights, counts)

    def _experts_local(self, tokens: Tensor, routing: RouterOutput) -> Tensor:
        alignment = self.zone_alignment(tokens.device, tokens.dtype)
        capacity = permute_capacity(tokens.shape[0], self.top_k, self.num_experts, alignment)
        rows, row_weights, perm_map = permute(
            _Fp8RoundTrip.apply(tokens) if self.dispatch_dtype is not None else tokens,
            routing.topk_idx,
            routing.topk_weights,
            num_experts=self.num_experts,
            capacity=capacity,
            alignment=alignment,
        )
        y = self._weighted_experts(rows, row_weights, perm_map.expert_counts)
        return unpermute(y, perm_map)

    def _experts_ep(self, tokens: Tensor) -> Tuple[RouterOutput, Tensor, Optional[Tensor]]:
        """(routing, combined expert output, the shared expert's output or None).

        A chunked step (``EpOptions(chunks=N)``) runs on the communication stream too, with or
        without ``overlap`` (its chunks overlap each other; docs/moe.md, "Chunked step").

        One control flow with and without overlap (``comm`` is ``None`` without): the same
        ops in the same order, so the autograd graph, and with it every result and gradient,
        is the same. With ``comm`` (docs/moe.md, "Overlap"), on the current stream:
        router choice -> prepare -> routing weights -> [dispatch launched on ``comm``] ->
        load statistics, aux loss, shared expert's gate/up -> join -> experts, weighting ->
        [combine launched on ``comm``] -> shared expert's down -> join.
        """
        step = self._step
        step.handle_for(tokens)  # before the router: a missing handle raises ahead of any collective
        shared_expert = self.shared_expert
        if _splittable(shared_expert):
            behind_dispatch, behind_combine = (lambda: shared_expert.gate_up(tokens)), shared_expert.down
        elif shared_expert is not None:  # the whole of an expert that can't be split, behind the dispatch
            behind_dispatch, behind_combine = (lambda: shared_expert(tokens)), None
        else:
            behind_dispatch = behind_combine = None
        # The router's load statistics and aux loss run after the dispatch's launch (on_weights).
        combined, shared, routing = step.run(
            tokens, lambda on_select, on_weights: self.router(tokens, on_select=on_select, on_weights=on_weights),
            self.experts, comm=comm_stream_for(tokens.device) if self.overlap or step.chunks > 1 else None,
            behind_dispatch=behind_dispatch, behind_combine=behind_combine)
        return routing, combined, shared

    @torch.no_grad()
    def update_expert_bias(self) -> Optional[Tensor]:
        """:meth:`TopKRouter.update_expert_bias` of this layer's router."""
        return self.router.update_expert_bias()

    def read_expert_load(self, global_sum: bool = False) -> Tensor:
        """:meth:`TopKRouter.read_expert_load` of this layer's router (global expert ids)."""
        return self.router.read_expert_load(global_sum)

    def reset_expert_load(self) -> None:
        """:meth:`TopKRouter.reset_expert_load` of this layer's router."""
        self.router.reset_expert_load()

    def extra_repr(self) -> str:
        fp8 = ", dispatch_dtype=fp8" if self.dispatch_dtype is not None else ""
        overlap = ", overlap=True" if self.overlap else ""
        return f"ep_size={self.ep_size}{fp8}{overlap}"


def _splittable(module: Optional[nn.Module]) -> bool:
    """Whether the layer may call a shared expert in two halves (:meth:`SwiGLU.gate_up`, then
    ``down``): a plain :class:`SwiGLU` with no hooks of its own. Hooks see a module's forward
    as a whole (``fully_shard`` hooks the module and changes its class, for one), so any other
    shared expert is called whole, behind the dispatch."""
    return type(module) is SwiGLU and not (
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
    )


class _Fp8RoundTrip(torch.autograd.Function):
    """``dequantize_fp8(quantize_fp8(x))``, straight through in backward: what the experts
    of an FP8-dispatch layer see when nothing is dispatched (no expert parallelism)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        values, scales = quantize_fp8(x)
        return dequantize_fp8(values, scales, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def expert_load_stats(model: nn.Module, global_sum: bool = False, reset: bool = False) -> Dict[str, Tensor]:
    """``{name: [E] int64 load}`` of every :class:`MoE` layer in ``model`` (module names as
    in ``model.named_modules()``): the choices per expert counted by training forwards
    since the last reset (:meth:`TopKRouter.read_expert_load`), what load balancing and
    expert placement (EPLB) read. No host sync; ``global_sum`` sums over each router's
    ``process_group`` (collective), ``reset`` zeroes the counters after reading.

    A layer whose handles drop overflowing choices (``overflow="drop"``) also has
    ``{name}.dropped``: the choices of this rank its handles dropped per expert since they
    were made (``EpHandle.dropped``; this rank's, whatever ``global_sum``; not reset).
    """
    stats: Dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            stats[name] = module.read_expert_load(global_sum)
            if reset:
                module.reset_expert_load()
            dropping = [h for h in module.handles.values() if h.config.overflow == "drop"]
            if dropping:
                stats[f"{name}.dropped"] = sum(h.dropped for h in dropping)
    return stats

