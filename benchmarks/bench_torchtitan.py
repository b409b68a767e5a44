"""TorchTitan MoE layer forward + backward: its all-to-all token dispatcher vs te_ep_torch's.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_torchtitan.py
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_torchtitan.py --device cpu   # gloo, tiny: tests the script

One TorchTitan 0.3.0 ``MoE`` layer (its router, ``GroupedExperts`` on
``torch._grouped_mm`` and EP sharding via ``ParallelDims`` + ``Module.parallelize``, EP
over all ranks, ``partial_dtensor`` SPMD backend) is built twice from the same seed:

* ``all_to_all``: TorchTitan's ``AllToAllTokenDispatcher`` (count exchange, host sync
  for the splits, all_to_all_single, its permutation);
* ``te_ep``: what ``use_te_ep`` selects (the ``te_ep_routed_experts`` override):
  ``TeEpRoutedExperts`` running te_ep's step (``EpStep.run``) with ``TeEpTokenDispatcher``
  (ep_dispatch/ep_combine on a static capacity, no host sync) and ``TeEpGroupedExperts``
  (the experts' work bounded by the routed rows), with the default capacity (the worst case);
* ``te_ep/tt-experts``: the dispatcher alone (``te_ep_dispatcher``) under TorchTitan's own
  ``RoutedExperts`` and ``GroupedExperts`` (its activation runs over every row of the buffer);
* ``te_ep cf=F`` (with ``--capacity-factor F``): ``te_ep`` with that capacity factor;
* ``te_ep chunks=N`` (with ``--chunks N[,M...]``): ``te_ep`` with its step split into N chunks
  (each chunk's communication on a communication stream under another chunk's experts),
  and ``te_ep chunks=N sms=K`` with ``--comm-sms K``: their GEMMs leaving K SMs free.

Default shape, DeepSeek-V2-Lite / DeepSeek-V3 "16B"-style MoE: dim 2048, expert FFN
1408, 64 routed experts, top-6, 8192 tokens per rank, bfloat16 activations and weights
(what FSDP mixed precision hands the layer), no shared experts (they do not touch the
dispatcher). A step is forward + backward of the layer with a fixed output gradient;
each timed step starts after a barrier and a device synchronisation and is timed with
CUDA events; a row reports the median over steps of the slowest rank, tokens per
second per GPU and the speedup over ``all_to_all``. Before timing, every te_ep layer's
output is compared with all_to_all's (max |diff| / max |ref| over ranks; the run fails
above 2e-2).

``--device cpu`` runs tiny sizes on gloo with the reference backend: it tests the
script; its numbers mean nothing. It needs 2 or more ranks: on a single rank TorchTitan
builds no EP mesh and never calls te_ep's dispatcher.
"""

from __future__ import annotations

import _common  # first: it sets the environment NCCL reads when it initialises

import argparse
import os

import torch
import torch.distributed as dist

from _common import Column


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tokens-per-rank", type=int, default=None, help="default 8192 (cuda), 64 (cpu)")
    p.add_argument("--dim", type=int, default=None, help="default 2048 (cuda), 32 (cpu)")
    p.add_argument("--ffn", type=int, default=None, help="expert FFN size; default 1408 (cuda), 64 (cpu)")
    p.add_argument("--experts", type=int, default=None, help="routed experts; default 64 (cuda), 8 (cpu)")
    p.add_argument("--top-k", type=int, default=None, help="default 6 (cuda), 2 (cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--backend", choices=("auto", "reference", "nccl_ep"), default="auto",
                   help="te_ep backend (cpu always uses reference)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="also time te_ep with this capacity_factor (TeEpTokenDispatcher.Config: a multiplier >= 1 "
                        "of a rank's mean receive load, top_k x tokens per rank plus zone padding); the te_ep row "
                        "keeps the default capacity (the worst case)")
    p.add_argument("--chunks", type=lambda t: [int(v) for v in t.split(",")], default=[],
                   help="comma-separated chunk counts (> 1): a 'te_ep chunks=N' row each")
    p.add_argument("--comm-sms", type=lambda t: [int(v) for v in t.split(",")], default=[0],
                   help="comma-separated SM counts the chunked rows' GEMMs leave to the communication (comm_sms); "
                        "default 0")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    big = args.device == "cuda"
    for name, cuda_default, cpu_default in (
        ("tokens_per_rank", 8192, 64), ("dim", 2048, 32), ("ffn", 1408, 64), ("experts", 64, 8), ("top_k", 6, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cuda_default if big else cpu_default)
    if args.device == "cpu":
        args.backend = "reference"
    if any(n < 2 for n in args.chunks) or any(k < 0 for k in args.comm_sms):
        p.error(f"--chunks takes counts > 1 and --comm-sms counts >= 0, got {args.chunks} and {args.comm_sms}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise SystemExit(
            f"bench_torchtitan.py needs 2 or more ranks, got {world}: EP spans all ranks, and on a single rank "
            "TorchTitan builds no EP mesh and never calls te_ep's dispatcher, so there is nothing to compare. "
            "Run it under torchrun with --nproc-per-node=2 or more"
        )
    # torch 2.11 lacks torch.compiler._is_non_strict_tracing, which TorchTitan 0.3.0's
    # AllToAllTokenDispatcher calls in eager mode (False outside tracing).
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
    import spmd_types as spmd
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    import te_ep_torch
    from te_ep_torch.integrations.torchtitan import te_ep_dispatcher, te_ep_experts, te_ep_routed_experts

    device = _common.init_distributed(args.device)
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    set_spmd_backend("partial_dtensor")
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world,
                      spmd_backend="partial_dtensor")
    tt_parallel_dims.device_type = device.type  # TorchTitan fixes it at import ("cuda" without GPUs)
    pd.build_mesh()

    def build(dispatcher_cfg, ours_experts: bool = False) -> MoE:
        experts_cfg = GroupedExperts.Config(dim=args.dim, hidden_dim=args.ffn, num_experts=args.experts)
        routed = RoutedExperts.Config(inner_experts=te_ep_experts(experts_cfg) if ours_experts else experts_cfg,
                                      token_dispatcher=dispatcher_cfg)
        cfg = MoE.Config(
            num_experts=args.experts,
            # ours_experts: the whole node te_ep's (what use_te_ep selects).
            routed_experts=te_ep_routed_experts(routed) if ours_experts else routed,
            router=TokenChoiceTopKRouter.Config(
                num_experts=args.experts, gate=Linear.Config(in_features=args.dim, out_features=args.experts),
                top_k=args.top_k, score_func="sigmoid", route_norm=True,
            ),
            load_balance_coeff=None,
        )
        set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                                expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
        with torch.device(device):
            moe = cfg.build()
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for _, p in sorted(moe.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
        moe.to(dtype)
        moe.parallelize(pd)
        return moe

    a2a_cfg = AllToAllTokenDispatcher.Config(num_experts=args.experts, top_k=args.top_k)

    def ours_cfg(capacity_factor, chunks: int = 1, comm_sms: int = 0):
        return te_ep_dispatcher(
            AllToAllTokenDispatcher.Config(num_experts=args.experts, top_k=args.top_k),
            hidden_dim=args.dim, num_max_tokens_per_rank=args.tokens_per_rank, dtype=args.dtype,
            backend=args.backend, capacity_factor=capacity_factor, chunks=chunks, comm_sms=comm_sms,
        )

    # te_ep: both overrides (use_te_ep), default capacity; te_ep/tt-experts: the dispatcher
    # alone, TorchTitan's own GroupedExperts (activation over the whole buffer).
    layers = {"all_to_all": build(a2a_cfg), "te_ep": build(ours_cfg(None), True),
              "te_ep/tt-experts": build(ours_cfg(None))}
    if args.capacity_factor is not None:
        layers[f"te_ep cf={args.capacity_factor:g}"] = build(ours_cfg(args.capacity_factor), True)
    for n in args.chunks:
        for sms in args.comm_sms:
            layers[f"te_ep chunks={n}" + (f" sms={sms}" if sms else "")] = build(ours_cfg(None, n, sms), True)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(1, args.tokens_per_rank, args.dim, generator=gen, device=device).to(dtype)
    grad = torch.randn(x.shape, generator=gen, device=device).to(dtype)

    def step(moe):
        xi = x.detach().requires_grad_(True)
        y = moe(xi)
        y.backward(grad)
        return y.detach()

    ys = {name: step(moe) for name, moe in layers.items()}
    ref = ys["all_to_all"].float()
    rel = torch.stack([(y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
                       for name, y in ys.items() if name != "all_to_all"]).max().reshape(1)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)

    times = {name: _common.median_ms(lambda: step(moe), device, args.warmup, args.iters, ranks=True).ms
             for name, moe in layers.items()}

    def capacity(name):
        if name == "all_to_all":
            return "-"
        return layers[name].routed_experts.token_dispatcher.handles()[0].config.capacity

    if rank == 0:
        handle = layers["te_ep"].routed_experts.token_dispatcher.handles()[0]
        print(f"TorchTitan MoE layer fwd+bwd, EP={world} on {device.type} "
              f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'gloo'}): "
              f"T/rank={args.tokens_per_rank} dim={args.dim} ffn={args.ffn} E={args.experts} top-{args.top_k} "
              f"{args.dtype}; te_ep {handle.mode}")
        print(f"outputs agree: max |diff| / max |ref| = {rel.item():.2e} (worst te_ep row)")
        _common.print_table([
            Column("dispatcher", "<22", "dispatcher"), Column("capacity", ">9", "capacity"),
            Column("step ms", ">9", "step_ms", ".3f"),
            Column("tokens/s/GPU", ">14", "tokens_per_s_per_gpu", ",.0f"),
            Column("speedup", ">8", lambda r: f"{r['speedup']:.2f}x"),
        ], [{"dispatcher": name, "capacity": capacity(name), "step_ms": ms,
             "tokens_per_s_per_gpu": args.tokens_per_rank / ms * 1e3,
             "speedup": times["all_to_all"] / ms} for name, ms in times.items()])
    te_ep_torch.shutdown_ep_groups()
    _common.close_distributed()
    return 0 if rel.item() <= 2e-2 else 1


if __name__ == "__main__":
    _common.leave(main())  # DTensor holds the process group past its destruction (see leave)
