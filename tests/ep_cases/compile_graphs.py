"""Static shapes at work: torch.compile, opcheck of every op, agreement of a backend with
the reference backend, and CUDA-graph capture."""

from __future__ import annotations

from typing import Sequence

import torch

import te_ep_torch as te

from .common import Step, all_inputs, check_equal, check_recv, expected_layout, fingerprint, make_group
from .fp8 import zone_sorted
from .dense import (
    Layer,
    assert_close_scaled,
    dense_reference,
    expert_forward_static,
    expert_forward_zones,
    layer_data,
    moe_step,
)


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------
def case_compile(ctx, compile_backend: str) -> None:
    """dispatch -> static-shape grouped linear -> combine under torch.compile(fullgraph=True)
    matches eager, forward and backward; eager matches the dense reference."""
    import torch._dynamo

    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(dtype="fp32", top_k=2, hidden=16, tokens=(8, 5), alignment=4, drop=0.1, seed=40)
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=2, hidden=16, dtype=torch.float32, alignment=4)
    El = group.num_local_experts

    def f(x, idx, w, ex):
        return moe_step(handle, x, idx, w, ex, expert_forward_static)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)
    for salt in (0, 1):  # second call: new routing values, same shapes (no stale state)
        layer = Layer(st, salt=salt)
        idx_all, w_all, xs, gys, experts = layer_data(layer, W)
        results = []
        for fn in (f, compiled):
            x = xs[r].to(dev, copy=True).requires_grad_()
            w = w_all[r].to(dev, copy=True).requires_grad_()
            ex = experts[r * El : (r + 1) * El].to(dev, copy=True).requires_grad_()
            y = fn(x, idx_all[r].to(dev), w, ex)
            y.backward(gys[r].to(dev))
            results.append((y.detach(), x.grad, w.grad, ex.grad))
        for name, a, b in zip(("y", "grad x", "grad w", "grad experts"), results[1], results[0]):
            assert_close_scaled(a, b, torch.float32, f"rank {r} salt {salt} compiled vs eager {name}")
        ref_y, ref_gx, ref_gw, ref_gW = dense_reference(layer, W)
        for name, a, b in zip(("y", "grad x", "grad w", "grad experts"), results[0],
                              (ref_y[r], ref_gx[r], ref_gw[r], ref_gW[r * El : (r + 1) * El])):
            assert_close_scaled(a, b, torch.float32, f"rank {r} salt {salt} eager static vs dense {name}")
    group.shutdown()


def case_compile_many_layers(ctx, compile_backend: str) -> None:
    """More MoE layers than torch._dynamo's recompile limit, each an nn.Module with its own
    handle, each compiled with fullgraph=True: one graph serves them all (under compile the ops
    take the handle as EpHandle.key, an input, not its id as a constant; nothing reads the
    handles' generations, which differ here), and every layer's
    output and gradients match eager. All forwards run before one backward over every layer,
    with a routing per layer, so a call that reached another layer's handle would give wrong
    gradients."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(dtype="fp32", top_k=2, hidden=16, tokens=(8, 5), alignment=4, drop=0.1, seed=44)
    group = make_group(ctx, st)
    El = group.num_local_experts
    num_layers = torch._dynamo.config.recompile_limit + 2

    class MoeLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.handle = group.create_handle(top_k=2, hidden=16, dtype=torch.float32, alignment=4)

        def forward(self, x, idx, w, ex):
            return moe_step(self.handle, x, idx, w, ex, expert_forward_static)

    layers = [MoeLayer() for _ in range(num_layers)]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compile_backend)
    compiled = [torch.compile(layer, fullgraph=True, backend=counter) for layer in layers]
    data = [layer_data(Layer(st, salt=i), W) for i in range(num_layers)]
    # one handle prepared once more, eagerly: the handles' generations differ (eager-only
    # bookkeeping; read under compile, it would be a guard and split the graph)
    layers[0].handle.prepare(data[0][0][r].to(dev))
    results = []
    for mods in (layers, compiled):
        leaves, loss = [], 0
        for mod, (idx_all, w_all, xs, gys, experts) in zip(mods, data):
            x = xs[r].to(dev, copy=True).requires_grad_()
            w = w_all[r].to(dev, copy=True).requires_grad_()
            ex = experts[r * El : (r + 1) * El].to(dev, copy=True).requires_grad_()
            y = mod(x, idx_all[r].to(dev), w, ex)
            loss = loss + (y * gys[r].to(dev)).sum()
            leaves.append((y.detach(), x, w, ex))
        loss.backward()
        results.append([(y, x.grad, w.grad, ex.grad) for y, x, w, ex in leaves])
    if counter.frame_count != 1:
        raise AssertionError(f"rank {r}: {num_layers} MoE layers compiled {counter.frame_count} graphs, expected 1")
    for i, (eager, comp) in enumerate(zip(*results)):
        for name, a, b in zip(("y", "grad x", "grad w", "grad experts"), comp, eager):
            assert_close_scaled(a, b, torch.float32, f"rank {r} layer {i} compiled vs eager {name}")
    group.shutdown()


# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------
def case_opcheck(ctx, which: int) -> None:
    """torch.library.opcheck of every communication op; all ranks run the same calls, so
    the collectives inside line up."""
    from torch.library import opcheck

    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    ops = torch.ops.te_ep
    steps = (Step(top_k=2, hidden=16, dtype="bf16", tokens=(5, 7), alignment=8, seed=50),
             # a rank without tokens: zero-row tensors through every op and its fake kernel
             Step(top_k=3, hidden=16, dtype="fp32", idx_dtype="i32", tokens=(4, 0), seed=51))
    for st in steps[which : which + 1]:
        group = make_group(ctx, st)
        h = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
        idx_all, w_all = all_inputs(st, W)
        T, cap, gname, El = st.num_tokens(r), h.config.capacity, group.group_name, group.num_local_experts
        idx, w = idx_all[r].to(dev), w_all[r].to(dev)
        x = fingerprint(r, T, st.hidden, st.torch_dtype()).to(dev)
        opcheck(ops.prepare.default, (idx, h.handle_mem, gname, h.id, El))
        # opcheck ran prepare on copies of handle_mem: record this step's routing for real
        ops.prepare(idx, h.handle_mem, gname, h.id, El)
        opcheck(ops.dispatch.default, (x, w, h.handle_mem, gname, h.id, cap))
        recv, recv_w = ops.dispatch(x, w, h.handle_mem, gname, h.id, cap)
        opcheck(ops.combine.default, (recv, h.handle_mem, gname, h.id, T))
        opcheck(ops.dispatch_bwd.default, (recv, recv_w, h.handle_mem, gname, h.id, T, st.top_k))
        opcheck(ops.combine_bwd.default, (x, h.handle_mem, gname, h.id, cap))
        # the form torch.compile calls: handle_id -1 and the handle's key
        opcheck(ops.prepare.default, (idx, h.handle_mem, gname, -1, El, h.key))
        ops.prepare(idx, h.handle_mem, gname, -1, El, h.key)
        opcheck(ops.dispatch.default, (x, w, h.handle_mem, gname, -1, cap, h.key))
        opcheck(ops.combine.default, (recv, h.handle_mem, gname, -1, T, h.key))
        opcheck(ops.dispatch_bwd.default, (recv, recv_w, h.handle_mem, gname, -1, T, st.top_k, h.key))
        opcheck(ops.combine_bwd.default, (x, h.handle_mem, gname, h.id, cap, h.key))
        opcheck(ops.prepare_dispatch.default, (x, idx, w, h.handle_mem, gname, h.id, El, cap))
        opcheck(ops.prepare_dispatch.default, (x, idx, w, h.handle_mem, gname, -1, El, cap, h.key))
        # what it returns for real: the step prepare and dispatch give (the layout, exactly)
        out = ops.prepare_dispatch(x, idx, w, h.handle_mem, gname, h.id, El, cap)
        check_recv(f"rank {r}: prepare_dispatch", *out, expected_layout(idx_all, r, El, st.alignment, cap), w_all,
                   st.hidden, st.torch_dtype(), ordered=group.backend == "reference")
        _opcheck_dispatch_fp8(ctx, st, group, idx_all, w)
        group.shutdown()


# FP8 dispatch scales blocks of 128 values; nccl_ep takes FP8 rows of a multiple of 512.
FP8_OPCHECK_HIDDEN = 512
# opcheck's test_schema compares the float8 input before and after the call with
# torch.allclose, which torch 2.11 lacks for Float8_e4m3fn on CPU ("mul_cpu_reduced_float");
# _opcheck_dispatch_fp8 checks what it would (inputs unchanged, no output aliasing an input).
_FP8_OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _opcheck_dispatch_fp8(ctx, st: Step, group, idx_all, w: torch.Tensor) -> None:
    """opcheck of te_ep.dispatch_fp8 and te_ep.prepare_dispatch_fp8 on an FP8 handle of ``group``
    with the step's routing (``idx_all``: every rank's)."""
    from torch.library import opcheck

    r, dev, ops = ctx.rank, torch.device(ctx.device), torch.ops.te_ep
    idx = idx_all[r].to(dev)
    where = f"rank {r} {st} dispatch_fp8"
    h = group.create_handle(top_k=st.top_k, hidden=FP8_OPCHECK_HIDDEN, dtype=st.torch_dtype(),
                            alignment=st.alignment, dispatch_dtype=torch.float8_e4m3fn)
    T, cap, gname = st.num_tokens(r), h.config.capacity, group.group_name
    q, s = te.quantize_fp8(fingerprint(r, T, FP8_OPCHECK_HIDDEN, st.torch_dtype()).to(dev))
    ops.prepare(idx, h.handle_mem, gname, h.id, group.num_local_experts)
    args = (q, s, w, h.handle_mem, gname, h.id, cap)
    before = [t.clone() for t in (q.view(torch.uint8), s, w)]
    opcheck(ops.dispatch_fp8.default, args, test_utils=_FP8_OPCHECK_UTILS)
    recv_v, recv_s, recv_w = ops.dispatch_fp8(*args)
    for name, t, old in zip(("values", "scales", "topk_weights"), (q.view(torch.uint8), s, w), before):
        check_equal(f"{name} after the call (inputs are not mutable)", t, old, where)
    inputs = {t.untyped_storage().data_ptr() for t in (q, s, w, h.handle_mem) if t.numel()}
    for name, t in (("recv_values", recv_v), ("recv_scales", recv_s), ("recv_weights", recv_w)):
        if t.numel() and t.untyped_storage().data_ptr() in inputs:
            raise AssertionError(f"{where}: {name} aliases an input; the schema declares no alias")
    # combine of the dequantized rows on the FP8 handle (combine stays in the tokens' dtype)
    rows = te.dequantize_fp8(recv_v, recv_s, st.torch_dtype())
    opcheck(ops.combine.default, (rows, h.handle_mem, gname, h.id, T))
    opcheck(ops.dispatch_fp8.default, (q, s, w, h.handle_mem, gname, -1, cap, h.key), test_utils=_FP8_OPCHECK_UTILS)
    # ep_dispatch_fp8's one op: prepare and dispatch_fp8 together, the same rows as the two ops
    El = group.num_local_experts
    fused_args = (q, s, idx, w, h.handle_mem, gname, h.id, El, cap)
    opcheck(ops.prepare_dispatch_fp8.default, fused_args, test_utils=_FP8_OPCHECK_UTILS)
    opcheck(ops.prepare_dispatch_fp8.default, (q, s, idx, w, h.handle_mem, gname, -1, El, cap, h.key),
            test_utils=_FP8_OPCHECK_UTILS)
    ops.prepare(idx, h.handle_mem, gname, h.id, El)
    two = [t.clone() for t in ops.dispatch_fp8(*args)]
    got = ops.prepare_dispatch_fp8(*fused_args)
    rows = [(v.cpu().view(torch.uint8), sc.cpu(), wt.cpu()) for v, sc, wt in (got[:3], two)]
    if group.backend != "reference":  # NCCL EP may order a zone's rows differently in each call
        layout = expected_layout(idx_all, r, El, st.alignment, cap)
        rows = [zone_sorted(*x, layout) for x in rows]
    for name, a, b in zip(("recv_values", "recv_scales", "recv_weights"), *rows):
        check_equal(f"prepare_dispatch_fp8 {name} (as prepare, then dispatch_fp8)", a, b, where)
    counts, total = ops.prepare(idx, h.handle_mem, gname, h.id, El)
    check_equal("prepare_dispatch_fp8 expert_counts", got[3], counts, where)
    check_equal("prepare_dispatch_fp8 total", got[4], total, where)
    for name, t in zip(("recv_values", "recv_scales", "recv_weights", "expert_counts", "total"), got):
        if t.numel() and t.untyped_storage().data_ptr() in inputs:
            raise AssertionError(f"{where}: prepare_dispatch_fp8's {name} aliases an input")


# ---------------------------------------------------------------------------
# backend agreement (GPU: nccl_ep vs reference in one process)
# ---------------------------------------------------------------------------
def case_backend_agreement(ctx, steps: Sequence[Step]) -> None:
    """The backend under test and the reference backend, on the same inputs: same counts,
    same rows per zone (any order), same combine output, same gradients."""
    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    for st in steps:
        outs = {}
        for be in (ctx.backend, "reference"):
            group = make_group(ctx, st, backend=be)
            h = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
            layer = Layer(st)
            idx_all, w_all, xs, gys, experts = layer_data(layer, W)
            x = xs[r].to(dev, copy=True).requires_grad_()
            w = w_all[r].to(dev, copy=True).requires_grad_()
            El = st.experts_per_rank
            ex = experts[r * El : (r + 1) * El].to(dev, copy=True).requires_grad_()
            out = te.ep_dispatch(h, x, idx_all[r].to(dev), w)
            expert_out = expert_forward_zones(out.tokens, out.weights, out.expert_counts, ex, x.dtype)
            y = te.ep_combine(h, expert_out, x.shape[0])
            y.backward(gys[r].to(dev))
            outs[be] = [t.detach().cpu() for t in (out.expert_counts, out.total, y, x.grad, w.grad, ex.grad)]
            # rows per zone as sorted multisets
            zones, off = [], 0
            for c in out.expert_counts.tolist():
                z = out.tokens.detach().cpu()[off : off + c].float()
                zones.append(z[torch.argsort(z[:, 0] * 1e6 + z[:, 1] * 1e3 + z[:, 2])] if c else z)
                off += c
            outs[be].append(zones)
            group.shutdown()
        a, b = outs[ctx.backend], outs["reference"]
        check_equal("expert_counts", a[0], b[0], f"rank {r} {st}")
        check_equal("total", a[1], b[1], f"rank {r} {st}")
        for e, (za, zb) in enumerate(zip(a[6], b[6])):
            assert za.shape == zb.shape and torch.allclose(za, zb, rtol=0, atol=0), f"rank {r} zone {e} rows differ"
        for name, ta, tb in zip(("y", "grad x", "grad w", "grad experts"), a[2:6], b[2:6]):
            assert_close_scaled(ta, tb, st.torch_dtype(), f"rank {r} {st}: {ctx.backend} vs reference {name}")


# ---------------------------------------------------------------------------
# CUDA graphs (GPU backends that never sync the host)
# ---------------------------------------------------------------------------
def _capture_and_replay(step, inputs, compare) -> None:
    """Warms ``step`` up on a side stream, captures ``step(*inputs(0))`` in a CUDA graph, then
    for seeds 1-3 copies ``inputs(seed)`` into the captured inputs, replays, runs ``step``
    eagerly on the same inputs and calls ``compare(seed, replayed, eager)`` (``replayed``: a
    clone of the graph's outputs, a tensor or a tuple of tensors). The graph is destroyed
    before returning: it holds NCCL resources that the group's shutdown frees."""
    static = inputs(0)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(*static)
        for seed in (1, 2, 3):
            fresh = inputs(seed)
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            replayed = static_out.clone() if isinstance(static_out, torch.Tensor) else [t.clone() for t in static_out]
            eager = step(*fresh)
            torch.cuda.synchronize()
            compare(seed, replayed, eager)
    del graph, static_out


def case_cuda_graph(ctx, fp8: bool = True) -> None:
    """prepare + dispatch + per-expert linear + combine captured once in a CUDA graph;
    replays on fresh tokens and routing (copied into the captured inputs) equal eager.
    Then, with ``fp8``, the same with FP8 dispatch (case_cuda_graph_fp8)."""
    _require_cuda(ctx, "cuda_graph")
    _cuda_graph_bf16(ctx)
    if fp8:
        case_cuda_graph_fp8(ctx)


def _require_cuda(ctx, case: str) -> None:
    if torch.device(ctx.device).type != "cuda":
        raise RuntimeError(f"case {case} captures CUDA graphs: it needs a CUDA device, got {ctx.device!r}")


def _cuda_graph_bf16(ctx) -> None:
    import te_ep_torch as te

    dev = torch.device(ctx.device)
    T, H, K = 96, 128, 2
    group = te.EpGroup(num_experts=4 * ctx.world_size, max_tokens_per_rank=T, backend=ctx.backend)
    handle = group.create_handle(top_k=K, hidden=H, dtype=torch.bfloat16, alignment=16)
    gen = torch.Generator().manual_seed(7)
    w1 = (torch.randn(group.num_experts, H, H, generator=gen) * H**-0.5).to(dev, torch.bfloat16)
    w1 = w1[ctx.rank * group.num_local_experts:(ctx.rank + 1) * group.num_local_experts]

    def step(x, idx, w):
        out = te.ep_dispatch(handle, x, idx, w)
        rows = torch.arange(out.tokens.shape[0], device=dev)
        expert = torch.bucketize(rows, out.expert_counts.cumsum(0), right=True).clamp(max=w1.shape[0] - 1)
        y = torch.bmm(out.tokens[:, None], w1[expert]).squeeze(1) * out.weights[:, None].to(torch.bfloat16)
        return te.ep_combine(handle, y, x.shape[0])

    def inputs(seed):
        g = torch.Generator().manual_seed(1000 * seed + ctx.rank)
        x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
        idx = torch.rand(T, group.num_experts, generator=g).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        w = torch.rand(T, K, generator=g).to(dev)
        return x, idx.to(dev), w

    def compare(seed, replayed, eager):
        assert torch.allclose(replayed.float(), eager.float(), rtol=2e-2, atol=2e-2), (
            f"replay {seed}: max |graph - eager| = {(replayed.float() - eager.float()).abs().max().item()}"
        )

    _capture_and_replay(step, inputs, compare)
    group.shutdown()


def _zone_rows_sorted(values: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
    """Each receive row as its bytes (values, scales, weight), rows sorted within each zone:
    backends other than reference may order a zone differently from one call to the next."""
    rows = torch.cat([values.view(torch.uint8), scales.view(torch.uint8), weights[:, None].view(torch.uint8)], 1)
    rows = rows.cpu()
    out, off = [], 0
    for c in [*counts.tolist(), rows.shape[0] - int(counts.sum())]:  # the zones, then the rows past the last
        out += sorted(row.tobytes() for row in rows[off : off + c].numpy())
        off += c
    if not out:
        return rows
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).reshape(rows.shape)


def case_cuda_graph_fp8(ctx) -> None:
    """case_cuda_graph with FP8 dispatch: prepare + ep_dispatch_fp8 (quantize included) +
    dequantize + a per-expert diagonal linear + combine captured once in a CUDA graph; each
    replay on fresh tokens and routing (copied into the captured inputs) equals eager on the
    same inputs bit for bit: counts, total, the received values, scales and weights (as
    bytes, each zone as a set of rows) and the combine output. Bitwise holds because every
    step between dispatch and combine is elementwise (no GEMM whose algorithm could differ),
    and a token's output sums at most top_k = 2 terms, a sum no order of arrival changes."""
    import te_ep_torch as te

    _require_cuda(ctx, "cuda_graph_fp8")
    dev = torch.device(ctx.device)
    T, H, K = 96, 512, 2  # H: FP8 rows on nccl_ep are a multiple of 512
    group = te.EpGroup(num_experts=4 * ctx.world_size, max_tokens_per_rank=T, backend=ctx.backend)
    handle = group.create_handle(top_k=K, hidden=H, dtype=torch.bfloat16, alignment=16,
                                 dispatch_dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(8)
    diag = (torch.rand(group.num_experts, H, generator=gen) + 0.5).to(dev, torch.bfloat16)
    diag = diag[ctx.rank * group.num_local_experts:(ctx.rank + 1) * group.num_local_experts]

    def step(x, idx, w):
        out = te.ep_dispatch_fp8(handle, x, idx, w)
        tokens = out.dequantize()
        rows = torch.arange(tokens.shape[0], device=dev)
        expert = torch.bucketize(rows, out.expert_counts.cumsum(0), right=True).clamp(max=diag.shape[0] - 1)
        y = tokens * diag[expert] * out.weights[:, None].to(torch.bfloat16)
        return te.ep_combine(handle, y, x.shape[0]), out.values, out.scales, out.weights, out.expert_counts, out.total

    def inputs(seed):
        g = torch.Generator().manual_seed(1000 * seed + ctx.rank)
        # magnitudes spread over binades, so the blocks get different scales
        x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-6, 7, (T, H // 128, 1), generator=g)
                                                        .float()).repeat_interleave(128, 1).reshape(T, H)
        idx = torch.rand(T, group.num_experts, generator=g).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        w = torch.rand(T, K, generator=g)
        return x.to(dev, torch.bfloat16), idx.to(dev), w.to(dev)

    def compare(seed, replayed, eager):
        where = f"rank {ctx.rank} replay {seed} vs eager"
        y_g, v_g, s_g, w_g, c_g, n_g = replayed
        y_e, v_e, s_e, w_e, c_e, n_e = eager
        check_equal("expert_counts", c_g, c_e, where)
        check_equal("total", n_g, n_e, where)
        check_equal("received rows (values, scales, weights as bytes; zones as sets)",
                    _zone_rows_sorted(v_g, s_g, w_g, c_g), _zone_rows_sorted(v_e, s_e, w_e, c_e), where)
        check_equal("combine output (bits)", y_g.view(torch.int16), y_e.view(torch.int16), where)
        if not bool(y_e.abs().gt(0).any()):
            raise AssertionError(f"{where}: the combine output is all zero, the comparison would prove nothing")

    _capture_and_replay(step, inputs, compare)
    group.shutdown()
