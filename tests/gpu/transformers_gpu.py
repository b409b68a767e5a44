"""transformers MoE models on te_ep, on GPUs: equality with the unsharded model, and speed.

    python3 -m torch.distributed.run --nproc-per-node=1 tests/gpu/transformers_gpu.py       # one GPU, EP 1, nccl_ep
    python3 -m torch.distributed.run --nproc-per-node=8 tests/gpu/transformers_gpu.py       # EP 8
    python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/transformers_gpu.py --device cpu --tiny   # logic

1. Equality (tests/_transformers_cases.py ``case_parity``): tiny Qwen3-MoE, Mixtral, gpt-oss
   and DeepSeek-V3 models (hidden 32, 8 experts, top-2) made expert-parallel over all ranks
   with ``parallelize_hf_moe`` (EP over the default group, and EP x FSDP2 on a (1, W) mesh),
   and on transformers >= 5.23 also sharded by transformers itself with
   ``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="te_ep")`` (layout
   "registry", ``case_registry_parity``; W >= 2), against the unsharded model on
   transformers' own "eager" experts: logits, loss and every
   gradient of the whole model, in float32 (max |diff| / max |ref| <= 1e-4; the te_ep
   experts run the loop implementation) and bfloat16 (3e-2; the te_ep experts run
   ``torch._grouped_mm`` on SM90+).
2. Speed: forward + backward of one MoE block (the model's own block class: router, experts,
   shared expert where the model has one) in bfloat16 at sizes of real models, with the
   model's ``grouped_mm`` experts implementation (every expert on this rank, no
   communication) and with te_ep (``parallelize_hf_moe``: dispatch, the rank's experts,
   combine), in the same run: CUDA events around ``--iters`` iterations after ``--warmup``
   ones, the median of ``--repeats`` such measurements. Prints a table with the ratio
   te_ep / grouped_mm (below 1: te_ep is faster). Both blocks also give the same output
   (bfloat16 tolerance) on the timed batch. (benchmarks/bench_transformers.py times the same
   blocks through transformers' own EP: te_ep against its ``all_to_all``, and in a CUDA graph.)

Exits non-zero if an equality check fails on any rank. ``--device cpu`` runs the same on
gloo with te_ep's reference backend (timings then say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# A script torchrun starts, outside pytest's pythonpath: tests/ and the repository root (an
# in-place build) on the import path, as pytest puts them.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]

import transformers  # noqa: E402

import te_ep_torch  # noqa: E402
from _dist import Ctx  # noqa: E402
from _transformers_cases import case_parity, case_registry_parity  # noqa: E402
from te_ep_torch import ep_combine, ep_dispatch  # noqa: E402
from te_ep_torch.integrations.transformers import HAS_EP_REGISTRY, parallelize_hf_moe  # noqa: E402
from te_ep_torch.zones import weighted_for_combine  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 3e-2}

# Blocks timed: the sizes of one MoE layer of a real model (hidden, expert FFN, experts, top-k).
BLOCKS = {
    "qwen3_moe": dict(label="Qwen3-30B-A3B", hidden=2048, ffn=768, experts=128, top_k=8),
    "mixtral": dict(label="Mixtral-8x7B", hidden=4096, ffn=14336, experts=8, top_k=2),
    "gpt_oss": dict(label="gpt-oss-20b", hidden=2880, ffn=2880, experts=32, top_k=4),
    "deepseek_v3": dict(label="DeepSeek-V2-Lite dims", hidden=2048, ffn=1408, experts=64, top_k=6),
}
TINY_BLOCK = dict(hidden=64, ffn=32, experts=8, top_k=2)


def block_config(family: str, sizes: dict):
    h, f, e, k = sizes["hidden"], sizes["ffn"], sizes["experts"], sizes["top_k"]
    common = dict(hidden_size=h, num_experts_per_tok=k, num_attention_heads=8, num_key_value_heads=8,
                  vocab_size=128, num_hidden_layers=1)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=e, moe_intermediate_size=f, norm_topk_prob=True, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=e, intermediate_size=f, **common)
    if family == "gpt_oss":
        return transformers.GptOssConfig(num_local_experts=e, intermediate_size=f, **common)
    if family == "deepseek_v3":
        groups = 8 if e % 8 == 0 and e >= 16 else 1
        return transformers.DeepseekV3Config(n_routed_experts=e, moe_intermediate_size=f, n_shared_experts=2,
                                             n_group=groups, topk_group=max(1, groups // 2), norm_topk_prob=True,
                                             **common)
    raise ValueError(family)


def make_block(family: str, config):
    """The model's own MoE block class, weights N(0, 0.02) (biases too), on the current device."""
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    elif family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    elif family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    block = Block(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.02)
    return block


def check_equality(ctx: Ctx, families) -> bool:
    """``case_parity`` of every family, dtype and layout; prints one line per check (rank 0)."""
    ok = True
    # transformers shards the model itself only over 2 or more ranks.
    layouts = ("group", "fsdp") + (("registry",) if HAS_EP_REGISTRY and ctx.world_size > 1 else ())
    for family in families:
        for dtype in ("float32", "bfloat16"):
            for layout in layouts:
                name = f"{family} {dtype} {layout} W={ctx.world_size}"
                error, worst, impls = "", (0.0, ""), []
                try:
                    if layout == "registry":
                        res = case_registry_parity(ctx, family=family, dtype=dtype)
                        if sorted(res["states"]) != sorted(res["layers"]):
                            raise AssertionError(f"experts not on te_ep: {res['layers']} vs {sorted(res['states'])}")
                        impls = sorted({i for st in res["states"].values() for i in st["impls"]})
                    else:
                        res = case_parity(ctx, family=family, layout=layout, dtype=dtype)
                        impls = sorted(set(res["impls"]))
                    worst = max((d["max_abs"] / max(d["ref_max"], 1e-6), n) for n, d in res["diffs"].items())
                    if worst[0] > TOL[dtype]:
                        error = f"max |diff| / max |ref| = {worst[0]:.2e} > {TOL[dtype]:g} ({worst[1]})"
                except Exception:  # noqa: BLE001 (one failing check must not stop the others)
                    error = traceback.format_exc()
                errors = [None] * ctx.world_size
                dist.all_gather_object(errors, error)
                failed = [(r, e) for r, e in enumerate(errors) if e]
                ok = ok and not failed
                if ctx.rank == 0:
                    if failed:
                        for r, e in failed:
                            print(f"FAIL {name} (rank {r}): {e}", flush=True)
                    else:
                        print(f"ok   {name}: worst {worst[0]:.1e} ({worst[1]}), experts {impls}", flush=True)
    return ok


def time_block(ctx: Ctx, family: str, sizes: dict, tokens: int, args, device: torch.device) -> dict:
    """Forward + backward of one MoE block, grouped_mm vs te_ep, in milliseconds per iteration."""
    config = block_config(family, sizes)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        ref = make_block(family, config).to(torch.bfloat16)
    ours = copy.deepcopy(ref)  # its own copy of the config too: the implementations stay apart
    for name, b in list(ref.named_buffers()) + list(ours.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    parallelize_hf_moe(ours, None, max_tokens_per_rank=tokens, dtype=torch.bfloat16,
                       options=te_ep_torch.EpOptions(backend=args.backend))
    blocks = {"grouped_mm": ref, "te_ep": ours}
    if args.capacity_factor is not None:
        fitted = copy.deepcopy(ref)
        parallelize_hf_moe(fitted, None, max_tokens_per_rank=tokens, dtype=torch.bfloat16,
                           options=te_ep_torch.EpOptions(backend=args.backend, capacity_factor=args.capacity_factor))
        blocks["te_ep_cf"] = fitted
    gen = torch.Generator(device="cpu").manual_seed(10 + ctx.rank)
    x = torch.randn(1, tokens, sizes["hidden"], generator=gen).to(device, torch.bfloat16)
    grad = torch.randn(1, tokens, sizes["hidden"], generator=gen).to(device, torch.bfloat16)

    def step(block):
        for p in block.parameters():
            p.grad = None
        inp = x.detach().requires_grad_(True)
        y = block(inp)
        y = y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores
        y.backward(grad)
        return y

    with torch.no_grad():
        y_ref, y_ours = ref(x), ours(x)
        y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
        y_ours = y_ours[0] if isinstance(y_ours, tuple) else y_ours
        rel = ((y_ours.float() - y_ref.float()).abs().max() / y_ref.float().abs().max().clamp_min(1e-12)).item()

    def measure(block, fn=None) -> float:
        run = fn if fn is not None else (lambda: step(block))
        for _ in range(args.warmup):
            run()
        samples = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(args.iters):
                    run()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / args.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    run()
                samples.append((time.perf_counter() - t0) * 1e3 / args.iters)
        # The slowest rank sets the step time of a data-parallel job.
        t = torch.tensor([statistics.median(samples)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    state = next(m.te_ep for m in ours.modules() if hasattr(m, "te_ep"))
    handle = state.step.handle_for(x.reshape(tokens, -1))
    # Dispatch + combine alone (forward and backward) on this block's shapes, uniform random
    # top-k routing: the communication the te_ep block adds to the local experts' work.
    route = torch.Generator(device="cpu").manual_seed(20 + ctx.rank)
    idx = torch.rand(tokens, sizes["experts"], generator=route).topk(sizes["top_k"], dim=1).indices.to(device)
    weights = torch.rand(tokens, sizes["top_k"], generator=route).to(device)

    def comm_step():
        xi = x.reshape(tokens, -1).detach().requires_grad_(True)
        w = weights.detach().requires_grad_(True)
        out = ep_dispatch(handle, xi, idx, w)
        y = ep_combine(handle, weighted_for_combine(out.tokens, out.weights, out.expert_counts, handle), tokens)
        y.backward(grad.reshape(tokens, -1))

    # Interleaved so drifting clocks hit both alike.
    times = {name: [] for name in list(blocks) + ["comm"]}
    for _ in range(2):
        for name, block in blocks.items():
            times[name].append(measure(block))
        times["comm"].append(measure(None, comm_step))
    result = {name: min(t) for name, t in times.items()}
    result.update(rel=rel, backend=state.group.backend, impls=sorted(set(state.impls.values())),
                  capacity=handle.config.capacity)
    te_ep_torch.shutdown_ep_groups()
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, help="te_ep backend for the timing (default: nccl_ep on cuda, "
                                                   "reference on cpu); the equality checks use the same")
    p.add_argument("--models", default=",".join(BLOCKS), help=f"comma-separated, of {list(BLOCKS)}")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the timed block")
    p.add_argument("--tiny", action="store_true", help=f"timed blocks of {TINY_BLOCK} and 128 tokens (logic only)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="also time te_ep with parallelize_hf_moe(options=EpOptions(capacity_factor=...)) (te_ep cf column)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    families = [f for f in args.models.split(",") if f]
    unknown = [f for f in families if f not in BLOCKS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}, choose from {list(BLOCKS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device; use --device cpu to check the logic")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 equality is checked tightly
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    args.backend = args.backend or ("nccl_ep" if device.type == "cuda" else "reference")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = Ctx(rank=rank, world_size=world, device=str(device), backend=args.backend)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, te_ep_torch "
              f"{te_ep_torch.__version__}; {world} rank(s) on {name}; te_ep backend {args.backend}", flush=True)
    ok = True
    if not args.skip_equality:
        ok = check_equality(ctx, families)
        te_ep_torch.shutdown_ep_groups()
        if rank == 0:
            print(f"equality: {'passed' if ok else 'FAILED'}", flush=True)
    if not args.skip_timing:
        rows = []
        tokens = 128 if args.tiny else args.tokens
        for family in families:
            sizes = dict(TINY_BLOCK, label="tiny") if args.tiny else BLOCKS[family]
            r = time_block(ctx, family, sizes, tokens, args, device)
            close = r["rel"] <= TOL["bfloat16"]
            ok = ok and close
            rows.append((family, sizes, r, close))
        if rank == 0:
            print(f"\nMoE block forward + backward, bfloat16, {tokens} tokens/rank, EP {world} "
                  f"(ms per iteration, median of {args.repeats} x {args.iters} after {args.warmup} warmup; "
                  "max over ranks)")
            header = (f"{'model':<14}{'block':<24}{'H':>6}{'FFN':>7}{'E':>5}{'K':>3}{'capacity':>9}"
                      f"{'grouped_mm':>12}{'te_ep':>10}{'te_ep cf':>10}{'comm':>8}{'te_ep / grouped_mm':>20}"
                      f"{'(te_ep - gmm) / comm':>22}  te_ep experts, same output")
            print(header)
            print("-" * len(header))
            for family, s, r, close in rows:
                cf = f"{r['te_ep_cf']:>10.3f}" if "te_ep_cf" in r else f"{'-':>10}"
                print(f"{family:<14}{s['label']:<24}{s['hidden']:>6}{s['ffn']:>7}{s['experts']:>5}"
                      f"{s['top_k']:>3}{r['capacity']:>9}{r['grouped_mm']:>12.3f}{r['te_ep']:>10.3f}{cf}"
                      f"{r['comm']:>8.3f}{r['te_ep'] / r['grouped_mm']:>20.2f}"
                      f"{(r['te_ep'] - r['grouped_mm']) / r['comm']:>22.2f}  {r['backend']}/{','.join(r['impls'])}, "
                      f"{'yes' if close else 'NO'} ({r['rel']:.1e})", flush=True)
            print("comm: ep_dispatch + ep_combine alone, forward + backward, on the block's shapes (uniform random "
                  "routing); te_ep cf: parallelize_hf_moe(options=EpOptions(capacity_factor=--capacity-factor))")
    te_ep_torch.shutdown_ep_groups()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # As examples/moe_train.py: leave without Python's finalization (a gloo worker thread
    # still releasing a finished collective can abort the process there).
    os._exit(code)
