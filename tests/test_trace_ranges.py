"""benchmarks/trace_ranges.py: the host calls, other threads and GPU work inside each named range
of a trace, per process: a made-up nsys sqlite export (the tables it reads) and a made-up
torch.profiler trace (the events it reads)."""

import gzip
import json
import sqlite3
import subprocess
import sys

import pytest

from _dist import REPO
from benchmarks import trace_ranges


def _tid(pid: int, thread: int) -> int:
    return (pid << 24) | thread  # nsys's globalTid: the process id above the thread's


@pytest.fixture
def export(tmp_path):
    path = tmp_path / "trace.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        create table StringIds(id integer, value text);
        create table NVTX_EVENTS(start integer, end integer, globalTid integer, text text, textId integer);
        create table CUPTI_ACTIVITY_KIND_RUNTIME(start integer, end integer, globalTid integer, nameId integer,
                                                 correlationId integer);
        create table OSRT_API(start integer, end integer, globalTid integer, nameId integer);
        create table CUPTI_ACTIVITY_KIND_KERNEL(start integer, end integer, correlationId integer, shortName integer);
        create table CUPTI_ACTIVITY_KIND_MEMSET(start integer, end integer, correlationId integer);
    """)
    db.executemany("insert into StringIds values (?, ?)", [
        (1, "cudaLaunchKernel"), (2, "cudaMemsetAsync"), (3, "ioctl"), (4, "te_ep/zero_copy combine"),
        (5, "zero_unrouted_rows_kernel")])
    a, b = _tid(100, 1), _tid(200, 7)
    db.executemany("insert into NVTX_EVENTS values (?, ?, ?, ?, ?)", [
        (1000, 2000, a, None, 4), (5000, 7000, a, None, 4),   # two calls on process 100 (name by id)
        (1000, 3000, b, "te_ep/zero_copy combine", None),      # one on process 200 (name as text)
        (9000, 9500, a, "nccl.ep/zero_copy combine", None)])   # filtered out below
    db.executemany("insert into CUPTI_ACTIVITY_KIND_RUNTIME values (?, ?, ?, ?, ?)", [
        (1100, 1300, a, 1, 11), (1400, 1500, a, 2, 12),       # inside the first range
        (5100, 5500, a, 1, 13),                                # inside the second
        (2500, 2600, a, 1, 14),                                # between the ranges: nobody's
        (1200, 2200, b, 1, 15)])                               # process 200's range
    db.execute("insert into OSRT_API values (1600, 1900, ?, 3)", (a,))
    db.executemany("insert into CUPTI_ACTIVITY_KIND_KERNEL values (?, ?, ?, ?)",
                   [(10000, 10800, 11, 5), (20000, 20300, 13, 5)])
    db.execute("insert into CUPTI_ACTIVITY_KIND_MEMSET values (11000, 11200, 12)")
    db.commit()
    return str(path)


def test_calls_inside_each_range_count_per_process(export):
    groups = trace_ranges.summarize(export, ["te_ep/"])
    assert sorted(groups) == [(100, "te_ep/zero_copy combine"), (200, "te_ep/zero_copy combine")]
    first, second = groups[(100, "te_ep/zero_copy combine")]
    assert (first["host"], first["api"], first["calls"], first["first"]) == (1000, 300, 2, 100)
    assert first["per_api"] == {"cudaLaunchKernel": 200, "cudaMemsetAsync": 100}
    assert first["per_os"] == {"ioctl": 300}
    # the kernel and the memset its two calls launched, from the first launch's start to the last end
    assert first["per_gpu"] == {"zero_unrouted_rows_kernel": 800, "[memset]": 200}
    assert first["gpu_span"] == 11200 - 10000
    assert (second["api"], second["calls"], second["per_gpu"]) == (400, 1, {"zero_unrouted_rows_kernel": 300})
    (other,) = groups[(200, "te_ep/zero_copy combine")]
    assert (other["host"], other["api"], other["gpu_span"]) == (2000, 1000, 0)
    text = trace_ranges.report(groups)
    assert "== pid 100  te_ep/zero_copy combine  (2 calls)" in text
    assert "cudaLaunchKernel" in text and "zero_unrouted_rows_kernel" in text


def test_an_export_without_the_traces_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.sqlite"
    sqlite3.connect(path).execute("create table StringIds(id integer, value text)")
    with pytest.raises(SystemExit, match="not an nsys sqlite export.*CUPTI_ACTIVITY_KIND_RUNTIME"):
        trace_ranges.summarize(str(path))


def _x(cat, name, ts, dur, tid=1, pid=100, corr=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


@pytest.fixture
def kineto(tmp_path):
    # torch.profiler's Chrome trace: microseconds; a range per call, on the calling thread.
    events = [
        _x("user_annotation", "te_ep/zero_copy prepare", 10.0, 100.0),
        _x("cpu_op", "te_ep::prepare", 12.0, 90.0),
        _x("cuda_runtime", "cudaLaunchKernel", 20.0, 5.0, corr=1),
        _x("cuda_runtime", "cudaMemsetAsync", 40.0, 30.0, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 150.0, 5.0, corr=3),       # after the range: nobody's
        _x("cuda_runtime", "cudaEventQuery", 50.0, 40.0, tid=9),          # another thread, 40 us inside
        _x("cuda_runtime", "cudaEventQuery", 100.0, 30.0, tid=9),         # 10 us of it inside
        _x("cuda_runtime", "cudaEventQuery", 50.0, 40.0, tid=9, pid=200),  # another process: not counted
        _x("kernel", "check_routing_kernel", 30.0, 6.0, tid=7, pid=0, corr=1),
        _x("gpu_memset", "Memset (Device)", 80.0, 2.0, tid=7, pid=0, corr=2),
        _x("gpu_user_annotation", "te_ep/zero_copy prepare", 30.0, 52.0, tid=7, pid=0),  # the GPU's copy of the range
        _x("user_annotation", "nccl.ep/zero_copy prepare", 300.0, 50.0),
    ]
    path = tmp_path / "te_ep_zero_copy.prepare.rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name", "pid": 100}]}, f)
    return str(path)


def test_torch_profiler_ranges_count_their_thread_other_threads_and_gpu_work(kineto):
    groups = trace_ranges.summarize_kineto([kineto], ["te_ep/"])
    assert list(groups) == [(100, "te_ep/zero_copy prepare")]
    (row,) = groups[(100, "te_ep/zero_copy prepare")]
    assert (row["host"], row["api"], row["calls"], row["first"]) == (100000, 35000, 2, 10000)
    assert row["per_api"] == {"cudaLaunchKernel": 5000, "cudaMemsetAsync": 30000}
    assert row["per_op"] == {"te_ep::prepare": 90000}
    assert row["per_other"] == {"thread 9: cudaEventQuery": 50000}
    assert row["per_gpu"] == {"check_routing_kernel": 6000, "[memset]": 2000}
    assert row["gpu_span"] == 82000 - 30000
    assert set(trace_ranges.summarize_kineto([kineto])) == {(100, "te_ep/zero_copy prepare"),
                                                            (100, "nccl.ep/zero_copy prepare")}


def test_command_line_reads_torch_profiler_traces_and_refuses_a_mix(kineto, export):
    script = str(REPO / "benchmarks" / "trace_ranges.py")
    out = subprocess.run([sys.executable, script, kineto, "--names", "te_ep/"], capture_output=True, text=True,
                         check=True).stdout
    assert "1 ranges" in out and "other thread 9: cudaEventQuery" in out
    mixed = subprocess.run([sys.executable, script, export, kineto], capture_output=True, text=True)
    assert mixed.returncode == 2 and "an nsys export is read alone" in mixed.stderr


def test_a_json_without_trace_events_is_refused_by_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a torch.profiler trace"):
        trace_ranges.summarize_kineto([str(path)])


def _profile_a_matmul(ctx, trace_dir):
    import torch

    from benchmarks import bench_dispatch_combine as bench

    x = torch.ones(32, 32)
    bench.profile_ops("te_ep/zero_copy", {"mm": bench.Op(lambda: x @ x)}, 3, torch.device("cpu"), trace_dir)
    return bench.trace_path(trace_dir, "te_ep/zero_copy", "mm", ctx.rank)


def test_bench_profile_writes_a_trace_per_rank_that_trace_ranges_reads(pools, tmp_path):
    # bench_dispatch_combine.py --profile 3 --trace DIR, on two CPU ranks: each rank's trace
    # holds the 3 profiled calls as ranges '<variant> <op>' with the op's own torch ops inside.
    paths = pools.run(2, _profile_a_matmul, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["te_ep_zero_copy.mm.rank0.json.gz",
                                                     "te_ep_zero_copy.mm.rank1.json.gz"]
    groups = trace_ranges.summarize_kineto(paths, ["te_ep/"])  # not the barriers' own ranges
    assert len(groups) == 2 and {name for _, name in groups} == {"te_ep/zero_copy mm"}
    for rows in groups.values():
        assert len(rows) == 3
        assert all(row["per_op"].get("aten::mm", 0) > 0 and row["host"] > 0 for row in rows)


def test_timeline_gives_each_host_event_and_the_first_gpu_work_from_the_range_start(kineto, export):
    # torch.profiler: the op and its CUDA calls on the range's thread, in order; the first GPU work
    # its calls launched (the kernel at 30 us) is 20 us after the range's start.
    groups = trace_ranges.summarize_kineto([kineto], ["te_ep/"])
    (row,) = groups[(100, "te_ep/zero_copy prepare")]
    assert row["steps"] == [(2000, 92000, "te_ep::prepare"), (10000, 15000, "cudaLaunchKernel"),
                            (30000, 60000, "cudaMemsetAsync")]
    assert row["gpu_first"] == 20000
    text = trace_ranges.timeline(groups)
    assert "== pid 100  te_ep/zero_copy prepare  (1 of 1 calls in this order" in text
    lines = text.splitlines()
    assert lines[1].split() == ["2.0", "..", "92.0", "te_ep::prepare"]
    assert lines[3].split() == ["30.0", "..", "60.0", "cudaMemsetAsync"]
    assert lines[4].split()[:2] == ["100.0", "the"] and lines[5].split()[:2] == ["20.0", "its"]
    # nsys: the CUDA calls; the medians over the two calls of process 100 that came in the
    # commonest order (the second range made one call only, so the first alone is that order)
    groups = trace_ranges.summarize(export, ["te_ep/"])
    first, second = groups[(100, "te_ep/zero_copy combine")]
    assert first["steps"] == [(100, 300, "cudaLaunchKernel"), (400, 500, "cudaMemsetAsync")]
    assert (first["gpu_first"], second["gpu_first"]) == (9000, 15000)
    text = trace_ranges.timeline(groups)
    assert "== pid 100  te_ep/zero_copy combine  (1 of 2 calls in this order" in text
    assert "== pid 200  te_ep/zero_copy combine  (1 of 1 calls in this order" in text
    assert "its first GPU work starts" not in text.split("== pid 200")[1]  # its call launched nothing traced


def test_command_line_timeline(kineto):
    script = str(REPO / "benchmarks" / "trace_ranges.py")
    out = subprocess.run([sys.executable, script, kineto, "--timeline"], capture_output=True, text=True,
                         check=True).stdout
    assert "2 ranges" in out and "calls in this order" in out and "its first GPU work starts" in out
    assert "median" in out and "other thread" not in out  # the summary is not printed
