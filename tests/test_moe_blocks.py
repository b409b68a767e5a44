"""te_ep_torch/testing/moe_blocks.py and benchmarks/bench_moe_layer.py on CPU (gloo, reference backend).

NativeMoEBlock and TeEpMoEBlock must compute the same layer: the same output
and the same gradients (input, router, expert weights) for the same parameters
and input, and both must match a dense single-process computation in float64.
The benchmark script must run under torchrun with ``--device cpu``, and
benchmarks/bench_quantize.py in one process with ``--device cpu``, printing its table
with the bytes each row must count.

Multi-process tests run on the 2-rank worker pool (tests/_dist.py), under a timeout; the
benchmark under torchrun (``run_torchrun``).
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import te_ep_torch as te
from _dist import REPO, run_torchrun, subprocess_env
from te_ep_torch.testing.moe_blocks import (
    ComputeOnlyMoEBlock,
    MoEConfig,
    NativeMoEBlock,
    TeEpMoEBlock,
    copy_parameters,
    fwd_bwd,
)

WORLD = 2
TIMEOUT_S = 150
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative L2 error allowed: between the two blocks, and against float64.
BLOCKS_TOL = {"fp32": 1e-5, "bf16": 1e-2}
DENSE_TOL = {"fp32": 1e-4, "bf16": 3e-2}
QUANTITIES = ("output", "grad x", "grad router", "grad w_gate", "grad w_up", "grad w_down")

# name: (dtype, gemm, alignment, tokens on rank 0, tokens on rank 1)
CASES = {
    "fp32-loop-a1": ("fp32", "loop", 1, 24, 17),
    "fp32-grouped_mm-a4": ("fp32", "grouped_mm", 4, 24, 17),
    "bf16-grouped_mm-a16": ("bf16", "grouped_mm", 16, 24, 17),
    "bf16-loop-a8": ("bf16", "loop", 8, 5, 30),
}
HIDDEN, FFN, EXPERTS, TOP_K, MAX_TOKENS = 32, 48, 8, 3, 32


# ---- what the ranks run -----------------------------------------------------------


def _dense(block, x, grad_out, rank, world):
    """The layer in float64 on one rank, every expert's weights gathered; expert grads summed over ranks."""
    full = {}
    for name in ("w_gate", "w_up", "w_down"):
        local = getattr(block, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        full[name] = torch.cat(parts).double().requires_grad_()
    router = block.router.detach().double().requires_grad_()
    leaf = x.detach().double().requires_grad_()
    # Same experts as the blocks chose (float32 scores): float64 could break near-ties differently.
    _, topk_idx = block.route(x)
    weights = (leaf @ router.t()).softmax(dim=-1).gather(1, topk_idx)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(leaf)
    for k in range(topk_idx.shape[1]):
        e = topk_idx[:, k]
        gate = torch.einsum("th,thf->tf", leaf, full["w_gate"][e])
        up = torch.einsum("th,thf->tf", leaf, full["w_up"][e])
        y = torch.einsum("tf,tfh->th", torch.nn.functional.silu(gate) * up, full["w_down"][e])
        out = out + weights[:, k : k + 1] * y
    out.backward(grad_out.double())
    local = block.num_local_experts
    result = {"output": out.detach(), "grad x": leaf.grad, "grad router": router.grad}
    for name, t in full.items():
        dist.all_reduce(t.grad)
        result[f"grad {name}"] = t.grad[rank * local : (rank + 1) * local]
    return result


def _rel(got, ref) -> float:
    got, ref = got.double(), ref.double()
    err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
    return float("inf") if not torch.isfinite(err) else float(err)


class _PoisonedTail(TeEpMoEBlock):
    """Writes NaN into every expert-output row after the last zone (never read by combine)."""

    poisoned_rows = 0

    def _zone_experts(self, tokens, expert_counts):
        y = super()._zone_experts(tokens, expert_counts)
        tail = torch.arange(y.shape[0], device=y.device)[:, None] >= expert_counts.sum()
        self.poisoned_rows = int(tail.sum())
        return torch.where(tail, torch.full_like(y, float("nan")), y)


def _agreement(ctx):
    rank, world = ctx.rank, ctx.world_size
    group = te.EpGroup(num_experts=EXPERTS, max_tokens_per_rank=MAX_TOKENS, backend="reference")
    metrics = {}
    for case, (dtype_name, gemm, alignment, t0, t1) in CASES.items():
        dtype = DTYPES[dtype_name]
        cfg = MoEConfig(hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, top_k=TOP_K, dtype=dtype)
        native = NativeMoEBlock(cfg, device="cpu", alignment=alignment, gemm=gemm, seed=3)
        # Another seed, then a copy: the blocks agree only if copy_parameters works.
        te_block = TeEpMoEBlock(cfg, group, alignment=alignment, gemm=gemm, seed=4)
        copy_parameters(native, te_block)
        gen = torch.Generator().manual_seed(100 + rank)
        tokens = (t0, t1)[rank]
        x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        grad_out = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        ref = fwd_bwd(native, x, grad_out)
        got = fwd_bwd(te_block, x, grad_out)
        dense = _dense(native, x, grad_out, rank, world)
        metrics[case] = {
            "blocks": {q: _rel(got[q], ref[q]) for q in QUANTITIES},
            "native_vs_dense": {q: _rel(ref[q], dense[q]) for q in QUANTITIES},
            "te_vs_dense": {q: _rel(got[q], dense[q]) for q in QUANTITIES},
        }
        te_block.handle.destroy()

    # Rank 0 has no tokens (native block only: te_ep's reference backend can't send nothing yet).
    cfg = MoEConfig(hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, top_k=TOP_K, dtype=torch.float32)
    native = NativeMoEBlock(cfg, device="cpu", alignment=4, gemm="loop", seed=3)
    x = torch.randn((0, 30)[rank], HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    grad_out = torch.randn_like(x)
    ref, dense = fwd_bwd(native, x, grad_out), _dense(native, x, grad_out, rank, world)
    metrics["native_empty_rank"] = {q: _rel(ref[q], dense[q]) if ref[q].numel() else 0.0 for q in QUANTITIES}

    plain = TeEpMoEBlock(cfg, group, alignment=4, gemm="grouped_mm", seed=5)
    poisoned = _PoisonedTail(cfg, group, alignment=4, gemm="grouped_mm", seed=5)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(7 + rank))
    grad_out = torch.randn_like(x)
    a, b = fwd_bwd(plain, x, grad_out), fwd_bwd(poisoned, x, grad_out)
    metrics["poisoned_tail"] = {q: float((a[q] - b[q]).abs().max()) if b[q].isfinite().all() else float("inf")
                                for q in QUANTITIES}
    metrics["poisoned_tail"]["rows"] = poisoned.poisoned_rows
    group.shutdown()
    return metrics


# ---- tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agreement(pools):
    merged = {}
    for metrics in pools.run(WORLD, _agreement, timeout=TIMEOUT_S):
        for case, table in metrics.items():
            dst = merged.setdefault(case, {})
            for key, value in table.items():
                if isinstance(value, dict):
                    inner = dst.setdefault(key, {})
                    for q, v in value.items():
                        inner[q] = max(inner.get(q, 0.0), v)
                else:
                    dst[key] = max(dst.get(key, 0.0), value)
    return merged


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_agree(agreement, case):
    tol = BLOCKS_TOL[CASES[case][0]]
    errors = agreement[case]["blocks"]
    assert all(errors[q] <= tol for q in QUANTITIES), f"relative L2 error te_ep vs native > {tol}: {errors}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block", ["native", "te"])
def test_block_matches_dense_float64(agreement, case, block):
    tol = DENSE_TOL[CASES[case][0]]
    errors = agreement[case][f"{block}_vs_dense"]
    assert all(errors[q] <= tol for q in QUANTITIES), f"relative L2 error {block} vs float64 > {tol}: {errors}"


def test_rows_after_last_zone_are_never_read(agreement):
    # TeEpMoEBlock leaves rows past the last zone as torch._grouped_mm left them (unwritten memory);
    # NaN there must change nothing, forward or backward.
    diffs = agreement["poisoned_tail"]
    assert diffs["rows"] > 0, "no row after the last zone: nothing was poisoned"
    assert all(diffs[q] == 0.0 for q in QUANTITIES), diffs


def test_native_block_with_an_empty_rank(agreement):
    errors = agreement["native_empty_rank"]
    assert all(errors[q] <= DENSE_TOL["fp32"] for q in QUANTITIES), errors


def test_copy_parameters_checks_names_and_shapes():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="shape"):
        copy_parameters(a, b)
    with pytest.raises(ValueError, match="names"):
        copy_parameters(a, torch.nn.Sequential(torch.nn.Linear(4, 3)))
    c = torch.nn.Linear(4, 3)
    copy_parameters(a, c)
    assert torch.equal(a.weight, c.weight) and torch.equal(a.bias, c.bias)


def _run_bench(tmp_path, *extra, timeout=TIMEOUT_S):
    csv_path = tmp_path / "moe_layer.csv"
    output = run_torchrun(REPO / "benchmarks" / "bench_moe_layer.py", "--device", "cpu", "--warmup", "1",
                          "--iters", "2", "--csv", str(csv_path), *extra, nprocs=WORLD, timeout=timeout, cwd=tmp_path,
                          OMP_NUM_THREADS="1")
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    return output, rows


def has_chunks_option() -> bool:
    """Whether this te_ep_torch's EpOptions has ``chunks`` (the bench's --chunks N != 1 needs it)."""
    import dataclasses

    return "chunks" in {f.name for f in dataclasses.fields(te.EpOptions)}


def _blocks(rows):
    return [(r["block"], r["backend"], r["mode"]) for r in rows]


def test_bench_moe_layer_cpu(tmp_path):
    """te.MoE (default capacity: the worst case) against the native block, and its compute-only stand-in."""
    output, rows = _run_bench(tmp_path)
    assert "fwd+bwd ms" in output and "tokens/s/GPU" in output, output
    assert "normalize_weights=False (te.MoE's default)" in output, output
    for q in QUANTITIES:
        assert any(line.split()[:len(q.split())] == q.split() and line.rstrip().endswith("ok")
                   for line in output.splitlines()), f"no passing verify line for {q!r}:\n{output}"
    assert "verify te_ep[reference, eager] vs native" in output, output
    assert "MISMATCH" not in output and "FAILED" not in output, output
    assert _blocks(rows) == [("native", "-", "eager"), ("te_ep", "reference", "eager"),
                             ("compute", "reference", "eager")]
    assert float(rows[0]["speedup"]) == 1.0
    assert all(float(r["step_ms"]) > 0 and float(r["tokens_per_s_per_gpu"]) > 0 for r in rows)
    te_ep, compute = rows[1], rows[2]
    # The default capacity (the stand-in gets the layer's).
    assert int(te_ep["capacity"]) == int(compute["capacity"]) > 0, rows
    exposed = float(te_ep["exposed_comm_ms"])
    assert abs(exposed - (float(te_ep["step_ms"]) - float(compute["step_ms"]))) < 1e-9
    assert abs(float(te_ep["exposed_comm_pct"]) - 100 * exposed / float(te_ep["step_ms"])) < 1e-6
    assert (f"exposed comm te_ep[reference, eager] = te_ep time - compute-only time: fwd+bwd "
            f"{float(te_ep['step_ms']):.3f} - {float(compute['step_ms']):.3f}" in output), output
    assert f"({float(te_ep['exposed_comm_pct']):.1f}% of the te_ep step" in output, output


def test_bench_moe_layer_cpu_shared_expert_overlap_and_capacity(tmp_path):
    """--shared-ffn gives both layers the same shared expert (verified: its three gradients too);
    --overlap adds MoE(overlap=True) (sequential on CPU, same results), and with --comm-sms K its
    comm_sms=K twin; --capacity-headroom sizes the handles for this routing and adds the
    default-capacity row."""
    output, rows = _run_bench(tmp_path, "--overlap", "--comm-sms", "0,8", "--shared-ffn", "24",
                              "--capacity-headroom", "1.1")
    for q in ("grad shared_gate", "grad shared_up", "grad shared_down"):
        assert sum(line.split()[:2] == q.split() and line.rstrip().endswith("ok") for line in output.splitlines()) == 4, (
            f"{q} not verified for the four te_ep layers:\n{output}")
    assert "MISMATCH" not in output and "FAILED" not in output, output
    assert [r["block"] for r in rows] == ["native", "te_ep", "te_ep-default", "te_ep-overlap", "te_ep-overlap-sms8",
                                          "compute"]
    assert int(rows[2]["capacity"]) > int(rows[1]["capacity"]) == int(rows[3]["capacity"]), rows
    assert "exposed comm te_ep-overlap[reference, eager]" in output, output


def test_bench_moe_layer_cpu_fp8(tmp_path):
    """--fp8 adds MoE(dispatch_dtype="fp8") per backend, verified against native with the FP8 tolerance."""
    output, rows = _run_bench(tmp_path, "--fp8", "--hidden", "128")
    assert "verify te_ep-fp8[reference, eager] vs native (relative L2 tolerance 0.08" in output, output
    assert "MISMATCH" not in output and "FAILED" not in output, output
    assert [r["block"] for r in rows] == ["native", "te_ep", "te_ep-fp8", "compute"]
    assert "exposed comm te_ep-fp8[reference, eager]" in output, output


def test_bench_moe_layer_cpu_bf16_grouped_mm(tmp_path):
    output, rows = _run_bench(tmp_path, "--dtype", "bf16", "--gemm", "grouped_mm", "--backend", "auto", "reference",
                              "--alignment", "8", "--top-k", "3")
    assert "resolves to reference, already measured" in output, output
    assert "MISMATCH" not in output, output
    assert [r["gemm"] for r in rows] == ["grouped_mm"] * 3
    assert [r["dtype"] for r in rows] == ["bf16"] * 3
    assert [r["alignment"] for r in rows] == ["8"] * 3


def test_bench_moe_layer_cpu_without_compute_only_and_chunks(tmp_path):
    """--no-compute-only: no compute-only row, no exposed-comm line. --chunks 1,2 --comm-sms 0,8
    (in the same run: each is a row of its own) adds te.MoE built with te.EpOptions(chunks=2)
    and with comm_sms=8, verified against native. Without the chunks field (an older te_ep_torch) only the first is run, and
    test_bench_moe_layer_cpu_refuses_what_it_cannot_run checks that the bench refuses --chunks."""
    chunks = has_chunks_option()
    output, rows = _run_bench(tmp_path, "--no-compute-only", "--queued",
                              *(["--chunks", "1,2", "--comm-sms", "0,8"] if chunks else []))
    assert [r["block"] for r in rows] == ["native", "te_ep",
                                          *(["te_ep-chunks2", "te_ep-chunks2-sms8"] if chunks else [])], output
    assert "exposed comm" not in output, output
    # --queued: each row's step also timed behind a spin (on CPU the wall time, as every field)
    # and the host's time, in the table and the CSV.
    assert "queued ms" in output and "host ms" in output, output
    assert all(float(r["queued_ms"]) > 0 and float(r["host_ms"]) > 0 for r in rows), rows
    assert "MISMATCH" not in output and "FAILED" not in output, output
    if chunks:
        for name in ("te_ep-chunks2", "te_ep-chunks2-sms8"):
            assert f"verify {name}[reference, eager] vs native" in output, output


def test_bench_moe_layer_cpu_compile(tmp_path):
    """The compile mode: te.MoE under torch.compile(fullgraph=True), verified against native;
    native (not traceable in one graph) timed eager, labelled and noted. Without the compute-only
    stand-in, whose compilation would double the test's time (the eager tests cover its row)."""
    output, rows = _run_bench(tmp_path, "--modes", "compile", "--iters", "1", "--no-compute-only",
                              timeout=3 * TIMEOUT_S)
    assert "verify te_ep[reference, compile] vs native" in output, output
    assert "MISMATCH" not in output and "FAILED" not in output, output
    assert _blocks(rows) == [("native", "-", "eager*"), ("te_ep", "reference", "compile")]
    assert "note: native: torch.compile(fullgraph=True) cannot trace it" in output, output


def test_bench_moe_layer_cpu_refuses_what_it_cannot_run(tmp_path):
    """--cuda-graph needs GPUs; --chunks N != 1 needs EpOptions.chunks (the row is built with
    te.EpOptions(chunks=N)): without the field the run stops before starting, naming it (with
    the field, test_bench_moe_layer_cpu_without_compute_only_and_chunks runs the row)."""
    script = REPO / "benchmarks" / "bench_moe_layer.py"
    env = subprocess_env(CUDA_VISIBLE_DEVICES="")
    graph = subprocess.run([sys.executable, str(script), "--device", "cpu", "--cuda-graph"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert graph.returncode == 2 and "needs --device cuda" in graph.stdout, graph.stdout
    if not has_chunks_option():
        chunks = subprocess.run([sys.executable, str(script), "--device", "cpu", "--chunks", "1,2"], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=TIMEOUT_S)
        assert chunks.returncode == 2 and "has no 'chunks' field" in chunks.stdout, chunks.stdout


# ---- benchmarks/bench_quantize.py (one process, --device cpu) ----------------------------------


def _python(script, *args, cwd) -> subprocess.CompletedProcess:
    """Runs ``script`` in one CPU process; returns the finished process (output in ``stdout``)."""
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    try:
        return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} did not finish within {TIMEOUT_S}s:\n{e.stdout}")


def _quantize_tables(output: str) -> dict:
    """{(T, H, dtype): [(op, bytes, ms, GB/s, x copy, x same), ...]} of bench_quantize's output."""
    tables, rows = {}, None
    for line in output.splitlines():
        m = re.fullmatch(r"T=(\d+) H=(\d+) (\w+)", line.strip())
        if m:
            rows = tables.setdefault((int(m[1]), int(m[2]), m[3]), [])
        elif rows is not None and line.strip() and not line.startswith(("op ", "---", "wrote")):
            *op, num_bytes, ms, gbps, x_copy, x_same = line.split()
            rows.append((" ".join(op), int(num_bytes), float(ms), float(gbps), float(x_copy), float(x_same)))
    return tables


def _quantize_bytes(tokens: int, hidden: int, in_size: int, out_size: int) -> dict:
    """Bytes each row of bench_quantize must count: read + written."""
    fp8 = tokens * hidden + tokens * hidden // 128 * 4  # e4m3 values + float32 scales
    quantize = tokens * hidden * in_size + fp8
    return {"copy": 2 * tokens * hidden * in_size, "copy same bytes": 2 * (quantize // 2), "quantize": quantize,
            "quantize pow2": quantize, "dequantize": fp8 + tokens * hidden * out_size}


def test_bench_quantize_cpu(tmp_path):
    csv_path = tmp_path / "quantize.csv"
    shapes = [(64, 256), (16, 2176)]  # 2176: a multiple of 128, not of 512
    proc = _python(REPO / "benchmarks" / "bench_quantize.py", "--device", "cpu", "--warmup", "1", "--iters", "3",
                   "--shapes", *[f"{t}x{h}" for t, h in shapes], "--csv", str(csv_path), cwd=tmp_path)
    output = proc.stdout
    assert proc.returncode == 0, output
    assert "device: CPU" in output and f"torch {torch.__version__}" in output, output
    tables = _quantize_tables(output)
    assert list(tables) == [(t, h, "bfloat16") for t, h in shapes], output
    for (tokens, hidden, _), rows in tables.items():
        assert [r[0] for r in rows] == ["copy", "copy same bytes", "quantize", "quantize pow2",
                                        "dequantize->bfloat16"], output
        want = _quantize_bytes(tokens, hidden, 2, 2)
        assert [r[1] for r in rows] == [want["copy"], want["copy same bytes"], want["quantize"],
                                        want["quantize pow2"], want["dequantize"]], output
        copy_gbps, same_gbps = rows[0][3], rows[1][3]
        assert rows[0][4] == 1.0 and rows[1][5] == 1.0, output
        for op, num_bytes, ms, gbps, x_copy, x_same in rows:
            assert ms > 0 and gbps > 0, output
            # printed to 4 decimals (ms), 1 (GB/s) and 2 (ratios): compare with matching slack
            assert abs(x_copy - gbps / copy_gbps) <= 0.01 + 0.01 * x_copy, (op, output)
            assert abs(x_same - gbps / same_gbps) <= 0.01 + 0.01 * x_same, (op, output)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["tokens"]), int(r["hidden"]), r["op"]) for r in rows] == [
        (t, h, op) for t, h in shapes for op in ("copy", "copy same bytes", "quantize", "quantize pow2", "dequantize")]
    for r in rows:
        want = _quantize_bytes(int(r["tokens"]), int(r["hidden"]), 2, 2)[r["op"]]
        assert int(r["bytes"]) == want, r
        assert float(r["gbps"]) == pytest.approx(want / (float(r["median_ms"]) * 1e-3) / 1e9), r
    assert [r["out_dtype"] for r in rows[:5]] == ["bfloat16", "uint8", "float8_e4m3fn", "float8_e4m3fn", "bfloat16"]


def test_bench_quantize_cpu_fp32_dequantize_dtype_and_bad_shape(tmp_path):
    script = REPO / "benchmarks" / "bench_quantize.py"
    proc = _python(script, "--device", "cpu", "--warmup", "0", "--iters", "2", "--dtype", "fp32",
                   "--dequantize-dtype", "bf16", "--shapes", "8x384", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    (rows,) = _quantize_tables(proc.stdout).values()
    assert [r[0] for r in rows][-1] == "dequantize->bfloat16", proc.stdout
    want = _quantize_bytes(8, 384, 4, 2)
    assert [r[1] for r in rows] == [want["copy"], want["copy same bytes"], want["quantize"], want["quantize pow2"],
                                    want["dequantize"]], proc.stdout
    # A hidden the op refuses is a usage error naming the argument and the block size.
    proc = _python(script, "--device", "cpu", "--shapes", "8x200", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "argument --shapes: hidden must be a multiple of the FP8 block, 128" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ep_size,ep_rank,alignment", [(1, 0, 1), (2, 1, 8), (4, 2, 16)])
def test_compute_only_block_is_the_layer_on_local_experts(ep_size, ep_rank, alignment):
    """The stand-in computes y[t] = sum_k w[t, k] * expert_{idx[t, k] % E_local}(x[t]) with this
    rank's experts, forward and backward (float64 reference); at EP size 1 that is the layer."""
    cfg = MoEConfig(hidden=16, ffn=24, num_experts=8, top_k=3, dtype=torch.float32)
    block = ComputeOnlyMoEBlock(cfg, ep_rank=ep_rank, ep_size=ep_size, device="cpu", alignment=alignment,
                                gemm="loop", seed=3)
    gen = torch.Generator().manual_seed(ep_size)
    x = torch.randn(11, 16, generator=gen).requires_grad_()
    grad_out = torch.randn(11, 16, generator=gen)
    out = block(x)
    out.backward(grad_out)

    w = {n: getattr(block, n).detach().double().requires_grad_() for n in ("w_gate", "w_up", "w_down")}
    router = block.router.detach().double().requires_grad_()
    leaf = x.detach().double().requires_grad_()
    _, topk_idx = block.route(x.detach())
    weights = (leaf @ router.t()).softmax(dim=-1).gather(1, topk_idx)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    ref = torch.zeros_like(leaf)
    for k in range(cfg.top_k):
        e = topk_idx[:, k] % block.num_local_experts
        h = torch.nn.functional.silu(torch.einsum("th,thf->tf", leaf, w["w_gate"][e]))
        h = h * torch.einsum("th,thf->tf", leaf, w["w_up"][e])
        ref = ref + weights[:, k : k + 1] * torch.einsum("tf,tfh->th", h, w["w_down"][e])
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), leaf.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block.router.grad.double(), router.grad, rtol=1e-4, atol=1e-5)
    for name, t in w.items():
        torch.testing.assert_close(getattr(block, name).grad.double(), t.grad, rtol=1e-4, atol=1e-5)


def test_tutorial_comparison_script_runs(tmp_path):
    text = (REPO / "docs" / "tutorial.md").read_text()
    start = text.index("# compare_blocks.py")
    script = tmp_path / "compare_blocks.py"
    script.write_text(text[start : text.index("```", start)])
    output = run_torchrun(script, nprocs=WORLD, timeout=TIMEOUT_S, OMP_NUM_THREADS="1")
    # Both ranks print: lines may interleave, numbers stay whole.
    diffs = [float(v) for v in re.findall(r"max \|diff\| ([0-9.e+-]+)", output)]
    assert len(diffs) == WORLD * len(QUANTITIES), output
    assert max(diffs) <= 1e-5, output

