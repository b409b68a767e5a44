"""transformers MoE blocks, forward + backward: transformers' own EP (``all_to_all``) vs te_ep through its registry.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_transformers.py
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_transformers.py --capacity-factor 1.25
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_transformers.py --device cpu   # gloo, tiny: tests the script

transformers >= 5.23 runs the experts of an MoE block expert-parallel through the
``EPImplementation`` that ``DistributedConfig(ep_implementation=...)`` names. This script
takes the four blocks of tests/gpu/transformers_gpu.py (the model's own block class: router,
experts, shared experts where the model has them, at the dims of Qwen3-30B-A3B,
Mixtral-8x7B, gpt-oss-20b and DeepSeek-V2-Lite), bfloat16, one set of weights, and shards
copies of each with transformers' own ``apply_expert_parallelism`` (the model's EP plan,
experts ``Shard(0)`` over all ranks: what ``from_pretrained(distributed_config=...)`` does
to the block) for:

* ``all_to_all``: transformers' ``AllToAllEP`` (two all_to_all_single per layer; the split
  sizes are read back to the host every layer), with its ``grouped_mm`` experts on GPUs;
* ``te_ep``: ``ep_implementation="te_ep"`` (te_ep_torch.integrations.transformers,
  options through ``register_te_ep``: ``max_tokens_per_rank`` = the tokens per rank,
  handles made for bfloat16 when the block is sharded, the worst-case capacity unless
  ``--capacity-factor``);
* ``te_ep graph``: the same te_ep block with its whole forward + backward captured once in
  a CUDA graph (``torch.cuda.graph``) and replayed (GPUs with the ``nccl_ep`` backend only:
  the reference backend plans routing on the host; elsewhere the column shows ``-``).
  ``all_to_all`` cannot be captured: it reads the split sizes back to the host in every
  layer; its column says so;
* ``te_ep cf=F`` (``--capacity-factor F``): ``te_ep`` with that capacity factor.

Every rank feeds the same tokens to every variant (seeded by rank) with the same output
gradient, so the routing is the same. Before timing, each te_ep variant's output and input
gradient are compared with ``all_to_all``'s (max |diff| / max |ref| over ranks; a block
above 3e-2 fails the run). Each step starts after a barrier and a synchronisation, is
timed with CUDA events (wall clock on CPU) after ``--warmup`` untimed steps, and the
variants take turns (benchmarks/_common.py); a cell is the median over ``--iters`` steps
of the slowest rank, and the ratios are against ``all_to_all`` of the same run.

``--device cpu`` runs tiny blocks on gloo with te_ep's reference backend and no graph: it
tests the script (tests/test_transformers_registry.py runs it); its numbers mean nothing.
"""

from __future__ import annotations

import _common  # first: it sets the environment NCCL reads when it initialises

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

from _common import Column

# The blocks and their dims are tests/gpu/transformers_gpu.py's (one table for both scripts).
# te_ep_torch is imported first, so the build _common chose is the one measured.
import te_ep_torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))
from transformers_gpu import BLOCKS, TINY_BLOCK, block_config, make_block  # noqa: E402

TOL = 3e-2  # bfloat16, as tests/gpu/transformers_gpu.py
A2A_GRAPH = "n/a: host sync"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--models", default=",".join(BLOCKS), help=f"comma-separated, of {list(BLOCKS)}")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank; default 4096 (cuda), 32 (cpu)")
    p.add_argument("--backend", choices=("auto", "reference", "nccl_ep"), default="auto",
                   help="te_ep backend (cpu always uses reference)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="also time te_ep with register_te_ep(options=EpOptions(capacity_factor=F)) (a multiplier >= 1 of a rank's mean "
                        "receive load); the te_ep row keeps the default capacity (the worst case)")
    p.add_argument("--no-graph", action="store_true", help="skip the te_ep graph column")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in BLOCKS]
    if unknown or not models:
        p.error(f"--models: unknown {unknown or args.models!r}; choose from {list(BLOCKS)}")
    args.models = models
    if args.tokens is None:
        args.tokens = 4096 if args.device == "cuda" else 32
    if args.tokens <= 0:
        p.error(f"--tokens must be positive, got {args.tokens}")
    if args.capacity_factor is not None and args.capacity_factor < 1.0:
        p.error(f"--capacity-factor must be >= 1.0, got {args.capacity_factor}")
    if args.warmup < 1 or args.iters < 1:
        p.error("--warmup and --iters must be >= 1 (the graph is captured after a warm-up)")
    if args.device == "cpu":
        args.backend = "reference"
        args.no_graph = True
    return args


def _block_plan(config) -> dict:
    """The model's EP plan for one decoder layer's MoE block: ``layers.*.mlp.X`` -> ``X``."""
    plan = {k.split(".mlp.", 1)[1]: v for k, v in (config.base_model_ep_plan or {}).items() if ".mlp." in k}
    if "ep_dispatch_experts" not in plan.values():
        raise SystemExit(f"{type(config).__name__}: its EP plan has no 'ep_dispatch_experts' rule for the MoE block")
    return plan


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _out(y):
    return y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores


def time_block(family: str, sizes: dict, args, device: torch.device, mesh) -> dict:
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from te_ep_torch.integrations.transformers import expert_parallel_modules

    rank = dist.get_rank()
    config = block_config(family, sizes)
    config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    plan = _block_plan(config)
    torch.manual_seed(0)  # the same weights on every rank: each keeps its own experts' slice
    with torch.device(device):
        base = make_block(family, config).to(torch.bfloat16)
    for name, b in base.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()

    def sharded(impl: str):
        block = copy.deepcopy(base)
        return apply_expert_parallelism(block, mesh["ep"], mesh["tp"], plan, ep_implementation=impl)

    blocks = {"all_to_all": sharded("all_to_all"), "te_ep": sharded("te_ep")}
    # register_te_ep(max_tokens_per_rank=, dtype=) made the handles with the sharding.
    backend = expert_parallel_modules(blocks["te_ep"])[0][1].te_ep.group.backend
    # The reference backend plans the routing on the host: only nccl_ep captures.
    graph = not args.no_graph and backend == "nccl_ep"
    if graph:
        blocks["te_ep graph"] = sharded("te_ep")
    if args.capacity_factor is not None:
        blocks[f"te_ep cf={args.capacity_factor:g}"] = sharded("te_ep_cf")
    del base
    gen = torch.Generator(device="cpu").manual_seed(10 + rank)
    x = torch.randn(1, args.tokens, sizes["hidden"], generator=gen).to(device, torch.bfloat16)
    grad = torch.randn(1, args.tokens, sizes["hidden"], generator=gen).to(device, torch.bfloat16)

    def step(block, inp):
        y = _out(block(inp))
        y.backward(grad)
        return y

    def eager(block):
        def run():
            for p in block.parameters():
                p.grad = None
            return step(block, x.detach().requires_grad_(True))
        return run

    calls = {label: eager(block) for label, block in blocks.items()}
    outputs = {}
    for label, block in blocks.items():
        for p in block.parameters():
            p.grad = None
        inp = x.detach().requires_grad_(True)
        outputs[label] = (step(block, inp).detach(), inp.grad.detach())
    if graph:
        calls["te_ep graph"], outputs["te_ep graph"] = _captured(blocks["te_ep graph"], step, x, args.warmup)
    ref_y, ref_dx = outputs["all_to_all"]
    rel = torch.tensor([max(_rel(y, ref_y), _rel(dx, ref_dx)) if label != "all_to_all" else 0.0
                        for label, (y, dx) in outputs.items()], dtype=torch.float64, device=device)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    timings = _common.interleaved_median_ms([_common.Call(fn) for fn in calls.values()], device, args.warmup,
                                            args.iters, ranks=True)
    te_ep_block = blocks["te_ep"]
    state = expert_parallel_modules(te_ep_block)[0][1].te_ep
    handle = next(iter(state.handles.values()))
    result = {"ms": {label: t.ms for label, t in zip(calls, timings)},
              "rel": dict(zip(outputs, rel.tolist())), "backend": state.group.backend, "mode": handle.mode,
              "impls": sorted(set(state.impls.values())), "capacity": handle.config.capacity}
    del blocks, calls, outputs
    te_ep_torch.shutdown_ep_groups()
    return result


def _captured(block, step, x, warmup: int):
    """``block``'s forward + backward captured in one CUDA graph: the replay call and its first (output, input grad)."""
    static_x = x.detach().clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Autograd's and te_ep's lazily made state (handles, workspaces) exists before capture.
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 3)):
            for p in block.parameters():
                p.grad = None
            static_x.grad = None
            step(block, static_x)
    torch.cuda.current_stream().wait_stream(side)
    for p in block.parameters():
        p.grad = None
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(block, static_x)
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, (static_y.detach().clone(), static_x.grad.detach().clone())


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise SystemExit(f"bench_transformers.py needs 2 or more ranks, got {world}: the experts are split over all "
                         "ranks. Run it under torchrun with --nproc-per-node=2 or more")
    import transformers

    from te_ep_torch.integrations.transformers import HAS_EP_REGISTRY, register_te_ep

    if not HAS_EP_REGISTRY:
        raise SystemExit(f"bench_transformers.py compares implementations of transformers' EP registry, which "
                         f"transformers {transformers.__version__} lacks (>= 5.23); tests/gpu/transformers_gpu.py "
                         "times parallelize_hf_moe")
    from torch.distributed.device_mesh import init_device_mesh

    device = _common.init_distributed(args.device)
    rank = dist.get_rank()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # DistributedConfig carries no te_ep options: they go with the registered name.
    common = dict(max_tokens_per_rank=args.tokens, dtype=torch.bfloat16)
    register_te_ep(**common, options=te_ep_torch.EpOptions(backend=args.backend))
    if args.capacity_factor is not None:
        register_te_ep("te_ep_cf", **common,
                       options=te_ep_torch.EpOptions(backend=args.backend, capacity_factor=args.capacity_factor))
    # What DistributedConfig(fsdp_size=W, ep_size=W) gives the experts: EP over all ranks, no TP.
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("tp", "ep"))
    rows, ok = [], True
    for family in args.models:
        sizes = dict(TINY_BLOCK, label="tiny") if device.type == "cpu" else BLOCKS[family]
        r = time_block(family, sizes, args, device, mesh)
        worst = max(r["rel"].values())
        same = worst <= TOL
        ok = ok and same
        if rank == 0:
            print(f"{family} ({sizes['label']}): te_ep vs all_to_all max |diff| / max |ref| (output, input grad) "
                  + ", ".join(f"{k} {v:.1e}" for k, v in r["rel"].items() if k != "all_to_all")
                  + f": {'ok' if same else 'FAILED'} (tolerance {TOL:g})", flush=True)
        a2a = r["ms"]["all_to_all"]
        rows.append(dict(
            model=family, label=sizes["label"], H=sizes["hidden"], FFN=sizes["ffn"], E=sizes["experts"],
            K=sizes["top_k"], capacity=r["capacity"], a2a=a2a, te_ep=r["ms"]["te_ep"],
            graph=r["ms"].get("te_ep graph"), cf=r["ms"].get(f"te_ep cf={args.capacity_factor:g}")
            if args.capacity_factor is not None else None,
            speedup=a2a / r["ms"]["te_ep"],
            graph_speedup=a2a / r["ms"]["te_ep graph"] if "te_ep graph" in r["ms"] else None,
            cf_speedup=a2a / r["ms"][f"te_ep cf={args.capacity_factor:g}"] if args.capacity_factor is not None
            else None,
            tokens_per_s=args.tokens / r["ms"]["te_ep"] * 1e3, te_ep_impl=f"{r['backend']}/{r['mode']}/"
            f"{','.join(r['impls'])}", same="yes" if same else "NO", worst=worst))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, gloo"
        print(f"\nMoE block forward + backward, bfloat16, {args.tokens} tokens/rank, EP {world} ({name}); torch "
              f"{torch.__version__}, transformers {transformers.__version__}, te_ep_torch {te_ep_torch.__version__}; "
              f"ms per step: median of {args.iters} after {args.warmup} warm-up, slowest rank")
        columns = [
            Column("model", "<12", "model"), Column("block", "<22", "label"), Column("H", ">5", "H"),
            Column("FFN", ">6", "FFN"), Column("E", ">4", "E"), Column("K", ">2", "K"),
            Column("capacity", ">9", "capacity"), Column("all_to_all", ">10", "a2a", ".3f"),
            Column("a2a graph", ">15", lambda r: A2A_GRAPH), Column("te_ep", ">8", "te_ep", ".3f"),
            Column("te_ep graph", ">11", "graph", ".3f"),
        ]
        if args.capacity_factor is not None:
            columns.append(Column(f"te_ep cf={args.capacity_factor:g}", ">12", "cf", ".3f"))
        columns += [Column("te_ep x", ">7", lambda r: f"{r['speedup']:.2f}x"),
                    Column("graph x", ">7", lambda r: None if r["graph_speedup"] is None
                           else f"{r['graph_speedup']:.2f}x")]
        if args.capacity_factor is not None:
            columns.append(Column("cf x", ">6", lambda r: f"{r['cf_speedup']:.2f}x"))
        columns += [Column("te_ep tokens/s", ">15", "tokens_per_s", ",.0f"),
                    Column("te_ep backend/mode/experts", "<34", "te_ep_impl"),
                    Column("same output", "<12", lambda r: f"{r['same']} ({r['worst']:.1e})")]
        _common.print_table(columns, rows)
        print("x: all_to_all ms / that column's ms (above 1: faster than transformers' all_to_all). a2a graph: "
              "transformers' all_to_all cannot be captured in a CUDA graph (it reads the split sizes back to the "
              "host every layer). te_ep graph: the te_ep block's forward + backward replayed from one CUDA graph "
              "(nccl_ep backend only; '-' where the te_ep backend is " + rows[0]["te_ep_impl"].split("/")[0] + ").",
              flush=True)
    _common.close_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    _common.leave(main())  # DTensor holds the process group past its destruction (see leave)
