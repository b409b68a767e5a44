"""What the host did inside each named range of a trace, per process: CUDA calls, other threads, GPU work.

Reads two kinds of trace of ``bench_dispatch_combine.py``, where every call of an op is a range
``<variant> <op>``, so the CUDA calls a range holds on its thread are that op's:

* torch.profiler traces, from ``--profile N --trace DIR`` (one ``.json.gz`` per rank, variant
  and op; docs/benchmarks.md). Works wherever torch.profiler does, GPU machine included.

      torchrun --nproc-per-node=2 benchmarks/bench_dispatch_combine.py --shapes main \
          --backends nccl_ep nccl_ep_alone --profile 20 --trace traces
      python3 benchmarks/trace_ranges.py traces/*.json.gz [--names SUBSTRING ...] [--timeline]

* nsys's sqlite export of a ``--nvtx`` run (``nsys profile -t cuda,nvtx,osrt -o trace torchrun
  ... --nvtx``, then ``nsys export --type sqlite -o trace.sqlite trace.nsys-rep``).

Per process and range name, medians over the range's calls: its host time, the time spent
inside CUDA API calls (and how many), the time outside them (Python and C++ of the op itself),
when the first CUDA call came, OS-runtime calls (nsys only), the span of the GPU work its calls
launched; then the CUDA calls, OS calls, kernels, the op's own torch ops (``op``, torch.profiler
only: inclusive times) and what the process's other threads did during the range (``other``,
torch.profiler only: their CUDA calls and torch ops, by thread) that took the most time.
From nsys it reads the tables StringIds, NVTX_EVENTS, CUPTI_ACTIVITY_KIND_RUNTIME and, where
present, OSRT_API, CUPTI_ACTIVITY_KIND_KERNEL / _MEMSET / _MEMCPY.

``--timeline`` prints, instead, when each host event of a call came (its CUDA calls, and from
torch.profiler its torch ops too) and when the GPU work it launched began, in us from the
range's start. Each is a median over the calls whose events came in the commonest order. With
the GPU idle at each call (how ``--profile`` calls), that shows what runs on the host before an
op's first kernel.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sqlite3
import statistics
from typing import Dict, List, Sequence, Tuple


def _columns(cur: sqlite3.Cursor, table: str) -> List[str]:
    return [row[1] for row in cur.execute(f"pragma table_info({table})")]


def _inside(calls: list, start: int, end: int) -> list:
    """The calls (tuples sorted by their start) that start within [start, end)."""
    return calls[bisect.bisect_left(calls, (start,)):bisect.bisect_left(calls, (end,))]


def _range_row(start: int, end: int, calls: Sequence[Tuple[int, int, str, object]],
               gpu: Dict[object, Tuple[int, int, str]], steps: Sequence[Tuple[int, int, str]] = (),
               **extra) -> dict:
    """One range's summary: its CUDA calls (start, end, name, correlation id) on its thread and the
    GPU work they launched (``gpu``: correlation id -> (start, end, label)); ``extra`` joins it.
    ``steps``, the host events on its thread in order (start, end, label), default its CUDA calls,
    become offsets from the range's start, as does the start of the first GPU work."""
    per_api, count = collections.Counter(), collections.Counter()
    for s, e, call, _ in calls:
        per_api[call] += e - s
        count[call] += 1
    work = [gpu[c[3]] for c in calls if c[3] in gpu]
    per_gpu = collections.Counter()
    for s, e, label in work:
        per_gpu[label] += e - s
    steps = steps or [(s, e, call) for s, e, call, _ in calls]
    return dict(host=end - start, api=sum(per_api.values()), calls=len(calls), per_api=per_api, count=count,
                per_gpu=per_gpu, first=(calls[0][0] - start) if calls else 0,
                gpu_span=(max(e for _, e, _ in work) - min(s for s, _, _ in work)) if work else 0,
                steps=[(s - start, e - start, label) for s, e, label in steps],
                gpu_first=(min(s for s, _, _ in work) - start) if work else None, **extra)


def summarize(path: str, names: Sequence[str] = ()) -> Dict[Tuple[int, str], List[dict]]:
    """{(pid, range name): one dict per range} of an nsys sqlite export, ranges whose name holds
    one of ``names`` (all if none)."""
    cur = sqlite3.connect(path).cursor()
    tables = {row[0] for row in cur.execute("select name from sqlite_master where type='table'")}
    missing = {"StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME"} - tables
    if missing:
        raise SystemExit(f"{path}: not an nsys sqlite export with CUDA and NVTX traces (no {sorted(missing)})")
    strings = dict(cur.execute("select id, value from StringIds"))
    nvtx = _columns(cur, "NVTX_EVENTS")
    text = "text" if "text" in nvtx else "NULL"
    text_id = "textId" if "textId" in nvtx else "NULL"
    ranges = []
    for start, end, tid, name, name_id in cur.execute(
            f"select start, end, globalTid, {text}, {text_id} from NVTX_EVENTS where end is not null"):
        name = name or strings.get(name_id, "")
        if name and (not names or any(n in name for n in names)):
            ranges.append((start, end, tid, name))

    def by_thread(rows):
        out = collections.defaultdict(list)
        for row in rows:
            out[row[2]].append(row)
        for calls in out.values():
            calls.sort()
        return out

    api = by_thread(cur.execute(
        "select start, end, globalTid, nameId, correlationId from CUPTI_ACTIVITY_KIND_RUNTIME"))
    osrt = by_thread(cur.execute("select start, end, globalTid, nameId, 0 from OSRT_API")) if "OSRT_API" in tables else {}
    gpu = {}
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        name_col = "shortName" if "shortName" in _columns(cur, "CUPTI_ACTIVITY_KIND_KERNEL") else "demangledName"
        for start, end, corr, name_id in cur.execute(
                f"select start, end, correlationId, {name_col} from CUPTI_ACTIVITY_KIND_KERNEL"):
            gpu[corr] = (start, end, strings.get(name_id, "?"))
    for table, label in (("CUPTI_ACTIVITY_KIND_MEMSET", "[memset]"), ("CUPTI_ACTIVITY_KIND_MEMCPY", "[memcpy]")):
        if table in tables:
            for start, end, corr in cur.execute(f"select start, end, correlationId from {table}"):
                gpu[corr] = (start, end, label)

    groups: Dict[Tuple[int, str], List[dict]] = collections.defaultdict(list)
    for start, end, tid, name in ranges:
        calls = [(s, e, strings.get(name_id, "?"), corr)
                 for s, e, _, name_id, corr in _inside(api.get(tid, []), start, end)]
        per_os = collections.Counter()
        for s, e, _, name_id, _ in _inside(osrt.get(tid, []), start, end):
            per_os[strings.get(name_id, "?")] += e - s
        groups[((tid >> 24) & 0xFFFFFF, name)].append(
            _range_row(start, end, calls, gpu, os=sum(per_os.values()), per_os=per_os))
    return groups


# torch.profiler's categories: host calls into CUDA, GPU work, and what else a thread does.
_API = ("cuda_runtime", "cuda_driver")
_GPU = {"kernel": None, "gpu_memset": "[memset]", "gpu_memcpy": "[memcpy]"}
_HOST_WORK = _API + ("cpu_op",)


def summarize_kineto(paths: Sequence[str], names: Sequence[str] = ()) -> Dict[Tuple[int, str], List[dict]]:
    """{(pid, range name): one dict per range} of torch.profiler traces (Chrome trace JSON,
    ``.gz`` too): the ``record_function`` ranges whose name holds one of ``names`` (all if none)."""
    groups: Dict[Tuple[int, str], List[dict]] = collections.defaultdict(list)
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents")
        if not isinstance(events, list):
            raise SystemExit(f"{path}: not a torch.profiler trace (no traceEvents)")

        def ns(value) -> int:
            return int(round(float(value) * 1000))  # the trace's times are microseconds

        ranges, host = [], collections.defaultdict(list)
        gpu: Dict[int, Tuple[int, int, str]] = {}
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            cat, start = e.get("cat", ""), ns(e["ts"])
            end, name = start + ns(e["dur"]), e.get("name", "?")
            corr = (e.get("args") or {}).get("correlation")
            if cat == "user_annotation" and (not names or any(n in name for n in names)):
                ranges.append((start, end, e.get("pid"), e.get("tid"), name))
            elif cat in _HOST_WORK:
                host[(e.get("pid"), e.get("tid"))].append((start, end, cat, name, corr))
            elif cat in _GPU and corr is not None:
                gpu[corr] = (start, end, _GPU[cat] or name)
        for calls in host.values():
            calls.sort(key=lambda c: (c[0], c[1]))  # the correlation id may be None
        for start, end, pid, tid, name in ranges:
            mine = _inside(host.get((pid, tid), []), start, end)
            calls = [(s, e, call, corr) for s, e, cat, call, corr in mine if cat in _API]
            per_op = collections.Counter()
            for s, e, cat, op, _ in mine:
                if cat == "cpu_op":
                    per_op[op] += e - s
            per_other = collections.Counter()
            for (other_pid, other_tid), work in host.items():
                if other_pid != pid or other_tid == tid:
                    continue
                for s, e, _, call, _ in work:
                    overlap = min(e, end) - max(s, start)
                    if overlap > 0:
                        per_other[f"thread {other_tid}: {call}"] += overlap
            steps = [(s, e, label) for s, e, _, label, _ in mine]  # its CUDA calls and torch ops
            groups[(pid, name)].append(_range_row(start, end, calls, gpu, steps, os=None,
                                                  per_os=collections.Counter(), per_op=per_op, per_other=per_other))
    return groups


def report(groups: Dict[Tuple[int, str], List[dict]], top: int = 10) -> str:
    def med(values):
        return statistics.median(values) if values else 0

    def us(ns):
        return f"{ns / 1e3:8.1f} us"

    lines = []
    for (pid, name), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"== pid {pid}  {name}  ({len(rows)} calls)")
        # torch.profiler traces have no OS-runtime calls
        os_calls = "-" if any(r["os"] is None for r in rows) else us(med([r["os"] for r in rows])).strip()
        lines.append(
            f"   host {us(med([r['host'] for r in rows]))}  in CUDA calls {us(med([r['api'] for r in rows]))} "
            f"({med([r['calls'] for r in rows]):.0f} calls)  outside them {us(med([r['host'] - r['api'] for r in rows]))}"
            f"  first CUDA call at {us(med([r['first'] for r in rows]))}  OS calls {os_calls}"
            f"  GPU span {us(med([r['gpu_span'] for r in rows]))}")
        for key, kind in (("per_api", "cuda"), ("per_os", "os"), ("per_gpu", "gpu"), ("per_op", "op"),
                          ("per_other", "other")):
            total = collections.Counter()
            for r in rows:
                total.update(r.get(key, {}))
            for label, _ in total.most_common(top):
                values = [r.get(key, {}).get(label, 0) for r in rows]
                times = f"  x{med([r['count'].get(label, 0) for r in rows]):.0f}" if kind == "cuda" else ""
                lines.append(f"     {kind:<5} {label[:60]:<60} median {us(med(values))}  max {us(max(values))}{times}")
    return "\n".join(lines)


def timeline(groups: Dict[Tuple[int, str], List[dict]]) -> str:
    """Per range name and process, when each host event of a call came (its CUDA calls; from
    torch.profiler also its torch ops, nested ones included) and when the GPU work it launched
    began, in us from the range's start: medians over the calls whose events came in the
    commonest order."""
    lines = []
    for (pid, name), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        orders = [tuple(label for _, _, label in r["steps"]) for r in rows]
        order = collections.Counter(orders).most_common(1)[0][0]
        same = [r for r, o in zip(rows, orders) if o == order]
        lines.append(f"== pid {pid}  {name}  ({len(same)} of {len(rows)} calls in this order; us from the range's "
                     "start, median)")
        for i, label in enumerate(order):
            start = statistics.median(r["steps"][i][0] for r in same) / 1e3
            end = statistics.median(r["steps"][i][1] for r in same) / 1e3
            lines.append(f"   {start:8.1f} .. {end:8.1f}  {label[:70]}")
        lines.append(f"   {statistics.median(r['host'] for r in same) / 1e3:8.1f}              the range ends")
        firsts = [r["gpu_first"] for r in same if r["gpu_first"] is not None]
        if firsts:
            lines.append(f"   {statistics.median(firsts) / 1e3:8.1f}              its first GPU work starts")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="torch.profiler traces (.json, .json.gz), or one nsys sqlite export (.sqlite)")
    parser.add_argument("--names", nargs="+", default=(), help="only ranges whose name holds one of these")
    parser.add_argument("--top", type=int, default=10, help="rows per kind (CUDA, OS, GPU, op, other) under each range")
    parser.add_argument("--timeline", action="store_true",
                        help="instead of the summary: when each host event of a call came and when its GPU work "
                             "began, from the range's start (medians of the calls in the commonest order)")
    args = parser.parse_args()
    sqlite_paths = [p for p in args.traces if p.endswith(".sqlite")]
    if sqlite_paths and len(args.traces) > 1:
        parser.error(f"an nsys export is read alone, got {len(args.traces)} traces")
    groups = (summarize(sqlite_paths[0], args.names) if sqlite_paths
              else summarize_kineto(args.traces, args.names))
    print(f"{sum(len(v) for v in groups.values())} ranges")
    print(timeline(groups) if args.timeline else report(groups, args.top))


if __name__ == "__main__":
    main()
