"""FP8 dispatch cases: block-scaled e4m3 rows through dispatch, checked exactly.

Values and scales are bytes in transit, so a receive row must equal, bit for bit,
``te.quantize_fp8`` of the sending rank's token (every rank rebuilds every rank's
tokens from the seed and quantizes them itself). On the reference backend the rows
arrive in the documented order; on other backends each zone is compared as a set of
rows. Padding rows: zero values and scale 0. Gradients go back through the
high-precision dispatch backward: the tokens' gradient equals the bfloat16
dispatch's bit for bit for the same row gradient, and the gradient of
``topk_weights`` is computed from the dequantized rows.
"""

from __future__ import annotations

from typing import Sequence

import torch

import te_ep_torch as te

from .common import Step, TeEpOps, all_inputs, capacity_for, check_equal, expected_layout, make_group, rng


def tokens_of(step: Step, src: int) -> torch.Tensor:
    """Rank `src`'s tokens: magnitudes spread over many binades, an all-zero block in row 0."""
    T, H = step.num_tokens(src), step.hidden
    g = rng(step.seed, src, 77)
    x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-12, 12, (T, H // te.ops.FP8_BLOCK, 1), generator=g)
                                                      .float()).repeat_interleave(te.ops.FP8_BLOCK, 1).reshape(T, H)
    if T > 0:
        x[0, : te.ops.FP8_BLOCK] = 0
    return x.to(step.torch_dtype())


def _expected_rows(step: Step, layout, W: int, pow2: bool):
    cap, H = len(layout.slots), step.hidden
    quantized = [te.quantize_fp8(tokens_of(step, r), pow2) for r in range(W)]
    values = torch.zeros(cap, H, dtype=torch.uint8)
    scales = torch.zeros(cap, H // te.ops.FP8_BLOCK, dtype=torch.float32)
    for s, slot in enumerate(layout.slots):
        if slot is not None:
            src, t, _, _ = slot
            values[s] = quantized[src][0][t].view(torch.uint8)
            scales[s] = quantized[src][1][t]
    return values, scales


def zone_sorted(values: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor, layout):
    """Rows of each zone sorted by their bytes (backends other than reference may reorder a zone)."""
    values, scales, weights = values.clone(), scales.clone(), weights.clone()
    off = 0
    for c, n in zip(layout.counts, layout.real):
        if n > 0:
            keys = [bytes(values[off + i].tolist()) + bytes(scales[off + i].view(torch.uint8).tolist())
                    for i in range(n)]
            perm = torch.tensor(sorted(range(n), key=keys.__getitem__))
            values[off : off + n] = values[off : off + n][perm]
            scales[off : off + n] = scales[off : off + n][perm]
            weights[off : off + n] = weights[off : off + n][perm]
        off += c
    return values, scales, weights


def case_fp8_dispatch_exact(ctx, steps: Sequence[Step], pow2: bool = False) -> None:
    for step in steps:
        W, rank = ctx.world_size, ctx.rank
        where = f"rank {rank} {step} pow2={pow2}"
        group = make_group(ctx, step)
        idx_all, w_all = all_inputs(step, W)
        handle = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=step.torch_dtype(),
                                     alignment=step.alignment, capacity=capacity_for(step, group, W, idx_all),
                                     dispatch_dtype=torch.float8_e4m3fn)
        cap = handle.config.capacity
        x = tokens_of(step, rank).to(ctx.device)
        out = te.ep_dispatch_fp8(handle, x, idx_all[rank].to(ctx.device), w_all[rank].to(ctx.device),
                                 pow2_scales=pow2)
        layout = expected_layout(idx_all, rank, step.experts_per_rank, step.alignment, cap)
        check_equal("expert_counts", out.expert_counts.cpu(), torch.tensor(layout.counts, dtype=torch.int32), where)
        check_equal("total", out.total.cpu(), torch.tensor([layout.total], dtype=torch.int32), where)
        if out.values.dtype != torch.float8_e4m3fn or out.scales.dtype != torch.float32:
            raise AssertionError(f"{where}: got {out.values.dtype} values and {out.scales.dtype} scales")
        exp_v, exp_s = _expected_rows(step, layout, W, pow2)
        exp_w = torch.zeros(cap, dtype=torch.float32)
        for s, slot in enumerate(layout.slots):
            if slot is not None:
                exp_w[s] = w_all[slot[0]][slot[1], slot[2]]
        got_v, got_s, got_w = out.values.cpu().view(torch.uint8), out.scales.cpu(), out.weights.detach().cpu()
        if ctx.backend != "reference":
            got_v, got_s, got_w = zone_sorted(got_v, got_s, got_w, layout)
            exp_v, exp_s, exp_w = zone_sorted(exp_v, exp_s, exp_w, layout)
        check_equal("recv_values (bytes)", got_v, exp_v, where)
        check_equal("recv_scales (bits)", got_s.view(torch.int32), exp_s.view(torch.int32), where)
        check_equal("recv_weights", got_w, exp_w, where)
        # Dequantizing gives what the plain kernels give for the same bytes.
        check_equal("dequantize()", out.dequantize().cpu(),
                    te.dequantize_fp8(out.values, out.scales, step.torch_dtype()).cpu(), where)
        # Pre-quantized input takes the same path and gives the same bytes.
        q, s = te.quantize_fp8(x, pow2)
        idx, w = idx_all[rank].to(ctx.device), w_all[rank].to(ctx.device)
        again = te.ep_dispatch_fp8(handle, q, idx, w, scales=s)
        got_again = (again.values.cpu().view(torch.uint8), again.scales.cpu(), again.weights.detach().cpu())
        if ctx.backend != "reference":
            got_again = zone_sorted(*got_again, layout)
        check_equal("pre-quantized values", got_again[0], got_v, where)
        check_equal("pre-quantized scales", got_again[1].view(torch.int32), got_s.view(torch.int32), where)
        # Which ops ep_dispatch_fp8 calls: the quantization, then one op (prepare_dispatch_fp8)
        # without a prepared routing, with or without its autograd Function; dispatch_fp8 alone
        # on a prepared one.
        for requires_grad in (True, False):
            xx, ww = x.clone().requires_grad_(requires_grad), w.clone().requires_grad_(requires_grad)
            with TeEpOps() as called:
                te.ep_dispatch_fp8(handle, xx, idx, ww, pow2_scales=pow2)
            assert called.names == ["quantize_fp8", "prepare_dispatch_fp8"], f"{where}: {called.names}"
            prepared = handle.prepare(idx)
            with TeEpOps() as called:
                te.ep_dispatch_fp8(handle, xx, idx, ww, prepared=prepared, pow2_scales=pow2)
            assert called.names == ["quantize_fp8", "dispatch_fp8"], f"{where}, prepared: {called.names}"
        group.shutdown()


def case_fp8_dispatch_grads(ctx, step: Step) -> None:
    """loss = sum(rows * c * weights[:, None]) on the FP8 and on the bfloat16 dispatch."""
    W, rank = ctx.world_size, ctx.rank
    where = f"rank {rank} {step}"
    group = make_group(ctx, step)
    idx_all, w_all = all_inputs(step, W)
    dtype = step.torch_dtype()
    fp8 = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=dtype, alignment=step.alignment,
                              dispatch_dtype=torch.float8_e4m3fn)
    plain = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=dtype, alignment=step.alignment)
    c = (torch.randn(step.hidden, generator=rng(step.seed, 0, 5)) / 8).to(ctx.device)
    idx = idx_all[rank].to(ctx.device)

    def run(handle, use_fp8):
        # clone: on CPU .to() returns the same tensor, and the runs must not share leaves
        x = tokens_of(step, rank).to(ctx.device).clone().requires_grad_()
        w = w_all[rank].to(ctx.device).clone().requires_grad_()
        if use_fp8:
            out = te.ep_dispatch_fp8(handle, x, idx, w)
            rows = out.dequantize(torch.float32)
        else:
            out = te.ep_dispatch(handle, x, idx, w)
            rows = out.tokens.float()
        (rows * c * out.weights.unsqueeze(1)).sum().backward()
        return x.grad.cpu().clone(), w.grad.cpu().clone()

    gx8, gw8 = run(fp8, True)
    gx, _ = run(plain, False)
    if ctx.backend == "reference":
        check_equal("grad tokens (FP8 vs bf16 dispatch)", gx8, gx, where)
    else:  # the same sums, possibly in another order
        torch.testing.assert_close(gx8, gx, rtol=1e-2, atol=1e-2 * float(gx.abs().max()),
                                   msg=lambda m: f"{where}: grad tokens (FP8 vs bf16 dispatch): {m}")
    # d loss / d w[t, k] = sum(dequantized row of token t * c), 0 for dropped choices.
    q, s = te.quantize_fp8(tokens_of(step, rank), False)
    deq = te.dequantize_fp8(q, s, torch.float32)
    expected = (deq @ c.cpu()).unsqueeze(1).expand(-1, step.top_k) * (idx_all[rank] >= 0)
    torch.testing.assert_close(gw8, expected.float(), rtol=1e-5, atol=1e-5 * float(expected.abs().max()) + 1e-30,
                               msg=lambda m: f"{where}: grad topk_weights: {m}")
    group.shutdown()


def case_fp8_errors(ctx) -> None:
    """FP8-specific argument errors, raised on every rank with names and values."""
    from .common import expect_raises

    step = Step(hidden=512, dtype="bf16")  # nccl_ep's FP8 dispatch needs hidden % 512 == 0
    group = make_group(ctx, step)
    expect_raises(lambda: group.create_handle(top_k=2, hidden=200, dispatch_dtype=torch.float8_e4m3fn),
                  "hidden must be a multiple of 128, got hidden=200", exc=ValueError)
    expect_raises(lambda: group.create_handle(top_k=2, hidden=512, dispatch_dtype=torch.float8_e5m2),
                  "dispatch_dtype must be None or torch.float8_e4m3fn", exc=ValueError)
    plain = group.create_handle(top_k=2, hidden=512)
    idx_all, w_all = all_inputs(step, ctx.world_size)
    x = tokens_of(step, ctx.rank).to(ctx.device)
    idx, w = idx_all[ctx.rank].to(ctx.device), w_all[ctx.rank].to(ctx.device)
    expect_raises(lambda: te.ep_dispatch_fp8(plain, x, idx, w), "created without FP8 dispatch", exc=ValueError)
    fp8 = group.create_handle(top_k=2, hidden=512, dispatch_dtype=torch.float8_e4m3fn)
    expect_raises(lambda: te.ep_dispatch_fp8(fp8, x.float(), idx, w), "tokens must be torch.bfloat16",
                  exc=ValueError)
    # The op itself: scales of the wrong width, agreed on by every rank.
    q, s = te.quantize_fp8(x)
    fp8.prepare(idx)
    bad = s[:, :1].contiguous() if ctx.rank == 0 else s
    expect_raises(lambda: te.ops.dispatch_fp8(q, bad, w, fp8.handle_mem, group.group_name, fp8.id,
                                              fp8.config.capacity),
                  "dispatch_fp8")
    group.shutdown()


FP8_STEPS = [
    Step(hidden=512, top_k=2),
    Step(hidden=512, top_k=3, dtype="fp32", alignment=16, drop=0.3, tokens=(13, 0, 7)),
    Step(hidden=1024, top_k=2, dtype="fp16", mode="skew_rank", idx_dtype="i32"),
    Step(hidden=512, top_k=2, mode="only_rank0", tokens=(7, 0)),
]


def case_fp8_tokens_dtype_one_rank(ctx) -> None:
    """ep_dispatch_fp8 with tokens of a wrong dtype on one rank only (float32 tokens to be
    quantized; bfloat16 tokens given with scales): the check happens in the dispatch_fp8 op,
    after prepare, where the ranks agree on it, so every rank raises in the step and none waits
    for the faulty one: the faulty rank a ValueError naming the argument, the values and the
    handle; the others a RuntimeError naming the op and the faulty rank. The same handle then
    dispatches exactly what it did before the faults."""
    from .common import expect_raises

    step = Step(hidden=512, dtype="bf16")
    W, r, last = ctx.world_size, ctx.rank, ctx.rank == ctx.world_size - 1
    group = make_group(ctx, step)
    handle = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=step.torch_dtype(),
                                 dispatch_dtype=torch.float8_e4m3fn)
    idx_all, w_all = all_inputs(step, W)
    x = tokens_of(step, r).to(ctx.device)
    idx, w = idx_all[r].to(ctx.device), w_all[r].to(ctx.device)
    q, s = te.quantize_fp8(x)
    layout = expected_layout(idx_all, r, step.experts_per_rank, step.alignment, handle.config.capacity)

    def received(out):
        v, sc, wt = out.values.cpu().view(torch.uint8), out.scales.cpu(), out.weights.detach().cpu()
        return zone_sorted(v, sc, wt, layout) if ctx.backend != "reference" else (v, sc, wt)

    clean = received(te.ep_dispatch_fp8(handle, x, idx, w))
    faults = [
        ("float32 tokens", lambda: te.ep_dispatch_fp8(handle, x.float() if last else x, idx, w),
         "ep_dispatch_fp8: tokens must be torch.bfloat16 (the handle's dtype; they are quantized here) or "
         "torch.float8_e4m3fn with scales, got torch.float32"),
        ("bfloat16 tokens with scales", lambda: te.ep_dispatch_fp8(handle, x if last else q, idx, w, scales=s),
         "ep_dispatch_fp8: tokens given with scales must be torch.float8_e4m3fn, got torch.bfloat16"),
    ]
    for kind, call, says in faults:
        if last:
            expect_raises(call, says, f"handle {handle.id}", exc=ValueError)
        else:
            expect_raises(call, "dispatch_fp8", f"rank {W - 1}")
        got = received(te.ep_dispatch_fp8(handle, x, idx, w))
        for name, a, b in zip(("values (bytes)", "scales", "weights"), got, clean):
            check_equal(f"{name} after {kind} on rank {W - 1}", a, b, f"rank {r}")
    group.shutdown()
