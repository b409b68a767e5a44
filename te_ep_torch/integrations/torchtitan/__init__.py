"""TorchTitan token dispatcher on the ``te_ep`` dispatch/combine ops.

TorchTitan (0.3.0) routes MoE tokens through a pluggable token dispatcher
(``torchtitan.models.common.token_dispatcher``): ``RoutedExperts`` calls
``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E)``, runs its
``GroupedExperts`` on the expert-major rows it gets back, and calls
``combine(rows, metadata, x_TD)``, which applies the routing scores and sums the rows
back to their tokens. :class:`TeEpTokenDispatcher` implements that interface with
:func:`te_ep_torch.ep_dispatch` / :func:`te_ep_torch.ep_combine`:

* one :class:`~te_ep_torch.EpHandle` per MoE layer (each layer builds its own
  dispatcher), on an :class:`~te_ep_torch.EpGroup` over the process group of the EP
  mesh dimension that ``RoutedExperts.parallelize`` wires in (shared by the layers);
* a static receive buffer of ``capacity`` rows: no host sync, no data-dependent shapes;
* the permutation is ours, fused into the exchange: dispatch returns the rows already
  expert-major (zones padded to ``alignment`` rows) with per-local-expert counts, which
  is what TorchTitan's grouped GEMM takes (``offs = counts.cumsum()``), and combine
  un-permutes and sums in one op. Neither TorchTitan's ``_local_reorder`` /
  ``_permute`` nor its ``scatter_add`` run;
* autograd through the ``te_ep`` ops (gradients reach the tokens and the routing
  scores, hence the router).

Chunked (``chunks=N``): TorchTitan's ``RoutedExperts`` calls its experts between
``dispatch`` and ``combine``, once, so a step split into chunks (each chunk's communication
under another chunk's experts) needs the layer's forward: :class:`TeEpRoutedExperts` (the
``te_ep_routed_experts`` override) runs ``dispatch -> experts -> combine`` as te_ep's
:meth:`~te_ep_torch.step.EpStep.run`, the code path of ``te.MoE``, unchunked included.

Selecting it: the ``@override`` factories :func:`te_ep_dispatcher`, :func:`te_ep_experts`
and :func:`te_ep_routed_experts`, listed in ``--override.imports`` (CLI) or added by
:func:`use_te_ep` (Python config). See docs/torchtitan.md.

Nothing else in te_ep_torch imports this module or TorchTitan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

try:
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.token_dispatcher import (
        BaseEPTokenDispatcher,
        LocalTokenDispatcher,
        TorchAOTokenDispatcher,
    )
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "te_ep_torch.integrations.torchtitan needs TorchTitan (tested with torchtitan==0.3.0): "
        "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 typeguard==4.6.0 "
        "docstring_parser==0.18.0 (docs/torchtitan.md)"
    ) from exc

from torchtitan.distributed.spmd_types import maybe_set_sparse_mesh
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from ..._dtensor_rules import local_tensor as _local
from ...group import DEFAULT_NCCL_EP_MODE, EpHandle
from ...moe import GROUPED_MM_ALIGNMENT
from ...ops.fp8 import FP8_BLOCK
from ...options import EpOptions
from ...overlap import comm_stream_for
from ...parallel import ep_group_for
from ...step import Dispatched, EpStep, check_eager
from ...zones import expert_ffn

__all__ = [
    "EXPERTS_OVERRIDE_TARGET",
    "OVERRIDE_TARGET",
    "ROUTED_EXPERTS_OVERRIDE_TARGET",
    "TeEpDispatchMetadata",
    "TeEpGroupedExperts",
    "TeEpRoutedExperts",
    "TeEpTokenDispatcher",
    "te_ep_dispatcher",
    "te_ep_experts",
    "te_ep_routed_experts",
    "use_te_ep",
]

# What a job lists in --override.imports to select this dispatcher, te_ep's experts and
# te_ep's routed-experts forward (the step in one call: chunks).
OVERRIDE_TARGET = f"{__name__}.te_ep_dispatcher"
EXPERTS_OVERRIDE_TARGET = f"{__name__}.te_ep_experts"
ROUTED_EXPERTS_OVERRIDE_TARGET = f"{__name__}.te_ep_routed_experts"

_DTYPES: Dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _dtype_name(dtype: Union[str, torch.dtype, None], what: str) -> Optional[str]:
    """``dtype`` as one of the names in ``_DTYPES`` (a ``torch.dtype`` is accepted too)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
    elif dtype in _DTYPES:
        return dtype
    raise ValueError(f"{what}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class TeEpDispatchMetadata:
    """What :meth:`TeEpTokenDispatcher.combine` needs from its dispatch: the layer's
    :class:`~te_ep_torch.step.Dispatched` (its handle, the rows' routing scores, the zone
    sizes that bound combine's weighting, the dispatch's token count)."""

    dispatched: Dispatched

    @property
    def handle(self) -> EpHandle:
        return self.dispatched.handle

    @property
    def row_weights_R(self) -> Tensor:
        """``[capacity]`` float32 routing score of each received row, 0 on padding and unused rows."""
        return self.dispatched.weights

    @property
    def expert_counts(self) -> Tensor:
        """``[E_local]`` int32 zone sizes (padding included)."""
        return self.dispatched.expert_counts

    @property
    def num_tokens(self) -> int:
        return self.dispatched.num_tokens


class TeEpTokenDispatcher(BaseEPTokenDispatcher):
    """TorchTitan token dispatcher on :func:`te_ep_torch.ep_dispatch` / :func:`~te_ep_torch.ep_combine`.

    Without an EP mesh (expert parallelism off) it reorders tokens locally, exactly as
    TorchTitan's all-to-all dispatcher does then.

    ``dispatch`` returns ``rows [capacity, D]`` (expert-major zones of the local
    experts, each padded with zero rows to a multiple of ``alignment``, then zero rows
    up to ``capacity``), ``counts [E_local]`` int32 (zone sizes, padding included) and a
    :class:`TeEpDispatchMetadata`. TorchTitan's ``GroupedExperts`` runs its grouped GEMM
    over the zones; ``combine`` multiplies each row of the zones by its routing score in
    float32 (as TorchTitan does; :func:`te_ep_torch.zones.weighted_for_combine`, which
    never touches the rows past the zones) and sums the rows of each token in float32
    (``ep_combine``). Pair it with :class:`TeEpGroupedExperts` (the ``te_ep_experts``
    override; :func:`use_te_ep` adds both): TorchTitan's own ``GroupedExperts`` runs its
    activation over every row of the buffer, whose size is the worst case.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        """Options of :class:`TeEpTokenDispatcher` (``num_experts``/``top_k`` as TorchTitan sets them).

        Attributes:
            hidden_dim: token width ``D``. ``None``: taken from the first batch.
            num_max_tokens_per_rank: most tokens a rank passes to one dispatch
                (``local_batch_size * seq_len / (cp * tp)`` in training). ``None``:
                the first batch's token count, so a later larger batch raises.
            dtype: dtype of the tokens entering the MoE layer (the FSDP
                ``mixed_precision_param``); ``None`` means ``"bfloat16"``. A handle for it
                is created when the EP mesh is wired if ``hidden_dim`` and
                ``num_max_tokens_per_rank`` are known; tokens of another dtype get their
                own handle on first use (eagerly).
            alignment: zone alignment in rows (power of two): 16 keeps every group of
                ``torch._grouped_mm`` 16-byte aligned for bf16, backward included.
            capacity_factor: ``None``: the receive buffer holds the worst case (every
                token of every rank on this rank's experts: no routing overflows it).
                A number >= 1.0 (typically 1.0 to 2.0): a multiplier of the mean receive
                load of a rank, as in TorchTitan's and Megatron's own configs:
                ``capacity_factor * top_k * num_max_tokens_per_rank`` rows plus zone
                padding (:meth:`te_ep_torch.EpGroup.capacity_for_factor`). A step that
                needs more raises ``capacity overflow`` (docs/ops.md, "Capacity"; nothing
                is dropped silently) unless ``overflow="drop"``. Values below 1.0 (the old
                fraction-of-the-worst-case meaning, removed in 0.3.0) are refused.
            overflow: ``"raise"`` or ``"drop"``: a step that needs more rows than the
                capacity raises on every rank, or drops the choices past each expert's
                share (counted in the handle's ``dropped``;
                :meth:`te_ep_torch.EpGroup.create_handle`).
            backend: te_ep backend (``"auto"``: NCCL EP on Hopper+ GPUs where it loads,
                else the torch.distributed ``"reference"`` backend).
            nccl_ep_mode, timeout, checks: :class:`te_ep_torch.EpGroup`'s options
                (``timeout`` in seconds; ``None``: the process group's).
            chunks: split each step's tokens into this many chunks whose dispatch and combine
                run under another chunk's experts (:class:`te_ep_torch.EpOptions`'s
                ``chunks``; 1: unchunked). Needs :class:`TeEpRoutedExperts` (the
                ``te_ep_routed_experts`` override, which :func:`use_te_ep` adds): TorchTitan's
                own ``RoutedExperts`` calls the experts once, between ``dispatch`` and
                ``combine``.
            comm_sms: SMs the chunks' expert GEMMs leave to the communication kernels beside
                them (:class:`te_ep_torch.EpOptions`'s ``comm_sms``; 0: none).
            fp8_dispatch: send the tokens as block-scaled FP8 (e4m3 and a float32 scale
                per 128 values, :func:`te_ep_torch.ep_dispatch_fp8`) and dequantize them
                before TorchTitan's grouped experts; combine and the backward stay in the
                tokens' dtype. ``hidden_dim`` a multiple of 128 (512 on ``nccl_ep``).
        """

        hidden_dim: int | None = None
        num_max_tokens_per_rank: int | None = None
        dtype: str | torch.dtype | None = None
        alignment: int = GROUPED_MM_ALIGNMENT
        capacity_factor: float | None = None
        overflow: str = "raise"
        backend: str = "auto"
        chunks: int = 1
        comm_sms: int = 0
        fp8_dispatch: bool = False
        nccl_ep_mode: str = DEFAULT_NCCL_EP_MODE
        timeout: float | None = None
        checks: str = "local"

    def __init__(self, config: Config):
        super().__init__(config)
        _check_config(config, "TeEpTokenDispatcher")
        self.hidden_dim = config.hidden_dim
        self.num_max_tokens_per_rank = config.num_max_tokens_per_rank
        self.dtype = _DTYPES[_dtype_name(config.dtype, "TeEpTokenDispatcher") or "bfloat16"]
        self.alignment = config.alignment
        self.fp8_dispatch = config.fp8_dispatch
        self.options = _options(config, "TeEpTokenDispatcher")
        self._step: Optional[EpStep] = None

    # ---- set-up -------------------------------------------------------------------

    def init_buffer(self) -> None:
        """Creates the layer's handle now when its sizes are known (collective over the EP group).

        Called by ``wire_meshes`` from ``RoutedExperts.parallelize``, before FSDP and
        ``torch.compile`` are applied, which is where a compiled model needs it: handles
        are made eagerly, never while tracing.
        """
        self._step = None
        if self.ep_mesh is None or self.hidden_dim is None or self.num_max_tokens_per_rank is None:
            return
        self._make_step(self.hidden_dim, self.num_max_tokens_per_rank).add_handle(self.dtype)

    def handles(self) -> Tuple[EpHandle, ...]:
        """The layer's te_ep handles, one per token dtype seen (created at wiring or first use)."""
        return () if self._step is None else tuple(self._step.handles.values())

    def _eager_hint(self) -> str:
        return ("handles are created when the EP mesh is wired: set the dispatcher's hidden_dim, "
                f"num_max_tokens_per_rank and dtype (got {self.hidden_dim}, {self.num_max_tokens_per_rank}, "
                f"{self.dtype}) through te_ep_dispatcher(...) override kwargs or use_te_ep(trainer_config) "
                "(TeEpTrainer fills them from the trainer config), or run an eager step first")

    def _make_step(self, hidden: int, max_tokens: int) -> EpStep:
        """The layer's step (its handles come later), on the EP group of these sizes."""
        if self.ep_mesh is None:
            raise RuntimeError("TeEpTokenDispatcher: no EP mesh; wire_meshes(ep_mesh=...) comes first")
        # One EpGroup per (EP process group, sizes, options), shared by the layers.
        group = ep_group_for(self.ep_mesh, num_experts=self.num_experts, max_tokens_per_rank=max_tokens,
                             **self.options.group_kwargs())
        self._step = EpStep(group, top_k=self.top_k, hidden=hidden, alignment=self.alignment, options=self.options,
                            fp8=self.fp8_dispatch, name="TeEpTokenDispatcher.dispatch", tokens_arg="x_TD",
                            max_tokens_option="num_max_tokens_per_rank", hidden_option="hidden_dim", eager_hint=self._eager_hint())
        self.hidden_dim, self.num_max_tokens_per_rank = hidden, max_tokens
        return self._step

    # ---- dispatch / combine ---------------------------------------------------------

    def dispatch(
        self,
        x_TD: Tensor,
        topk_scores_TK: Tensor,
        topk_expert_ids_TK: Tensor,
        num_local_tokens_per_expert_E: Tensor,
    ):
        """Sends each token to the ranks of its experts (collective over the EP group).

        Returns ``(rows_RD, counts_e, metadata)`` with ``R = capacity``; see the class
        docstring. ``num_local_tokens_per_expert_E`` is not needed: the routing
        exchange counts what each rank receives.
        """
        if self.ep_mesh is None:
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        del num_local_tokens_per_expert_E
        step = self.step_for(x_TD)
        if step.chunks > 1:
            raise ValueError(
                f"TeEpTokenDispatcher: chunks={step.chunks} runs each chunk's experts between its dispatch and "
                "combine, which TorchTitan's RoutedExperts cannot (it calls dispatch, the experts once, then "
                f"combine): select te_ep with the te_ep_routed_experts override ({ROUTED_EXPERTS_OVERRIDE_TARGET}"
                "={...} in --override.imports, the dispatcher's options as its kwargs, in place of te_ep_dispatcher "
                "and te_ep_experts; use_te_ep adds it) or set chunks=1"
            )
        dispatched = step.join(None, step.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK), x_TD)
        return dispatched.rows, dispatched.expert_counts, TeEpDispatchMetadata(dispatched)

    def step_for(self, x_TD: Tensor) -> EpStep:
        """The layer's :class:`~te_ep_torch.step.EpStep` (made now, eagerly, where its sizes were
        unknown at wiring: this batch's)."""
        if self._step is None:
            check_eager("TeEpTokenDispatcher.dispatch", x_TD.dtype, [], self._eager_hint())
            self._make_step(self.hidden_dim or x_TD.shape[1], self.num_max_tokens_per_rank or x_TD.shape[0])
        return self._step

    def combine(self, routed_output_RD: Tensor, metadata, x_TD: Tensor) -> Tensor:
        """Scores the expert rows and sums them back to their tokens (collective); ``[T, D]``."""
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        if not isinstance(metadata, TeEpDispatchMetadata):
            raise TypeError(
                f"TeEpTokenDispatcher.combine: metadata must be the TeEpDispatchMetadata of this dispatcher's "
                f"dispatch, got {type(metadata).__name__}"
            )
        # Bounded by the rows in use: rows past the zones (which torch._grouped_mm leaves
        # unwritten) are neither read nor weighted, and get a zero score gradient.
        return self._step.join(None, self._step.combine(routed_output_RD, metadata.dispatched))


class TeEpGroupedExperts(GroupedExperts):
    """TorchTitan's ``GroupedExperts`` whose forward is te_ep's expert FFN on the zones.

    Same parameters (``w1_EFD``, ``w2_EDF``, ``w3_EFD``), so checkpoints, FSDP and EP
    sharding are unchanged; the forward computes ``w2(silu(w1 x) * w3 x)`` in bfloat16 as
    TorchTitan's does (same GEMMs, same roundings), through
    :func:`te_ep_torch.zones.expert_ffn`: the w1 and w3 grouped GEMMs, the SwiGLU kernel,
    the w2 grouped GEMM, each bounded by the rows in use.
    TorchTitan's own forward runs its activation over every row of te_ep's receive buffer,
    whose size is the worst case (every token of every rank): that work grows with the
    number of GPUs, this one does not. Selected by the :func:`te_ep_experts` override.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        w1, w2, w3 = (_local(p).bfloat16().transpose(-2, -1) for p in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        counts = num_tokens_per_expert_E.to(torch.int32)
        # torch._grouped_mm on every device, and x cast to bfloat16 by each GEMM (its two
        # gradients then add in x's dtype), as TorchTitan's own forward does.
        y = expert_ffn(x_RD, counts, (w1, w3), w2, gate="swiglu", impl="grouped_mm")
        return y.type_as(x_RD)


class TeEpRoutedExperts(RoutedExperts):
    """TorchTitan's ``RoutedExperts`` whose forward is te_ep's whole step.

    Same children (``inner_experts``, ``token_dispatcher``) and parameters. With a
    :class:`TeEpTokenDispatcher` wired to an EP mesh, the forward is
    :meth:`te_ep_torch.step.EpStep.run` of the dispatcher's step: dispatch, the experts
    (``inner_experts``) on the received zones, the routing scores applied, combine; the code
    path of ``te.MoE``. Unchunked that is the ``dispatch``/``combine`` pair TorchTitan's forward
    calls (same ops, same results); with ``chunks=N`` the step runs N chunks whose
    communication, on a communication stream, runs under another chunk's experts, forward and
    backward (docs/moe.md, "Chunked step"). Under ``torch.compile`` the chunks run in
    sequence on the caller's stream. Any other dispatcher (or no EP mesh): TorchTitan's
    forward. Selected by the :func:`te_ep_routed_experts` override.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(
        self,
        x_BLD: Tensor,
        topk_scores_BLK: Tensor,
        topk_expert_ids_BLK: Tensor,
        num_local_tokens_per_expert_E: Tensor,
    ) -> Tensor:
        dispatcher = self.token_dispatcher
        if not isinstance(dispatcher, TeEpTokenDispatcher) or dispatcher.ep_mesh is None:
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        x_TD = x_BLD.view(B * L, D)
        step = dispatcher.step_for(x_TD)

        def experts(rows: Tensor, counts: Tensor) -> Tensor:
            with maybe_set_sparse_mesh():
                return self.inner_experts(rows, counts)

        routing = (topk_expert_ids_BLK.view(B * L, K), topk_scores_BLK.view(B * L, K))
        comm = comm_stream_for(x_TD.device) if step.chunks > 1 else None
        out_TD, _, _ = step.run(x_TD, routing, experts, comm=comm)
        return out_TD.view(B, -1, D)


@override(
    target=RoutedExperts.Config,
    exact=True,
    description="te_ep_torch routed experts: dispatch, experts and combine as one te_ep step (chunks)",
)
def te_ep_routed_experts(cfg: RoutedExperts.Config, **options: Any) -> TeEpRoutedExperts.Config:
    """TorchTitan override: the whole routed-experts node becomes te_ep's.

    ``RoutedExperts`` becomes :class:`TeEpRoutedExperts` (same fields), its EP token dispatcher
    :class:`TeEpTokenDispatcher` (:func:`te_ep_dispatcher`; ``options`` are its kwargs) and its
    plain ``GroupedExperts`` :class:`TeEpGroupedExperts` (:func:`te_ep_experts`). One entry
    selects te_ep for the layer, chunked steps included::

        --override.imports 'te_ep_torch.integrations.torchtitan.te_ep_routed_experts={"chunks": 2}'

    TorchTitan refuses it next to :func:`te_ep_dispatcher` or :func:`te_ep_experts` in one
    ``override.imports`` (they claim nodes inside this one); :func:`use_te_ep` adds it. Only the
    plain ``RoutedExperts`` is replaced (``exact``).
    """
    new = derive(cfg, TeEpRoutedExperts.Config)
    if isinstance(new.token_dispatcher, BaseEPTokenDispatcher.Config):
        new.token_dispatcher = te_ep_dispatcher(new.token_dispatcher, **options)
    elif options:
        raise ValueError(f"te_ep_routed_experts: options {sorted(options)} are te_ep dispatcher options, but this "
                         f"layer's token dispatcher is {type(new.token_dispatcher).__qualname__} (no expert parallelism)")
    if type(new.inner_experts) is GroupedExperts.Config:
        new.inner_experts = te_ep_experts(new.inner_experts)
    return new


@override(
    target=GroupedExperts.Config,
    exact=True,
    description="te_ep_torch expert FFN on the receive zones (work bounded by the routed rows)",
)
def te_ep_experts(cfg: GroupedExperts.Config) -> TeEpGroupedExperts.Config:
    """TorchTitan override: ``GroupedExperts`` becomes :class:`TeEpGroupedExperts` (same fields).

    Activate with ``--override.imports te_ep_torch.integrations.torchtitan.te_ep_experts``
    next to :func:`te_ep_dispatcher`, or :func:`use_te_ep` (which adds both). Only the
    plain ``GroupedExperts`` is replaced (``exact``): subclasses made by converters (FP8 /
    MXFP8 grouped GEMMs) keep their own forward.
    """
    return derive(cfg, TeEpGroupedExperts.Config)


def _options(cfg: Any, what: str) -> EpOptions:
    """The config's EP options as one record (validated; errors name ``what`` and the field)."""
    return EpOptions.build(what, backend=cfg.backend, nccl_ep_mode=cfg.nccl_ep_mode, timeout=cfg.timeout,
                           checks=cfg.checks, capacity_factor=cfg.capacity_factor, overflow=cfg.overflow,
                           chunks=cfg.chunks, comm_sms=cfg.comm_sms)


def _check_config(cfg: Any, what: str) -> None:
    """Argument checks shared by the dispatcher and the override (ValueError naming the field)."""
    for name in ("hidden_dim", "num_max_tokens_per_rank"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{what}: {name} must be a positive int or None, got {value!r}")
    _dtype_name(cfg.dtype, what)
    alignment = cfg.alignment
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{what}: alignment must be a power of two, got {alignment!r}")
    _options(cfg, what)
    if not isinstance(cfg.fp8_dispatch, bool):
        raise ValueError(f"{what}: fp8_dispatch must be a bool, got {cfg.fp8_dispatch!r}")
    if cfg.fp8_dispatch and cfg.hidden_dim is not None and cfg.hidden_dim % FP8_BLOCK:
        raise ValueError(f"{what}: fp8_dispatch scales blocks of {FP8_BLOCK} values, so hidden_dim must be a "
                         f"multiple of {FP8_BLOCK}, got {cfg.hidden_dim}")


@override(
    target=BaseEPTokenDispatcher.Config,
    description="te_ep_torch token dispatch/combine (static capacity, no host sync)",
)
def te_ep_dispatcher(
    cfg: BaseEPTokenDispatcher.Config,
    *,
    hidden_dim: Optional[int] = None,
    num_max_tokens_per_rank: Optional[int] = None,
    dtype: Optional[str] = None,
    alignment: Optional[int] = None,
    capacity_factor: Optional[float] = None,
    overflow: Optional[str] = None,
    backend: Optional[str] = None,
    chunks: Optional[int] = None,
    comm_sms: Optional[int] = None,
    fp8_dispatch: Optional[bool] = None,
    nccl_ep_mode: Optional[str] = None,
    timeout: Optional[float] = None,
    checks: Optional[str] = None,
) -> TeEpTokenDispatcher.Config:
    """TorchTitan override: every EP token dispatcher config becomes a :class:`TeEpTokenDispatcher.Config`.

    Activate with ``--override.imports te_ep_torch.integrations.torchtitan.te_ep_dispatcher``
    (kwargs as JSON after ``=``, e.g. ``...te_ep_dispatcher={"num_max_tokens_per_rank": 8192,
    "hidden_dim": 2048}``) or :func:`use_te_ep`. It replaces the all-to-all ("standard"),
    DeepEP, HybridEP and MinimalAsyncEP dispatcher configs (keeping ``num_experts``,
    ``top_k`` and, where the source has them, ``hidden_dim`` and
    ``num_max_tokens_per_rank``); kwargs that are not ``None`` set the fields of
    :class:`TeEpTokenDispatcher.Config`. The FP8/MXFP8 padded dispatcher
    (``TorchAOTokenDispatcher``, for TorchAO's FP8 grouped GEMMs) is refused; te_ep's own
    FP8 is ``fp8_dispatch=True`` (FP8 on the link, bf16 grouped GEMMs).
    """
    if isinstance(cfg, TorchAOTokenDispatcher.Config):
        raise ValueError(
            "te_ep_dispatcher: the model uses TorchAOTokenDispatcher (FP8/MXFP8 grouped GEMMs with padded token "
            "groups), which te_ep_torch's TorchTitan dispatcher does not serve: drop the FP8/MXFP8 grouped "
            "experts converter or this override (te_ep's FP8 dispatch is the fp8_dispatch=True option: FP8 "
            "tokens on the link, the experts' own GEMMs)"
        )
    deltas = {
        name: value
        for name, value in (
            ("hidden_dim", hidden_dim),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("dtype", dtype),
            ("alignment", alignment),
            ("capacity_factor", capacity_factor),
            ("overflow", overflow),
            ("backend", backend),
            ("chunks", chunks),
            ("comm_sms", comm_sms),
            ("fp8_dispatch", fp8_dispatch),
            ("nccl_ep_mode", nccl_ep_mode),
            ("timeout", timeout),
            ("checks", checks),
        )
        if value is not None
    }
    if isinstance(cfg, TeEpTokenDispatcher.Config):
        new = dataclasses.replace(cfg, **deltas)
    else:
        new = derive(cfg, TeEpTokenDispatcher.Config, **deltas)
    # A MinimalAsyncEP source carries a torch.dtype; keep the JSON-friendly name.
    new.dtype = _dtype_name(new.dtype, "te_ep_dispatcher")
    _check_config(new, "te_ep_dispatcher")
    return new


def use_te_ep(trainer_config: Any, **options: Any) -> Any:
    """Switches a TorchTitan ``Trainer.Config`` to te_ep; returns a :class:`~.trainer.TeEpTrainer` config.

    For ``config_registry`` functions (``return use_te_ep(my_config(), capacity_factor=1.25)``);
    ``--module te_ep_torch.integrations.torchtitan`` does the same to TorchTitan's own configs.
    In the config's model tree, now (TorchTitan's override mechanism, so the result is what
    ``--override.imports`` would give): every EP token dispatcher becomes a
    :class:`TeEpTokenDispatcher` (:func:`te_ep_dispatcher`; ``options`` are its kwargs), the
    plain ``GroupedExperts`` become :class:`TeEpGroupedExperts` (:func:`te_ep_experts`) and the
    plain ``RoutedExperts`` :class:`TeEpRoutedExperts` (:func:`te_ep_routed_experts`). The
    returned config has the same fields; its Trainer admits te_ep to TorchTitan's CUDA-graph
    step and fills the sizes not given in ``options`` from the final config, CLI included
    (:func:`~.trainer.fill_sizes`). ``trainer_config``'s tree is changed in place: use the
    returned config, whose Trainer is the one that captures te_ep.
    """
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from .trainer import TeEpTrainer  # TorchTitan's Trainer and its training stack

    for entry in trainer_config.override.imports:
        name = entry if isinstance(entry, str) else entry[0]
        if name in (OVERRIDE_TARGET, EXPERTS_OVERRIDE_TARGET, ROUTED_EXPERTS_OVERRIDE_TARGET):
            raise ValueError(
                f"use_te_ep: {name} is already in override.imports; pass its options to use_te_ep instead"
            )
    # The routed-experts node first (with its dispatcher and experts); then the dispatchers and
    # experts of any other node (a RoutedExperts subclass). Two passes: TorchTitan refuses one
    # that claims a node and a node inside it.
    apply_overrides(OverrideConfig(imports=[(ROUTED_EXPERTS_OVERRIDE_TARGET, dict(options))]), trainer_config)
    apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, dict(options)), EXPERTS_OVERRIDE_TARGET]),
                    trainer_config)
    if trainer_config.model_spec is None or not any(
        True for _ in trainer_config.model_spec.model.traverse(TeEpTokenDispatcher.Config)
    ):
        raise ValueError("use_te_ep: trainer_config's model has no MoE token dispatcher for te_ep to replace")
    values = {f.name: getattr(trainer_config, f.name) for f in dataclasses.fields(trainer_config) if f.init}
    return TeEpTrainer.Config(**values)
