"""MoE layer forward + backward: te_ep_torch vs plain PyTorch expert parallelism.

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_moe_layer.py [--backend auto reference] [--csv out.csv]
    torchrun --standalone --nproc-per-node=gpu benchmarks/bench_moe_layer.py      # every GPU of the node
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_moe_layer.py --device cpu   # gloo, tiny: tests the script

One MoE layer (te_ep_torch/testing/moe_blocks.py: float32 softmax top-k router, SwiGLU
experts with stacked weights, EP over all ranks) runs as

* ``native``  NativeMoEBlock: all_to_all_single of counts, ``.tolist()`` splits,
  sort by expert, all_to_all_single of rows, regroup by local expert (zones
  padded to --alignment), experts, the reverse, weighted sum per token;
* ``te_ep``   TeEpMoEBlock: ep_dispatch (zones aligned to --alignment), the
  grouped GEMM on the expert-major buffer, weights, ep_combine; once per
  --backend (``auto`` is nccl_ep on Hopper GPUs where NCCL EP loads);
* ``te_ep-fp8`` (with --fp8) TeEpMoEBlock with FP8 dispatch: tokens quantized to
  e4m3 with a float32 scale per 128 values, dispatched, dequantized before the
  experts; combine and backward in --dtype. Verified against native with the FP8
  tolerance (e4m3 keeps 4 significant bits);
* ``te_ep-overlap`` (with --overlap) TeEpMoEBlock with dispatch and combine on a
  communication stream and the shared expert (--shared-ffn) on the current stream
  meanwhile (te_ep_torch.overlap); verified like ``te_ep``;
* ``compute`` ComputeOnlyMoEBlock, after each te_ep block (unless
  --no-compute-only): the same router, experts and weighting with dispatch and
  combine replaced by local stand-ins of the same shapes (``te.permute`` of
  this rank's tokens to its own experts into the same capacity and alignment,
  ``te.unpermute`` back), i.e. the layer's compute-only time; printed as
  ``exposed comm = te_ep time - compute-only time``. Timed, not verified (its
  experts differ from the EP block's).

Both use the same experts kernel (--gemm: ``torch._grouped_mm`` where
te_ep_torch.moe.grouped_mm_supported says so, i.e. bf16 on SM 90+ with H and F
multiples of 8, else a loop over experts), the same parameters (copied from the native
block) and the same input. Default shape: 8192 tokens per rank, hidden 4096,
64 experts, top-8, expert FFN size 1536 (SwiGLU: gate and up H x 1536, down
1536 x H), bfloat16.

Before timing, each te_ep block's output and gradients (input, router, the
three expert weights) are compared with the native block's: max |diff| and
relative L2 error, worst rank; the run fails (exit 1) if the relative error
exceeds the dtype's tolerance.

A step is forward + backward of the layer on the same input with a fixed output
gradient. Each timed iteration starts after a barrier and a device
synchronisation and is timed with CUDA events; a row reports the median over
iterations of the slowest rank, the tokens per second per GPU that it means and
its speedup over ``native`` (native time / te_ep time). ``fwd ms`` times the
forward alone (autograd graph recorded, then dropped). ``step GiB`` (GPU only)
is the peak memory a step allocates on top of what was resident before it
(activations, communication buffers, gradients), worst rank.

te_ep receive capacity: by default this run's routing (which is the same every
step: same input, same router) needs at most N padded rows on a rank; the
handles get ceil(N * --capacity-headroom) rows (a capacity factor, in effect).
--worst-case-capacity sizes them for any routing instead. Unless it is given, a
``te_ep-default`` row times the same block with the default capacity (the worst case:
what a user gets without sizing the buffer), so the two rows show what the capacity
costs in time (the zone kernels keep the work bounded by the rows in use).

``--device cpu`` runs tiny sizes on gloo with the reference backend: it tests
the script; its numbers mean nothing. NVLink multicast is never used:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
are the defaults.
"""

from __future__ import annotations

import _common  # first: it sets the environment NCCL reads when it initialises

import argparse
import math
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import te_ep_torch as te
from _common import Column
from te_ep_torch.testing.moe_blocks import (
    GEMMS,
    MoEConfig,
    ComputeOnlyMoEBlock,
    NativeMoEBlock,
    TeEpMoEBlock,
    copy_parameters,
    fwd_bwd,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative L2 error allowed between the two blocks (outputs and every gradient).
# bf16: the native backward accumulates the gradient of the input in bf16
# (index_select's backward), te_ep in float32; bugs give errors of order 1.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# FP8 dispatch feeds the experts values rounded to 4 significant bits (relative error at
# most 2^-4, about 3.6% RMS); outputs and gradients then differ from native by a few percent.
FP8_TOLERANCE = 0.08

DEFAULTS = {
    # device: tokens, hidden, ffn, experts, top_k, dtype, warmup, iters
    "cuda": dict(tokens=8192, hidden=4096, ffn=1536, experts=64, top_k=8, dtype="bf16", warmup=10, iters=30),
    "cpu": dict(tokens=48, hidden=32, ffn=48, experts=8, top_k=2, dtype="fp32", warmup=1, iters=3),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: NCCL, one GPU per rank; cpu: gloo, reference backend, tiny default sizes")
    parser.add_argument("--backend", nargs="+", default=None, choices=te.BACKENDS,
                        help="te_ep backends to time (default: auto; on cpu: reference)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default 8192; cpu 48)")
    parser.add_argument("--hidden", type=int, help="hidden size H (default 4096; cpu 32)")
    parser.add_argument("--ffn", type=int, help="expert FFN size F (default 1536; cpu 48)")
    parser.add_argument("--experts", type=int, help="global number of experts (default 64; cpu 8)")
    parser.add_argument("--top-k", type=int, help="experts per token (default 8; cpu 2)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="token and expert dtype (default bf16; cpu fp32)")
    parser.add_argument("--alignment", type=int, default=16,
                        help="rows per expert zone are padded to a multiple of this, in both blocks")
    parser.add_argument("--gemm", choices=GEMMS, default="auto",
                        help="experts kernel of both blocks: auto = grouped_mm where "
                             "te_ep_torch.moe.grouped_mm_supported (bf16, SM 90+), else loop")
    parser.add_argument("--capacity-headroom", type=float, default=1.1,
                        help="te_ep capacity = this x the padded rows this run's routing needs on the busiest rank")
    parser.add_argument("--worst-case-capacity", action="store_true",
                        help="size te_ep receive buffers for any routing (EpGroup.worst_case_capacity)")
    parser.add_argument("--warmup", type=int, help="untimed steps per measurement (default 10; cpu 1)")
    parser.add_argument("--iters", type=int, help="timed steps per measurement (default 30; cpu 3)")
    parser.add_argument("--no-compute-only", action="store_true",
                        help="skip the compute-only stand-in of each te_ep block (and the exposed-comm line)")
    parser.add_argument("--shared-ffn", type=int, default=0,
                        help="inner width of a shared SwiGLU expert in every block (0: none)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time each te_ep block with dispatch/combine on a communication stream and the "
                             "shared expert overlapping them (te_ep-overlap rows)")
    parser.add_argument("--fp8", action="store_true",
                        help="also time each te_ep block with FP8 dispatch (te_ep-fp8 rows)")
    parser.add_argument("--nccl-ep-mode", default=te.DEFAULT_NCCL_EP_MODE, choices=["staged", "zero_copy", "auto"],
                        help="EpGroup(nccl_ep_mode=...) of the te_ep blocks (run once per mode to compare them)")
    parser.add_argument("--checks", default="local", choices=["local", "device", "synchronous"],
                        help="EpGroup(checks=...) of the te_ep blocks (docs/ops.md, 'Check modes')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend is None:
        args.backend = ["auto"] if args.device == "cuda" else ["reference"]
    args.backend = list(dict.fromkeys(args.backend))
    if args.alignment < 1 or args.alignment & (args.alignment - 1):
        parser.error(f"--alignment must be a power of two, got {args.alignment}")
    if args.capacity_headroom < 1.0:
        parser.error(f"--capacity-headroom must be >= 1, got {args.capacity_headroom}")
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    return args


def fit_capacity(block: NativeMoEBlock, x: torch.Tensor, args, group: te.EpGroup) -> int:
    """Receive rows for this run's routing on the busiest rank, times the headroom."""
    if args.worst_case_capacity:
        return group.worst_case_capacity(args.top_k, args.alignment)
    with torch.no_grad():
        _, topk_idx = block.route(x)
    counts = torch.bincount(topk_idx.flatten(), minlength=args.experts)
    dist.all_reduce(counts)
    a = args.alignment
    need = int(((counts + a - 1) // a * a).view(group.ep_size, -1).sum(1).max())
    # nccl_ep wants capacity >= max_tokens_per_rank.
    return max(args.tokens, math.ceil(need * args.capacity_headroom / a) * a)


def compare(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], device) -> Dict[str, tuple]:
    """``name -> (max |diff|, relative L2 error)``, the worst over ranks."""
    values = []
    for name in ref:
        a, b = got[name].float(), ref[name].float()
        values += [(a - b).abs().max(), (a - b).norm() / b.norm().clamp_min(1e-30)]
    stats = torch.stack(values).to(torch.float64).to(device)
    # A NaN must not vanish in the MAX reduction: make it infinite first.
    stats = torch.nan_to_num(stats, nan=math.inf)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.tolist()
    return {name: (stats[2 * i], stats[2 * i + 1]) for i, name in enumerate(ref)}


def describe(args, world: int, device: torch.device, dtype: torch.dtype) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo; numbers mean nothing)"
    lines = [
        f"{world} x {where}, torch {torch.__version__}, te_ep_torch {te.__version__}",
        f"MoE layer: tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} (SwiGLU) experts={args.experts} "
        f"top_k={args.top_k} dtype={str(dtype).replace('torch.', '')} alignment={args.alignment}",
        f"step = forward + backward; median of {args.iters} timed steps after {args.warmup} warmup, slowest rank",
    ]
    if device.type == "cuda":
        lines.append(", ".join(f"{name}={os.environ.get(name)}" for name, _ in _common.MULTICAST_OFF))
    return "\n".join(lines)


COLUMNS = [
    Column("block", "<13", "block"), Column("backend", "<10", "backend"), Column("gemm", "<10", "gemm"),
    Column("capacity", ">9", "capacity"), Column("fwd ms", ">8", "fwd_ms", ".3f"),
    Column("fwd+bwd ms", ">11", "step_ms", ".3f"), Column("tokens/s/GPU", ">13", "tokens_per_s_per_gpu", ",.0f"),
    Column("x native", ">9", "speedup", ".2f"), Column("fwd x", ">6", "fwd_speedup", ".2f"),
    Column("step GiB", ">9", "step_GiB", ".2f"),
]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = _common.init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be divisible by the number of ranks ({world})")
    config = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k, dtype=dtype,
                       shared_ffn=args.shared_ffn)

    gen = torch.Generator(device="cpu").manual_seed(10_000 + 7919 * args.seed + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_out = (torch.randn(args.tokens, args.hidden, generator=gen) * 0.1).to(device=device, dtype=dtype)

    native = NativeMoEBlock(config, device=device, alignment=args.alignment, gemm=args.gemm, seed=args.seed)
    if rank == 0:
        print(describe(args, world, device, dtype), flush=True)
    reference = fwd_bwd(native, x, grad_out)

    peak = device.type == "cuda"
    blocks = [("native", "-", native, None)]
    verify_ok = True
    seen = set()
    rows = []
    for backend in args.backend:
        group = te.EpGroup(num_experts=args.experts, max_tokens_per_rank=args.tokens, backend=backend, device=device,
                           nccl_ep_mode=args.nccl_ep_mode, checks=args.checks)
        if group.backend in seen:
            if rank == 0:
                print(f"\n--backend {backend} resolves to {group.backend}, already measured", flush=True)
            group.shutdown()
            continue
        seen.add(group.backend)
        capacity = fit_capacity(native, x, args, group)
        worst = group.worst_case_capacity(args.top_k, args.alignment)
        variants = [("te_ep", False, False, capacity)]
        if capacity != worst:
            # What a user gets without sizing the buffer (the default capacity, the worst case).
            variants.append(("te_ep-default", False, False, worst))
        if args.overlap:
            variants.append(("te_ep-overlap", False, True, capacity))
        if args.fp8:
            variants.append(("te_ep-fp8", True, False, capacity))
        for name, fp8, overlap, cap in variants:
            block = TeEpMoEBlock(config, group, alignment=args.alignment, capacity=cap, gemm=args.gemm,
                                 seed=args.seed + 1, dispatch_dtype=torch.float8_e4m3fn if fp8 else None,
                                 overlap=overlap)
            copy_parameters(native, block)
            tolerance = FP8_TOLERANCE if fp8 else TOLERANCE[dtype]
            if rank == 0:
                print(f"\nverify {name}[{group.backend}] vs native (relative L2 tolerance {tolerance:g}, worst rank):",
                      flush=True)
            result = compare(reference, fwd_bwd(block, x, grad_out), device)
            for what, (max_abs, rel) in result.items():
                ok = rel <= tolerance
                verify_ok &= ok
                if rank == 0:
                    print(f"  {what:<14} max|diff| {max_abs:.3e}  rel L2 {rel:.3e}  {'ok' if ok else 'MISMATCH'}")
            blocks.append((name, group.backend, block, cap))
        if not args.no_compute_only:
            stand_in = ComputeOnlyMoEBlock(config, ep_rank=rank, ep_size=world, device=device,
                                           alignment=args.alignment, capacity=capacity, gemm=args.gemm,
                                           seed=args.seed + 1)
            copy_parameters(native, stand_in)
            blocks.append(("compute", group.backend, stand_in, capacity))

    if rank == 0:
        print("\ntiming ...", flush=True)
    leaf = x.detach().requires_grad_()

    def before(block):
        def reset():
            leaf.grad = None
            for p in block.parameters():
                p.grad = None
        return reset

    for name, backend, block, capacity in blocks:
        reset = before(block)
        reset()
        if peak:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
        fwd = _common.median_ms(lambda: block(leaf), device, args.warmup, args.iters, ranks=True, before=reset).ms
        step = _common.median_ms(lambda: block(leaf).backward(grad_out), device, args.warmup, args.iters, ranks=True,
                                 before=reset).ms
        peak_gib = None
        if peak:
            value = torch.tensor([(torch.cuda.max_memory_allocated(device) - resident) / 2**30], device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            peak_gib = float(value.item())
        rows.append({
            "block": name, "backend": backend, "gemm": block.gemm, "capacity": capacity if capacity else "-",
            "world": world, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts,
            "top_k": args.top_k, "dtype": args.dtype, "alignment": args.alignment,
            "fwd_ms": fwd, "step_ms": step, "tokens_per_s_per_gpu": args.tokens / (step * 1e-3),
            "step_GiB": peak_gib,
        })
    for row in rows:
        row["speedup"] = rows[0]["step_ms"] / row["step_ms"]
        row["fwd_speedup"] = rows[0]["fwd_ms"] / row["fwd_ms"]
    # Exposed communication: the te_ep layer's time minus that of its compute-only stand-in.
    compute = {row["backend"]: row for row in rows if row["block"] == "compute"}
    exposed = []
    for row in rows:
        if row["block"].startswith("te_ep") and row["backend"] in compute:
            base = compute[row["backend"]]
            row["exposed_comm_ms"] = row["step_ms"] - base["step_ms"]
            row["exposed_comm_fwd_ms"] = row["fwd_ms"] - base["fwd_ms"]
            exposed.append(f"exposed comm {row['block']}[{row['backend']}]: fwd+bwd {row['step_ms']:.3f} - {base['step_ms']:.3f} "
                           f"= {row['exposed_comm_ms']:.3f} ms ({100 * row['exposed_comm_ms'] / row['step_ms']:.1f}% "
                           f"of the step; layer / compute-only = {row['step_ms'] / base['step_ms']:.2f}x), "
                           f"fwd {row['exposed_comm_fwd_ms']:.3f} ms")

    if rank == 0:
        print()
        _common.print_table(COLUMNS, rows)
        print("x native = native time / row time, forward + backward ('fwd x': forward alone); "
              "step GiB = peak memory a step adds to what is resident (worst rank)")
        for line in exposed:
            print(line)
        if not verify_ok:
            print("VERIFICATION FAILED: the te_ep block does not match the native block (see above)")
        if args.csv:
            _common.write_csv(args.csv, rows)
    for name, _, block, _ in blocks[1:]:
        if name == "te_ep":  # the other te_ep-* blocks share the group of the te_ep block before them
            block.group.shutdown()
    _common.close_distributed()
    return 0 if verify_ok else 1


if __name__ == "__main__":
    sys.exit(main())
