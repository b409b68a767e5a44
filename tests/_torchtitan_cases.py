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

The bodies take a ``Ctx`` (tests/_dist.py) and run on CPU/gloo in the worker pools, or
on CUDA/NCCL when this file is launched with torchrun (``python -m torch.distributed.run
--nproc-per-node N tests/_torchtitan_cases.py <case> '<json kwargs>'``), which the GPU
test does.
"""

from __future__ import annotations

import contextlib
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
from torchtitan.models.common.moe import (  # noqa: E402
    MoE,
    GroupedExperts,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

import te_ep_torch  # noqa: E402,F401
from te_ep_torch.integrations.torchtitan import TeEpTokenDispatcher, te_ep_dispatcher  # noqa: E402

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


def _build(ctx, pd: ParallelDims, dispatcher_cfg, *, dtype: torch.dtype, bias: torch.Tensor, fsdp: bool,
           dim: int = DIM) -> MoE:
    cfg = MoE.Config(
        num_experts=NUM_EXPERTS,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=FFN, num_experts=NUM_EXPERTS),
            token_dispatcher=dispatcher_cfg,
        ),
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
):
    """Ours vs TorchTitan's all-to-all dispatcher on the same weights and batch.

    Returns ``{"diffs": {tensor: {max_abs, ref_max, close_f32}}, "counts": [E],
    "handle": str}`` of this rank.
    """
    ep = ep or ctx.world_size
    torch_dtype = _DTYPES[dtype]
    bias = _bias(scenario, ep)
    ref_pd = _parallel_dims(ctx, ep, "partial_dtensor")
    ours_pd = ref_pd if ours_spmd_backend == "partial_dtensor" else _parallel_dims(ctx, ep, ours_spmd_backend)

    ref = _build(ctx, ref_pd, AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                 dtype=torch_dtype, bias=bias, fsdp=fsdp, dim=dim)
    backend = "reference" if ctx.device == "cpu" else "auto"
    sizes = {}
    if compile:
        # Handles are created when the EP mesh is wired, before tracing: the sizes must be known.
        sizes = dict(hidden_dim=dim, num_max_tokens_per_rank=batch * SEQ, dtype=dtype)
    ours_cfg = te_ep_dispatcher(AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
                                backend=backend, fp8_dispatch=fp8, **sizes)
    ours = _build(ctx, ours_pd, ours_cfg, dtype=torch_dtype, bias=bias, fsdp=fsdp, dim=dim)
    dispatcher = ours.routed_experts.token_dispatcher
    if not isinstance(dispatcher, TeEpTokenDispatcher) or dispatcher.ep_mesh is None:
        raise AssertionError(f"the override did not give an EP-wired TeEpTokenDispatcher: {dispatcher!r}")
    if compile and not dispatcher._handles:
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
    handle = repr(next(iter(dispatcher._handles.values())))
    return {"diffs": diffs, "counts": counts, "handle": handle, "ep": ep}


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
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _main()
