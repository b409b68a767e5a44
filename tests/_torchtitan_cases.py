"""Worker bodies of tests/test_torchtitan.py: TorchTitan's MoE layer, all-to-all vs te_ep dispatcher.

Every case builds TorchTitan's own ``MoE`` twice from the same seed, once with its
``AllToAllTokenDispatcher`` (the reference) and once with ``TeEpTokenDispatcher``
selected by the ``te_ep_dispatcher`` override, shards both with TorchTitan's code
(``set_moe_sharding_config`` + ``Module.parallelize`` on a ``ParallelDims`` mesh, expert
weights ``Shard(0)`` DTensors on the ``ep`` axis, the dispatcher wired to that axis),
optionally applies FSDP2 on TorchTitan's meshes (the routed experts on ``efsdp``, as
TorchTitan shards them, the router on ``fsdp``) and torch.compile to our layer, runs forward and
backward on the same per-rank batch and returns the largest differences of the output,
the input gradient, the router gate gradient and every expert weight gradient.
``case_compiled_fsdp_blocks`` does the same for two MoE blocks wrapped as TorchTitan
wraps them (EP sharding, its ``apply_compile``, FSDP2 per block) over two train steps.

The bodies take a ``Ctx`` (tests/_dist.py) and run on CPU/gloo in the worker pools, or
on CUDA/NCCL when this file is launched with torchrun (``python -m torch.distributed.run
--nproc-per-node N tests/_torchtitan_cases.py <case> '<json kwargs>'``), which the GPU
test does.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist

# torch 2.11 has no torch.compiler._is_non_strict_tracing, which TorchTitan 0.3.0's
# AllToAllTokenDispatcher (our reference) calls in eager mode. Outside tracing it is
# False; a torch that has the attribute keeps its own.
if not hasattr(torch.compiler, "_is_non_strict_tracing"):
    torch.compiler._is_non_strict_tracing = lambda: False

import spmd_types as spmd  # noqa: E402  (a TorchTitan dependency)
import torchtitan.distributed.parallel_dims as tt_parallel_dims  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.nn_modules import RMSNorm  # noqa: E402
from torchtitan.models.common.moe import (  # noqa: E402
    MoE,
    GroupedExperts,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402
from torchtitan.protocols.module import Module, ModuleDict  # noqa: E402

import te_ep_torch  # noqa: E402,F401
from te_ep_torch.integrations.torchtitan import (  # noqa: E402
    TeEpRoutedExperts,
    TeEpTokenDispatcher,
    te_ep_dispatcher,
    te_ep_experts,
    te_ep_routed_experts,
)

DIM, FFN, NUM_EXPERTS, TOP_K, SEQ = 32, 64, 8, 2, 24
SCENARIOS = ("random", "uneven", "one_rank")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parallel_dims(ctx, ep: int, spmd_backend: str) -> ParallelDims:
    pd = ParallelDims(
        dp_replicate=1, dp_shard=ctx.world_size, cp=1, tp=1, pp=1, ep=ep,
        world_size=ctx.world_size, spmd_backend=spmd_backend,
    )
    # TorchTitan picks the mesh device type once at import ("cuda" on a machine
    # without accelerators); the CPU workers need a gloo ("cpu") mesh.
    saved = tt_parallel_dims.device_type
    tt_parallel_dims.device_type = "cuda" if ctx.device.startswith("cuda") else "cpu"
    try:
        pd.build_mesh()
    finally:
        tt_parallel_dims.device_type = saved
    return pd


@contextlib.contextmanager
def _spmd_backend(pd: ParallelDims):
    """The SPMD backend (and, for spmd_types, the mesh context) TorchTitan's trainer sets up."""
    saved = get_spmd_backend()
    set_spmd_backend(pd.spmd_backend)
    try:
        with contextlib.ExitStack() as stack:
            if pd.spmd_backend == "spmd_types":
                from torchtitan.distributed.spmd_types import set_current_spmd_mesh, set_spmd_meshes, spmd_dense_mesh

                set_spmd_meshes(dense_mesh=pd.spmd_dense_mesh(), sparse_mesh=pd.spmd_sparse_mesh())
                stack.enter_context(set_current_spmd_mesh(spmd_dense_mesh()))
            yield
    finally:
        set_spmd_backend(saved)


def _bias(scenario: str, ep: int) -> torch.Tensor:
    """Router selection bias (TorchTitan's ``expert_bias_E``) that makes the routing of a scenario."""
    local = NUM_EXPERTS // ep
    bias = torch.zeros(NUM_EXPERTS)
    if scenario == "uneven":
        bias[0] = 1.0  # a hot expert
        bias[(ep - 1) * local:] = -10.0  # the last EP rank receives no token at all
    elif scenario == "one_rank":
        bias[:local] = 10.0  # every choice lands on EP rank 0 (local >= top_k)
    elif scenario != "random":
        raise ValueError(f"unknown scenario {scenario!r}")
    return bias


def _moe_config(dispatcher_cfg, dim: int = DIM, te_experts: bool = True, routed: bool = False) -> MoE.Config:
    # te_experts: TeEpGroupedExperts (what use_te_ep selects) on both sides, so that the
    # dispatchers are what differs (test_torchtitan.py holds TeEpGroupedExperts to
    # TorchTitan's GroupedExperts on its own); False: TorchTitan's GroupedExperts.
    # routed: TeEpRoutedExperts (the te_ep_routed_experts override: te_ep's whole step), for
    # this side only; False: TorchTitan's RoutedExperts calling dispatch and combine.
    experts_cfg = GroupedExperts.Config(dim=dim, hidden_dim=FFN, num_experts=NUM_EXPERTS)
    if te_experts:
        experts_cfg = te_ep_experts(experts_cfg)
    routed_cfg = RoutedExperts.Config(inner_experts=experts_cfg, token_dispatcher=dispatcher_cfg)
    if routed:
        routed_cfg = te_ep_routed_experts(routed_cfg)
    cfg = MoE.Config(
        num_experts=NUM_EXPERTS,
        routed_experts=routed_cfg,
        router=TokenChoiceTopKRouter.Config(
            num_experts=NUM_EXPERTS,
            gate=Linear.Config(in_features=dim, out_features=NUM_EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
        load_balance_coeff=1e-3,
    )
    set_moe_sharding_config(
        cfg, enable_ep=True, enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    return cfg


def _build(ctx, pd: ParallelDims, dispatcher_cfg, *, dtype: torch.dtype, bias: torch.Tensor, fsdp: bool,
           dim: int = DIM, te_experts: bool = True, routed: bool = False) -> MoE:
    cfg = _moe_config(dispatcher_cfg, dim, te_experts, routed)
    device = torch.device(ctx.device)
    with torch.device(device):
        moe = cfg.build()
    gen = torch.Generator().manual_seed(1234)  # same weights on every rank and for both dispatchers
    with torch.no_grad():
        for _, p in sorted(moe.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        moe.expert_bias_E.copy_(bias)
    moe.to(dtype)
    moe.expert_bias_E.data = moe.expert_bias_E.data.float()
    with _spmd_backend(pd):
        moe.parallelize(pd)
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        fully_shard(moe.routed_experts.inner_experts, mesh=pd.get_mesh("efsdp"), mp_policy=mp)
        fully_shard(moe.router, mesh=pd.get_mesh("fsdp"), mp_policy=mp)
    return moe


def _full(t: torch.Tensor, name: str, pd: ParallelDims) -> torch.Tensor:
    """A gradient as a plain global tensor.

    EP- and FSDP-sharded DTensors are gathered; under the spmd_types backend expert
    weights are plain local shards ``[E_local, ...]``, gathered over the EP group.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    if "inner_experts" in name and t.shape[0] != NUM_EXPERTS:
        group = pd.get_mesh("ep").get_group()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    return t


def _step(moe: MoE, x: torch.Tensor, pd: ParallelDims, module=None):
    for p in moe.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    with _spmd_backend(pd):
        y = (module if module is not None else moe)(x)
        # A loss that weighs every output element differently (not a plain sum).
        w = torch.linspace(-1.0, 1.0, y.numel(), device=y.device).view_as(y)
        (y.float() * w).sum().backward()
    grads = {name: _full(p.grad, name, pd).float().clone() for name, p in moe.named_parameters()}
    return y.detach().float(), x.grad.float(), grads


def _global_expert_counts(moe: MoE, x: torch.Tensor, pd: ParallelDims, ep_group) -> list:
    """Choices per expert over the EP group (what the scenario made of the routing)."""
    with torch.no_grad(), _spmd_backend(pd):
        _, ids, _ = moe.router(x, moe.expert_bias_E)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=NUM_EXPERTS).to(torch.int64)
    dist.all_reduce(counts, group=ep_group)
    return counts.cpu().tolist()


def _diff(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    return {
        "max_abs": (a - b).abs().max().item() if a.numel() else 0.0,
        "ref_max": b.abs().max().item() if b.numel() else 0.0,
        "close_f32": bool(torch.allclose(a, b, atol=1e-5, rtol=1e-4)),
    }


def case_parity(
    ctx,
    *,
    scenario: str,
    ep: Optional[int] = None,
    dtype: str = "float32",
    fsdp: bool = False,
    compile: bool = False,
    compile_backend: str = "inductor",
    ours_spmd_backend: str = "partial_dtensor",
    batch: int = 1,
    dim: int = DIM,
    fp8: bool = False,
    capacity_factor: Optional[float] = None,
    te_experts: bool = True,
    routed: bool = False,
    chunks: int = 1,
):
    """Ours vs TorchTitan's all-to-all dispatcher on the same weights and batch.

    ``routed``: ours runs TeEpRoutedExperts (te_ep's whole step), split into ``chunks``.
    Returns ``{"diffs": {tensor: {max_abs, ref_max, close_f32}}, "counts": [E],
    "handle": str, "handles": [str]}`` of this rank (``handles``: one per chunk).
    """
    ep = ep or ctx.world_size
    torch_dtype = _DTYPES[dtype]
    bias = _bias(scenario, ep)
    ref_pd = _parallel_dims(ctx, ep, "partial_dtensor")
    ours_pd = ref_pd if ours_spmd_backend == "partial_dtensor" else _parallel_dims(ctx, ep, ours_spmd_backend)

    ref = _build(ctx, ref_pd, AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                 dtype=torch_dtype, bias=bias, fsdp=fsdp, dim=dim, te_experts=te_experts)
    backend = "reference" if ctx.device == "cpu" else "auto"
    sizes = {}
    if compile:
        # Handles are created when the EP mesh is wired, before tracing: the sizes must be known.
        sizes = dict(hidden_dim=dim, num_max_tokens_per_rank=batch * SEQ, dtype=dtype)
    ours_cfg = te_ep_dispatcher(AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                                backend=backend, fp8_dispatch=fp8, capacity_factor=capacity_factor, chunks=chunks,
                                **sizes)
    ours = _build(ctx, ours_pd, ours_cfg, dtype=torch_dtype, bias=bias, fsdp=fsdp, dim=dim, te_experts=te_experts,
                  routed=routed)
    dispatcher = ours.routed_experts.token_dispatcher
    if not isinstance(dispatcher, TeEpTokenDispatcher) or dispatcher.ep_mesh is None:
        raise AssertionError(f"the override did not give an EP-wired TeEpTokenDispatcher: {dispatcher!r}")
    if routed != isinstance(ours.routed_experts, TeEpRoutedExperts):
        raise AssertionError(f"routed={routed}, but the layer's routed experts are {type(ours.routed_experts)}")
    if compile and not dispatcher.handles():
        raise AssertionError("the handle should exist before compiling (sizes were given)")
    module = None
    if compile:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        module = torch.compile(ours, backend=compile_backend, fullgraph=True)

    gen = torch.Generator().manual_seed(100 + ctx.rank)  # a different batch on every rank
    x = torch.randn(batch, SEQ, dim, generator=gen).to(device=ctx.device, dtype=torch_dtype)

    ref_y, ref_gx, ref_g = _step(ref, x, ref_pd)
    our_y, our_gx, our_g = _step(ours, x, ours_pd, module)
    if compile:
        # A second step through the compiled layer (no recompilation, same routing).
        our_y2, _, _ = _step(ours, x, ours_pd, module)
        if not torch.equal(our_y2, our_y):
            raise AssertionError("the compiled layer gave another output on its second step")

    diffs = {"output": _diff(our_y, ref_y), "input_grad": _diff(our_gx, ref_gx)}
    for name in ref_g:
        diffs[name + ".grad"] = _diff(our_g[name], ref_g[name])
    counts = _global_expert_counts(ref, x, ref_pd, ref_pd.get_mesh("ep").get_group())
    handle = repr(dispatcher.handles()[0])
    handles = [repr(h) for hs in dispatcher._step.chunk_handles.values() for h in hs]
    return {"diffs": diffs, "counts": counts, "handle": handle, "handles": handles, "ep": ep}


def case_chunks_need_routed_experts(ctx) -> Dict[str, str]:
    """chunks=2 with TorchTitan's own RoutedExperts (dispatch, experts once, combine): every rank
    raises before any collective, naming the override that runs a chunked step."""
    pd = _parallel_dims(ctx, ctx.world_size, "partial_dtensor")
    cfg = te_ep_dispatcher(AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                           backend="reference" if ctx.device == "cpu" else "auto", chunks=2)
    moe = _build(ctx, pd, cfg, dtype=torch.float32, bias=_bias("random", ctx.world_size), fsdp=False)
    x = torch.randn(1, SEQ, DIM, device=ctx.device)
    try:
        _step(moe, x, pd)
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


# ---- TorchTitan's own per-block torch.compile + FSDP2 ------------------------------------


class _MoEBlock(Module):
    """The MoE half of a TorchTitan transformer block: ``x + moe(ffn_norm(x))``.

    Attention is left out: TorchTitan's language-model attention backends (flex, varlen)
    need inductor or CUDA, which would make the CPU test slow without testing anything of
    the dispatcher. What TorchTitan's compile and FSDP code reads of a block is here:
    ``moe_enabled``, ``moe.routed_experts.inner_experts`` and the parameters.
    """

    moe_enabled = True

    def __init__(self, moe: MoE, norm: RMSNorm):
        super().__init__()
        self.ffn_norm = norm
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ffn_norm(x))


class _MoEDecoder(Module):
    """What TorchTitan's ``apply_compile`` and FSDP code use of a ``Decoder``: ``layers`` (no embedding,
    final norm or head)."""

    enable_weight_tying = False

    def __init__(self, blocks):
        super().__init__()
        self.layers = ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.tok_embeddings = self.norm = self.lm_head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def _apply_fsdp_like_torchtitan(model: _MoEDecoder, pd: ParallelDims, dtype: torch.dtype, experts: str) -> None:
    """FSDP2 with the layout of TorchTitan 0.3.0's ``apply_fsdp_to_decoder``, on torch 2.11's API.

    TorchTitan 0.3.0's own function cannot be imported on torch 2.11
    (``torchtitan.distributed.fsdp`` imports ``DataParallelMeshDims``), and its MoE branch
    puts a block's routed expert weights in the block's FSDP unit on another mesh
    (``efsdp``, through ``ShardPlacementResult``), which torch 2.11's ``fully_shard`` cannot
    express. Here, as there: one ``fully_shard`` per block on ``fsdp`` (``Shard(0)``),
    then the root; ``param_dtype`` / ``reduce_dtype``, ``cast_forward_inputs=False``,
    ``reshard_after_forward=True`` for the blocks ("default" policy, no PP), gradient
    division off (factor 1.0; a SUM reduction, as gloo has no PREMUL_SUM), explicit
    forward/backward prefetching between blocks (EP > 1). The expert weights (``experts``):

    * ``"efsdp_size_1"``: when ``efsdp`` has one rank (EP = world size), TorchTitan's
      expert sharding on it shards nothing and its reduce-scatter is the identity; the
      block's unit leaves them out (``ignored_params``): the same placements and math.
    * ``"nested"``: their own FSDP unit on ``efsdp`` inside the block's (TorchTitan's
      scheme before per-parameter meshes), for ``efsdp`` > 1.
    """
    from torch.distributed.fsdp import FSDPModule

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    blocks = list(model.layers.values())
    ignored = set()
    for block in blocks:
        inner = block.moe.routed_experts.inner_experts
        if experts == "nested":
            fully_shard(inner, mesh=pd.get_mesh("efsdp"), mp_policy=mp, reshard_after_forward=True)
        elif experts == "efsdp_size_1":
            efsdp = pd.get_mesh("efsdp").size()
            if efsdp != 1:
                raise ValueError(f"experts='efsdp_size_1' needs EP = world size (efsdp has {efsdp} ranks)")
            ignored |= set(inner.parameters())
        else:
            raise ValueError(f"unknown experts={experts!r}")
        fully_shard(block, mesh=pd.get_mesh("fsdp"), mp_policy=mp, reshard_after_forward=True,
                    ignored_params=ignored or None)
    fully_shard(model, mesh=pd.get_mesh("fsdp"), mp_policy=mp, ignored_params=ignored or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Gloo has no PREMUL_SUM (what a factor of 1.0 selects on NCCL): a plain SUM, same result.
            module.set_force_sum_reduction_for_comms(True)
    for block, nxt in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([block])


def _build_wrapped_decoder(ctx, pd: ParallelDims, dispatcher_cfg, *, biases, compile_backend: str,
                           experts: str) -> _MoEDecoder:
    """MoE blocks parallelized in the order of TorchTitan's ``parallelize_qwen3`` / ``parallelize_deepseekv3``.

    ``Module.parallelize`` (TorchTitan's EP sharding, the dispatcher wired to the ``ep``
    mesh), then TorchTitan's ``apply_compile`` (``block.compile(backend, fullgraph=True)``
    per block, ``capture_scalar_outputs``), then FSDP2 (``_apply_fsdp_like_torchtitan``).
    float32 parameters and reduction.
    """
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    with torch.device(torch.device(ctx.device)):
        blocks = [
            _MoEBlock(_moe_config(copy.deepcopy(dispatcher_cfg)).build(),
                      RMSNorm.Config(normalized_shape=DIM, eps=1e-6).build())
            for _ in biases
        ]
    model = _MoEDecoder(blocks)
    gen = torch.Generator().manual_seed(4321)  # same weights on every rank and for both dispatchers
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("ffn_norm.weight") else noise * p.shape[-1] ** -0.5)
        for block, bias in zip(blocks, biases):
            block.moe.expert_bias_E.copy_(bias)
    with _spmd_backend(pd):
        model.parallelize(pd)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=compile_backend, components=["model"]),
                  parallel_dims=pd)
    _apply_fsdp_like_torchtitan(model, pd, torch.float32, experts)
    return model


def _wrapping_of(model: _MoEDecoder) -> dict:
    """What TorchTitan's wrapping made of the blocks (checked by the test)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    block = model.layers["0"]
    w1 = block.moe.routed_experts.inner_experts.w1_EFD
    gate = block.moe.router.gate.weight
    return {
        "root_fsdp": isinstance(model, FSDPModule),
        "blocks_fsdp": all(isinstance(b, FSDPModule) for b in model.layers.values()),
        "blocks_compiled": all(b._compiled_call_impl is not None for b in model.layers.values()),
        "expert_mesh": list(w1.device_mesh.mesh_dim_names) if isinstance(w1, DTensor) else None,
        "expert_placements": [str(pl) for pl in w1.placements] if isinstance(w1, DTensor) else None,
        "expert_local_rows": w1.to_local().shape[0] if isinstance(w1, DTensor) else None,
        "gate_mesh": list(gate.device_mesh.mesh_dim_names) if isinstance(gate, DTensor) else None,
    }


def _run_steps(model: _MoEDecoder, pd: ParallelDims, xs, *, lr: float):
    """Forward, backward and an SGD step per batch; per step: output, input grad, parameter grads."""
    from torch._dynamo.utils import counters

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = []
    for x in xs:
        graphs = counters["stats"]["unique_graphs"]
        y, gx, grads = _step(model, x, pd, model)
        tokens = []
        for block in model.layers.values():
            tokens.append(block.moe.tokens_per_expert_E.detach().clone())
            block.moe.tokens_per_expert_E.zero_()
        opt.step()
        steps.append({"y": y, "gx": gx, "grads": grads, "tokens": tokens,
                      "new_graphs": counters["stats"]["unique_graphs"] - graphs})
    return steps


def case_compiled_fsdp_blocks(ctx, *, ep: int, experts: str = "efsdp_size_1", compile_backend: str = "aot_eager",
                              steps: int = 2, num_layers: int = 2):
    """TorchTitan's per-block ``torch.compile(fullgraph=True)`` + FSDP2 of MoE blocks: ours vs all-to-all.

    ``num_layers`` MoE blocks (layer 0 with the "uneven" routing, where the last EP rank
    receives no token; the others "random"), wrapped as ``_build_wrapped_decoder`` says,
    once with TorchTitan's ``AllToAllTokenDispatcher`` (compiled the same way) and once
    with ours; float32; another batch on every rank and every step, an SGD step (lr 0.05)
    after each backward, so step 2 runs the compiled blocks on updated, re-gathered
    weights and new routing.

    Returns ``{"errors": {dispatcher: text}}`` if torch.compile refused a model (the same
    failure on every rank), else per step the diffs of the output, the input gradient,
    every parameter's full gradient and each layer's ``tokens_per_expert_E``, the graphs
    dynamo compiled during the step, the EP-global expert counts of each layer, and what
    the wrapping made of both models.
    """
    import traceback

    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    saved = (dynamo_config.capture_scalar_outputs, dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint,
             inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    torch._dynamo.reset()
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    try:
        pd = _parallel_dims(ctx, ep, "partial_dtensor")
        biases = [_bias("uneven", ep)] + [_bias("random", ep)] * (num_layers - 1)
        configs = {
            "all_to_all": AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
            # Handles are created when the EP mesh is wired, before tracing: the sizes must be known.
            "te_ep": te_ep_dispatcher(AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                                      backend="reference" if ctx.device == "cpu" else "auto",
                                      hidden_dim=DIM, num_max_tokens_per_rank=SEQ, dtype="float32"),
        }
        gen = torch.Generator().manual_seed(200 + ctx.rank)  # another batch on every rank and every step
        xs = [torch.randn(1, SEQ, DIM, generator=gen).to(ctx.device) for _ in range(steps)]
        runs, wrapping, errors = {}, {}, {}
        for name, cfg in configs.items():
            try:
                model = _build_wrapped_decoder(ctx, pd, cfg, biases=biases, compile_backend=compile_backend,
                                               experts=experts)
                if name == "te_ep":
                    dispatchers = [b.moe.routed_experts.token_dispatcher for b in model.layers.values()]
                    if not all(isinstance(d, TeEpTokenDispatcher) and d.ep_mesh is not None and d.handles()
                               for d in dispatchers):
                        raise AssertionError(f"the override did not give EP-wired TeEpTokenDispatchers with "
                                             f"handles: {dispatchers}")
                    if len({id(d.handles()[0]) for d in dispatchers}) != num_layers:
                        raise AssertionError("the MoE layers do not have one te_ep handle each")
                wrapping[name] = _wrapping_of(model)
                runs[name] = _run_steps(model, pd, xs, lr=0.05)
            except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
                # torch.compile refused the model (the same on every rank: tracing is deterministic).
                errors[name] = "".join(traceback.format_exception(exc))[-6000:]
                torch._dynamo.reset()
                dist.barrier()
        if errors:
            return {"errors": errors}

        ep_group = pd.get_mesh("ep").get_group()
        out = []
        for r, o in zip(runs["all_to_all"], runs["te_ep"]):
            diffs = {"output": _diff(o["y"], r["y"]), "input_grad": _diff(o["gx"], r["gx"])}
            for name in r["grads"]:
                diffs[name + ".grad"] = _diff(o["grads"][name], r["grads"][name])
            counts = []
            for layer, (t_ref, t_our) in enumerate(zip(r["tokens"], o["tokens"])):
                diffs[f"layers.{layer}.moe.tokens_per_expert_E"] = _diff(t_our, t_ref)
                t = t_ref.clone()
                dist.all_reduce(t, group=ep_group)
                counts.append([int(c) for c in t.tolist()])
            out.append({"diffs": diffs, "counts": counts,
                        "ref_new_graphs": r["new_graphs"], "our_new_graphs": o["new_graphs"]})
        return {"steps": out, "ep": ep, "wrapping": wrapping, "grad_names": sorted(runs["all_to_all"][0]["grads"])}
    finally:
        torch._dynamo.reset()
        (dynamo_config.capture_scalar_outputs, dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint,
         inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) = saved


def case_bad_batch_one_rank(ctx, *, fault: str) -> Dict[str, str]:
    """TeEpTokenDispatcher.dispatch with a batch that is bad on the last rank only (``fault``:
    "tokens", more tokens than num_max_tokens_per_rank; "hidden", a wrong width): every rank
    raises in the step (the ops' checks, agreed across the ranks), none waits for the faulty
    one; then a good dispatch + combine on the same dispatcher is exact. Returns this rank's
    exception type and message."""
    from torch.distributed.device_mesh import init_device_mesh

    W, last = ctx.world_size, ctx.rank == ctx.world_size - 1
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("ep",))
    d = TeEpTokenDispatcher(TeEpTokenDispatcher.Config(
        num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_dim=DIM, num_max_tokens_per_rank=SEQ, dtype="float32",
        backend="reference"))
    d.wire_meshes(ep_mesh=mesh)
    gen = torch.Generator().manual_seed(100 + ctx.rank)

    def batch(T: int, D: int):
        x = torch.randn(T, D, generator=gen)
        ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(T)])
        scores = torch.rand(T, TOP_K, generator=gen)
        return x, scores, ids, torch.zeros(NUM_EXPERTS, dtype=torch.int64)

    T, D = (SEQ + 3, DIM) if last and fault == "tokens" else (SEQ, DIM + 1) if last else (SEQ, DIM)
    try:
        d.dispatch(*batch(T, D))
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        seen = {"type": type(exc).__name__, "message": str(exc)}
    else:
        seen = {"type": "none", "message": ""}
    x, scores, ids, counts = batch(SEQ, DIM)
    rows, _, metadata = d.dispatch(x, scores, ids, counts)
    out = d.combine(rows, metadata, x)  # identity experts: each token comes back times its summed scores
    torch.testing.assert_close(out, x * scores.sum(1, keepdim=True), atol=1e-5, rtol=1e-5)
    return seen


def _main() -> None:
    """torchrun entry (GPU): ``_torchtitan_cases.py <case> '<json kwargs>'``; prints one JSON line per rank."""
    from _dist import Ctx

    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    ctx = Ctx(rank=dist.get_rank(), world_size=dist.get_world_size(), device=f"cuda:{local_rank}", backend="auto")
    try:
        result = globals()[name](ctx, **kwargs)
        print("RESULT " + json.dumps({"rank": ctx.rank, **result}), flush=True)
    finally:
        te_ep_torch.shutdown_ep_groups()
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
