"""benchmarks/timeline.py: reading GPU streams out of a profiler trace (plotting needs a GPU
trace and matplotlib; the parsing is tested here on a synthetic trace)."""

import json

import pytest

from benchmarks import timeline


def _kernel(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


TRACE = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 100},  # host side: ignored
    _kernel("ncclEpHtDispatchKernel", 110, 50, 21),
    _kernel("sm90_xmma_gemm_bf16", 100, 30, 7),
    _kernel("sm90_xmma_gemm_bf16", 140, 40, 7),
    _kernel("Memset (Device)", 200, 5, 7, cat="gpu_memset"),
    _kernel("te_ep::permutation::zero_unused_rows_kernel", 150, 20, 21),
    {"ph": "f", "name": "flow", "ts": 120},
]}


def test_lanes_by_stream_relative_to_the_first_gpu_event():
    lanes = timeline.lanes_from_trace(TRACE)
    assert sorted(lanes) == [7, 21]
    assert lanes[7] == [(0.0, 30.0, "sm90_xmma_gemm_bf16"), (40.0, 40.0, "sm90_xmma_gemm_bf16"),
                        (100.0, 5.0, "Memset (Device)")]
    assert [e[0] for e in lanes[21]] == [10.0, 50.0]


def test_busy_time_counts_overlaps_once():
    assert timeline.busy_us([(0, 10, "a"), (5, 10, "b"), (30, 5, "c")]) == 20
    assert timeline.busy_us(timeline.lanes_from_trace(TRACE)[21]) == 60  # [10, 60) and [50, 70)


def test_kinds():
    assert timeline.kind_of("ncclEpHtDispatchKernel") == "communication"
    assert timeline.kind_of("void nccl_ep::ht_local_reduce<8>(...)") == "communication"
    assert timeline.kind_of("te_ep::nccl_ep::(anonymous namespace)::zero_unused_rows_kernel") == "te_ep"
    assert timeline.kind_of("sm90_xmma_gemm_bf16") == "GEMM"
    assert timeline.kind_of("te_ep::permutation::zero_unused_rows_kernel") == "te_ep"
    assert timeline.kind_of("vectorized_elementwise_kernel") == "other"


def test_a_trace_without_gpu_work_has_no_lanes(tmp_path):
    assert timeline.lanes_from_trace({"traceEvents": TRACE["traceEvents"][:1]}) == {}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": TRACE["traceEvents"][:1]}))
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    with pytest.raises(SystemExit, match="no GPU kernels"):
        timeline.plot(str(path), str(tmp_path / "x.png"), "t")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    out = tmp_path / "t.png"
    timeline.plot(str(path), str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
