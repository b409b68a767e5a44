"""Sharding layer: expert parallelism as a ``ParallelStyle``, FSDP2 on a (dp, ep) mesh, DCP.

* :class:`ExpertParallel` — for ``torch.distributed.tensor.parallel.parallelize_module``:
  turns the expert weights of a :class:`~te_ep_torch.moe.MoE` into ``Shard(0)`` DTensors
  on a 1-D EP mesh and makes the layer dispatch/combine its tokens with the ``te_ep`` ops
  over that mesh's process group.
* :func:`apply_fsdp` — ``fully_shard`` for a model whose MoE layers are expert-parallel,
  on a 2-D ``(dp, ep)`` mesh, with the gradient scaling that makes every gradient equal to
  the unsharded model's (the math is in its docstring and in docs/moe.md).
* :func:`parallelize_moe_model` — both of the above for every MoE layer of a model.
* :func:`save_checkpoint` / :func:`load_checkpoint` — ``torch.distributed.checkpoint``
  of the sharded model (and optimizer); a checkpoint loads into another ``(dp, ep)``
  layout, because DCP stores global tensors and expert weights keep their global
  ``[E, ...]`` shape whatever the sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from .group import DEFAULT_NCCL_EP_MODE, EpGroup
from .moe import MoE
from .options import UNSET, EpOptions

__all__ = [
    "ExpertParallel",
    "apply_fsdp",
    "ep_group_for",
    "init_moe_mesh",
    "load_checkpoint",
    "moe_layers",
    "parallelize_moe_model",
    "save_checkpoint",
    "shutdown_ep_groups",
]

_EP_GROUPS: Dict[Tuple, EpGroup] = {}
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(EpOptions))


def init_moe_mesh(
    device_type: str, *, dp: int, ep: int, dim_names: Tuple[str, str] = ("dp", "ep")
) -> DeviceMesh:
    """A ``(dp, ep)`` device mesh over all ranks (``dp * ep`` must be the world size).

    EP is the inner (fastest-varying) dim, so an EP group is ``ep`` consecutive ranks
    (one node's GPUs when ``ep`` is the GPUs per node).
    """
    if dp * ep != dist.get_world_size():
        raise ValueError(f"init_moe_mesh: dp ({dp}) * ep ({ep}) must equal the world size ({dist.get_world_size()})")
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=dim_names)


def ep_group_for(
    mesh_or_group,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    backend: str = "auto",
    device=None,
    nccl_ep_mode: str = DEFAULT_NCCL_EP_MODE,
    timeout=None,
    checks: str = "local",
) -> EpGroup:
    """The :class:`EpGroup` over a 1-D mesh's (or a process group's) ranks, shared by layers.

    One group per ``(process group, num_experts, max_tokens_per_rank, backend, device,
    nccl_ep_mode, timeout, checks)`` is created and cached, so the MoE layers of a model share
    it; each layer still gets its own handle. :func:`shutdown_ep_groups` releases them.
    ``nccl_ep_mode``, ``timeout`` and ``checks`` are :class:`EpGroup`'s.
    """
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"ep_group_for: needs a 1-D mesh (the EP dim), got {mesh_or_group.ndim}-D")
        pg = mesh_or_group.get_group()
        if device is None and mesh_or_group.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        pg = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    key = (pg.group_name, num_experts, max_tokens_per_rank, backend, None if device is None else str(device),
           nccl_ep_mode, None if timeout is None else str(timeout), checks)
    group = _EP_GROUPS.get(key)
    if group is None or group.closed:
        group = EpGroup(
            pg, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank, backend=backend, device=device,
            nccl_ep_mode=nccl_ep_mode, timeout=timeout, checks=checks,
        )
        _EP_GROUPS[key] = group
    return group


def shutdown_ep_groups() -> None:
    """Shuts down every group :func:`ep_group_for` created (call before destroying process groups)."""
    for group in _EP_GROUPS.values():
        group.shutdown()
    _EP_GROUPS.clear()


def moe_layers(model: nn.Module) -> Iterable[Tuple[str, MoE]]:
    """``(name, layer)`` for every :class:`~te_ep_torch.moe.MoE` in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


class ExpertParallel(ParallelStyle):
    """Expert parallelism for one :class:`~te_ep_torch.moe.MoE` layer.

    Apply with ``parallelize_module(moe, mesh["ep"], ExpertParallel(...))`` (or a plan
    ``{"layers.0.moe": ExpertParallel(...)}`` on the model). On the 1-D EP mesh of
    ``W`` ranks it

    * replaces ``w_gate``, ``w_up`` and ``w_down`` of ``moe.experts`` by DTensors of the
      same global shape ``[E, ...]`` placed ``Shard(0)``: rank ``r`` keeps experts
      ``[r * E / W, (r + 1) * E / W)``, the block ``EpGroup`` assigns it. By default
      rank 0's values are scattered (``src_data_rank=0``), so every rank starts from
      the same global weights even if they were initialized differently.
    * makes the layer route tokens with ``ep_dispatch`` / ``ep_combine`` over
      ``mesh.get_group()`` (an :class:`EpGroup` from :func:`ep_group_for`).

    Router and shared expert are untouched (replicated, plain tensors).

    Args:
        max_tokens_per_rank: most tokens (``batch * seq`` per rank) one forward sees.
        dtype: token dtype the layer sees (the compute dtype); default: expert weight dtype.
        src_data_rank: rank whose weights are scattered; ``None`` keeps each rank's own
            slice of its local (full) weights without communication.
        options: the EP options as one :class:`~te_ep_torch.options.EpOptions`, e.g.
            ``ExpertParallel(max_tokens_per_rank=T, options=te.EpOptions(capacity_factor=1.25))``
            (default ``EpOptions()``): the group's ``backend`` (``"auto"``: ``nccl_ep`` on CUDA
            where usable, else ``reference``), ``nccl_ep_mode``, ``timeout`` and ``checks``
            (:class:`EpGroup`), and the handle's ``capacity`` (receive rows per rank; default
            the worst case, which never overflows), ``capacity_factor`` (the receive rows as a
            multiplier >= 1.0 of a rank's mean load, ``top_k * max_tokens_per_rank``, plus zone
            padding; :meth:`~te_ep_torch.EpGroup.capacity_for_factor`; not with ``capacity``)
            and ``overflow`` (``"raise"`` or ``"drop"``; :meth:`~te_ep_torch.EpGroup.create_handle`).
        backend, capacity, capacity_factor, overflow, nccl_ep_mode, timeout, checks: deprecated
            (``FutureWarning``; removed in 0.4): the same fields of ``options``, one keyword
            each (``ValueError`` if one differs from its default besides ``options``). The
            style reads them as attributes still (``style.capacity_factor``: its options').
    """

    def __init__(
        self,
        *,
        max_tokens_per_rank: int,
        backend: str = UNSET,
        dtype: Optional[torch.dtype] = None,
        capacity: Optional[int] = UNSET,
        capacity_factor: Optional[float] = UNSET,
        overflow: str = UNSET,
        src_data_rank: Optional[int] = 0,
        nccl_ep_mode: str = UNSET,
        timeout=UNSET,
        checks: str = UNSET,
        options: Optional[EpOptions] = None,
    ) -> None:
        super().__init__()
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dtype = dtype
        # Checked now: applying the style shards the weights before the handle is made.
        self.options = EpOptions.resolve(
            "ExpertParallel", options, backend=backend, nccl_ep_mode=nccl_ep_mode, timeout=timeout, checks=checks,
            capacity=capacity, capacity_factor=capacity_factor, overflow=overflow)
        self.src_data_rank = src_data_rank

    def __getattr__(self, name: str):
        # The options read as attributes, as before they were one record (style.capacity_factor, ...).
        if name in _OPTION_NAMES and "options" in self.__dict__:
            return getattr(self.__dict__["options"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoE):
            raise TypeError(f"ExpertParallel: applies to te_ep_torch.moe.MoE layers, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"ExpertParallel: needs a 1-D mesh (the EP dim), got {device_mesh.ndim}-D")
        ep_size = device_mesh.size()
        if module.num_experts % ep_size:
            raise ValueError(
                f"ExpertParallel: num_experts ({module.num_experts}) must be divisible by the EP size ({ep_size})"
            )
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                raise RuntimeError(f"ExpertParallel: experts.{name} is already a DTensor; apply the style once")
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = ep_group_for(device_mesh, num_experts=module.num_experts, max_tokens_per_rank=self.max_tokens_per_rank,
                             **self.options.group_kwargs())
        module.enable_expert_parallel(group, dtype=self.dtype, options=self.options)
        return module


def _flat_dp_mesh(mesh: DeviceMesh, dp_dim: str, ep_dim: str) -> DeviceMesh:
    name = f"{dp_dim}_{ep_dim}"
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return mesh[(dp_dim, ep_dim)]._flatten(name)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    dp_dim: str = "dp",
    ep_dim: str = "ep",
    blocks: Optional[Iterable[nn.Module]] = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 (``fully_shard``) for a model whose MoE layers are expert-parallel on ``mesh[ep_dim]``.

    Mesh: 2-D ``(dp, ep)`` (:func:`init_moe_mesh`), world ``N = dp * ep``. Every rank
    sees its own tokens, so all ``N`` ranks are data-parallel for the dense
    parameters; experts are split over ``ep`` and replicated over ``dp``.

    * each ``moe.experts`` is sharded with ``fully_shard`` on ``mesh[dp_dim]``. Its dim 0
      (experts) is already split by EP, so FSDP shards dim 1 (``Shard(1)``; the hidden
      dim of ``w_gate``/``w_up``, the FFN dim of ``w_down``): parameters end up as 2-D
      DTensors placed ``(Shard(1), Shard(0))`` on ``(dp, ep)``.
    * each module of ``blocks`` (e.g. the transformer blocks), then ``model`` itself, is
      sharded on the flattened ``dp x ep`` mesh (all ranks), which holds all parameters
      not already taken by an inner ``fully_shard`` (router, attention, embeddings...).
    * every MoE router gets ``process_group`` = that flattened group, so the aux loss
      and the bias-update load are those of the global batch.

    Gradient scaling. Let rank ``r`` (of ``N``) compute ``L_r``, the mean loss over
    its own tokens (all ranks the same token count), and let the reference be the
    unsharded model on the concatenated batch, ``L = (1/N) sum_r L_r``.

    * dense parameter ``p``: rank ``r``'s backward gives ``dL_r/dp``; FSDP's
      reduce-scatter over all ``N`` ranks averages: ``(1/N) sum_r dL_r/dp = dL/dp``.
      Default FSDP behaviour, nothing to change.
    * expert ``e`` owned by EP rank ``q``: in dp replica ``d`` it receives the tokens of
      all ``ep`` ranks ``(d, *)`` and the combine's backward returns each source rank's
      loss gradient, so rank ``(d, q)``'s backward gives
      ``g_d = sum_{s in ep} dL_(d,s)/dw_e``. FSDP on ``mesh[dp_dim]`` reduces over the
      ``dp`` replicas; an average would give ``(1/dp) sum_d g_d = (N/dp) dL/dw_e =
      ep * dL/dw_e``. So the experts' divide factor is set to ``N = dp * ep``
      (``set_gradient_divide_factor``): ``(1/N) sum_d g_d = (1/N) sum_r dL_r/dw_e =
      dL/dw_e``. This holds for ``dp = 1`` too (FSDP then only divides).

    A loss that is a sum over tokens instead of a mean (or unequal token counts) needs
    its own factor on both kinds of parameters alike; the expert/dense ratio stays.

    Args:
        model: the model; its MoE layers must already be expert-parallel on
            ``mesh[ep_dim]`` (:class:`ExpertParallel`), with ``dp = 1`` as well.
        mesh: 2-D mesh with dims ``dp_dim`` and ``ep_dim``.
        blocks: modules to shard as their own FSDP units (all-gathered one at a time).
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` for every unit.
        reshard_after_forward: passed to ``fully_shard``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh.ndim != 2 or set(mesh.mesh_dim_names or ()) != {dp_dim, ep_dim}:
        raise ValueError(f"apply_fsdp: needs a 2-D mesh with dims ({dp_dim!r}, {ep_dim!r}), got {mesh}")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    ep_mesh, dp_mesh = mesh[ep_dim], mesh[dp_dim]
    dense_mesh = _flat_dp_mesh(mesh, dp_dim, ep_dim)
    world = dense_mesh.size()
    # Gloo has no pre-multiplied sum; FSDP then divides around a plain sum instead.
    # (Not on one rank: FSDP skips the collective and divides by itself there.)
    force_sum = dp_mesh.size() > 1 and dist.get_backend(dp_mesh.get_group()) != "nccl"
    for name, moe in moe_layers(model):
        group = moe.ep_group
        if group is None or group.group_name != ep_mesh.get_group().group_name:
            raise RuntimeError(
                f"apply_fsdp: MoE layer {name!r} is not expert-parallel on mesh[{ep_dim!r}]; "
                "apply ExpertParallel (parallelize_module) on that mesh dim first"
            )
        fully_shard(
            moe.experts,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=lambda _param: Shard(1),
            mp_policy=mp_policy,
        )
        moe.experts.set_gradient_divide_factor(float(world))
        if force_sum:
            moe.experts.set_force_sum_reduction_for_comms(True)
        moe.router.process_group = dense_mesh.get_group()
    for block in blocks or ():
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    return model


def parallelize_moe_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    max_tokens_per_rank: int,
    backend: str = UNSET,
    dtype: Optional[torch.dtype] = None,
    capacity: Optional[int] = UNSET,
    capacity_factor: Optional[float] = UNSET,
    overflow: str = UNSET,
    dp_dim: str = "dp",
    ep_dim: str = "ep",
    blocks: Optional[Iterable[nn.Module]] = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    nccl_ep_mode: str = UNSET,
    timeout=UNSET,
    checks: str = UNSET,
    options: Optional[EpOptions] = None,
) -> nn.Module:
    """:class:`ExpertParallel` on ``mesh[ep_dim]`` for every MoE layer, then :func:`apply_fsdp`.

    ``dtype`` defaults to ``mp_policy.param_dtype`` (the dtype the experts compute in)
    and else to the expert weights' dtype. ``options`` (one
    :class:`~te_ep_torch.options.EpOptions`, e.g. ``options=te.EpOptions(capacity_factor=1.25)``;
    default ``EpOptions()``) is :class:`ExpertParallel`'s. The keywords ``backend``,
    ``capacity``, ``capacity_factor``, ``overflow``, ``nccl_ep_mode``, ``timeout`` and ``checks``
    are deprecated (``FutureWarning``; removed in 0.4): pass them as fields of ``options``.
    """
    if dtype is None and mp_policy is not None:
        dtype = mp_policy.param_dtype
    options = EpOptions.resolve("parallelize_moe_model", options, backend=backend, nccl_ep_mode=nccl_ep_mode,
                                timeout=timeout, checks=checks, capacity=capacity, capacity_factor=capacity_factor,
                                overflow=overflow)
    style = ExpertParallel(max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, options=options)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("parallelize_moe_model: the model has no te_ep_torch.moe.MoE layer")
    parallelize_module(model, mesh[ep_dim], {name: style for name, _ in layers})
    return apply_fsdp(
        model,
        mesh,
        dp_dim=dp_dim,
        ep_dim=ep_dim,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
    )


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Saves the sharded model (and optimizer) with ``torch.distributed.checkpoint`` (collective).

    Each rank writes its own shards; the checkpoint holds global tensors (experts as
    ``[E, ...]``), so :func:`load_checkpoint` can read it into any ``(dp, ep)`` layout
    and any world size.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state_dict(model, optimizer), checkpoint_id=path)


def load_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a :func:`save_checkpoint` checkpoint in place, resharding as needed (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state
