"""Hugging Face transformers MoE models on the ``te_ep`` dispatch/combine ops.

Two ways in, by transformers version (docs/transformers.md):

* transformers >= 5.23 has expert parallelism of its own: ``from_pretrained(...,
  distributed_config=DistributedConfig(fsdp_size=W, ep_size=E, ep_implementation=NAME))``
  shards the experts of every ``"ep_dispatch_experts"`` rule of the model's EP plan over
  ``E`` ranks, applies FSDP2, and hands each experts module's tokens to the
  ``EPImplementation`` registered as ``NAME`` in ``EPImplementationInterface``. Importing
  this module registers :class:`TeEpImplementation` there as ``"te_ep"`` (default
  options); :func:`register_te_ep` registers it with other options (capacity, overflow,
  backend, checks, ...), under ``"te_ep"`` or a name of its own, since a
  ``DistributedConfig`` carries no per-implementation options.
* transformers 5.17 to 5.22 (and any version): :func:`parallelize_hf_moe` makes a loaded
  model expert-parallel itself, through transformers' experts registry
  (``ExpertsInterface``, where this module registers :data:`IMPLEMENTATION`, ``"te_ep"``,
  as an experts implementation). On >= 5.23 it still works and warns that the
  ``DistributedConfig`` entry is the way.

Either way, per experts module decorated with ``@use_experts_implementation`` (Qwen3-MoE,
Mixtral, gpt-oss, DeepSeek-V3, OLMoE, ...):

* its weights (``gate_up_proj`` / ``up_proj``, ``down_proj`` and their biases) are
  ``Shard(0)`` DTensors over the EP ranks, names and global shapes kept, so rank ``r``
  holds experts ``[r E / W, (r + 1) E / W)``, the block :class:`~te_ep_torch.EpGroup`
  assigns it;
* its forward sends each token to the ranks of its experts with
  :func:`te_ep_torch.ep_dispatch`, runs the local experts on the expert-major rows
  (the module's own gate function ``_apply_gate`` / ``act_fn``, its biases, its weight
  layout), weights the rows by the router's weights in float32 and sums them back with
  :func:`te_ep_torch.ep_combine`; one :class:`~te_ep_torch.EpHandle` per experts module
  (a :class:`TeEpExpertsState`, attribute ``te_ep`` of the module);
* the router, shared experts and everything else are the model's own, so its routing
  (softmax or sigmoid, top-k, group limits, normalisation, score bias, scaling) is
  exactly its own.

FSDP2: transformers applies it on its own meshes (``fsdp_size``); :func:`parallelize_hf_moe`
on a ``(dp, ep)`` mesh applies it with the gradient scaling of
:func:`te_ep_torch.parallel.apply_fsdp`. Either way every gradient equals the unsharded
model's, and the state dict keeps the model's names and global shapes: DCP
(:func:`te_ep_torch.parallel.save_checkpoint`) writes it, any EP size or the unsharded
model reads it back.

Nothing else in te_ep_torch imports this module or transformers.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

try:
    import transformers
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "te_ep_torch.integrations.transformers needs Hugging Face transformers 5.17 to 5.24 (CI runs 5.24.0): "
        "pip install --no-deps transformers==5.24.0 (docs/transformers.md)"
    ) from exc
try:
    from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
except ImportError as exc:  # pragma: no cover - exercised only with another transformers
    raise ImportError(
        f"te_ep_torch.integrations.transformers: transformers {transformers.__version__} lacks the experts interface "
        "it plugs into (transformers.integrations.moe.ExpertsInterface and its default gate); tested with "
        "transformers 5.17.0 and 5.24.0 (docs/transformers.md)"
    ) from exc

from transformers import activations as _activations

try:
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
except ImportError:  # transformers 5.17 to 5.22: no EP registry, parallelize_hf_moe only
    EPImplementation = EPImplementationInterface = None

from .._dtensor_rules import local_tensor as _local
from ..group import EpGroup, EpHandle
from ..moe import EXPERT_IMPLS, GROUPED_MM_ALIGNMENT, grouped_mm_supported
from ..options import UNSET, EpOptions
from ..parallel import _flat_dp_mesh, ep_group_for
from ..step import EpStep
from ..zones import expert_ffn

__all__ = [
    "EXPERT_IMPLS",
    "HAS_EP_REGISTRY",
    "IMPLEMENTATION",
    "TeEpExpertsState",
    "TeEpImplementation",
    "expert_parallel_modules",
    "parallelize_hf_moe",
    "register_te_ep",
    "te_ep_experts_forward",
]

# The name under which transformers' ExpertsInterface finds te_ep's experts forward, and
# EPImplementationInterface (>= 5.23) te_ep's EP implementation.
IMPLEMENTATION = "te_ep"
# Whether this transformers has DistributedConfig(ep_implementation=...) and its registry (>= 5.23).
HAS_EP_REGISTRY = EPImplementationInterface is not None

# The activations whose gate the zone kernels compute (te_ep_torch.zones): SiLU, as torch and
# transformers (ACT2FN["silu"]) make it, and gpt-oss's clamped SwiGLU, recognised by its function.
_SILU_TYPES = (nn.SiLU, getattr(_activations, "SiLUActivation", nn.SiLU))
try:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as _GptOssExperts

    _GPT_OSS_APPLY_GATE = _GptOssExperts._apply_gate
except ImportError:  # pragma: no cover - a transformers without gpt-oss
    _GPT_OSS_APPLY_GATE = None

# Parameters of a decorated experts module, by transformers' naming; te_ep shards exactly
# these (dim 0 = experts) and refuses a module with any other parameter or buffer.
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = tuple(f"{name}_bias" for name in _WEIGHTS)
# Set on an experts module by @use_experts_implementation; the forward reads them.
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


@dataclasses.dataclass
class TeEpExpertsState:
    """What :func:`parallelize_hf_moe` or :class:`TeEpImplementation` attaches to an experts module
    (as ``module.te_ep``).

    Attributes:
        name: the module's name in the model (for messages).
        group: the :class:`~te_ep_torch.EpGroup` its tokens travel over.
        top_k: experts per token (the router's).
        hidden: token width.
        expert_impl, alignment: the grouped-GEMM implementation (``"auto"``, ``"grouped_mm"``,
            ``"loop"``) and zone alignment (``None``: what the implementation wants) asked for.
        dims: the feature dims of the experts' GEMMs (what ``torch._grouped_mm`` needs aligned).
        options: the handles' :class:`~te_ep_torch.options.EpOptions` (capacity, overflow).
        entry: the call whose arguments set those options (named in messages):
            ``"parallelize_hf_moe"`` or ``"register_te_ep"``.
        step: the module's :class:`~te_ep_torch.step.EpStep`: one handle per token dtype (the
            first made by :func:`parallelize_hf_moe`, or on the first forward of
            :class:`TeEpImplementation` unless its ``dtype`` option names it; tokens of another
            dtype get their own on first eager use).
    """

    name: str
    group: EpGroup
    top_k: int
    hidden: int
    expert_impl: str
    alignment: Optional[int]
    dims: Tuple[int, ...]
    options: EpOptions = dataclasses.field(default_factory=EpOptions)
    entry: str = "parallelize_hf_moe"
    step: EpStep = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.step = EpStep(
            self.group, top_k=self.top_k, hidden=self.hidden, alignment=self.alignment_for, options=self.options,
            name=f"te_ep experts {self.name!r}", tokens_arg="hidden_states",
            eager_hint=f"pass {self.entry}(..., dtype=) the tokens' dtype so the handle is made beforehand")

    @property
    def handles(self) -> Dict[torch.dtype, EpHandle]:
        """The module's handles by token dtype."""
        return self.step.handles

    @property
    def impls(self) -> Dict[torch.dtype, str]:
        """The grouped-GEMM implementation per token dtype with a handle."""
        return {dtype: self.impl_for(dtype) for dtype in self.step.handles}

    def impl_for(self, dtype: torch.dtype) -> str:
        """The grouped-GEMM implementation for tokens of ``dtype``: ``"grouped_mm"`` or ``"loop"``."""
        if self.expert_impl != "auto":
            return self.expert_impl
        return "grouped_mm" if grouped_mm_supported(self.group.device, dtype, *self.dims) else "loop"

    def alignment_for(self, dtype: torch.dtype) -> int:
        """The zone alignment of the handle for tokens of ``dtype``."""
        if self.alignment is not None:
            return self.alignment
        return GROUPED_MM_ALIGNMENT if self.impl_for(dtype) == "grouped_mm" else 1

    def create_handle(self, dtype: torch.dtype) -> EpHandle:
        """Creates the handle for tokens of ``dtype`` (collective over the EP group)."""
        return self.step.add_handle(dtype)


def te_ep_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ``"te_ep"`` experts implementation (what ``ExpertsInterface`` calls; collective over the EP group).

    ``hidden_states [T, H]``, ``top_k_index [T, K]`` (global expert ids) and
    ``top_k_weights [T, K]`` come from the model's router; returns ``[T, H]`` in
    ``hidden_states``' dtype: the sum over each token's experts of the weighted
    expert outputs, as every transformers experts implementation does.
    """
    state: Optional[TeEpExpertsState] = getattr(self, "te_ep", None)
    if state is None:
        raise RuntimeError(
            f"{type(self).__name__}: config._experts_implementation is {IMPLEMENTATION!r} but this experts module "
            "was not made expert-parallel; call te_ep_torch.integrations.transformers.parallelize_hf_moe on the "
            "model that owns it (a model built from the same config object shares the setting: give each model "
            "its own config, e.g. copy.deepcopy(config))"
        )
    return _ep_step(self, state, hidden_states, top_k_index, top_k_weights)


def _ep_step(experts: nn.Module, state: TeEpExpertsState, hidden_states: Tensor, top_k_index: Tensor,
             top_k_weights: Tensor) -> Tensor:
    """One experts step on te_ep: dispatch, this rank's experts, weighting, combine (collective)."""
    shape = hidden_states.shape
    tokens = hidden_states.reshape(-1, shape[-1])
    top_k = top_k_index.shape[-1]
    if top_k != state.top_k:
        raise ValueError(
            f"te_ep experts {state.name!r}: top_k_index has {top_k} choices per token, the layer's handle was made "
            f"for top_k={state.top_k}; pass {state.entry}(..., top_k={top_k})"
        )
    impl = state.impl_for(tokens.dtype)
    # te_ep weights rows in float32 (the step casts); a bfloat16 router weight converts exactly.
    y, _, _ = state.step.run(tokens, (top_k_index.reshape(-1, top_k), top_k_weights.reshape(-1, top_k)),
                             lambda rows, counts: _run_local_experts(experts, rows, counts, impl))
    return y.reshape(shape)


def _run_local_experts(experts: nn.Module, rows: Tensor, counts: Tensor, impl: str) -> Tensor:
    """The experts of this rank on ``rows [R, H]`` (expert-major zones of ``counts [E_local]`` rows),
    through :func:`te_ep_torch.zones.expert_ffn`; rows past the zones are unspecified."""
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    w1, w2 = _local(getattr(experts, first)), _local(experts.down_proj)
    b1 = _local(getattr(experts, first + "_bias")) if experts.has_bias else None
    b2 = _local(experts.down_proj_bias) if experts.has_bias else None
    if not experts.is_transposed:  # [E, out, in] -> [E, in, out]
        w1, w2 = w1.transpose(-2, -1), w2.transpose(-2, -1)
    y = expert_ffn(rows, counts, w1, w2, b1=b1, b2=b2, impl=impl, **_gate_of(experts))
    return y.to(rows.dtype)


def _gate_of(experts: nn.Module) -> Dict[str, Any]:
    """How :func:`~te_ep_torch.zones.expert_ffn` applies this module's activation.

    The gates the zone kernels compute, recognised by the module's own function: the
    default ``_apply_gate`` with a SiLU activation (Qwen3-MoE, Mixtral, DeepSeek, OLMoE, ...)
    and gpt-oss's clamped SwiGLU (interleaved columns). Any other activation runs as the
    module's own function, over every row of the buffer (docs/transformers.md)."""
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if experts.has_gate and apply_gate is _default_apply_gate and isinstance(getattr(experts, "act_fn", None),
                                                                             _SILU_TYPES):
        return {"gate": "swiglu"}
    if experts.has_gate and apply_gate is not None and apply_gate is _GPT_OSS_APPLY_GATE:
        return {"gate": "clamped_swiglu", "interleaved": True, "alpha": float(experts.alpha),
                "limit": float(experts.limit)}
    return {"activation": experts._apply_gate if experts.has_gate else experts.act_fn}


ExpertsInterface.register(IMPLEMENTATION, te_ep_experts_forward)


# ---- parallelize_hf_moe -------------------------------------------------------------------


def _is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is an experts class decorated with transformers' ``@use_experts_implementation``."""
    return all(hasattr(module, flag) for flag in _FLAGS) and hasattr(module, "config")


def expert_parallel_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of ``model`` that runs on te_ep: made expert-parallel by
    :func:`parallelize_hf_moe`, or by ``DistributedConfig(ep_implementation="te_ep")`` (there from the
    first forward on, unless :func:`register_te_ep` was given ``max_tokens_per_rank``)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "te_ep", None), TeEpExpertsState)]


@dataclasses.dataclass
class _Layout:
    """An experts module checked for te_ep: what sharding and the handle need."""

    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    hidden: int
    dims: Tuple[int, ...]
    params: List[str]


def _check_layout(name: str, m: nn.Module, ep_size: int, top_k: Optional[int], device_type: str, *,
                  entry: str = "parallelize_hf_moe", sharded: bool = False) -> _Layout:
    """The layout of one decorated experts module; ValueError naming what te_ep can't serve.

    ``sharded``: transformers' EP plan has already split the weights (``Shard(0)`` DTensors
    over the EP mesh, ``num_experts`` the local count, the weights possibly still on the
    meta device, loaded later); otherwise the module holds every expert's weights."""
    what = f"{entry}: experts module {name!r} ({type(m).__name__})"
    num_experts = getattr(m, "num_experts", None)
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"{what} has no positive int attribute num_experts (got {num_experts!r}); te_ep needs the "
                         "expert count that its weights' dim 0 holds")
    if sharded:
        if not getattr(m, "_is_expert_parallel", False):
            raise ValueError(f"{what}: its weights are not split over the EP ranks; te_ep needs the model's ep_plan "
                             "to shard them with the 'grouped_gemm' rule (the default plan of transformers' MoE "
                             "models does; an ep_plan override must keep it)")
        num_experts *= ep_size
    if getattr(m, "has_post_expert_norm", False):
        raise ValueError(f"{what} normalises each expert's output (has_post_expert_norm=True), which te_ep's "
                         "experts step does not do; keep transformers' own experts implementation")
    first = "gate_up_proj" if m.has_gate else "up_proj"
    required = [first, "down_proj"] + ([first + "_bias", "down_proj_bias"] if m.has_bias else [])
    params = dict(m.named_parameters(recurse=False))
    missing = [p for p in required if p not in params]
    if missing:
        raise ValueError(f"{what} has no parameter {missing[0]!r}: te_ep runs experts whose weights are "
                         f"{required} (has_gate={m.has_gate}, has_bias={m.has_bias}), got {sorted(params)}")
    extra = [p for p in params if p not in required]
    extra += [f"{child}.{p}" for child, sub in m.named_children() for p, _ in sub.named_parameters()]
    if extra:
        raise ValueError(f"{what} has parameter {extra[0]!r}, which te_ep does not know how to shard or use "
                         f"(it runs experts made of {required} only), e.g. quantized experts; load the model "
                         "unquantized or keep transformers' own experts implementation")
    buffers = [b for b, _ in m.named_buffers()]
    if buffers:
        raise ValueError(f"{what} has buffer {buffers[0]!r}, which te_ep does not know how to shard or use")
    for p in required:
        t = params[p]
        if sharded:
            if not isinstance(t, DTensor) or tuple(t.placements) != (Shard(0),) or t.device_mesh.size() != ep_size:
                got = f"{type(t).__name__} {getattr(t, 'placements', '')}".strip()
                raise ValueError(f"{what}: {p} must be a DTensor sharded Shard(0) over the {ep_size} EP ranks (the "
                                 f"ep_plan's 'grouped_gemm' rule), got {got}")
        elif isinstance(t, DTensor):
            raise RuntimeError(f"{what}: {p} is already a DTensor; parallelize_hf_moe applies once, to a model "
                               "whose experts hold all their weights")
        if t.dim() != (2 if p.endswith("_bias") else 3) or t.shape[0] != num_experts:
            raise ValueError(f"{what}: {p} has shape {tuple(t.shape)}, expected [num_experts={num_experts}, ...] "
                             f"({'2' if p.endswith('_bias') else '3'}-D)")
        if sharded:
            continue
        if t.device.type == "meta":
            raise ValueError(f"{what}: {p} is on the meta device; load or initialize the weights first")
        if t.device.type != device_type:
            raise ValueError(f"{what}: {p} is on {t.device}, the EP mesh on {device_type!r}; move the model "
                             f"(model.to(...)) before parallelize_hf_moe")
    if not m.is_concatenated and type(m)._apply_gate is _default_apply_gate:
        raise ValueError(f"{what} stores gate and up interleaved (is_concatenated=False) without its own "
                         "_apply_gate, which transformers' default gate (first half gate, second half up) would read "
                         "wrong")
    w1, w2 = params[first], params["down_proj"]
    (in1, out1), (in2, out2) = ((w.shape[1], w.shape[2]) if m.is_transposed else (w.shape[2], w.shape[1])
                                for w in (w1, w2))
    if out2 != in1:
        raise ValueError(f"{what}: {first} takes {in1} features and down_proj gives {out2}: the experts must map "
                         f"tokens to tokens of the same width (is_transposed={m.is_transposed})")
    if m.has_gate and type(m)._apply_gate is _default_apply_gate and out1 != 2 * in2:
        raise ValueError(f"{what}: {first} gives {out1} features, down_proj takes {in2}; the default gate needs "
                         f"{2 * in2}")
    if num_experts % ep_size:
        raise ValueError(f"{what}: num_experts ({num_experts}) must be divisible by the EP size ({ep_size}); te_ep "
                         "gives every EP rank the same number of experts")
    if top_k is None:
        top_k = getattr(m.config, "num_experts_per_tok", None)
        if not isinstance(top_k, int):
            raise ValueError(f"{what}: its config has no int num_experts_per_tok (got {top_k!r}); pass "
                             f"{entry}(..., top_k=) the experts each token goes to")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{what}: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return _Layout(name, m, num_experts, top_k, int(in1), (int(in1), int(out1), int(in2)), list(required))


_EP_FIELDS = frozenset(f.name for f in dataclasses.fields(EpOptions))


def _check_options(what: str = "parallelize_hf_moe", *, max_tokens_may_be_none: bool = False,
                   ep_options: Optional[EpOptions] = None, **options) -> EpOptions:
    """The EP options as one record (``ep_options``, or the deprecated EP keywords among
    ``options``, :data:`~te_ep_torch.options.UNSET` where not passed; ``EpOptions.resolve``
    warns for those passed, pointing at the caller of ``what``); ValueError naming the wrong
    argument of ``what`` (:func:`parallelize_hf_moe` or :func:`register_te_ep`)."""
    max_tokens = options["max_tokens_per_rank"]
    if not (max_tokens_may_be_none and max_tokens is None) and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0):
        raise ValueError(f"{what}: max_tokens_per_rank must be a positive int (batch size * sequence length per "
                         f"rank){' or None (the first batch)' if max_tokens_may_be_none else ''}, got {max_tokens!r}")
    keywords = {name: options.pop(name) for name in list(options) if name in _EP_FIELDS}
    record = EpOptions.resolve(what, ep_options, stacklevel=2, **keywords)
    dtype = options["dtype"]
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    alignment = options["alignment"]
    if alignment is not None and (not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1)):
        raise ValueError(f"{what}: alignment must be None or a power of two, got {alignment!r}")
    if options["expert_impl"] not in EXPERT_IMPLS:
        raise ValueError(f"{what}: expert_impl must be one of {EXPERT_IMPLS}, got {options['expert_impl']!r}")
    if options["expert_impl"] == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise ValueError(f"{what}: expert_impl='grouped_mm' needs torch._grouped_mm (torch {torch.__version__})")
    top_k = options["top_k"]
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"{what}: top_k must be None or a positive int, got {top_k!r}")
    return record


def _meshes(model: nn.Module, mesh_or_group, dp_dim: str, ep_dim: str) -> Tuple[DeviceMesh, Optional[DeviceMesh]]:
    """``(ep_mesh, 2-D mesh or None)`` from what the caller passed."""
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim == 1:
            return mesh_or_group, None
        names = mesh_or_group.mesh_dim_names or ()
        if mesh_or_group.ndim != 2 or set(names) != {dp_dim, ep_dim}:
            raise ValueError(f"parallelize_hf_moe: mesh_or_group must be a 1-D EP mesh or a 2-D mesh with dims "
                             f"({dp_dim!r}, {ep_dim!r}) (dp_dim, ep_dim), got {mesh_or_group}")
        return mesh_or_group[ep_dim], mesh_or_group
    if mesh_or_group is not None and not isinstance(mesh_or_group, dist.ProcessGroup):
        raise TypeError(f"parallelize_hf_moe: mesh_or_group must be a DeviceMesh, a ProcessGroup or None (the "
                        f"default group), got {type(mesh_or_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("parallelize_hf_moe: torch.distributed is not initialized; call init_process_group first")
    pg = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    param = next(iter(model.parameters()), None)
    device_type = param.device.type if param is not None else "cpu"
    return DeviceMesh.from_group(pg, device_type), None


def _default_blocks(model: nn.Module) -> List[nn.Module]:
    """The transformer blocks of a transformers model: its ``_no_split_modules`` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def parallelize_hf_moe(
    model: nn.Module,
    mesh_or_group=None,
    *,
    max_tokens_per_rank: int,
    backend: str = UNSET,
    nccl_ep_mode: str = UNSET,
    timeout=UNSET,
    checks: str = UNSET,
    dtype: Optional[torch.dtype] = None,
    alignment: Optional[int] = None,
    capacity_factor: Optional[float] = UNSET,
    overflow: str = UNSET,
    expert_impl: str = "auto",
    top_k: Optional[int] = None,
    src_data_rank: Optional[int] = 0,
    dp_dim: str = "dp",
    ep_dim: str = "ep",
    blocks: Optional[Iterable[nn.Module]] = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    options: Optional[EpOptions] = None,
) -> nn.Module:
    """Makes a transformers MoE model expert-parallel on te_ep (collective; in place; returns ``model``).

    The way in on transformers 5.17 to 5.22. On >= 5.23 it keeps working but warns
    (``DeprecationWarning``): there, transformers shards the model
    itself and ``DistributedConfig(ep_size=..., ep_implementation="te_ep")`` runs its
    experts on te_ep (:func:`register_te_ep`, docs/transformers.md).

    Every experts module decorated with transformers' ``@use_experts_implementation``
    gets its weights sharded ``Shard(0)`` over the EP ranks (names and global shapes
    kept), its own :class:`~te_ep_torch.EpHandle` (attribute ``te_ep``, a
    :class:`TeEpExpertsState`) and the ``"te_ep"`` experts implementation (set on its
    config, ``config._experts_implementation``). Everything is checked before anything
    changes: a model without such experts, experts with parameters te_ep does not know
    (quantized ones, say), a layout it can't read or ``num_experts`` not divisible by the
    EP size raise ``ValueError`` naming the module and what is wrong.

    Args:
        model: a loaded transformers model (weights materialized on the device the mesh
            is on; every rank holds the same weights, or see ``src_data_rank``).
        mesh_or_group: where the experts go.
            * a 1-D ``DeviceMesh``, a ``ProcessGroup`` or ``None`` (the default group):
              expert parallelism over those ranks only. Every other parameter stays a
              plain replicated tensor whose gradient is this rank's; reduce those over the
              ranks as data parallelism does. An expert's gradient already sums the losses
              of all EP ranks' tokens (docs/moe.md, "ExpertParallel").
            * a 2-D ``DeviceMesh`` with dims ``(dp_dim, ep_dim)``
              (:func:`te_ep_torch.parallel.init_moe_mesh`): expert parallelism on
              ``mesh[ep_dim]``, then FSDP2: each experts module on ``mesh[dp_dim]``
              (``Shard(1)``, gradient divided by the world size), each of ``blocks`` and
              then ``model`` on the flattened mesh. With each rank's loss the mean over its
              own tokens, every gradient equals the unsharded model's on the concatenated
              batch (te_ep_torch.parallel.apply_fsdp has the derivation).
        max_tokens_per_rank: most tokens one forward of a rank sends into an MoE layer
            (batch size * sequence length). A longer batch raises ``ValueError`` naming it.
        dtype: dtype of the tokens entering the experts, the handles are made for it now
            (before any ``torch.compile``); default ``mp_policy.param_dtype`` and else the
            experts' weight dtype. Tokens of another dtype get their own handle on first
            eager use.
        alignment: rows each expert zone is padded to (power of two); ``None``: 16 where
            the experts run ``torch._grouped_mm``, else 1.
        expert_impl: how the local experts run on the received rows: ``"grouped_mm"``
            (``torch._grouped_mm``), ``"loop"`` (a dense GEMM per local expert over the
            buffer, any device and dtype) or ``"auto"`` (``grouped_mm`` on CUDA SM90+ in
            bfloat16 with dims a multiple of 8, else ``loop``).
        top_k: experts per token; default the config's ``num_experts_per_tok``.
        src_data_rank: the EP rank whose expert weights are scattered (so every rank
            starts from the same weights); ``None`` keeps each rank's own slice without
            communication (every rank loaded the same checkpoint).
        dp_dim, ep_dim: the 2-D mesh's dim names.
        blocks: modules that become their own FSDP units (2-D mesh only); default the
            model's ``_no_split_modules`` classes (its decoder layers).
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` of every FSDP unit
            (2-D mesh only). The experts' units never cast their inputs, so the router's
            weights reach them in the router's own dtype.
        reshard_after_forward: ``fully_shard``'s (2-D mesh only).
        options: te_ep's EP options as one :class:`~te_ep_torch.options.EpOptions` (default
            ``EpOptions()``), e.g. ``options=te.EpOptions(capacity_factor=1.25)``. Its
            ``backend``: ``"auto"`` (``nccl_ep`` on Hopper+ GPUs where NCCL EP loads, else
            ``"reference"``), ``"reference"`` or ``"nccl_ep"``; ``nccl_ep_mode``, ``timeout``,
            ``checks``: :class:`~te_ep_torch.EpGroup`'s (NCCL EP's transport mode, the
            watchdog's limit, how bad input is caught: docs/ops.md, "Check modes");
            ``capacity_factor``: receive rows as a multiplier (>= 1.0, typically 1.0 to 2.0) of
            the mean receive load of a rank, ``top_k * max_tokens_per_rank``, plus zone padding
            (:meth:`te_ep_torch.EpGroup.capacity_for_factor`); ``None`` = the worst case (every
            token of every EP rank here), which no routing overflows. A step that needs more
            raises ``capacity overflow`` (docs/ops.md, "Capacity"). Values below 1.0 (the old
            fraction-of-the-worst-case meaning, removed in 0.3.0) are refused; ``capacity``:
            receive rows instead; ``overflow``: ``"raise"`` or ``"drop"``, what a step that
            needs more rows than the capacity does (:meth:`te_ep_torch.EpGroup.create_handle`;
            dropped choices are counted in each handle's ``dropped``).
        backend, nccl_ep_mode, timeout, checks, capacity_factor, overflow: deprecated
            (``FutureWarning``; removed in 0.4): the same fields of ``options``, one keyword
            each.
    """
    if HAS_EP_REGISTRY:
        warnings.warn(
            f"parallelize_hf_moe: transformers {transformers.__version__} has expert parallelism of its own; load the "
            f"model with distributed_config=DistributedConfig(ep_size=..., ep_implementation={IMPLEMENTATION!r}) "
            "instead (te_ep_torch.integrations.transformers.register_te_ep takes the options; docs/transformers.md). "
            "parallelize_hf_moe keeps working.", DeprecationWarning, stacklevel=2)
    options = _check_options(max_tokens_per_rank=max_tokens_per_rank, backend=backend, nccl_ep_mode=nccl_ep_mode,
                             timeout=timeout, checks=checks, dtype=dtype, alignment=alignment,
                             capacity_factor=capacity_factor, overflow=overflow, expert_impl=expert_impl, top_k=top_k,
                             ep_options=options)
    ep_mesh, mesh = _meshes(model, mesh_or_group, dp_dim, ep_dim)
    if mesh is None and (mp_policy is not None or blocks is not None):
        raise ValueError("parallelize_hf_moe: mp_policy and blocks are FSDP2 options; they need a 2-D (dp, ep) mesh "
                         "as mesh_or_group")
    found = [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]
    if not found:
        raise ValueError(
            f"parallelize_hf_moe: {type(model).__name__} has no experts module of transformers' "
            "@use_experts_implementation kind (stacked [num_experts, ...] weights, has_gate/has_bias/is_transposed "
            f"flags; transformers {transformers.__version__}), so te_ep has nothing to run"
        )
    inside = tuple(name + "." for name, _ in found)
    others = [name for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] == "experts" and not _is_experts_module(m) and not name.startswith(inside)]
    if others:
        raise ValueError(
            f"parallelize_hf_moe: {others[0]!r} ({type(model.get_submodule(others[0])).__name__}) holds experts that "
            "are not of transformers' @use_experts_implementation kind; te_ep would leave them replicated on every "
            "rank, so the model is refused"
        )
    ep_size = ep_mesh.size()
    layouts = [_check_layout(name, m, ep_size, top_k, ep_mesh.device_type) for name, m in found]
    if dtype is None and mp_policy is not None:
        dtype = mp_policy.param_dtype

    for layout in layouts:
        m = layout.module
        for p in layout.params:
            param = getattr(m, p)
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=src_data_rank)
            m.register_parameter(p, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = ep_group_for(ep_mesh, num_experts=layout.num_experts, max_tokens_per_rank=max_tokens_per_rank,
                             **options.group_kwargs())
        state = TeEpExpertsState(name=layout.name, group=group, top_k=layout.top_k, hidden=layout.hidden,
                                 expert_impl=expert_impl, alignment=alignment, dims=layout.dims, options=options)
        state.create_handle(dtype if dtype is not None else getattr(m, layout.params[0]).dtype)
        m.te_ep = state
    # The experts forward is chosen by the config the module was built with (shared by the
    # model's layers; the setter passes it on to sub-configs).
    for config in {id(layout.module.config): layout.module.config for layout in layouts}.values():
        config._experts_implementation = IMPLEMENTATION
    unset = [layout for layout in layouts if layout.module.config._experts_implementation != IMPLEMENTATION]
    if unset:
        raise RuntimeError(f"parallelize_hf_moe: {unset[0].name!r} kept experts implementation "
                           f"{unset[0].module.config._experts_implementation!r} after its config was set to "
                           f"{IMPLEMENTATION!r}")
    if mesh is not None:
        _apply_fsdp(model, mesh, [layout.module for layout in layouts], dp_dim=dp_dim, ep_dim=ep_dim,
                    blocks=_default_blocks(model) if blocks is None else list(blocks), mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward)
    return model


def _apply_fsdp(model: nn.Module, mesh: DeviceMesh, experts: List[nn.Module], *, dp_dim: str, ep_dim: str,
                blocks: List[nn.Module], mp_policy, reshard_after_forward: bool) -> None:
    """FSDP2 as :func:`te_ep_torch.parallel.apply_fsdp` lays it out, for transformers' experts modules."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    # The router's weights (float32 in DeepSeek-V3, say) reach the experts uncast.
    experts_mp = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    dp_mesh = mesh[dp_dim]
    dense_mesh = _flat_dp_mesh(mesh, dp_dim, ep_dim)
    world = dense_mesh.size()
    # Gloo has no pre-multiplied sum; FSDP then divides around a plain sum instead.
    force_sum = dp_mesh.size() > 1 and dist.get_backend(dp_mesh.get_group()) != "nccl"
    for m in experts:
        # Dim 0 (experts) is split by EP already: FSDP shards dim 1.
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda _param: Shard(1), mp_policy=experts_mp)
        m.set_gradient_divide_factor(float(world))
        if force_sum:
            m.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


# ---- transformers' EP registry (>= 5.23) ----------------------------------------------------


def register_te_ep(
    name: str = IMPLEMENTATION,
    *,
    max_tokens_per_rank: Optional[int] = None,
    backend: str = UNSET,
    nccl_ep_mode: str = UNSET,
    timeout=UNSET,
    checks: str = UNSET,
    dtype: Optional[torch.dtype] = None,
    alignment: Optional[int] = None,
    capacity_factor: Optional[float] = UNSET,
    overflow: str = UNSET,
    expert_impl: str = "auto",
    top_k: Optional[int] = None,
    options: Optional[EpOptions] = None,
):
    """Registers te_ep with these options as transformers' EP implementation ``name`` (transformers >= 5.23).

    ``DistributedConfig(ep_size=..., ep_implementation=name)`` then runs every experts
    module of the model's ``"ep_dispatch_experts"`` rules on te_ep. A ``DistributedConfig``
    carries no per-implementation options, so they are fixed here, per name: importing
    this module registers ``"te_ep"`` with the defaults; calling this again with ``"te_ep"``
    replaces them for models sharded afterwards, and another ``name`` registers a second
    configuration beside it (say
    ``register_te_ep("te_ep_cf1.25", options=te.EpOptions(capacity_factor=1.25))``).
    Idempotent: the same name and options return the class already registered.

    Args:
        name: the ``ep_implementation`` name; not one of transformers' own.
        max_tokens_per_rank: most tokens one forward of a rank sends into an MoE layer
            (batch size * sequence length); ``None``: the largest first batch of the EP
            ranks (a longer batch later raises ``ValueError`` naming this option).
        dtype, alignment, expert_impl, top_k, options: as :func:`parallelize_hf_moe`'s
            (``dtype``: the handles are made when the model is sharded if
            ``max_tokens_per_rank`` is given too, else on the first forward).
        backend, nccl_ep_mode, timeout, checks, capacity_factor, overflow: deprecated
            (``FutureWarning``; removed in 0.4): the same fields of ``options``.

    Returns:
        the registered :class:`TeEpImplementation` subclass (``options`` holds the options).

    Raises:
        RuntimeError: transformers has no EP registry (< 5.23: use :func:`parallelize_hf_moe`).
        ValueError: an option or ``name`` is invalid (the message names it).
    """
    if not HAS_EP_REGISTRY:
        raise RuntimeError(
            f"register_te_ep: transformers {transformers.__version__} has no EP implementation registry "
            "(DistributedConfig(ep_implementation=...) needs transformers >= 5.23); use parallelize_hf_moe "
            "(docs/transformers.md)"
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_te_ep: name must be a non-empty str, got {name!r}")
    ep_options = options
    options = dict(max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, alignment=alignment,
                   expert_impl=expert_impl, top_k=top_k)
    record = _check_options("register_te_ep", max_tokens_may_be_none=True, ep_options=ep_options, backend=backend,
                            nccl_ep_mode=nccl_ep_mode, timeout=timeout, checks=checks,
                            capacity_factor=capacity_factor, overflow=overflow, **options)
    options.update(dataclasses.asdict(record))  # the class keeps plain values: the record's
    registry = EPImplementationInterface()
    current = registry[name] if name in registry else None
    if current is not None and not (isinstance(current, type) and issubclass(current, TeEpImplementation)):
        raise ValueError(f"register_te_ep: name {name!r} is taken by {getattr(current, '__name__', current)!r}, "
                         "not a te_ep implementation; choose another name")
    if current is not None and current.options == options:
        return current
    cls = type("TeEpImplementation", (TeEpImplementation,),
               {"options": options, "registered_name": name, "__module__": __name__,
                "__doc__": f"te_ep registered as ep_implementation={name!r} with options {options}."})
    EPImplementationInterface.register(name, cls)
    return cls


if HAS_EP_REGISTRY:

    class TeEpImplementation(EPImplementation):
        """te_ep as transformers' ``EPImplementation`` (>= 5.23): what
        ``DistributedConfig(ep_implementation="te_ep")`` builds, one per experts module.

        transformers has already split the module's weights ``Shard(0)`` over the EP mesh
        (its ``grouped_gemm`` rule) and calls this with the rank's own tokens
        ``hidden_states [T, H]``, the router's ``top_k_index [T, K]`` (global expert ids) and
        ``top_k_weights [T, K]``, inside a context where the module's parameters are plain
        local tensors; it returns the weighted sum over each token's experts, as
        :func:`te_ep_experts_forward` does for :func:`parallelize_hf_moe`.

        The module's :class:`TeEpExpertsState` (``module.te_ep``) is made here when the
        options name ``max_tokens_per_rank``, else on the first forward, sized to that
        batch (the largest over the EP ranks: one all-reduce, once per layer). Its handle
        is made here for the options' ``dtype``, else for the dtype of the first tokens.

        ``options`` (class attribute) are :func:`register_te_ep`'s, which registers a
        subclass carrying them; this class carries the defaults, registered as ``"te_ep"``
        when the module is imported.
        """

        # register_te_ep's defaults (parallelize_hf_moe's, but max_tokens_per_rank=None).
        options: ClassVar[Dict[str, Any]] = {
            **{name: p.default for name, p in inspect.signature(register_te_ep).parameters.items()
               if name not in ("name", "options") and name not in _EP_FIELDS},
            **dataclasses.asdict(EpOptions())}
        registered_name: ClassVar[str] = IMPLEMENTATION

        def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            what = f"ep_implementation={self.registered_name!r}"
            if tp_mesh.size() > 1:
                raise ValueError(
                    f"{what}: te_ep needs each rank of the EP group to hold a batch of its own (tp_size=1); here "
                    f"{tp_mesh.size()} tensor-parallel ranks share one (DistributedConfig tp_size={tp_mesh.size()}); "
                    "use tp_size=1, or transformers' ep_implementation='auto' or 'all_reduce'"
                )
            if not _is_experts_module(experts):
                raise ValueError(
                    f"{what}: {type(experts).__name__} is not an experts module of transformers' "
                    "@use_experts_implementation kind (stacked [num_experts, ...] weights, has_gate/has_bias/"
                    "is_transposed flags), which is what te_ep runs; keep transformers' own ep_implementation"
                )
            self.experts = experts
            self.name = type(experts).__name__
            self.layout = _check_layout(self.name, experts, ep_mesh.size(), self.options["top_k"], ep_mesh.device_type,
                                        entry="register_te_ep", sharded=True)
            self.state: Optional[TeEpExpertsState] = None
            if self.options["max_tokens_per_rank"] is not None:
                self._make_state(self.options["max_tokens_per_rank"])

        def _make_state(self, max_tokens_per_rank: int) -> TeEpExpertsState:
            """The module's group, state and (for the ``dtype`` option) handle: collective over the EP mesh."""
            opts, layout = self.options, self.layout
            record = _check_options("register_te_ep", max_tokens_may_be_none=True,
                                    ep_options=EpOptions(**{k: v for k, v in opts.items() if k in _EP_FIELDS}),
                                    **{k: v for k, v in opts.items() if k not in _EP_FIELDS})
            group = ep_group_for(self.ep_mesh, num_experts=layout.num_experts, max_tokens_per_rank=max_tokens_per_rank,
                                 **record.group_kwargs())
            state = TeEpExpertsState(name=self.name, group=group, top_k=layout.top_k, hidden=layout.hidden,
                                     expert_impl=opts["expert_impl"], alignment=opts["alignment"], dims=layout.dims,
                                     options=record, entry="register_te_ep")
            if opts["dtype"] is not None:
                state.create_handle(opts["dtype"])
            self.experts.te_ep = state
            self.state = state
            return state

        def _state_from_first_batch(self, hidden_states: Tensor) -> TeEpExpertsState:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"te_ep experts {self.name!r}: ep_implementation={self.registered_name!r} sizes its buffers from "
                    "the first batch, which it can't do while torch.compile traces the layer; run one eager step "
                    "first, or register_te_ep(max_tokens_per_rank=..., dtype=...) so they are made when the model is "
                    "sharded"
                )
            tokens = torch.tensor([hidden_states.numel() // hidden_states.shape[-1]], dtype=torch.int64,
                                  device=hidden_states.device)
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.ep_mesh.get_group())
            return self._make_state(max(int(tokens.item()), 1))

        def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            state = self.state if self.state is not None else self._state_from_first_batch(hidden_states)
            return _ep_step(self.experts, state, hidden_states, top_k_index, top_k_weights)

    EPImplementationInterface.register(IMPLEMENTATION, TeEpImplementation)
else:
    TeEpImplementation = None
