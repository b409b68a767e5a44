"""benchmarks/timeline.py: reading GPU streams out of a profiler trace, the overlap analysis
(steps cut by their record_function ranges, exposed / overlapped / idle time, queue delays by
correlation id, kinds of kernel names) on synthetic traces in torch.profiler's format, and
``record`` under torchrun on CPU followed by ``overlap`` on its traces (plotting needs
matplotlib; a CPU trace has no GPU lanes)."""

import json
from pathlib import Path

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


# ---- overlap: cutting steps, exposed / overlapped / idle time, queue delays ----------------------
# Synthetic traces in the format torch.profiler exports (Kineto's Chrome trace): host ranges of
# record_function ("user_annotation"), launch calls ("cuda_runtime" / "cuda_driver") linked to
# their GPU operations by ``args.correlation``, kernels with ``args.stream`` and ``args.grid``.

GEMM = "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<GemmUniversal<>>>(Params)"
DISPATCH = "nccl_ep_jit_ht_dispatch_kernel"
COMBINE = "nccl_ep_jit_ht_combine_kernel"


def _range(i, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": f"te_ep_step {i}", "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"External id": 100 + i}}


def _launch(corr, ts, dur=2, name="cudaLaunchKernel", cat="cuda_runtime", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 1000 + corr, "cbid": 211, "correlation": corr}}


def _gpu(name, ts, dur, stream, corr=None, grid=None, cat="kernel"):
    args = {"device": 0, "stream": stream}
    if corr is not None:
        args["correlation"] = corr
        args["External id"] = 1000 + corr
    if grid is not None:
        args["grid"] = list(grid)
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


# One step, times in us (the step's host range [0, 90), every launch inside it):
#   stream 7:  GEMM [100, 200)  GEMM [250, 300)  te_ep [320, 330)        memset [400, 405)
#   stream 20:      dispatch [150, 260)                   combine [330, 350)
#   stream 30:                                             NCCL [340, 345)
# comm busy = [150, 260) + [330, 350) = 130; overlapped with non-comm = [150, 200) + [250, 260)
# = 60; exposed = [200, 250) + [330, 350) = 70 (two comm kernels at once are still exposed);
# idle = [300, 320) + [350, 400) = 70 of the span [100, 405) = 305; two streams busy at once:
# [150, 200) + [250, 260) + [340, 345) = 65.
def _one_step_events():
    return [
        _range(0, 0, 90),
        _launch(1, 10), _gpu(GEMM, 100, 100, 7, corr=1, grid=(132, 1, 1)),
        _launch(2, 20), _gpu(DISPATCH, 150, 110, 20, corr=2, grid=(16, 1, 1)),
        _launch(3, 30), _gpu(GEMM, 250, 50, 7, corr=3, grid=(132, 1, 1)),
        _launch(4, 40), _gpu("te_ep::nccl_ep::(anonymous namespace)::zero_unused_rows_kernel", 320, 10, 7, corr=4),
        _launch(5, 50, name="cuLaunchKernelEx", cat="cuda_driver"), _gpu(COMBINE, 330, 20, 20, corr=5),
        _launch(6, 60), _gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 340, 5, 30,
                             corr=6),
        _launch(7, 70, name="cudaMemsetAsync"), _gpu("Memset (Device)", 400, 5, 7, corr=7, cat="gpu_memset"),
    ]


def test_overlap_exposed_and_idle_time_of_one_step():
    steps = timeline.steps_from_trace({"traceEvents": _one_step_events()})
    assert [s.name for s in steps] == ["te_ep_step 0"] and len(steps[0].ops) == 7
    m = timeline.step_metrics(steps[0])
    assert m["span_ms"] == 305 / 1e3
    assert m["host_ms"] == 90 / 1e3
    assert m["comm_busy_ms"] == 130 / 1e3
    assert m["exposed_comm_ms"] == 70 / 1e3
    assert m["overlapped_comm_ms"] == 60 / 1e3
    assert m["overlapped_comm_pct"] == pytest.approx(100 * 60 / 130)
    assert m["idle_ms"] == 70 / 1e3
    assert m["multi_stream_ms"] == 65 / 1e3
    assert m["kernel_GEMM_ms"] == 150 / 1e3
    assert m["kernel_communication_ms"] == 135 / 1e3
    assert m["kernel_te_ep_ms"] == 10 / 1e3
    assert m["kernel_other_ms"] == 5 / 1e3
    assert (m["stream_7_busy_ms"], m["stream_20_busy_ms"], m["stream_30_busy_ms"]) == (165 / 1e3, 130 / 1e3, 5 / 1e3)


def test_overlap_with_nothing_overlapping_is_all_exposed():
    """Communication and GEMMs one after another (what the hypothesis expects of a chunked step):
    no overlapped time however many streams they are queued on."""
    events = [_range(0, 0, 50),
              _launch(1, 1), _gpu(GEMM, 100, 100, 7, corr=1),
              _launch(2, 2), _gpu(DISPATCH, 200, 40, 20, corr=2),
              _launch(3, 3), _gpu(GEMM, 240, 60, 7, corr=3),
              _launch(4, 4), _gpu(COMBINE, 310, 30, 20, corr=4),
              # A zero-length memset ends the span: [340, 350) is idle too.
              _launch(5, 5, name="cudaMemsetAsync"), _gpu("Memset (Device)", 350, 0, 7, corr=5, cat="gpu_memset")]
    m = timeline.step_metrics(timeline.steps_from_trace({"traceEvents": events})[0])
    assert (m["exposed_comm_ms"], m["overlapped_comm_ms"], m["overlapped_comm_pct"]) == (70 / 1e3, 0.0, 0.0)
    assert (m["idle_ms"], m["multi_stream_ms"], m["span_ms"]) == (20 / 1e3, 0.0, 250 / 1e3)


def test_steps_are_cut_by_the_host_ranges_of_the_launches():
    """A kernel belongs to the step whose record_function range holds its launch call, even when
    it runs after the range ended or was launched by another thread (autograd's); a kernel
    launched between the ranges (the barrier's) belongs to none; one without a launch in the
    trace goes by its start: the step's GPU-side range, else its host range."""
    events = [
        _range(0, 0, 1000), _range(1, 2000, 1000),
        _range(0, 1400, 200, cat="gpu_user_annotation"),
        _launch(1, 900), _gpu("k_step0_runs_late", 1500, 10, 7, corr=1),
        _launch(2, 1500), _gpu("barrier_allreduce_nccl", 1600, 10, 30, corr=2),
        _launch(3, 2100, tid=2), _gpu("k_step1_autograd_thread", 2150, 10, 7, corr=3),
        _launch(4, 2200, name="cuLaunchKernelEx", cat="cuda_driver"), _gpu("k_step1_driver", 2250, 10, 20, corr=4),
        _gpu("no_launch_in_gpu_range_of_step0", 1450, 5, 20),
        _gpu("no_launch_in_host_range_of_step1", 2500, 5, 20),
        _gpu("no_launch_outside", 5000, 5, 20),
    ]
    steps = timeline.steps_from_trace({"traceEvents": events})
    assert [s.name for s in steps] == ["te_ep_step 0", "te_ep_step 1"]
    assert [s.host for s in steps] == [(0.0, 1000.0), (2000.0, 3000.0)]
    assert [op.name for op in steps[0].ops] == ["no_launch_in_gpu_range_of_step0", "k_step0_runs_late"]
    assert [op.name for op in steps[1].ops] == ["k_step1_autograd_thread", "k_step1_driver",
                                                "no_launch_in_host_range_of_step1"]
    assert [op.launch for op in steps[1].ops] == [2100.0, 2200.0, None]
    # Without te_ep_step ranges (an older trace): one step of everything.
    whole = timeline.steps_from_trace({"traceEvents": [e for e in events if "te_ep_step" not in e["name"]]})
    assert [(s.name, s.host, len(s.ops)) for s in whole] == [("all", None, 7)]


def test_queue_delay_of_communication_kernels_by_correlation_id():
    """queue = kernel start - start of its launch call (matched by correlation id, not by
    order); blocked = start - max(launch, end of its stream's earlier work); under other = the
    part of blocked while a non-communication kernel ran."""
    events = [
        _range(0, 0, 400),
        _launch(1, 90), _gpu(GEMM, 100, 200, 7, corr=1),
        # Launched at 120, its stream idle: waits until the GEMM ends at 300 (all under it).
        _launch(2, 120, dur=5), _gpu(DISPATCH, 300, 40, 20, corr=2),
        # Launched at 130 behind the dispatch (ends 340), starts at 350: 10 us after its stream was free.
        _launch(3, 130, name="cuLaunchKernelEx", cat="cuda_driver"), _gpu(DISPATCH, 350, 20, 20, corr=3),
        # The launch of correlation 9 is not in the trace (the step by its start: in the host range).
        _gpu(COMBINE, 380, 10, 20, corr=9),
        _launch(4, 140), _gpu(GEMM, 345, 100, 7, corr=4),
    ]
    step = timeline.steps_from_trace({"traceEvents": events})[0]
    waits = timeline.comm_waits(step.ops)
    assert waits == [timeline.CommWait(DISPATCH, 180.0, 180.0, 180.0),
                     timeline.CommWait(DISPATCH, 220.0, 10.0, 5.0),  # [340, 350): the GEMM from 345
                     timeline.CommWait(COMBINE, None, None, None)]
    m = timeline.step_metrics(step)
    assert m["comm_queue_median_us"] == 200.0
    assert m["comm_blocked_ms"] == 190 / 1e3
    assert m["comm_blocked_under_other_ms"] == 185 / 1e3
    delays = {d.name: d for d in timeline.comm_delays([step])}
    assert delays[DISPATCH] == timeline.CommDelay(DISPATCH, 2.0, 200.0, 220.0, 95.0, 92.5)
    assert delays[COMBINE] == timeline.CommDelay(COMBINE, 1.0, None, None, None, None)


def _step_events(i, t0, gap):
    """Step i at t0: a GEMM [t0+100, t0+200), a dispatch [t0+200, t0+200+gap) then a GEMM
    overlapping the dispatch's last 10 us: exposed = gap - 10, overlapped = 10."""
    c = 10 * i
    return [_range(i, t0, 50),
            _launch(c + 1, t0 + 1), _gpu(GEMM, t0 + 100, 100, 7, corr=c + 1, grid=(132, 1, 1)),
            _launch(c + 2, t0 + 2), _gpu(DISPATCH, t0 + 200, gap, 20, corr=c + 2, grid=(16, 1, 1)),
            _launch(c + 3, t0 + 3), _gpu(GEMM, t0 + 190 + gap, 20, 7, corr=c + 3, grid=(116, 1, 1))]


def _three_steps(tmp_path, gaps=(30, 70, 50), step_ms=(1.5, 0.5, 1.0)):
    events = [e for i, gap in enumerate(gaps) for e in _step_events(i, 10_000 * i, gap)]
    meta = {"layer": "te.MoE", "compute_only": False, "chunks": 2, "overlap": False, "sm_carveout": 16, "rank": 1,
            "world": 2, "backend": "nccl_ep", "nccl_ep_mode": "zero_copy", "step_ms": list(step_ms),
            "unprofiled_step_ms": [0.9, 0.7, 0.8, 2.0]}
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps({"traceEvents": events, "te_ep_timeline": meta}))
    return path


def test_overlap_report_takes_medians_over_steps(tmp_path, capsys):
    path = _three_steps(tmp_path)
    report = timeline.analyse(str(path))
    assert report.label == "c2 sm16 r1"
    assert [m["exposed_comm_ms"] for m in report.per_step] == [20 / 1e3, 60 / 1e3, 40 / 1e3]
    assert report.median["exposed_comm_ms"] == 40 / 1e3
    assert report.median["overlapped_comm_ms"] == 10 / 1e3
    assert report.median["step_ms"] == 1.0
    assert report.median["unprofiled_step_ms"] == pytest.approx(0.85)
    assert report.median["span_ms"] == 160 / 1e3  # spans 140, 180, 160
    assert report.median["steps"] == 3
    kernels = {k.name: k for k in timeline.top_kernels(report.steps)}
    assert kernels[GEMM] == timeline.KernelStats(GEMM, "GEMM", 120 / 1e3, 2, 60.0, 132)
    assert kernels[DISPATCH] == timeline.KernelStats(DISPATCH, "communication", 50 / 1e3, 1, 50.0, 16)
    assert [k.name for k in timeline.top_kernels(report.steps, top=1)] == [GEMM]
    assert timeline.median_step(report.steps).name == "te_ep_step 2"

    timeline.main(["overlap", str(path), str(path), "--csv", str(tmp_path / "o.csv")])
    out = capsys.readouterr().out
    assert "chunks=2 comm_sms=0 overlap=False sm_carveout=16, rank 1/2, nccl_ep (zero_copy)" in out, out
    rows = {line[:38].strip(): line[38:].split() for line in out.splitlines() if line[:38].strip()}
    assert rows["exposed comm ms"] == ["0.040", "0.040"], out
    assert rows["overlapped comm ms"] == ["0.010", "0.010"], out
    assert rows["steps"] == ["3", "3"], out
    assert "top 2 kernels" in out and "cutlass::device_kernel" in out, out
    with open(tmp_path / "o.csv") as f:
        csv_rows = list(__import__("csv").DictReader(f))
    assert [r["step"] for r in csv_rows] == ["te_ep_step 0", "te_ep_step 1", "te_ep_step 2", "median"] * 2
    assert [float(r["exposed_comm_ms"]) for r in csv_rows[:4]] == [0.02, 0.06, 0.04, 0.04]


def test_plot_picks_one_step(tmp_path):
    path = _three_steps(tmp_path)
    trace = json.loads(path.read_text())
    lanes = timeline.lanes_from_trace(trace, step=1)
    assert lanes == {7: [(0.0, 100.0, GEMM), (160.0, 20.0, GEMM)], 20: [(100.0, 70.0, DISPATCH)]}
    assert len(timeline.lanes_from_trace(trace)[7]) == 6  # every step's
    with pytest.raises(SystemExit, match="no profiled step 5"):
        timeline.lanes_from_trace(trace, step=5)


@pytest.mark.parametrize("name, kind", [
    (DISPATCH, "communication"),
    (COMBINE, "communication"),
    ("nccl_ep_jit_ht_local_dup_kernel", "communication"),
    ("void nccl_ep::ht::notify_dispatch<8>(int const*, int*, int)", "communication"),
    ("void ht_ep::scan_kernel<8, 128>(ht_ep::scan_param_t)", "communication"),
    ("void ll_ep::dispatch<false, 7168>(void*, float*, int)", "communication"),
    ("ncclEpHtDispatchKernel", "communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    (GEMM, "GEMM"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<"
     "cute::tuple<int, int, int> >, cute::tuple<cute::C<128>, cute::C<256>, cute::C<64> > > >(Params)", "GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "GEMM"),
    ("void at::cuda::detail::prepare_grouped_gemm_data<c10::BFloat16>(c10::BFloat16*, int*)", "GEMM"),
    ("void te_ep::nccl_ep::(anonymous namespace)::finish_prepare_kernel(int const*, int*)", "te_ep"),
    ("void te_ep::permutation::permute_kernel<__nv_bfloat16, 8>(te_ep::PermuteArgs)", "te_ep"),
    # "weight_", "fill_", "all_" hold ht_ / ll_ inside a word: not NCCL EP's.
    ("void at::native::weight_norm_fwd_first_dim_kernel<float, float>(float*, float*)", "other"),
    ("void at::native::(anonymous namespace)::fill_reverse_indices_kernel<long>(long*, int)", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int)",
     "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<bool, at::native::func_wrapper_t<bool, "
     "at::native::and_kernel_cuda(at::TensorIterator&)::{lambda(bool, bool)#1}>, unsigned int, bool, 4> >(int)",
     "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_kinds_of_real_kernel_names(name, kind):
    assert timeline.kind_of(name) == kind


@pytest.mark.parametrize("name, short", [
    ("void ht_ep::scan_kernel<8, 128>(ht_ep::scan_param_t)", "ht_ep::scan_kernel<8, 128>"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("Memset (Device)", "Memset (Device)"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
    ("void " + "k" * 80 + "(int)", "k" * 61 + "..."),
])
def test_short_kernel_names(name, short):
    assert timeline.short_name(name) == short


def test_bench_moe_layer_builders_import_as_a_package_module():
    """record builds its layers with bench_moe_layer's own builders: the module imports as
    benchmarks.bench_moe_layer (its _common from the package), not only as a script."""
    from benchmarks import bench_moe_layer

    assert bench_moe_layer._common.__name__ == "benchmarks._common"
    assert callable(bench_moe_layer.setup) and callable(bench_moe_layer.make_moe)
    assert bench_moe_layer.Setup._fields == ("dtype", "normalize", "gemm", "alignment", "native", "x", "grad_out")


# ---- record under torchrun (CPU: gloo, reference backend, tiny dims), then overlap -------------

TINY = ["--cpu", "--tokens", "12", "--hidden", "16", "--ffn", "16", "--experts", "4", "--top-k", "2", "--warmup", "1"]
SCRIPT = Path(timeline.__file__)


def _check_cpu_reports(reports, steps):
    for r, n in zip(reports, steps):
        assert [s.name for s in r.steps] == [f"te_ep_step {i}" for i in range(n)]
        assert all(s.ops == [] for s in r.steps)  # CPU: no GPU lanes
        assert len(r.meta["step_ms"]) == len(r.meta["unprofiled_step_ms"]) == n
        assert all(m["host_ms"] > 0 and m["step_ms"] > 0 for m in r.per_step)
        # The timer's step lies inside its record_function range on the host.
        assert all(m["step_ms"] <= m["host_ms"] for m in r.per_step)
        assert r.median["span_ms"] is None


def test_record_then_overlap_cpu(tmp_path, capsys):
    from _dist import run_torchrun

    out = run_torchrun(SCRIPT, "record", "--out-dir", tmp_path / "c2", "--chunks", "2", "--sm-carveout", "4", *TINY,
                       nprocs=2, timeout=120, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert "sm carveout: 4 SMs left free" in out, out
    assert "te.MoE, chunks=2, overlap=False, backend reference" in out, out
    step_lines = [line for line in out.splitlines() if line.startswith("te_ep_step ")]
    assert [line.split(":")[0] for line in step_lines] == ["te_ep_step 0", "te_ep_step 1", "te_ep_step 2"], out
    assert "the same steps unprofiled, just before" in out, out

    paths = [str(tmp_path / "c2" / f"rank{r}.json") for r in (0, 1)]
    capsys.readouterr()
    reports = timeline.overlap(paths, str(tmp_path / "o.csv"))
    printed = capsys.readouterr().out
    assert [r.label for r in reports] == ["c2 sm4 r0", "c2 sm4 r1"], printed
    _check_cpu_reports(reports, (3, 3))
    assert [(r.meta["rank"], r.meta["world"], r.meta["chunks"], r.meta["sm_carveout"], r.meta["backend"])
            for r in reports] == [(0, 2, 2, 4, "reference"), (1, 2, 2, 4, "reference")]
    assert "no GPU operations in the profiled steps" in printed
    with open(tmp_path / "o.csv") as f:
        assert len(list(__import__("csv").DictReader(f))) == 2 * (3 + 1)


def test_record_compute_only_cpu(tmp_path):
    """--compute-only records bench_moe_layer's compute-only stand-in; one rank, started as
    torchrun would (its environment), without torchrun's own interpreter."""
    import socket
    import subprocess
    import sys

    from _dist import subprocess_env

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = subprocess_env(OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port))
    run = subprocess.run([sys.executable, str(SCRIPT), "record", "--out-dir", str(tmp_path), "--compute-only",
                          "--steps", "2", *TINY], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert "compute-only stand-in of te.MoE, chunks=1" in run.stdout and "sm carveout: none" in run.stdout, run.stdout
    report = timeline.analyse(str(tmp_path / "rank0.json"))
    _check_cpu_reports([report], (2,))
    assert report.label == "compute r0" and report.meta["compute_only"] and report.meta["sm_carveout"] is None
    refused = subprocess.run([sys.executable, str(SCRIPT), "record", "--out-dir", str(tmp_path), "--compute-only",
                              "--chunks", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=60)
    assert refused.returncode == 2 and "--compute-only has no communication" in refused.stdout, refused.stdout


def test_gaps_name_the_host_calls_behind_each_idle_stretch(capsys):
    """``gaps``: an idle stretch is cut between the last operation to end and the next to start,
    on any stream; its ``late`` part runs until the next operation's launch (by correlation id)
    and the host calls named are those of the launching thread that hold that launch."""
    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
                "args": {"correlation": corr}}

    def kernel(name, ts, dur, stream, corr):
        e = _kernel(name, ts, dur, stream)
        e["args"]["correlation"] = corr
        return e

    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "te_ep_step 0", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 10, "tid": 1},
        launch(1, 2),
        kernel("sm90_xmma_gemm_bf16", 10, 100, 7, 1),          # [10, 110)
        launch(2, 20),
        kernel("ncclEpHtDispatchKernel", 50, 80, 21, 2),       # [50, 130): overlaps the GEMM
        # The next kernel's launch (at 300) comes 170 us after the GPU went idle (130), inside
        # te_ep::dispatch inside autograd's engine on thread 2.
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: X", "ts": 250, "dur": 100,
         "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": "te_ep::dispatch", "ts": 280, "dur": 40, "tid": 2},
        launch(3, 300, tid=2),
        kernel("te_ep::zones::glu_kernel", 320, 10, 7, 3),     # idle [130, 320): 190 us, 170 late
        launch(4, 305, tid=2),
        kernel("sm90_xmma_gemm_bf16", 333, 10, 7, 4),          # idle [330, 333): under min_us
        kernel("Memset (Device)", 400, 5, 7, None),            # no launch in the trace
    ]}
    steps = timeline.steps_from_trace(trace)
    launches, host_ops = timeline.host_calls(trace)
    found = timeline.step_gaps(steps[0], launches, host_ops, min_us=5.0)
    assert [(g.at, g.length, g.host_late) for g in found] == [(120.0, 190.0, 170.0), (333.0, 57.0, None)]
    assert found[0].before == "ncclEpHtDispatchKernel" and found[0].after == "te_ep::zones::glu_kernel"
    assert found[0].host == "autograd::engine::evaluate_function: X > te_ep::dispatch"
    assert found[1].host == "-"
    assert timeline.step_gaps(steps[0], launches, host_ops, min_us=0.0, depth=1)[1].length == 3.0


def test_gaps_report(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    timeline.main(["gaps", str(path), "--min-us", "1"])
    out = capsys.readouterr().out
    # TRACE: busy [100, 180) and [200, 205): one 20 us stretch, no launches in the trace.
    assert "1 idle stretches >= 1 us, 0.020 ms; of it 0.000 ms before the next operation's launch" in out
    assert "sm90_xmma_gemm_bf16 -> Memset (Device) | -" in out
