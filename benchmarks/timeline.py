"""A timeline picture of one MoE layer step: which GPU stream runs what, when.

    # 1. on the GPUs: record one forward + backward of the overlapped te_ep layer
    torchrun --nproc-per-node=2 benchmarks/timeline.py record --out-dir traces/
    # 2. anywhere with matplotlib: draw rank 0's GPU streams
    python3 benchmarks/timeline.py plot traces/rank0.json --out docs/timeline_overlap.png

``record`` builds the benchmark layer of bench_moe_layer.py (te_ep_torch/testing/moe_blocks.py:
TeEpMoEBlock with a shared expert, ``--overlap`` by default, ``--no-overlap`` for the
sequential layer), runs ``--warmup`` steps, then profiles one step with
``torch.profiler`` and writes each rank's Chrome trace to ``OUT_DIR/rank<r>.json``.
``plot`` reads such a trace, keeps the GPU kernels and memory operations of the profiled
step, and draws one lane per CUDA stream (the communication stream of
te_ep_torch.overlap next to the compute stream), coloured by kind: NCCL EP and NCCL
kernels (communication), GEMMs, te_ep's own kernels, the rest.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Tuple

Lane = List[Tuple[float, float, str]]  # (start us, duration us, kernel name)

# First match wins: te_ep's own kernels (namespace te_ep, including those next to NCCL EP),
# then NCCL and NCCL EP's (nccl_ep::..., its ht_/ll_ kernels), then GEMMs.
KINDS = (
    ("te_ep", ("te_ep",)),
    ("communication", ("nccl", "ht_", "ll_")),
    ("GEMM", ("gemm", "sm90", "cutlass", "grouped")),
)
COLORS = {"communication": "#d62728", "GEMM": "#1f77b4", "te_ep": "#2ca02c", "other": "#7f7f7f"}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def lanes_from_trace(trace: Dict) -> Dict[int, Lane]:
    """GPU activity of a Chrome trace by CUDA stream: ``{stream: [(start, dur, name)]}``, times
    in microseconds from the first GPU event."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "stream" in e.get("args", {})]
    if not gpu:
        return {}
    t0 = min(float(e["ts"]) for e in gpu)
    lanes: Dict[int, Lane] = {}
    for e in sorted(gpu, key=lambda e: float(e["ts"])):
        lanes.setdefault(int(e["args"]["stream"]), []).append(
            (float(e["ts"]) - t0, float(e.get("dur", 0.0)), str(e.get("name", "")))
        )
    return lanes


def busy_us(lane: Lane) -> float:
    """Time the stream runs something (overlapping events counted once)."""
    total, end = 0.0, float("-inf")
    for start, dur, _ in sorted(lane):
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def plot(trace_path: str, out: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"plot needs matplotlib (pip install matplotlib): {exc}")
    with open(trace_path) as f:
        lanes = lanes_from_trace(json.load(f))
    if not lanes:
        raise SystemExit(f"{trace_path}: no GPU kernels in the trace (was it recorded on a GPU?)")
    streams = sorted(lanes, key=lambda s: -busy_us(lanes[s]))
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(streams)))
    for row, stream in enumerate(streams):
        for start, dur, name in lanes[stream]:
            ax.broken_barh([(start / 1000, max(dur, 1.0) / 1000)], (row - 0.4, 0.8), color=COLORS[kind_of(name)])
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}\nbusy {busy_us(lanes[s]) / 1000:.2f} ms" for s in streams])
    ax.set_xlabel("ms from the first GPU event of the step")
    ax.invert_yaxis()
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", ncol=len(COLORS), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}: {len(streams)} streams, "
          + ", ".join(f"stream {s} busy {busy_us(lanes[s]) / 1000:.2f} ms" for s in streams))


def record(args) -> None:
    # Here, not at the top: plotting needs neither torch nor a process group.
    import _common  # first: it sets the environment NCCL reads when it initialises
    import torch
    import torch.distributed as dist

    import te_ep_torch as te
    from te_ep_torch.testing.moe_blocks import MoEConfig, TeEpMoEBlock

    device = _common.init_distributed("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cuda = device.type == "cuda"
    rank = dist.get_rank()
    dtype = torch.bfloat16 if cuda else torch.float32
    config = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k, dtype=dtype,
                       shared_ffn=args.shared_ffn)
    group = te.EpGroup(num_experts=args.experts, max_tokens_per_rank=args.tokens, device=device,
                       nccl_ep_mode=args.nccl_ep_mode, checks=args.checks)
    block = TeEpMoEBlock(config, group, alignment=16, overlap=not args.no_overlap)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype) * 0.1

    def step():
        block(x).backward(grad)

    for _ in range(args.warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    print(f"rank {rank}: wrote {path} ({'overlapped' if not args.no_overlap else 'sequential'} layer, "
          f"backend {group.backend})", flush=True)
    group.shutdown()
    _common.close_distributed()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="profile one layer step under torchrun, one trace per rank")
    rec.add_argument("--out-dir", required=True)
    rec.add_argument("--tokens", type=int, default=8192)
    rec.add_argument("--hidden", type=int, default=4096)
    rec.add_argument("--ffn", type=int, default=1536)
    rec.add_argument("--shared-ffn", type=int, default=3072)
    rec.add_argument("--experts", type=int, default=64)
    rec.add_argument("--top-k", type=int, default=8)
    rec.add_argument("--warmup", type=int, default=5)
    rec.add_argument("--no-overlap", action="store_true", help="record the sequential layer instead")
    rec.add_argument("--nccl-ep-mode", default="staged", choices=["staged", "zero_copy", "auto"])
    rec.add_argument("--checks", default="local", choices=["local", "device", "synchronous"])
    rec.add_argument("--cpu", action="store_true", help="gloo on CPU (tests the script; no GPU lanes)")
    plo = sub.add_parser("plot", help="draw a recorded trace's GPU streams to a PNG")
    plo.add_argument("trace")
    plo.add_argument("--out", required=True)
    plo.add_argument("--title", default="one MoE layer step (forward + backward), GPU streams")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        plot(args.trace, args.out, args.title)


if __name__ == "__main__":
    main()
