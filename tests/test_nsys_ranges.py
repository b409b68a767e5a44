"""benchmarks/nsys_ranges.py: the host calls, OS calls and GPU work inside each NVTX range of an
nsys sqlite export, per process (a made-up export of the tables it reads)."""

import sqlite3
import sys

import pytest

from _dist import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import nsys_ranges  # noqa: E402


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
    groups = nsys_ranges.summarize(export, ["te_ep/"])
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
    text = nsys_ranges.report(groups)
    assert "== pid 100  te_ep/zero_copy combine  (2 calls)" in text
    assert "cudaLaunchKernel" in text and "zero_unrouted_rows_kernel" in text


def test_an_export_without_the_traces_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.sqlite"
    sqlite3.connect(path).execute("create table StringIds(id integer, value text)")
    with pytest.raises(SystemExit, match="not an nsys sqlite export.*CUPTI_ACTIVITY_KIND_RUNTIME"):
        nsys_ranges.summarize(str(path))
