"""MoE layer forward + backward: ``te.MoE`` (te_ep_torch.moe) vs plain PyTorch expert parallelism.

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_moe_layer.py [--backend auto reference] [--csv out.csv]
    torchrun --standalone --nproc-per-node=4 benchmarks/bench_moe_layer.py --modes eager,compile,graph --chunks 1,2,4
    torchrun --standalone --nproc-per-node=gpu benchmarks/bench_moe_layer.py      # every GPU of the node
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_moe_layer.py --device cpu   # gloo, tiny: tests the script

The layer users import, ``te_ep_torch.MoE`` (float32 softmax top-k ``TopKRouter``,
``GroupedExperts`` SwiGLU experts with stacked weights, optional ``SwiGLU`` shared expert),
built with its default arguments (router options, ``alignment``, ``expert_impl`` unless
--alignment / --gemm say otherwise), this rank's ``E / W`` experts kept (plain local tensors)
and ``MoE.enable_expert_parallel(group)`` over all ranks, is timed against
``NativeMoEBlock`` (te_ep_torch/testing/moe_blocks.py), which computes the same function:
the same router math (``normalize_weights`` set to the MoE router's default: off for
softmax scores, the weights are the scores), the same experts, the same unweighted shared
expert, ``y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])``. Rows:

* ``native``  NativeMoEBlock: all_to_all_single of counts, ``.tolist()`` splits,
  sort by expert, all_to_all_single of rows, regroup by local expert (zones
  padded to the alignment), experts, the reverse, weighted sum per token;
* ``te_ep``   ``te.MoE``: router, ep_dispatch (zones aligned as the layer picks), grouped
  experts, ``zone_scale`` weighting, ep_combine (+ shared expert); once per --backend
  (``auto`` is nccl_ep on Hopper GPUs where NCCL EP loads), default capacity (the worst
  case: what a user gets) unless --capacity-headroom or --capacity-factor;
* ``te_ep-default`` (with --capacity-headroom or --capacity-factor) the same layer with the
  default capacity, so the two rows show what the capacity costs in time (the zone kernels
  keep the work bounded by the rows in use);
* ``te_ep-fp8`` (with --fp8) ``te.MoE(dispatch_dtype="fp8")``: tokens dispatched as e4m3
  with a float32 scale per 128 values, dequantized before the experts; combine and backward
  in --dtype. Verified against native with the FP8 tolerance (e4m3 keeps 4 significant
  bits); --hidden must be a multiple of 128 (512 on nccl_ep);
* ``te_ep-overlap`` (with --overlap) ``te.MoE(overlap=True)``: dispatch and combine on a
  communication stream, the shared expert (--shared-ffn) and the router's statistics on
  the current stream meanwhile (sequential on CPU and under torch.compile); verified like
  ``te_ep``;
* ``te_ep-chunksN`` (--chunks N, each N != 1) ``te.MoE`` enabled with
  ``options=te.EpOptions(chunks=N)`` (and the run's capacity option); needs a te_ep_torch
  whose EpOptions has ``chunks``, else the run stops at once saying so;
* ``te_ep-chunksN-smsK`` (--comm-sms K, each K != 0) the same with ``comm_sms=K``: the chunks'
  expert GEMMs leave K SMs to the communication kernels beside them; with --overlap also
  ``te_ep-overlap-smsK``: the experts' weight gradients under ``dispatch_bwd`` leave K SMs;
* ``compute`` after each backend's te_ep layer (unless --no-compute-only):
  ``ComputeOnlyMoE``, the same MoE's router, experts, weighting and shared expert with
  dispatch and combine replaced by local stand-ins of the same shapes (``te.permute`` of
  this rank's tokens to its own experts into the te_ep layer's capacity and alignment,
  ``te.unpermute`` back), i.e. the layer's compute-only time; printed as ``exposed comm =
  te_ep time - compute-only time`` with its share of the te_ep step in %. Timed, not
  verified (its experts differ from the EP layer's).

``te.MoE`` replaces the testing block ``TeEpMoEBlock`` in this benchmark (that block stays
in te_ep_torch/testing for docs/tutorial.md and the tests). benchmarks/timeline.py builds
its layers with ``setup`` and ``make_moe`` below.

Execution modes (--modes, comma-separated; --compile and --cuda-graph add theirs), each
applied to every row alike, each row labelled with its mode; ``x native`` compares with
native in the same mode:

* ``eager`` (default): the modules as they are;
* ``compile``: ``torch.compile(layer, fullgraph=True)`` of each layer's module, as
  docs/moe.md ("torch.compile") documents for MoE (the compute-only stand-in too); backward
  through AOT autograd. Native cannot trace in one graph (``.tolist()`` and host split
  sizes), and compiled with graph breaks (``fullgraph=False``) its input and expert
  gradients came out wrong (torch 2.11, 2 CPU ranks): it is timed eager in this mode,
  labelled ``eager*``, and a printed line says so;
* ``graph`` (GPUs only): the whole forward + backward step captured once in a CUDA graph
  (``torch.cuda.graph`` after warm-up on a side stream) and replayed, one layer's graph at a
  time (captured, verified, timed, released: graphs alive side by side slow each other's
  replays); ``fwd ms`` and ``step GiB`` are not measured. Native's ``.tolist()`` host sync cannot be captured, nor a
  te_ep layer on the reference backend (routing planned on the host): those are timed eager
  in this mode, labelled ``eager*``, and a printed line says so.

Both layers use the same experts kernel family (--gemm: ``torch._grouped_mm`` where
te_ep_torch.moe.grouped_mm_supported says so, i.e. bf16 on SM 90+ with H and F multiples
of 8, else a loop: native's loops over its zones with host sizes, MoE's is its static-shape
``loop``), the same parameters (copied from the native block) and the same input. Default
shape: 8192 tokens per rank, hidden 4096, 64 experts, top-8, expert FFN size 1536 (SwiGLU:
gate and up H x 1536, down 1536 x H), bfloat16.

Before timing, each te_ep layer's output and gradients (input, router, the three expert
weights, the shared expert's three) are compared with the native block's, in every mode:
max |diff| and relative L2 error, worst rank; the run fails (exit 1) if the relative error
exceeds the dtype's tolerance.

A step is forward + backward of the layer on the same input with a fixed output
gradient. Each timed iteration starts after a barrier and a device
synchronisation and is timed with CUDA events; in the eager and compile modes the
layers take turns (each iteration times every layer once, in reverse order every
other iteration), so that a drift of the machine weighs on every row alike; in the
graph mode each layer's graph is captured, timed and released before the next one's
(one graph alive at a time). A row reports the median over iterations of the slowest
rank, the tokens per second per GPU that it means and its speedup over ``native``
(native time / row time). ``fwd ms`` times the
forward alone (autograd graph recorded, then dropped). ``step GiB`` (GPU only)
is the peak memory a step allocates on top of what was resident before it
with the previous step's gradients (activations, communication buffers; the step's
gradients take the place of those), worst rank, from one untimed step. ``--queued`` adds
``queued ms``, the step issued behind a 2 ms spin of the GPU and timed from the spin's end
(the GPU's own time, with the host ahead as in a training step that has work queued before
the layer), and ``host ms``, the host's wall time of the step's calls: a row whose ``fwd+bwd
ms`` exceeds its ``queued ms`` waited for its host path (Python, launches, synchronisations).

te_ep receive capacity: the layer's default (``EpGroup.worst_case_capacity``, which no
routing overflows) unless --capacity-headroom X (this run's routing, the same every step,
needs at most N padded rows on a rank: the handles get ceil(N * X) rows) or
--capacity-factor F (``enable_expert_parallel(capacity_factor=F)``).

``--device cpu`` runs tiny sizes on gloo with the reference backend: it tests
the script; its numbers mean nothing. NVLink multicast is never used:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
are the defaults.
"""

from __future__ import annotations

# _common first: it sets the environment NCCL reads when it initialises. Run as a script
# (python3 or torchrun), this folder is on the import path; imported (benchmarks/timeline.py
# and the tests import benchmarks.bench_moe_layer), the modules beside it are in its package.
if __package__:
    from . import _common
    from ._common import Column
else:
    import _common
    from _common import Column

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

import te_ep_torch as te
from te_ep_torch.moe import GROUPED_MM_ALIGNMENT
from te_ep_torch.testing.moe_blocks import (
    GEMMS,
    ComputeOnlyMoE,
    MoEConfig,
    NativeMoEBlock,
    copy_parameters_to_moe,
    fwd_bwd,
    moe_gradients,
    resolve_gemm,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative L2 error allowed between the two layers (outputs and every gradient).
# bf16: the native backward accumulates the gradient of the input in bf16
# (index_select's backward), te_ep in float32; bugs give errors of order 1.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# FP8 dispatch feeds the experts values rounded to 4 significant bits (relative error at
# most 2^-4, about 3.6% RMS); outputs and gradients then differ from native by a few percent.
FP8_TOLERANCE = 0.08
MODES = ("eager", "compile", "graph")

DEFAULTS = {
    # device: tokens, hidden, ffn, experts, top_k, dtype, warmup, iters
    "cuda": dict(tokens=8192, hidden=4096, ffn=1536, experts=64, top_k=8, dtype="bf16", warmup=10, iters=30),
    "cpu": dict(tokens=48, hidden=32, ffn=48, experts=8, top_k=2, dtype="fp32", warmup=1, iters=3),
}


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def _mode_list(text: str) -> List[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in MODES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return values


def _sms_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def has_chunks_option() -> bool:
    """Whether this te_ep_torch's EpOptions has the ``chunks`` field (--chunks N != 1 needs it)."""
    return "chunks" in {f.name for f in dataclasses.fields(te.EpOptions)}


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
    parser.add_argument("--alignment", type=int, default=None,
                        help="rows per expert zone are padded to a multiple of this, in both layers (default: "
                             "MoE's, 16 where the experts run torch._grouped_mm, else 1)")
    parser.add_argument("--gemm", choices=GEMMS, default="auto",
                        help="experts kernel of both layers (MoE's expert_impl): auto = grouped_mm where "
                             "te_ep_torch.moe.grouped_mm_supported (bf16, SM 90+), else loop")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-headroom", type=float, default=None,
                          help="te_ep capacity = this x the padded rows this run's routing needs on the busiest "
                               "rank (default: MoE's default capacity, the worst case)")
    capacity.add_argument("--capacity-factor", type=float, default=None,
                          help="te_ep layers enabled with capacity_factor=this (default: the worst case)")
    parser.add_argument("--modes", type=_mode_list, default=None,
                        help=f"execution modes, comma-separated subset of {','.join(MODES)} (default eager)")
    parser.add_argument("--compile", action="store_true", help="add the compile mode (torch.compile, fullgraph)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="add the graph mode (whole fwd+bwd step captured in a CUDA graph; GPUs only)")
    parser.add_argument("--chunks", type=_int_list, default=[1],
                        help="comma-separated chunk counts; each N != 1 adds a te_ep-chunksN row "
                             "(te.MoE with options=te.EpOptions(chunks=N)); default 1")
    parser.add_argument("--comm-sms", type=_sms_list, default=[0],
                        help="comma-separated SM counts the GEMMs beside the communication leave to it "
                             "(te.EpOptions(comm_sms=K)); each K != 0 adds a te_ep-chunksN-smsK row per N (and "
                             "te_ep-overlap-smsK with --overlap); default 0")
    parser.add_argument("--queued", action="store_true",
                        help="also time each step queued behind a spin of the GPU (its GPU time, the host ahead, "
                             "as in a training step with work queued before the layer: 'queued ms') and the "
                             "host's wall time of the step's calls ('host ms')")
    parser.add_argument("--warmup", type=int, help="untimed steps per measurement (default 10; cpu 1)")
    parser.add_argument("--iters", type=int, help="timed steps per measurement (default 30; cpu 3)")
    parser.add_argument("--no-compute-only", action="store_true",
                        help="skip the compute-only stand-in of each backend's te_ep layer (and the exposed-comm line)")
    parser.add_argument("--shared-ffn", type=int, default=0,
                        help="inner width of a shared SwiGLU expert in both layers (MoE's shared_expert_ffn_hidden; "
                             "0: none)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time each backend's MoE(overlap=True): dispatch/combine on a communication "
                             "stream, the shared expert overlapping them (te_ep-overlap rows)")
    parser.add_argument("--fp8", action="store_true",
                        help="also time each backend's MoE(dispatch_dtype='fp8') (te_ep-fp8 rows)")
    parser.add_argument("--nccl-ep-mode", default=te.DEFAULT_NCCL_EP_MODE, choices=["staged", "zero_copy", "auto"],
                        help="EpGroup(nccl_ep_mode=...) of the te_ep layers (run once per mode to compare them)")
    parser.add_argument("--checks", default="local", choices=["local", "device", "synchronous"],
                        help="EpGroup(checks=...) of the te_ep layers (docs/ops.md, 'Check modes')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend is None:
        args.backend = ["auto"] if args.device == "cuda" else ["reference"]
    args.backend = list(dict.fromkeys(args.backend))
    modes = list(args.modes or ["eager"])
    modes += [m for m, on in (("compile", args.compile), ("graph", args.cuda_graph)) if on and m not in modes]
    args.modes = [m for m in MODES if m in modes]
    if "graph" in args.modes and args.device != "cuda":
        parser.error("the graph mode (--cuda-graph, --modes graph) captures CUDA graphs: it needs --device cuda")
    if any(n != 1 for n in args.chunks) and not has_chunks_option():
        parser.error(f"--chunks {','.join(map(str, args.chunks))}: te.EpOptions of this te_ep_torch "
                     f"({te.__version__}, {os.path.dirname(te.__file__)}) has no 'chunks' field; only --chunks 1 runs")
    if args.alignment is not None and (args.alignment < 1 or args.alignment & (args.alignment - 1)):
        parser.error(f"--alignment must be a power of two, got {args.alignment}")
    if args.capacity_headroom is not None and args.capacity_headroom < 1.0:
        parser.error(f"--capacity-headroom must be >= 1, got {args.capacity_headroom}")
    if args.capacity_factor is not None and args.capacity_factor < 1.0:
        parser.error(f"--capacity-factor must be >= 1, got {args.capacity_factor}")
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be >= 0 and --iters >= 1")
    return args


def fit_capacity(block: NativeMoEBlock, x: torch.Tensor, args, group: te.EpGroup, alignment: int) -> int:
    """Receive rows for this run's routing on the busiest rank, times the headroom."""
    with torch.no_grad():
        _, topk_idx = block.route(x)
    counts = torch.bincount(topk_idx.flatten(), minlength=args.experts)
    dist.all_reduce(counts)
    a = alignment
    need = int(((counts + a - 1) // a * a).view(group.ep_size, -1).sum(1).max())
    # nccl_ep wants capacity >= max_tokens_per_rank.
    return max(args.tokens, math.ceil(need * args.capacity_headroom / a) * a)


class Setup(NamedTuple):
    """What every timed layer shares: the run's dtype, the MoE's defaults, the native block, the input."""

    dtype: torch.dtype
    normalize: bool  # te.MoE's router default: whether top-k weights are renormalised
    gemm: str  # the experts kernel family both layers use (resolve_gemm)
    alignment: int  # rows per expert zone are padded to a multiple of this
    native: NativeMoEBlock
    x: torch.Tensor
    grad_out: torch.Tensor


def setup(args, device: torch.device, rank: int) -> Setup:
    """The native block (whose parameters ``make_moe`` copies into each MoE), the input and the
    output gradient of a step (seeded by ``args.seed`` and ``rank``), from the sizes in ``args``
    (tokens, hidden, ffn, experts, top_k, dtype, shared_ffn, gemm, alignment, seed)."""
    dtype = DTYPES[args.dtype]
    # The MoE's defaults, read from the classes rather than restated: the router's weight
    # normalisation (softmax: off) and the zone alignment (16 under torch._grouped_mm, else 1).
    normalize = te.TopKRouter(args.hidden, args.experts, args.top_k, device="meta").normalize_weights
    gemm = resolve_gemm(args.gemm, device, dtype, args.hidden, args.ffn)
    alignment = args.alignment or (GROUPED_MM_ALIGNMENT if gemm == "grouped_mm" else 1)
    config = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k, dtype=dtype,
                       shared_ffn=args.shared_ffn, normalize_weights=normalize)
    gen = torch.Generator(device="cpu").manual_seed(10_000 + 7919 * args.seed + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_out = (torch.randn(args.tokens, args.hidden, generator=gen) * 0.1).to(device=device, dtype=dtype)
    native = NativeMoEBlock(config, device=device, alignment=alignment, gemm=args.gemm, seed=args.seed)
    return Setup(dtype, normalize, gemm, alignment, native, x, grad_out)


def make_moe(args, group: te.EpGroup, native: NativeMoEBlock, dtype: torch.dtype, *, fp8: bool = False,
             overlap: bool = False, chunks: int = 1, comm_sms: int = 0,
             handle: Optional[Dict[str, object]] = None) -> te.MoE:
    """``te.MoE`` as a user builds it (default arguments but the bench's sizes and options),
    this rank's experts kept, expert parallelism enabled over ``group``, the native block's
    parameters copied in."""
    moe = te.MoE(args.hidden, args.ffn, args.experts, args.top_k, shared_expert_ffn_hidden=args.shared_ffn,
                 expert_impl=args.gemm, alignment=args.alignment, dispatch_dtype="fp8" if fp8 else None,
                 overlap=overlap, dtype=dtype, device=group.device)
    # What enable_expert_parallel takes: this rank's E / W experts (plain tensors; ExpertParallel
    # with src_data_rank=None keeps the same slice, as Shard(0) DTensors).
    first, local = group.rank * group.num_local_experts, group.num_local_experts
    for name in ("w_gate", "w_up", "w_down"):
        w = getattr(moe.experts, name)
        setattr(moe.experts, name, torch.nn.Parameter(w.detach()[first : first + local].clone()))
    handle = dict(handle or {})
    if chunks != 1:  # only then: EpOptions(chunks=...) needs a te_ep_torch that has the field
        moe.enable_expert_parallel(group, options=te.EpOptions(chunks=chunks, **handle,
                                                               **({"comm_sms": comm_sms} if comm_sms else {})))
    else:
        moe.enable_expert_parallel(group, **handle)
    copy_parameters_to_moe(native, moe)
    return moe


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


def describe(args, world: int, device: torch.device, dtype: torch.dtype, alignment: int, normalize: bool) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo; numbers mean nothing)"
    lines = [
        f"{world} x {where}, torch {torch.__version__}, te_ep_torch {te.__version__}",
        f"MoE layer: tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} (SwiGLU) experts={args.experts} "
        f"top_k={args.top_k} shared_ffn={args.shared_ffn} dtype={str(dtype).replace('torch.', '')} "
        f"alignment={alignment} router: softmax, normalize_weights={normalize} (te.MoE's default)",
        f"modes: {', '.join(args.modes)}; step = forward + backward; median of {args.iters} timed steps after "
        f"{args.warmup} warmup, slowest rank",
    ]
    if device.type == "cuda":
        lines.append(", ".join(f"{name}={os.environ.get(name)}" for name, _ in _common.MULTICAST_OFF))
    return "\n".join(lines)


COLUMNS = [
    Column("block", "<15", "block"), Column("mode", "<8", "mode"), Column("backend", "<10", "backend"),
    Column("gemm", "<10", "gemm"), Column("capacity", ">9", "capacity"), Column("fwd ms", ">8", "fwd_ms", ".3f"),
    Column("fwd+bwd ms", ">11", "step_ms", ".3f"), Column("tokens/s/GPU", ">13", "tokens_per_s_per_gpu", ",.0f"),
    Column("x native", ">9", "speedup", ".2f"), Column("fwd x", ">6", "fwd_speedup", ".2f"),
    Column("step GiB", ">9", "step_GiB", ".2f"),
]

# --queued: the step issued behind a spin of the GPU (_common.QUEUE_AHEAD_MS), timed from the
# spin's end (the GPU's time with the host ahead), and the host's wall time of the step's calls.
QUEUED_COLUMNS = [Column("queued ms", ">10", "queued_ms", ".3f"), Column("host ms", ">8", "host_ms", ".3f")]


class Layer(NamedTuple):
    """One timed layer: its row name, backend, the module, what to verify it with."""

    name: str
    backend: str
    module: torch.nn.Module
    capacity: Optional[int]
    gemm: str
    tolerance: Optional[float]  # None: not verified (native itself, the compute-only stand-in)
    capturable: bool  # whether its step can be captured in a CUDA graph (no host sync)


class Runner(NamedTuple):
    """A layer in one mode: the step (forward + backward), the forward alone (None: not
    timed), the gradient reset before each call, and the first step's results."""

    mode: str
    step: Callable[[], object]
    forward: Optional[Callable[[], object]]
    before: Optional[Callable[[], object]]
    results: Callable[[], Dict[str, torch.Tensor]]
    release: Callable[[], None]


def _gradients(layer: Layer, native: NativeMoEBlock, out: torch.Tensor, leaf: torch.Tensor) -> Dict[str, torch.Tensor]:
    result = {"output": out.detach(), "grad x": leaf.grad}
    if isinstance(layer.module, te.MoE):
        result.update(moe_gradients(layer.module, native))
    elif isinstance(layer.module, NativeMoEBlock):
        for name, p in layer.module.named_parameters():
            result[f"grad {name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return result


def runner(mode: str, layer: Layer, native: NativeMoEBlock, x: torch.Tensor, grad_out: torch.Tensor,
           warmup: int, notes: List[str]) -> Runner:
    """``layer`` ready to time in ``mode`` (may fall back, noting why in ``notes``)."""
    module = layer.module
    leaf = x.detach().clone().requires_grad_()

    def reset():
        leaf.grad = None
        for p in module.parameters():
            p.grad = None

    def first_step(fn):
        def results():
            reset()
            out = fn(leaf)
            out.backward(grad_out)
            return _gradients(layer, native, out, leaf)
        return results

    def eager_runner(label, fn):
        return Runner(label, lambda: fn(leaf).backward(grad_out), lambda: fn(leaf), reset, first_step(fn),
                      lambda: None)

    if mode == "eager":
        return eager_runner("eager", module)
    if mode == "compile":
        if isinstance(module, NativeMoEBlock):
            notes.append(f"{layer.name}: torch.compile(fullgraph=True) cannot trace it (.tolist() split sizes on "
                         "the host, all_to_all_single with host splits), and compiled with graph breaks "
                         "(fullgraph=False) its input and expert gradients came out wrong (torch 2.11, CPU): timed "
                         "eager in the compile mode (eager*)")
            return eager_runner("eager*", module)
        return eager_runner("compile", torch.compile(module, fullgraph=True))
    # graph
    if not layer.capturable:
        why = ("its .tolist() host sync" if isinstance(module, NativeMoEBlock)
               else f"the {layer.backend} backend's host-side routing")
        notes.append(f"{layer.name}[{layer.backend}]: not capturable in a CUDA graph ({why}): timed eager in the "
                     "graph mode (eager*)")
        return eager_runner("eager*", module)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Autograd's and te_ep's lazily made state (workspaces, the comm stream) exists before capture.
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 3)):
            reset()
            module(leaf).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module(leaf)
        static_out.backward(grad_out)
    graph.replay()
    captured = _gradients(layer, native, static_out, leaf)
    state = {"graph": graph}
    del graph

    def release():
        state.clear()  # the graph holds NCCL resources that the group's shutdown frees

    return Runner("graph", lambda: state["graph"].replay(), None, None, lambda: captured, release)


def _step_gib(run: Runner, device: torch.device) -> float:
    """The peak memory one step adds to what is resident with the previous step's gradients
    (GiB, worst rank): activations and communication buffers; the step's gradients take the
    place of the previous ones (``run.before`` drops those as a training loop's zero_grad does)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    if run.before is not None:
        run.before()
    run.step()
    torch.cuda.synchronize(device)
    value = torch.tensor([(torch.cuda.max_memory_allocated(device) - resident) / 2**30], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(runs: List[Runner], args, device: torch.device) -> List[Tuple[Optional[float], _common.Timing]]:
    """``(forward ms or None, step timing)`` of each of ``runs``, timed in turns."""
    steps = _common.interleaved_median_ms([_common.Call(r.step, r.before) for r in runs], device, args.warmup,
                                          args.iters, ranks=True, queued=args.queued)
    with_forward = [i for i, r in enumerate(runs) if r.forward is not None]
    forwards = _common.interleaved_median_ms([_common.Call(runs[i].forward, runs[i].before) for i in with_forward],
                                             device, args.warmup, args.iters, ranks=True) if with_forward else []
    fwd: List[Optional[float]] = [None] * len(runs)
    for i, timing in zip(with_forward, forwards):
        fwd[i] = timing.ms
    return list(zip(fwd, steps))


def _row(args, world: int, alignment: int, mode: str, layer: Layer, run: Runner, gib: Optional[float],
         fwd: Optional[float], timing: _common.Timing) -> Dict:
    return {
        "block": layer.name, "mode": run.mode, "backend": layer.backend, "gemm": layer.gemm,
        "capacity": layer.capacity if layer.capacity else "-", "world": world, "tokens": args.tokens,
        "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "top_k": args.top_k,
        "shared_ffn": args.shared_ffn, "dtype": args.dtype, "alignment": alignment,
        "fwd_ms": fwd, "step_ms": timing.ms, "tokens_per_s_per_gpu": args.tokens / (timing.ms * 1e-3),
        "step_GiB": gib, "_mode": mode,
        **({"queued_ms": timing.queued_ms, "host_ms": timing.host_ms} if args.queued else {}),
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = _common.init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be divisible by the number of ranks ({world})")
    if args.fp8 and args.hidden % 128:
        raise SystemExit(f"--fp8: MoE's FP8 dispatch needs --hidden to be a multiple of 128, got {args.hidden}")
    dtype, normalize, _, alignment, native, x, grad_out = setup(args, device, rank)
    if rank == 0:
        print(describe(args, world, device, dtype, alignment, normalize), flush=True)
    reference = fwd_bwd(native, x, grad_out)

    layers = [Layer("native", "-", native, None, native.gemm, None, False)]
    groups, seen = [], set()
    for backend in args.backend:
        group = te.EpGroup(num_experts=args.experts, max_tokens_per_rank=args.tokens, backend=backend, device=device,
                           nccl_ep_mode=args.nccl_ep_mode, checks=args.checks)
        if group.backend in seen:
            if rank == 0:
                print(f"\n--backend {backend} resolves to {group.backend}, already measured", flush=True)
            group.shutdown()
            continue
        seen.add(group.backend)
        groups.append(group)
        if args.capacity_headroom is not None:
            handle = {"capacity": fit_capacity(native, x, args, group, alignment)}
        elif args.capacity_factor is not None:
            handle = {"capacity_factor": args.capacity_factor}
        else:
            handle = {}
        capturable = group.backend != "reference"  # the reference backend plans routing on the host
        tol = TOLERANCE[dtype]
        te_ep = make_moe(args, group, native, dtype, handle=handle)
        capacity = te_ep.handles[dtype].config.capacity
        variants = [("te_ep", te_ep, tol)]
        if capacity != group.worst_case_capacity(args.top_k, alignment):
            # What a user gets without sizing the buffer (the default capacity, the worst case).
            variants.append(("te_ep-default", make_moe(args, group, native, dtype), tol))
        if args.overlap:
            for sms in args.comm_sms:
                variants.append(("te_ep-overlap" + (f"-sms{sms}" if sms else ""),
                                 make_moe(args, group, native, dtype, overlap=True, comm_sms=sms, handle=handle), tol))
        if args.fp8:
            variants.append(("te_ep-fp8", make_moe(args, group, native, dtype, fp8=True, handle=handle),
                             FP8_TOLERANCE))
        for n in args.chunks:
            for sms in args.comm_sms if n != 1 else ():
                variants.append((f"te_ep-chunks{n}" + (f"-sms{sms}" if sms else ""),
                                 make_moe(args, group, native, dtype, chunks=n, comm_sms=sms, handle=handle), tol))
        for name, moe, tolerance in variants:
            layers.append(Layer(name, group.backend, moe, moe.handles[dtype].config.capacity,
                                moe.experts.resolved_impl(device, dtype), tolerance, capturable))
        if not args.no_compute_only:
            layers.append(Layer("compute", group.backend, ComputeOnlyMoE(te_ep, capacity=capacity), capacity,
                                te_ep.experts.resolved_impl(device, dtype), None, True))

    peak = device.type == "cuda"
    verify_ok = True
    rows, notes = [], []
    for mode in args.modes:
        if rank == 0:
            print(f"\n{mode}: every layer verified, then " + (
                "each timed alone, its captured graph released before the next layer's is captured" if mode == "graph"
                else "all timed in turns (each iteration times every layer once)"), flush=True)
        # A captured graph is timed and released before the next is captured: several alive slow
        # each other's replays (measured at EP size 1: te.MoE 16.9 ms with five other graphs alive,
        # 14.0 alone), and a graph holds NCCL resources the groups' shutdown frees. Eager and
        # compiled layers are timed in turns, so that a drift of the machine weighs on every row
        # alike and the ratios to native hold it out.
        ready: List[Tuple[Layer, Runner, Optional[float]]] = []
        for layer in layers:
            run = runner(mode, layer, native, x, grad_out, args.warmup, notes)
            got = run.results()  # also the untimed first call (compilation) of the layer
            if layer.tolerance is not None:
                if rank == 0:
                    print(f"\nverify {layer.name}[{layer.backend}, {run.mode}] vs native (relative L2 tolerance "
                          f"{layer.tolerance:g}, worst rank):", flush=True)
                for what, (max_abs, rel) in compare(reference, got, device).items():
                    ok = rel <= layer.tolerance
                    verify_ok &= ok
                    if rank == 0:
                        print(f"  {what:<14} max|diff| {max_abs:.3e}  rel L2 {rel:.3e}  {'ok' if ok else 'MISMATCH'}")
            got = None  # its gradients would stay resident next to the measured step's and count in its peak
            ready.append((layer, run, _step_gib(run, device) if peak and run.mode != "graph" else None))
            if mode == "graph":
                gib = ready.pop()[2]
                rows.append(_row(args, world, alignment, mode, layer, run, gib, *_timed([run], args, device)[0]))
                run.release()
            run = None
        if ready:
            for (layer, run, gib), timed in zip(ready, _timed([r for _, r, _ in ready], args, device)):
                rows.append(_row(args, world, alignment, mode, layer, run, gib, *timed))
                run.release()
            ready = []

    exposed = []
    for mode in args.modes:
        in_mode = [row for row in rows if row["_mode"] == mode]
        base_native = in_mode[0]
        for row in in_mode:
            row["speedup"] = base_native["step_ms"] / row["step_ms"]
            row["fwd_speedup"] = (base_native["fwd_ms"] / row["fwd_ms"]
                                  if row["fwd_ms"] is not None and base_native["fwd_ms"] is not None else None)
        # Exposed communication: the te_ep layer's time minus that of its compute-only stand-in.
        compute = {row["backend"]: row for row in in_mode if row["block"] == "compute"}
        for row in in_mode:
            if row["block"].startswith("te_ep") and row["backend"] in compute:
                base = compute[row["backend"]]
                row["exposed_comm_ms"] = row["step_ms"] - base["step_ms"]
                row["exposed_comm_pct"] = 100 * row["exposed_comm_ms"] / row["step_ms"]
                fwd = ""
                if row["fwd_ms"] is not None and base["fwd_ms"] is not None:
                    row["exposed_comm_fwd_ms"] = row["fwd_ms"] - base["fwd_ms"]
                    fwd = f", fwd {row['exposed_comm_fwd_ms']:.3f} ms"
                exposed.append(f"exposed comm {row['block']}[{row['backend']}, {row['mode']}] = te_ep time - "
                               f"compute-only time: fwd+bwd {row['step_ms']:.3f} - {base['step_ms']:.3f} = "
                               f"{row['exposed_comm_ms']:.3f} ms ({row['exposed_comm_pct']:.1f}% of the te_ep step; "
                               f"layer / compute-only = {row['step_ms'] / base['step_ms']:.2f}x){fwd}")
    for row in rows:
        del row["_mode"]

    if rank == 0:
        print()
        _common.print_table(COLUMNS + (QUEUED_COLUMNS if args.queued else []), rows)
        print("x native = native time / row time in the same mode, forward + backward ('fwd x': forward alone); "
              "step GiB = peak memory a step adds to what is resident (worst rank)")
        for line in dict.fromkeys(notes):
            print(f"note: {line}")
        for line in exposed:
            print(line)
        if not verify_ok:
            print("VERIFICATION FAILED: a te_ep layer does not match the native block (see above)")
        if args.csv:
            _common.write_csv(args.csv, rows)
    del layers
    for group in groups:
        group.shutdown()
    _common.close_distributed()
    return 0 if verify_ok else 1


if __name__ == "__main__":
    sys.exit(main())
