"""What the GPU does during one MoE layer step: which stream runs what, when, and how much of
the communication overlaps compute.

    # 1. on the GPUs: profile 3 forward + backward steps of te.MoE, one Chrome trace per rank
    torchrun --nproc-per-node=2 benchmarks/timeline.py record --out-dir traces/c2 --chunks 2
    # 2. anywhere (no torch needed): overlap, idle time and queue delays per step, medians
    python3 benchmarks/timeline.py overlap traces/c1/rank0.json traces/c2/rank0.json [--csv out.csv]
    # 2b. where the GPU idles, and which host calls it waited for
    python3 benchmarks/timeline.py gaps traces/c1/rank0.json
    # 3. anywhere with matplotlib: draw one step's GPU streams
    python3 benchmarks/timeline.py plot traces/c2/rank0.json --out timeline.png

``record`` builds the layer users import, ``te.MoE``, with bench_moe_layer.py's builders
(``setup`` and ``make_moe``: default arguments but the sizes given here, this rank's experts,
``enable_expert_parallel`` over all ranks; the same defaults as that benchmark: 8192 tokens
per rank, hidden 4096, ffn 1536, 64 experts, top-8, bf16; tiny sizes with ``--cpu``).
``--chunks N`` enables it with ``te.EpOptions(chunks=N)``, ``--overlap`` builds
``te.MoE(overlap=True)``, ``--compute-only`` times bench_moe_layer's compute-only stand-in
(``ComputeOnlyMoE``: the same router, experts and weighting, no communication);
``--compile`` wraps the layer in ``torch.compile(fullgraph=True)`` (bench_moe_layer's compile
mode) and ``--graph`` replays the step captured in a CUDA graph.
``--sm-carveout K`` calls ``torch._C._set_sm_carveout_experimental(K)`` before the warm-up,
so that torch's persistent GEMMs (``torch._grouped_mm`` included) leave K SMs free for
kernels on other streams. After ``--warmup`` steps it profiles ``--steps`` steps (default 3)
with ``torch.profiler``, each after a barrier and a device synchronisation and inside
``record_function("te_ep_step <i>")``, writes each rank's Chrome trace to
``OUT_DIR/rank<r>.json`` (the run's configuration and its step times under the trace's
``te_ep_timeline`` key) and prints on rank 0 each step's time from CUDA events around it
(wall clock on CPU), rank 0's and the slowest rank's, and the median of as many steps timed
the same way just before, without the profiler (what the profiler costs). ``--cpu`` (gloo,
reference backend) tests the script; its traces have host events only.

``overlap`` reads traces (one per rank, or one per configuration) and cuts each into its
profiled steps: a GPU operation (kernel, copy, memset) belongs to the step whose
``te_ep_step`` range holds the host call that launched it (the runtime or driver event with
the kernel's ``args.correlation``; a trace without those ranges is one step). Per step, in
ms unless named otherwise, then the median over steps:

* ``GPU span``: first start to last end of the step's GPU operations; ``host range``: the
  ``record_function`` range on the host;
* ``idle``: time in the span when no operation runs on any stream; ``>=2 streams busy``:
  time when operations run on two streams or more;
* ``comm busy``: time when some communication kernel runs; of it, ``exposed comm`` when
  no other operation (GEMM, te_ep, other) runs on any stream, ``overlapped comm`` when one
  does (so exposed + overlapped = comm busy);
* kernel time by kind (the sum of the durations: a GEMM that slows down under overlap
  shows here), and each stream's busy time;
* communication kernels' ``queue delay``: from the start of the host call that launched
  the kernel to the kernel's start on the GPU (median), and how long they waited after
  being launched and their stream free (all earlier work of their stream done): the sum
  per step, and the part of it during which a non-communication operation ran on another
  stream. A kernel cannot start while a persistent GEMM holds every SM, nor before an event
  it waits for (e.g. the experts of its chunk), so this wait counts both. A kernel whose
  launch is not in the trace has no delays (``-``).

Kinds, by kernel name: ``te_ep`` (te_ep's own kernels, including those next to NCCL EP),
``communication`` (NCCL and NCCL EP: ``nccl``, ``ncclEp``, ``nccl_ep``, and names with a
``ht_`` / ``ll_`` word: NCCL EP's high-throughput and low-latency kernels), ``GEMM``
(``gemm``, ``GemmUniversal``, ``cutlass``, ``sm90``, ``xmma``, ``nvjet``, ``cublas``,
``grouped``: cuBLAS and ``torch._grouped_mm``'s CUTLASS kernels), ``other``. It then lists
each trace's top kernels by time per step (count, mean duration, grid size: a persistent
GEMM's grid follows the SMs it may use, so a carve-out shows there) and the communication
kernels' delays. ``--csv`` writes
every step's numbers and the medians.

``gaps`` lists where the GPU idles in each trace's median step (by GPU span): every stretch of
at least ``--min-us`` with no operation on any stream, the operations before and after it, how
much of it came before the next operation was even launched (``late``: the host was behind:
Python, the dispatcher, an allocation, a synchronisation), and the host calls (``cpu_op``
ranges of the launching thread, the autograd engine's included) around that launch; and the
idle time summed by those host calls.

``plot`` draws one profiled step (``--step``, default the median by GPU span) as one lane per
CUDA stream, coloured by kind.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import csv
import gzip
import json
import os
import re
import statistics
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

Lane = List[Tuple[float, float, str]]  # (start us, duration us, kernel name)

STEP_RANGE = "te_ep_step"
_STEP_NAME = re.compile(r"^te_ep_step (\d+)$")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
COMM = "communication"

# First match wins, on the lower-cased name: te_ep's own kernels (namespace te_ep, including
# those next to NCCL EP), then NCCL and NCCL EP (nccl_ep::..., ncclEp..., its JIT entry points
# nccl_ep_jit_ht_*; ht_ep::/ll_ep:: kernels: ht_/ll_ starting a word, so that "weight_" or
# "fill_" do not count), then GEMMs (cuBLAS: nvjet/xmma/cublas; torch._grouped_mm: CUTLASS's
# GemmUniversal).
KIND_PATTERNS = (
    ("te_ep", re.compile(r"te_ep")),
    (COMM, re.compile(r"nccl|(?<![a-z0-9])(?:ht|ll)_")),
    ("GEMM", re.compile(r"gemm|sm90|sm100|cutlass|grouped|xmma|nvjet|cublas")),
)
KINDS = ("communication", "GEMM", "te_ep", "other")
COLORS = {"communication": "#d62728", "GEMM": "#1f77b4", "te_ep": "#2ca02c", "other": "#7f7f7f"}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KIND_PATTERNS:
        if pattern.search(low):
            return kind
    return "other"


# ---------------------------------------------------------------------------------------------
# Reading a trace
# ---------------------------------------------------------------------------------------------


class Op(NamedTuple):
    """One GPU operation of a trace, times in microseconds (the trace's clock)."""

    start: float
    end: float
    stream: int
    name: str
    kind: str
    launch: Optional[float]  # start of the host call that launched it (None: not in the trace)
    grid: Optional[int]  # blocks of a kernel (x * y * z)
    corr: Optional[int] = None  # the trace's correlation id of its launch


class Step(NamedTuple):
    """A profiled step: its name, its host range (None: the whole trace) and its GPU operations."""

    name: str
    host: Optional[Tuple[float, float]]
    ops: List[Op]


def load_trace(path: str) -> Dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def _events(trace) -> List[Dict]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def launch_calls(trace) -> Dict[int, Tuple[float, object]]:
    """``{correlation id: (start, thread)}`` of the host calls that launched GPU operations."""
    launches: Dict[int, Tuple[float, object]] = {}
    for e in _events(trace):
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            corr, ts = int(e["args"]["correlation"]), float(e["ts"])
            # Where several host events share an id, the launch call itself (cudaLaunchKernel,
            # cuLaunchKernelEx, cudaMemcpyAsync ...) is the last; keep the earliest start.
            if corr not in launches or ts < launches[corr][0]:
                launches[corr] = (ts, e.get("tid"))
    return launches


def gpu_ops(trace) -> List[Op]:
    """The trace's kernels, copies and memsets, by start time, each with the start of the host
    call that launched it (linked by ``args.correlation``)."""
    events = _events(trace)
    launches = {corr: ts for corr, (ts, _) in launch_calls(trace).items()}
    ops = []
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES or "stream" not in args:
            continue
        start = float(e["ts"])
        name = str(e.get("name", ""))
        corr = args.get("correlation")
        grid = args.get("grid")
        blocks = None
        if isinstance(grid, (list, tuple)) and grid:
            blocks = 1
            for g in grid:
                blocks *= int(g)
        ops.append(Op(start, start + float(e.get("dur", 0.0)), int(args["stream"]), name, kind_of(name),
                      launches.get(int(corr)) if corr is not None else None, blocks,
                      int(corr) if corr is not None else None))
    ops.sort(key=lambda op: (op.start, op.end))
    return ops


def step_ranges(trace, category: str = "user_annotation") -> List[Tuple[int, float, float]]:
    """``(index, start, end)`` of each ``te_ep_step <i>`` range of the trace, by index."""
    out = []
    for e in _events(trace):
        if e.get("ph") == "X" and e.get("cat") == category:
            m = _STEP_NAME.match(str(e.get("name", "")))
            if m:
                out.append((int(m.group(1)), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return sorted(out)


def _find(ranges: Sequence[Tuple[int, float, float]], t: float) -> Optional[int]:
    """Position in ``ranges`` (sorted, disjoint) of the range holding ``t``."""
    i = bisect.bisect_right([r[1] for r in ranges], t) - 1
    if i >= 0 and t <= ranges[i][2]:
        return i
    return None


def steps_from_trace(trace) -> List[Step]:
    """The profiled steps of a trace. A GPU operation belongs to the step whose host range
    holds the start of its launch call; one without a launch in the trace, to the step whose
    GPU-side range (``gpu_user_annotation``) or else host range holds its start. A trace
    without ``te_ep_step`` ranges is one step, ``all``."""
    ops = gpu_ops(trace)
    ranges = sorted(step_ranges(trace), key=lambda r: r[1])
    if not ranges:
        return [Step("all", None, ops)]
    gpu_ranges = {i: (s, e) for i, s, e in step_ranges(trace, "gpu_user_annotation")}
    by_gpu = sorted(((i, s, e) for i, (s, e) in gpu_ranges.items()), key=lambda r: r[1])
    steps = [Step(f"{STEP_RANGE} {i}", (s, e), []) for i, s, e in ranges]
    position = {i: k for k, (i, _, _) in enumerate(ranges)}
    for op in ops:
        k = _find(ranges, op.launch) if op.launch is not None else None
        if op.launch is None:
            g = _find(by_gpu, op.start)
            k = position.get(by_gpu[g][0]) if g is not None else _find(ranges, op.start)
        if k is not None:
            steps[k].ops.append(op)
    return sorted(steps, key=lambda s: int(s.name.split()[-1]))


# ---------------------------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------------------------


def merge(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of ``[start, end)`` intervals as sorted disjoint intervals."""
    out: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def covered(merged: Sequence[Tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end)`` covered by the sorted disjoint intervals ``merged``."""
    total = 0.0
    i = max(bisect.bisect_right([m[0] for m in merged], start) - 1, 0)
    for s, e in merged[i:]:
        if s >= end:
            break
        total += max(0.0, min(e, end) - max(s, start))
    return total


def busy_us(lane: Lane) -> float:
    """Time the stream runs something (overlapping events counted once)."""
    return sum(e - s for s, e in merge((start, start + dur) for start, dur, _ in lane))


# ---------------------------------------------------------------------------------------------
# Per-step analysis
# ---------------------------------------------------------------------------------------------


class CommWait(NamedTuple):
    """A communication kernel's waits, microseconds."""

    name: str
    queue: Optional[float]  # launch call start -> kernel start (None: no launch in the trace)
    blocked: Optional[float]  # launched and its stream free -> kernel start
    blocked_under_other: Optional[float]  # the part of ``blocked`` while a non-comm op ran elsewhere


def comm_waits(ops: Sequence[Op]) -> List[CommWait]:
    """For each communication kernel of ``ops`` (one step), how long it waited (see CommWait)."""
    others = merge((op.start, op.end) for op in ops if op.kind != COMM)
    free_at: Dict[int, float] = {}  # stream -> end of its work so far
    out = []
    for op in sorted(ops, key=lambda o: (o.start, o.end)):
        stream_free = free_at.get(op.stream, float("-inf"))
        free_at[op.stream] = max(stream_free, op.end)
        if op.kind != COMM:
            continue
        if op.launch is None:
            out.append(CommWait(op.name, None, None, None))
            continue
        ready = max(op.launch, stream_free)
        blocked = max(0.0, op.start - ready)
        under = covered(others, ready, op.start) if blocked > 0 else 0.0
        out.append(CommWait(op.name, op.start - op.launch, blocked, under))
    return out


def step_metrics(step: Step) -> Dict[str, Optional[float]]:
    """One step's numbers (ms; ``comm_queue_median_us`` in us); the GPU ones None where the step
    has no GPU operation."""
    ops = [op for op in step.ops if op.end >= op.start]
    m: Dict[str, Optional[float]] = {
        "gpu_ops": float(len(ops)),
        "host_ms": (step.host[1] - step.host[0]) / 1e3 if step.host else None,
    }
    gpu_keys = ["span_ms", "idle_ms", "multi_stream_ms", "comm_busy_ms", "exposed_comm_ms", "overlapped_comm_ms",
                "overlapped_comm_pct"] + [f"kernel_{k}_ms" for k in KINDS] + [
                "comm_queue_median_us", "comm_blocked_ms", "comm_blocked_under_other_ms"]
    if not ops:
        m.update(dict.fromkeys(gpu_keys))
        return m
    # Sweep the step's time once: between two consecutive boundaries nothing starts or ends.
    bounds: List[Tuple[float, int, Op]] = []
    for op in ops:
        if op.end > op.start:
            bounds += [(op.start, 1, op), (op.end, -1, op)]
    bounds.sort(key=lambda b: b[0])
    n_comm = n_other = 0
    per_stream: Dict[int, int] = collections.Counter()
    idle = multi = exposed = overlapped = 0.0
    first = min(op.start for op in ops)
    last = max(op.end for op in ops)
    prev = first
    i = 0
    while i < len(bounds):
        t = bounds[i][0]
        length = t - prev
        if length > 0:
            if n_comm == 0 and n_other == 0:
                idle += length
            elif n_other == 0:
                exposed += length
            elif n_comm > 0:
                overlapped += length
            if sum(1 for c in per_stream.values() if c > 0) >= 2:
                multi += length
        while i < len(bounds) and bounds[i][0] == t:
            _, delta, op = bounds[i]
            if op.kind == COMM:
                n_comm += delta
            else:
                n_other += delta
            per_stream[op.stream] += delta
            i += 1
        prev = t
    idle += last - prev  # after the last end of a kernel with a duration (a zero-length one may end the span)
    comm_busy = exposed + overlapped
    m.update({
        "span_ms": (last - first) / 1e3,
        "idle_ms": idle / 1e3,
        "multi_stream_ms": multi / 1e3,
        "comm_busy_ms": comm_busy / 1e3,
        "exposed_comm_ms": exposed / 1e3,
        "overlapped_comm_ms": overlapped / 1e3,
        "overlapped_comm_pct": 100 * overlapped / comm_busy if comm_busy > 0 else None,
    })
    for kind in KINDS:
        m[f"kernel_{kind}_ms"] = sum(op.end - op.start for op in ops if op.kind == kind) / 1e3
    waits = [w for w in comm_waits(ops) if w.queue is not None]
    m["comm_queue_median_us"] = statistics.median(w.queue for w in waits) if waits else None
    m["comm_blocked_ms"] = sum(w.blocked for w in waits) / 1e3 if waits else None
    m["comm_blocked_under_other_ms"] = sum(w.blocked_under_other for w in waits) / 1e3 if waits else None
    lanes = collections.defaultdict(list)
    for op in ops:
        lanes[op.stream].append((op.start, op.end))
    for stream in sorted(lanes):
        m[f"stream_{stream}_busy_ms"] = sum(e - s for s, e in merge(lanes[stream])) / 1e3
    return m


def median_metrics(per_step: Sequence[Dict[str, Optional[float]]]) -> Dict[str, Optional[float]]:
    """Each number's median over the steps that have it (None where none has)."""
    keys = list(dict.fromkeys(k for m in per_step for k in m))
    out: Dict[str, Optional[float]] = {}
    for key in keys:
        values = [m[key] for m in per_step if m.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


class KernelStats(NamedTuple):
    name: str
    kind: str
    total_ms: float  # per step, median over steps
    count: float  # per step, median over steps
    mean_us: float  # over every instance
    grid: Optional[int]  # most common grid size (blocks)


def top_kernels(steps: Sequence[Step], top: int = 15) -> List[KernelStats]:
    """The ``top`` names by time per step (the median over steps of each name's total)."""
    per_step: Dict[str, List[Tuple[float, int]]] = collections.defaultdict(list)
    durations: Dict[str, List[float]] = collections.defaultdict(list)
    grids: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for step in steps:
        totals: Dict[str, List[float]] = collections.defaultdict(list)
        for op in step.ops:
            totals[op.name].append(op.end - op.start)
            durations[op.name].append(op.end - op.start)
            if op.grid is not None:
                grids[op.name][op.grid] += 1
        for name in durations:
            per_step[name].append((sum(totals.get(name, ())), len(totals.get(name, ()))))
    n = len(steps)
    out = []
    for name, samples in per_step.items():
        samples = samples + [(0.0, 0)] * (n - len(samples))  # steps before its first run
        out.append(KernelStats(name, kind_of(name), statistics.median(s[0] for s in samples) / 1e3,
                               statistics.median(s[1] for s in samples), statistics.fmean(durations[name]),
                               grids[name].most_common(1)[0][0] if grids[name] else None))
    out.sort(key=lambda k: (-k.total_ms, k.name))
    return out[:top]


class CommDelay(NamedTuple):
    name: str
    count: float  # per step, median over steps
    queue_median_us: Optional[float]
    queue_max_us: Optional[float]
    blocked_median_us: Optional[float]
    under_other_median_us: Optional[float]


def comm_delays(steps: Sequence[Step]) -> List[CommDelay]:
    """Per communication kernel name, its waits over every profiled step."""
    waits: Dict[str, List[CommWait]] = collections.defaultdict(list)
    for step in steps:
        for w in comm_waits(step.ops):
            waits[w.name].append(w)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = []
    for name, ws in waits.items():
        queues = [w.queue for w in ws if w.queue is not None]
        out.append(CommDelay(name, len(ws) / max(len(steps), 1), med(queues), max(queues) if queues else None,
                             med(w.blocked for w in ws), med(w.blocked_under_other for w in ws)))
    out.sort(key=lambda d: -(d.queue_median_us or 0.0))
    return out


# ---------------------------------------------------------------------------------------------
# The overlap report
# ---------------------------------------------------------------------------------------------

ROWS = (
    ("steps", "steps", "{:.0f}"),
    ("step_ms", "step ms (record's timer, this rank)", "{:.3f}"),
    ("unprofiled_step_ms", "  same, without the profiler", "{:.3f}"),
    ("host_ms", "host range ms", "{:.3f}"),
    ("span_ms", "GPU span ms", "{:.3f}"),
    ("idle_ms", "idle ms (no op on any stream)", "{:.3f}"),
    ("multi_stream_ms", ">=2 streams busy ms", "{:.3f}"),
    ("comm_busy_ms", "comm busy ms", "{:.3f}"),
    ("exposed_comm_ms", "  exposed comm ms", "{:.3f}"),
    ("overlapped_comm_ms", "  overlapped comm ms", "{:.3f}"),
    ("overlapped_comm_pct", "  overlapped share %", "{:.1f}"),
    ("kernel_communication_ms", "kernel ms: communication", "{:.3f}"),
    ("kernel_GEMM_ms", "kernel ms: GEMM", "{:.3f}"),
    ("kernel_te_ep_ms", "kernel ms: te_ep", "{:.3f}"),
    ("kernel_other_ms", "kernel ms: other", "{:.3f}"),
    ("comm_queue_median_us", "comm launch->start median us", "{:.1f}"),
    ("comm_blocked_ms", "comm wait, stream free, sum ms", "{:.3f}"),
    ("comm_blocked_under_other_ms", "  of it under non-comm ms", "{:.3f}"),
)


class Report(NamedTuple):
    path: str
    label: str
    meta: Dict
    steps: List[Step]
    per_step: List[Dict[str, Optional[float]]]
    median: Dict[str, Optional[float]]


def label_of(meta: Dict, path: str) -> str:
    """A short column title: ``c<chunks>`` / ``compute``, ``cs<comm_sms>``, ``ov``, ``sm<K>``, ``r<rank>``."""
    if not meta:
        return os.path.basename(os.path.dirname(path)) or os.path.basename(path)
    words = ["compute" if meta.get("compute_only") else f"c{meta.get('chunks', 1)}"]
    if meta.get("comm_sms"):
        words.append(f"cs{meta['comm_sms']}")
    if meta.get("graph"):
        words.append("graph")
    if meta.get("compile"):
        words.append("compiled")
    if meta.get("overlap"):
        words.append("ov")
    if meta.get("sm_carveout") is not None:
        words.append(f"sm{meta['sm_carveout']}")
    words.append(f"r{meta.get('rank', '?')}")
    return " ".join(words)


def analyse(path: str) -> Report:
    trace = load_trace(path)
    meta = trace.get("te_ep_timeline") or {}
    if isinstance(meta, str):
        meta = json.loads(meta)
    steps = steps_from_trace(trace)
    per_step = [step_metrics(s) for s in steps]
    times = meta.get("step_ms") or []
    for m, ms in zip(per_step, times):
        m["step_ms"] = ms
    median = median_metrics(per_step)
    median["steps"] = float(len(steps))
    unprofiled = meta.get("unprofiled_step_ms")
    median["unprofiled_step_ms"] = statistics.median(unprofiled) if unprofiled else None
    return Report(path, label_of(meta, path), meta, steps, per_step, median)


def short_name(name: str, width: int = 64) -> str:
    """A kernel name without ``void ``, its argument list and (past ``width``) its tail."""
    name = re.sub(r"^void ", "", name)
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                # A signature's argument list follows the name at once ("Memset (Device)" keeps its own).
                if i > 0 and name[i - 1] != " ":
                    name = name[:i]
                break
    return name if len(name) <= width else name[: width - 3] + "..."


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def describe(report: Report, number: int) -> str:
    meta = report.meta
    if not meta:
        return f"[{number}] {report.path}: {len(report.steps)} step(s), no te_ep_timeline metadata"
    what = "compute-only stand-in of te.MoE" if meta.get("compute_only") else "te.MoE"
    carve = meta.get("sm_carveout")
    text = (f"[{number}] {report.path}: {what} chunks={meta.get('chunks')} comm_sms={meta.get('comm_sms', 0)} "
            f"overlap={meta.get('overlap')} "
            f"sm_carveout={'none' if carve is None else carve}, rank {meta.get('rank')}/{meta.get('world')}, "
            f"{meta.get('backend')} ({meta.get('nccl_ep_mode')})")
    dims = [f"{key}={meta[field]}" for key, field in (("T", "tokens"), ("H", "hidden"), ("F", "ffn"),
                                                       ("E", "experts"), ("K", "top_k"), ("shared", "shared_ffn"))
            if field in meta]
    dims += [str(meta[field]) for field in ("dtype", "gemm", "device") if field in meta]
    return text + (", " + " ".join(dims) if dims else "")


def format_report(reports: Sequence[Report], top: int = 15) -> str:
    lines = [describe(r, i + 1) for i, r in enumerate(reports)]
    lines.append("medians over each trace's profiled steps")
    titles = [f"[{i + 1}] {r.label}" for i, r in enumerate(reports)]
    width = max(10, *(len(t) for t in titles))
    first = max(len(title) for _, title, _ in ROWS) + 2
    lines.append("")
    lines.append(" " * first + "".join(t.rjust(width + 2) for t in titles))
    for key, title, fmt in ROWS:
        lines.append(title.ljust(first) + "".join(_cell(r.median.get(key), fmt).rjust(width + 2) for r in reports))
    streams = sorted({k for r in reports for k in r.median if k.startswith("stream_")},
                     key=lambda k: int(k.split("_")[1]))
    for key in streams:
        title = f"stream {key.split('_')[1]} busy ms"
        lines.append(title.ljust(first) + "".join(_cell(r.median.get(key), "{:.3f}").rjust(width + 2)
                                                  for r in reports))
    for i, r in enumerate(reports):
        kernels = top_kernels(r.steps, top)
        if not kernels:
            lines += ["", f"[{i + 1}] {r.label}: no GPU operations in the profiled steps"]
            continue
        lines += ["", f"[{i + 1}] {r.label}: top {len(kernels)} kernels by time per step (medians over steps)",
                  f"  {'ms/step':>8} {'count':>6} {'mean us':>9} {'grid':>6}  {'kind':<13} name"]
        for k in kernels:
            lines.append(f"  {k.total_ms:8.3f} {k.count:6.1f} {k.mean_us:9.1f} {_cell(k.grid, '{}'):>6}  "
                         f"{k.kind:<13} {short_name(k.name)}")
        delays = comm_delays(r.steps)
        if delays:
            lines += [f"[{i + 1}] {r.label}: communication kernels' waits, us (queue: launch call -> start; "
                      "stream free: launched and its stream's earlier work done -> start; under other: the part "
                      "of that wait while a non-comm op ran)",
                      f"  {'count':>6} {'queue med':>10} {'queue max':>10} {'free med':>9} {'under med':>10}  name"]
            for d in delays:
                lines.append(f"  {d.count:6.1f} {_cell(d.queue_median_us, '{:.1f}'):>10} "
                             f"{_cell(d.queue_max_us, '{:.1f}'):>10} {_cell(d.blocked_median_us, '{:.1f}'):>9} "
                             f"{_cell(d.under_other_median_us, '{:.1f}'):>10}  {short_name(d.name)}")
    return "\n".join(lines)


def write_csv(path: str, reports: Sequence[Report]) -> None:
    """One line per trace and step, then one per trace with the medians (step ``median``)."""
    rows = []
    for r in reports:
        for step, m in zip(r.steps, r.per_step):
            rows.append({"trace": r.path, "label": r.label, "step": step.name, **m})
        rows.append({"trace": r.path, "label": r.label, "step": "median", **r.median})
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def overlap(paths: Sequence[str], csv_path: Optional[str] = None, top: int = 15) -> List[Report]:
    reports = [analyse(p) for p in paths]
    print(format_report(reports, top))
    if csv_path:
        write_csv(csv_path, reports)
        print(f"wrote {csv_path}")
    return reports


# ---------------------------------------------------------------------------------------------
# Idle gaps: where the GPU waits, and for which host call
# ---------------------------------------------------------------------------------------------


class Gap(NamedTuple):
    """A stretch of a step when no GPU operation runs on any stream (microseconds)."""

    at: float  # from the step's first GPU operation
    length: float
    before: str  # the operation that ended last before it
    after: str  # the operation that starts at its end
    host_late: Optional[float]  # of ``length``, the part before ``after`` was launched (None: no launch)
    host: str  # the host calls around ``after``'s launch, outermost first ("-": none in the trace)


def host_calls(trace) -> Tuple[Dict[int, Tuple[float, object]], Dict[object, List[Tuple[float, float, str]]]]:
    """:func:`launch_calls` and ``{thread: [(start, end, name)] of the host ops (cpu_op,
    user_annotation) by start}`` of a trace."""
    ops: Dict[object, List[Tuple[float, float, str]]] = collections.defaultdict(list)
    for e in _events(trace):
        if (e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
                and not _STEP_NAME.match(str(e.get("name", "")))):
            ts = float(e["ts"])
            ops[e.get("tid")].append((ts, ts + float(e.get("dur", 0.0)), str(e.get("name", ""))))
    for thread_ops in ops.values():
        thread_ops.sort(key=lambda o: (o[0], -o[1]))
    return launch_calls(trace), ops


def _around(ops: Sequence[Tuple[float, float, str]], t: float, depth: int) -> str:
    """The innermost ``depth`` host ops of one thread that hold ``t``, outermost first."""
    holding = [o for o in ops[: bisect.bisect_right([o[0] for o in ops], t)] if o[1] >= t]  # in ops' order
    names = [o[2] for o in holding][-depth:]
    return " > ".join(names) if names else "-"


def step_gaps(step: Step, launches, host_ops, min_us: float = 5.0, depth: int = 3) -> List[Gap]:
    """The idle stretches of ``step`` of at least ``min_us``, in order."""
    ops = sorted((op for op in step.ops if op.end >= op.start), key=lambda o: (o.start, o.end))
    if not ops:
        return []
    origin = ops[0].start
    busy = merge((op.start, op.end) for op in ops)
    out = []
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        if gap_end - gap_start < min_us:
            continue
        before = max((op for op in ops if op.end <= gap_start), key=lambda o: o.end)
        after = next(op for op in ops if op.start >= gap_end)
        launch = launches.get(after.corr) if after.corr is not None else None
        late = None if launch is None else min(gap_end - gap_start, max(0.0, launch[0] - gap_start))
        host = "-" if launch is None else _around(host_ops.get(launch[1], []), launch[0], depth)
        out.append(Gap(gap_start - origin, gap_end - gap_start, short_name(before.name, 48),
                       short_name(after.name, 48), late, host))
    return out


def gaps(paths: Sequence[str], min_us: float = 5.0, top: int = 20, depth: int = 3) -> None:
    """Prints, per trace, its median step's idle stretches: the longest ``top``, and the idle
    time summed by the host calls around the launch of the operation that ends each stretch
    (where the launch came after the GPU had gone idle, the host was late: the step waited
    for Python, the dispatcher or a synchronisation, not for the GPU)."""
    for path in paths:
        trace = load_trace(path)
        steps = steps_from_trace(trace)
        step = median_step(steps)
        launches, host_ops = host_calls(trace)
        found = step_gaps(step, launches, host_ops, min_us, depth)
        total = sum(g.length for g in found)
        late = sum(g.host_late or 0.0 for g in found)
        print(f"{path}: {step.name} (the median of {len(steps)} by GPU span): {len(found)} idle stretches "
              f">= {min_us:g} us, {total / 1e3:.3f} ms; of it {late / 1e3:.3f} ms before the next operation's "
              f"launch (host late)")
        by_host: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for g in found:
            row = by_host[g.host]
            row[0] += 1
            row[1] += g.length
            row[2] += g.host_late or 0.0
        print(f"  idle by the host calls around the next launch (top {top}):")
        print(f"  {'count':>5} {'idle us':>9} {'late us':>9}  host calls (outermost first)")
        for host, (count, length, host_late) in sorted(by_host.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"  {count:>5} {length:>9.1f} {host_late:>9.1f}  {host}")
        print(f"  longest stretches (top {top}):")
        print(f"  {'at us':>9} {'idle us':>8} {'late us':>8}  before -> after | host calls")
        for g in sorted(found, key=lambda g: -g.length)[:top]:
            print(f"  {g.at:>9.1f} {g.length:>8.1f} {_cell(g.host_late, '{:.1f}'):>8}  {g.before} -> {g.after} "
                  f"| {g.host}")


# ---------------------------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------------------------


def median_step(steps: Sequence[Step]) -> Step:
    """The step with the median GPU span (the lower median for an even count)."""
    ranked = sorted(steps, key=lambda s: (max((o.end for o in s.ops), default=0.0)
                                          - min((o.start for o in s.ops), default=0.0)))
    return ranked[(len(ranked) - 1) // 2]


def lanes_from_trace(trace: Dict, step: Optional[int] = None) -> Dict[int, Lane]:
    """GPU activity by CUDA stream: ``{stream: [(start, dur, name)]}``, times in microseconds
    from the first GPU event; all of the trace's (``step`` None) or profiled step ``step``'s."""
    if step is None:
        ops = gpu_ops(trace)
    else:
        steps = {s.name: s for s in steps_from_trace(trace)}
        name = f"{STEP_RANGE} {step}"
        if name not in steps:
            raise SystemExit(f"no profiled step {step} in the trace (steps: {', '.join(steps) or 'none'})")
        ops = steps[name].ops
    if not ops:
        return {}
    t0 = min(op.start for op in ops)
    lanes: Dict[int, Lane] = {}
    for op in sorted(ops, key=lambda o: o.start):
        lanes.setdefault(op.stream, []).append((op.start - t0, op.end - op.start, op.name))
    return lanes


def plot(trace_path: str, out: str, title: str, step: Optional[int] = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"plot needs matplotlib (pip install matplotlib): {exc}")
    trace = load_trace(trace_path)
    if step is None:
        steps = steps_from_trace(trace)
        if steps[0].host is not None:
            step = int(median_step(steps).name.split()[-1])
    lanes = lanes_from_trace(trace, step)
    if not lanes:
        raise SystemExit(f"{trace_path}: no GPU kernels in the trace (was it recorded on a GPU?)")
    streams = sorted(lanes, key=lambda s: -busy_us(lanes[s]))
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(streams)))
    for row, stream in enumerate(streams):
        for start, dur, name in lanes[stream]:
            ax.broken_barh([(start / 1000, max(dur, 1.0) / 1000)], (row - 0.4, 0.8), color=COLORS[kind_of(name)])
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}\nbusy {busy_us(lanes[s]) / 1000:.2f} ms" for s in streams])
    ax.set_xlabel("ms from the first GPU event of the step" + (f" ({STEP_RANGE} {step})" if step is not None else ""))
    ax.invert_yaxis()
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", ncol=len(COLORS), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}: {len(streams)} streams, "
          + ", ".join(f"stream {s} busy {busy_us(lanes[s]) / 1000:.2f} ms" for s in streams))


# ---------------------------------------------------------------------------------------------
# Recording (under torchrun)
# ---------------------------------------------------------------------------------------------


def record(args) -> None:
    # Here, not at the top: overlap and plot need neither torch nor a process group. _common
    # first (through bench_moe_layer too): it sets the environment NCCL reads when it initialises.
    if __package__:
        from . import _common
        from . import bench_moe_layer as bench
    else:
        import _common
        import bench_moe_layer as bench
    import time

    import torch
    import torch.distributed as dist

    import te_ep_torch as te
    from te_ep_torch.testing.moe_blocks import ComputeOnlyMoE

    if args.chunks != 1 and not bench.has_chunks_option():
        raise SystemExit(f"--chunks {args.chunks}: te.EpOptions of this te_ep_torch has no 'chunks' field")
    device = _common.init_distributed("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    for key, value in bench.DEFAULTS[device.type].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be divisible by the number of ranks ({world})")
    backend = args.backend or ("auto" if cuda else "reference")
    nccl_ep_mode = args.nccl_ep_mode or te.DEFAULT_NCCL_EP_MODE

    carveout = None
    if args.sm_carveout is not None:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            raise SystemExit(f"--sm-carveout: torch {torch.__version__} has no torch._C._set_sm_carveout_experimental")
        setter(args.sm_carveout)
        carveout = torch._C._get_sm_carveout_experimental()
    if rank == 0:
        print(f"sm carveout: {'none (torch default: GEMMs may take every SM)' if carveout is None else carveout}"
              + ("" if carveout is None else f" SMs left free by torch's persistent GEMMs "
                 f"(torch._C._set_sm_carveout_experimental({args.sm_carveout}))"), flush=True)

    s = bench.setup(args, device, rank)
    x, grad_out, dtype = s.x, s.grad_out, s.dtype
    group = te.EpGroup(num_experts=args.experts, max_tokens_per_rank=args.tokens, backend=backend, device=device,
                       nccl_ep_mode=nccl_ep_mode, checks=args.checks)
    moe = bench.make_moe(args, group, s.native, dtype, overlap=args.overlap, chunks=args.chunks,
                         comm_sms=args.comm_sms)
    del s  # the native block: only its parameters were needed
    layer = ComputeOnlyMoE(moe, capacity=moe.handles[dtype].config.capacity) if args.compute_only else moe
    what = "compute-only stand-in of te.MoE" if args.compute_only else "te.MoE"
    if args.compile:
        layer = torch.compile(layer, fullgraph=True)

    leaf = x.detach().clone().requires_grad_()
    params = list(layer.parameters())

    def reset():
        leaf.grad = None
        for p in params:
            p.grad = None

    def step():
        layer(leaf).backward(grad_out)

    def synchronize():
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        reset()
        step()
    synchronize()
    graph = None
    if args.graph:
        # The step captured in a CUDA graph (as bench_moe_layer's graph mode: warmed up on a side
        # stream, gradients accumulate in place); each profiled step is a replay.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                reset()
                step()
        torch.cuda.current_stream().wait_stream(side)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        synchronize()
        step = graph.replay  # noqa: F811 (the captured step from here on)
        reset = lambda: None  # noqa: E731 (the graph's gradients are its static buffers)

    meta = {
        "layer": what, "compute_only": args.compute_only, "chunks": args.chunks, "comm_sms": args.comm_sms,
        "overlap": args.overlap, "graph": args.graph, "compile": args.compile,
        "sm_carveout": carveout, "rank": rank, "world": world, "backend": group.backend,
        "nccl_ep_mode": nccl_ep_mode, "checks": args.checks, "tokens": args.tokens, "hidden": args.hidden,
        "ffn": args.ffn, "experts": args.experts, "top_k": args.top_k, "shared_ffn": args.shared_ffn,
        "dtype": args.dtype, "gemm": moe.experts.resolved_impl(device, dtype), "warmup": args.warmup,
        "device": torch.cuda.get_device_name(device) if cuda else "CPU", "torch": torch.__version__,
        "te_ep_torch": te.__version__,
    }
    def timed_steps() -> List[float]:
        """``args.steps`` steps, each after a barrier and inside its record_function range: ms each."""
        times = []
        for i in range(args.steps):
            reset()
            dist.barrier()
            synchronize()
            with torch.profiler.record_function(f"{STEP_RANGE} {i}"):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    t0 = time.perf_counter()
                step()
                if cuda:
                    end.record()
                else:
                    times.append((time.perf_counter() - t0) * 1e3)
            synchronize()
            if cuda:
                times.append(start.elapsed_time(end))
        return times

    # The same steps without the profiler first: what the profiler's own cost does to the times.
    unprofiled = timed_steps()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        times = timed_steps()
        meta["step_ms"] = times
        meta["unprofiled_step_ms"] = unprofiled
        prof.add_metadata_json("te_ep_timeline", json.dumps(meta))
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    prof.export_chrome_trace(path)

    worst = torch.tensor([times, unprofiled], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    slowest, slowest_unprofiled = worst.tolist()
    # A captured graph holds NCCL resources that the group's shutdown frees: it goes first.
    graph = step = None
    print(f"rank {rank}: wrote {path}", flush=True)
    if rank == 0:
        clock = "CUDA events" if cuda else "wall clock"
        print(f"{what}, chunks={args.chunks}, overlap={args.overlap}, backend {group.backend} ({nccl_ep_mode}), "
              f"{world} ranks, T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} K={args.top_k} "
              f"shared_ffn={args.shared_ffn} {args.dtype}")
        for i, (mine, worst) in enumerate(zip(times, slowest)):
            print(f"{STEP_RANGE} {i}: {mine:.3f} ms ({clock}, rank 0), slowest rank {worst:.3f} ms")
        print(f"median step: {statistics.median(times):.3f} ms (rank 0), slowest rank "
              f"{statistics.median(slowest):.3f} ms; the same steps unprofiled, just before: "
              f"{statistics.median(unprofiled):.3f} ms (rank 0), slowest rank "
              f"{statistics.median(slowest_unprofiled):.3f} ms", flush=True)
    group.shutdown()
    _common.close_distributed()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="profile layer steps under torchrun, one trace per rank")
    rec.add_argument("--out-dir", required=True)
    rec.add_argument("--tokens", type=int, help="tokens per rank (default 8192; --cpu 48)")
    rec.add_argument("--hidden", type=int, help="hidden size (default 4096; --cpu 32)")
    rec.add_argument("--ffn", type=int, help="expert FFN size (default 1536; --cpu 48)")
    rec.add_argument("--experts", type=int, help="global number of experts (default 64; --cpu 8)")
    rec.add_argument("--top-k", type=int, help="experts per token (default 8; --cpu 2)")
    rec.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default bf16; --cpu fp32")
    rec.add_argument("--shared-ffn", type=int, default=0, help="shared expert's inner width (0: none)")
    rec.add_argument("--gemm", default="auto", help="the experts' kernel (MoE's expert_impl; bench_moe_layer's --gemm)")
    rec.add_argument("--alignment", type=int, default=None, help="zone alignment (default: te.MoE's)")
    rec.add_argument("--backend", default=None, help="EpGroup backend (default auto; --cpu reference)")
    rec.add_argument("--chunks", type=int, default=1, help="te.EpOptions(chunks=N) (default 1: unchunked)")
    rec.add_argument("--overlap", action="store_true", help="te.MoE(overlap=True)")
    rec.add_argument("--compute-only", action="store_true",
                     help="the layer's compute-only stand-in (bench_moe_layer's ComputeOnlyMoE: no communication)")
    rec.add_argument("--compile", action="store_true",
                     help="torch.compile(layer, fullgraph=True) before the warm-up (bench_moe_layer's compile mode)")
    rec.add_argument("--graph", action="store_true",
                     help="capture the step in a CUDA graph after the warm-up and profile its replays (GPU only)")
    rec.add_argument("--comm-sms", type=int, default=0, metavar="K",
                     help="te.EpOptions(comm_sms=K) with --chunks N > 1 or --overlap: the expert GEMMs beside the "
                          "communication leave K SMs to it (the layer's own carveout, during its overlap only)")
    rec.add_argument("--sm-carveout", type=int, default=None, metavar="K",
                     help="torch._C._set_sm_carveout_experimental(K) before the warm-up: torch's persistent GEMMs "
                          "leave K SMs free (default: not called)")
    rec.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; --cpu 1)")
    rec.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    rec.add_argument("--nccl-ep-mode", default=None, choices=["staged", "zero_copy", "auto"],
                     help="EpGroup(nccl_ep_mode=...) (default te_ep_torch's)")
    rec.add_argument("--checks", default="local", choices=["local", "device", "synchronous"])
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--cpu", action="store_true", help="gloo on CPU, reference backend (tests the script; no GPU lanes)")
    ovl = sub.add_parser("overlap", help="overlap, idle time and queue delays per profiled step of recorded traces")
    ovl.add_argument("traces", nargs="+")
    ovl.add_argument("--csv", help="also write every step's numbers and the medians to this CSV file")
    ovl.add_argument("--top", type=int, default=15, help="kernel names listed per trace (default 15)")
    gap = sub.add_parser("gaps", help="where the GPU idles in the median profiled step, and the host calls behind it")
    gap.add_argument("traces", nargs="+")
    gap.add_argument("--min-us", type=float, default=5.0, help="shortest idle stretch counted (default 5 us)")
    gap.add_argument("--top", type=int, default=20, help="rows listed (default 20)")
    gap.add_argument("--depth", type=int, default=3, help="host calls named around each launch (default 3)")
    plo = sub.add_parser("plot", help="draw a recorded step's GPU streams to a PNG")
    plo.add_argument("trace")
    plo.add_argument("--out", required=True)
    plo.add_argument("--step", type=int, default=None, help="profiled step to draw (default: the median by GPU span)")
    plo.add_argument("--title", default="one MoE layer step (forward + backward), GPU streams")
    args = parser.parse_args(argv)
    if args.command == "record":
        if args.steps < 1 or (args.warmup is not None and args.warmup < 0):
            parser.error("--steps must be >= 1 and --warmup >= 0")
        if args.chunks < 1:
            parser.error(f"--chunks must be >= 1, got {args.chunks}")
        if args.graph and args.cpu:
            parser.error("--graph captures a CUDA graph: not with --cpu")
        if args.comm_sms and args.chunks == 1 and not args.overlap:
            parser.error("--comm-sms applies beside a communication stream: give --chunks N > 1 or --overlap with it")
        if args.compute_only and (args.chunks != 1 or args.overlap):
            parser.error("--compute-only has no communication to chunk or overlap: leave --chunks and --overlap out")
        if args.sm_carveout is not None and args.sm_carveout < 0:
            parser.error(f"--sm-carveout must be >= 0, got {args.sm_carveout}")
        record(args)
    elif args.command == "overlap":
        overlap(args.traces, args.csv, args.top)
    elif args.command == "gaps":
        gaps(args.traces, args.min_us, args.top, args.depth)
    else:
        plot(args.trace, args.out, args.title, args.step)


if __name__ == "__main__":
    main()
