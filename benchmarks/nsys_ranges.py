"""What the host did inside each NVTX range of an nsys trace, per process: CUDA calls, OS calls, GPU work.

For ``bench_dispatch_combine.py --nvtx`` under nsys (docs/benchmarks.md): every timed call is
an NVTX range ``<variant> <op>``, so the CUDA calls a range holds on its thread are that op's.

    nsys profile -t cuda,nvtx,osrt -o trace torchrun --nproc-per-node=2 \\
        benchmarks/bench_dispatch_combine.py --shapes main --backends nccl_ep nccl_ep_alone --nvtx
    nsys export --type sqlite -o trace.sqlite trace.nsys-rep
    python3 benchmarks/nsys_ranges.py trace.sqlite [NAME_SUBSTRING ...]

Per process and range name, medians over the range's calls: its host time, the time spent
inside CUDA API calls (and how many), the time outside them (Python and C++ of the op itself),
when the first CUDA call came, OS-runtime calls (futex, ioctl, ...), the span of the GPU work
its calls launched; then the CUDA calls, OS calls and kernels that took the most time.
Reads the tables of nsys's sqlite export (StringIds, NVTX_EVENTS, CUPTI_ACTIVITY_KIND_RUNTIME
and, where present, OSRT_API, CUPTI_ACTIVITY_KIND_KERNEL / _MEMSET / _MEMCPY).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import sqlite3
import statistics
from typing import Dict, List, Sequence, Tuple


def _columns(cur: sqlite3.Cursor, table: str) -> List[str]:
    return [row[1] for row in cur.execute(f"pragma table_info({table})")]


def summarize(path: str, names: Sequence[str] = ()) -> Dict[Tuple[int, str], List[dict]]:
    """{(pid, range name): one dict per range}, ranges whose name holds one of ``names`` (all if none)."""
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

    def inside(calls, start, end):
        lo = bisect.bisect_left(calls, (start,))
        hi = bisect.bisect_left(calls, (end,))
        return calls[lo:hi]

    groups: Dict[Tuple[int, str], List[dict]] = collections.defaultdict(list)
    for start, end, tid, name in ranges:
        calls = inside(api.get(tid, []), start, end)
        per_api, count = collections.Counter(), collections.Counter()
        for s, e, _, name_id, _ in calls:
            per_api[strings.get(name_id, "?")] += e - s
            count[strings.get(name_id, "?")] += 1
        per_os = collections.Counter()
        for s, e, _, name_id, _ in inside(osrt.get(tid, []), start, end):
            per_os[strings.get(name_id, "?")] += e - s
        work = [gpu[c[4]] for c in calls if c[4] in gpu]
        per_gpu = collections.Counter()
        for s, e, label in work:
            per_gpu[label] += e - s
        groups[((tid >> 24) & 0xFFFFFF, name)].append(dict(
            host=end - start, api=sum(per_api.values()), calls=len(calls), per_api=per_api, count=count,
            os=sum(per_os.values()), per_os=per_os, per_gpu=per_gpu,
            first=(calls[0][0] - start) if calls else 0,
            gpu_span=(max(e for _, e, _ in work) - min(s for s, _, _ in work)) if work else 0))
    return groups


def report(groups: Dict[Tuple[int, str], List[dict]], top: int = 10) -> str:
    def med(values):
        return statistics.median(values) if values else 0

    def us(ns):
        return f"{ns / 1e3:8.1f} us"

    lines = []
    for (pid, name), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"== pid {pid}  {name}  ({len(rows)} calls)")
        lines.append(
            f"   host {us(med([r['host'] for r in rows]))}  in CUDA calls {us(med([r['api'] for r in rows]))} "
            f"({med([r['calls'] for r in rows]):.0f} calls)  outside them {us(med([r['host'] - r['api'] for r in rows]))}"
            f"  first CUDA call at {us(med([r['first'] for r in rows]))}  OS calls {us(med([r['os'] for r in rows]))}"
            f"  GPU span {us(med([r['gpu_span'] for r in rows]))}")
        for key, kind in (("per_api", "cuda"), ("per_os", "os"), ("per_gpu", "gpu")):
            total = collections.Counter()
            for r in rows:
                total.update(r[key])
            for label, _ in total.most_common(top):
                values = [r[key].get(label, 0) for r in rows]
                times = f"  x{med([r['count'].get(label, 0) for r in rows]):.0f}" if kind == "cuda" else ""
                lines.append(f"     {kind:<4} {label[:60]:<60} median {us(med(values))}  max {us(max(values))}{times}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("sqlite", help="nsys export --type sqlite of the trace")
    parser.add_argument("names", nargs="*", help="only ranges whose name holds one of these")
    parser.add_argument("--top", type=int, default=10, help="rows per kind (CUDA, OS, GPU) under each range")
    args = parser.parse_args()
    groups = summarize(args.sqlite, args.names)
    print(f"{sum(len(v) for v in groups.values())} ranges")
    print(report(groups, args.top))


if __name__ == "__main__":
    main()
