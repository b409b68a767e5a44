"""The exact step (dispatch layout, combine and both backward ops checked bit for bit on
the reference backend) over many routings, and two layers' raw ops interleaved."""

from __future__ import annotations

from typing import Sequence

import torch

import te_ep_torch as te

from .common import (
    Layout,
    Step,
    TeEpOps,
    all_inputs,
    capacity_for,
    check_equal,
    check_recv,
    decode_key,
    expected_layout,
    fingerprint,
    make_group,
    poison_next_alloc,
    zone_multiplier,
)


def run_exact_step(ctx, group, handle, step: Step, ep_rank: int, W: int, salt: int = 0, tag: str = "") -> None:
    """One public-API step checked exactly (see the package docstring) on this rank."""
    dev = torch.device(ctx.device)
    dtype, H = step.torch_dtype(), step.hidden
    idx_all, w_all = all_inputs(step, W, salt)
    T = step.num_tokens(ep_rank)
    cap = handle.config.capacity
    layout = expected_layout(idx_all, ep_rank, step.experts_per_rank, step.alignment, cap)
    where = f"rank {ctx.rank} {tag}{step}"
    ordered = group.backend == "reference"

    # prepare alone agrees with the layout (and leaves the handle ready for a re-prepare)
    counts, total = handle.prepare(idx_all[ep_rank].to(dev))
    check_equal("prepare expert_counts", counts.cpu(), torch.tensor(layout.counts, dtype=torch.int32), where)
    check_equal("prepare total", total.cpu(), torch.tensor([layout.total], dtype=torch.int32), where)

    x = fingerprint(ep_rank, T, H, dtype).to(dev, copy=True).requires_grad_()
    w = w_all[ep_rank].to(dev, copy=True).requires_grad_()
    out = te.ep_dispatch(handle, x, idx_all[ep_rank].to(dev), w)
    assert isinstance(out, te.DispatchOutput), type(out)
    check_recv(where, out.tokens, out.weights, out.expert_counts, out.total, layout, w_all, H, dtype, ordered)

    # Expert output = recv row * 2^(g % 4) on real rows; garbage on padding and
    # unused rows, which combine must ignore and whose gradient must go nowhere.
    mult = torch.zeros(cap, 1, dtype=torch.float32)
    garbage = torch.zeros(cap, H, dtype=torch.float32)
    gw = torch.zeros(cap, dtype=torch.float32)
    for s, slot in enumerate(layout.slots):
        if slot is None:
            garbage[s] = 77.0 + s
            gw[s] = 1000.0 + s
        else:
            mult[s] = zone_multiplier(slot[3])
            gw[s] = slot[3] + 1  # grad of recv weight s = its global expert + 1
    # slot[3] holds the zone's expert, the same for any order within the zone
    expert_out = out.tokens * mult.to(dev, dtype) + garbage.to(dev, dtype)
    expert_out.retain_grad()
    out.tokens.retain_grad()
    out.weights.retain_grad()
    # The output of combine comes from NaN-filled memory: a token row combine leaves
    # unwritten (e.g. one whose choices were all dropped) would fail the check.
    poison_next_alloc(dev, T * H * dtype.itemsize)
    y = te.ep_combine(handle, expert_out, T)

    idx64 = idx_all[ep_rank].to(torch.int64)
    valid = idx64 >= 0
    m = torch.where(valid, (2 ** (idx64.clamp(min=0) % 4)).to(torch.float32), torch.zeros(()))
    S = m.sum(1, keepdim=True)
    check_sum("combine output", y.detach().cpu(), (x.detach().cpu().float() * S).to(dtype), where, ordered)

    # backward: grad y = a fingerprint; grad of recv weights = expert id + 1 per slot
    gy = fingerprint(ep_rank + 50, T, H, dtype)
    torch.autograd.backward([y, out.weights], [gy.to(dev), gw.to(dev)])
    # combine backward is a dispatch of gy: compare with the expected fingerprint
    # layout of the gy rows (padding rows zero).
    exp_geo = torch.zeros(cap, H, dtype=dtype)
    for s, slot in enumerate(layout.slots):
        if slot is not None:
            exp_geo[s] = fingerprint(slot[0] + 50, slot[1] + 1, H, dtype)[slot[1]]
    got_geo = expert_out.grad.detach().cpu()
    if not ordered:
        # same permutation as the forward buffer (it is the same routing)
        got_geo = reorder_like(out.tokens.detach().cpu(), got_geo, layout)
    check_equal("combine backward (grad of expert_out)", got_geo, exp_geo, where)
    check_sum("dispatch backward (grad of tokens)", x.grad.cpu(), (gy.float() * S).to(dtype), where, ordered)
    exp_gw = torch.where(valid, (idx64 + 1).to(torch.float32), torch.zeros(()))
    check_equal("dispatch backward (grad of topk_weights)", w.grad.cpu(), exp_gw, where)

    # dispatch's backward op once more, its token gradient allocated from NaN-filled memory:
    # the rows it leaves unwritten must still read zero.
    poison_next_alloc(dev, T * H * dtype.itemsize)
    gx, gwt = torch.ops.te_ep.dispatch_bwd(out.tokens.grad, out.weights.grad, handle.handle_mem, group.group_name,
                                           handle.id, T, step.top_k)
    check_sum("dispatch_bwd on poisoned memory (grad of tokens)", gx.cpu(), (gy.float() * S).to(dtype), where,
              ordered)
    check_equal("dispatch_bwd on poisoned memory (grad of topk_weights)", gwt.cpu(), exp_gw, where)


# A backend may add a rank's rows of one token before sending the partial sum
# back (nccl_ep does, in the token dtype): one extra rounding per source rank.
SUM_RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_sum(what: str, actual: torch.Tensor, expected: torch.Tensor, where: str, exact: bool) -> None:
    """Combine-like sums: bit-exact on the reference backend, within SUM_RTOL elsewhere."""
    if exact or actual.shape != expected.shape or actual.dtype != expected.dtype:
        check_equal(what, actual, expected, where)
        return
    rtol = SUM_RTOL[expected.dtype]
    a, e = actual.float(), expected.float()
    scale = float(e.abs().max()) if e.numel() else 0.0
    if not torch.allclose(a, e, rtol=rtol, atol=rtol * scale):
        err = float((a - e).abs().max())
        raise AssertionError(f"{where}: {what} differs by up to {err} (allowed {rtol} relative to {scale})")


def reorder_like(recv_tokens: torch.Tensor, other: torch.Tensor, layout: Layout) -> torch.Tensor:
    other = other.clone()
    off = 0
    for c, n in zip(layout.counts, layout.real):
        if n > 0:
            perm = decode_key(recv_tokens[off : off + n]).argsort()
            other[off : off + n] = other[off : off + n][perm]
        off += c
    return other


def case_exact_steps(ctx, steps: Sequence[Step]) -> None:
    """Each step on a fresh group + handle, checked exactly; the group is shut down after."""
    for step in steps:
        group = make_group(ctx, step)
        idx_all, _ = all_inputs(step, ctx.world_size)
        handle = group.create_handle(
            top_k=step.top_k,
            hidden=step.hidden,
            dtype=step.torch_dtype(),
            alignment=step.alignment,
            capacity=capacity_for(step, group, ctx.world_size, idx_all),
        )
        run_exact_step(ctx, group, handle, step, ctx.rank, ctx.world_size)
        group.shutdown()


# Steps batched per task (spawning is what costs time on a small machine, not steps).
ROUTING_STEPS = [
    Step(mode="uniform", top_k=2),
    Step(mode="uniform", top_k=1, tokens=(7,)),
    Step(mode="uniform", top_k=3, hidden=24, idx_dtype="i32"),
    Step(mode="uniform", top_k=8, tokens=(13, 7, 0, 5)),
    Step(mode="uniform", top_k=5, dtype="fp16", tokens=(6, 11, 1)),  # top_k > experts_per_rank
    Step(mode="skew_expert", top_k=2, tokens=(13,)),
    Step(mode="skew_rank", top_k=2, experts_per_rank=8, tokens=(13, 9)),
    Step(mode="skew_rank", top_k=4, dtype="fp32", idx_dtype="i32"),
    Step(mode="empty_experts", top_k=2),
    Step(mode="only_rank0", top_k=2, tokens=(7, 0)),
    Step(mode="uniform", top_k=2, drop=0.3),
    Step(mode="uniform", top_k=1, drop=0.5, idx_dtype="i32"),
    Step(mode="skew_expert", top_k=3, drop=0.9),  # many all-dropped tokens
    Step(mode="uniform", top_k=2, drop=1.0),  # nothing sent anywhere
    Step(mode="uniform", top_k=2, tokens=(0,)),  # every rank empty
    Step(mode="uniform", top_k=2, tokens=(0, 7)),  # one rank empty
    Step(mode="uniform", top_k=1, experts_per_rank=8, tokens=(5, 13)),  # most zones hold a row or two
]

# num_experts that are not multiples of 4 (at some world size): only the reference backend
# takes them, and it must handle any E_local, 1 included.
ANY_EXPERTS_STEPS = [
    Step(mode="uniform", top_k=1, experts_per_rank=1, tokens=(5, 13)),
    Step(mode="uniform", top_k=5, experts_per_rank=3, dtype="fp16", tokens=(6, 11, 1)),
    Step(mode="empty_experts", top_k=2, experts_per_rank=3),
    Step(mode="skew_expert", top_k=2, experts_per_rank=2, alignment=16, drop=0.2, tokens=(7, 0, 13)),
    Step(capacity="tight", top_k=3, alignment=8, experts_per_rank=3, tokens=(7, 13, 2)),
]

ALIGNMENT_STEPS = [
    Step(alignment=a, top_k=k, experts_per_rank=e, mode=mode, dtype=dt, idx_dtype=it, drop=drop, tokens=ts)
    for a in (1, 8, 16, 128)
    for (k, e, mode, dt, it, drop, ts) in [
        (2, 4, "uniform", "bf16", "i64", 0.0, (7, 13)),
        (3, 8, "empty_experts", "fp32", "i32", 0.2, (13, 0, 5)),
        (1, 4, "skew_rank", "fp16", "i64", 0.0, (1, 6)),
    ]
]

CAPACITY_STEPS = [
    Step(capacity="plus5", top_k=2),
    Step(capacity="tight", top_k=2, mode="skew_rank"),
    Step(capacity="tight", top_k=3, alignment=8, experts_per_rank=8, tokens=(7, 13, 2)),
    Step(capacity="tight", top_k=2, mode="only_rank0", dtype="fp32"),
]


# ---------------------------------------------------------------------------
# interleaved raw ops of two layers
# ---------------------------------------------------------------------------
def case_two_layers_raw(ctx) -> None:
    """prepare A, prepare B, dispatch A, dispatch B, combine B, combine A, then the
    backward ops in reverse, through torch.ops.te_ep directly. Each handle must
    keep its own routing: B's prepare must not clobber A's."""
    dev, r, W = torch.device(ctx.device), ctx.rank, ctx.world_size
    A = Step(top_k=2, hidden=16, alignment=8, dtype="bf16", idx_dtype="i64", tokens=(7, 13), seed=3)
    B = Step(top_k=3, hidden=24, alignment=1, dtype="fp32", idx_dtype="i32", tokens=(5, 0, 9), seed=4,
             mode="skew_rank")
    # same E and max_tokens: both layers on one group
    group = make_group(ctx, A)
    assert group.num_experts == B.experts_per_rank * W
    ops = torch.ops.te_ep
    st = {}
    for name, step in (("A", A), ("B", B)):
        h = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=step.torch_dtype(),
                                alignment=step.alignment)
        idx_all, w_all = all_inputs(step, W)
        lay = expected_layout(idx_all, r, step.experts_per_rank, step.alignment, h.config.capacity)
        st[name] = dict(step=step, h=h, idx_all=idx_all, w_all=w_all, lay=lay, T=step.num_tokens(r))
    El = group.num_local_experts
    for name in "AB":
        s = st[name]
        counts, total = ops.prepare(s["idx_all"][r].to(dev), s["h"].handle_mem, group.group_name, s["h"].id, El)
        check_equal(f"{name} prepare counts", counts.cpu(), torch.tensor(s["lay"].counts, dtype=torch.int32), name)
        s["counts"], s["total"] = counts, total
    for name in "AB":
        s = st[name]
        step, h = s["step"], s["h"]
        x = fingerprint(r, s["T"], step.hidden, step.torch_dtype()).to(dev)
        rt, rw = ops.dispatch(x, s["w_all"][r].to(dev), h.handle_mem, group.group_name, h.id, h.config.capacity)
        check_recv(f"rank {r} layer {name}", rt, rw, s["counts"], s["total"], s["lay"], s["w_all"],
                   step.hidden, step.torch_dtype(), group.backend == "reference")
        s["rt"], s["x"] = rt, x
    for name in "BA":
        s = st[name]
        step, h = s["step"], s["h"]
        y = ops.combine(s["rt"], h.handle_mem, group.group_name, h.id, s["T"])
        idx64 = s["idx_all"][r].to(torch.int64)
        nvalid = (idx64 >= 0).sum(1, keepdim=True).float()
        check_sum(f"layer {name} combine", y.cpu(), (s["x"].cpu().float() * nvalid).to(step.torch_dtype()), name,
                  group.backend == "reference")
    for name in "BA":
        s = st[name]
        step, h = s["step"], s["h"]
        gy = fingerprint(r + 50, s["T"], step.hidden, step.torch_dtype()).to(dev)
        g_recv = ops.combine_bwd(gy, h.handle_mem, group.group_name, h.id, h.config.capacity)
        # a dispatch of gy without weights: same slots as the forward dispatch
        exp = torch.zeros_like(s["rt"]).cpu()
        for i, slot in enumerate(s["lay"].slots):
            if slot is not None:
                exp[i] = fingerprint(slot[0] + 50, slot[1] + 1, step.hidden, step.torch_dtype())[slot[1]]
        got = g_recv.cpu()
        if group.backend != "reference":
            got = reorder_like(s["rt"].cpu(), got, s["lay"])
        check_equal(f"layer {name} combine_bwd", got, exp, name)
        # grad of recv weight = zone's global expert + 1 (order within a zone is irrelevant)
        # (garbage on padding: dispatch_bwd must ignore it)
        gw = torch.zeros(h.config.capacity, dtype=torch.float32)
        for i, slot in enumerate(s["lay"].slots):
            gw[i] = 1000.0 + i if slot is None else slot[3] + 1
        g_tok, g_w = ops.dispatch_bwd(s["rt"], gw.to(dev), h.handle_mem, group.group_name, h.id, s["T"], step.top_k)
        idx64 = s["idx_all"][r].to(torch.int64)
        nvalid = (idx64 >= 0).sum(1, keepdim=True).float()
        check_sum(f"layer {name} dispatch_bwd tokens", g_tok.cpu(),
                  (s["x"].cpu().float() * nvalid).to(step.torch_dtype()), name, group.backend == "reference")
        exp_gw = torch.where(idx64 >= 0, (idx64 + 1).float(), torch.zeros(()))
        check_equal(f"layer {name} dispatch_bwd weights", g_w.cpu(), exp_gw, name)
    group.shutdown()



def case_no_grad_path(ctx) -> None:
    """ep_dispatch / ep_combine with nothing to differentiate (inputs that do not require grad,
    or torch.no_grad()) call the ops without their autograd Functions: the same combine output
    as through them, and no autograd graph."""
    step = Step(top_k=2, hidden=32, drop=0.2, tokens=(7, 13, 0))
    group = make_group(ctx, step)
    handle = group.create_handle(top_k=step.top_k, hidden=step.hidden, dtype=step.torch_dtype())
    dev = torch.device(ctx.device)
    idx_all, w_all = all_inputs(step, ctx.world_size)
    T = step.num_tokens(ctx.rank)
    x = fingerprint(ctx.rank, T, step.hidden, step.torch_dtype()).to(dev)
    idx, w = idx_all[ctx.rank].to(dev), w_all[ctx.rank].to(dev)
    where = f"rank {ctx.rank} no-grad path"

    def run(requires_grad: bool):
        xx, ww = x.clone().requires_grad_(requires_grad), w.clone().requires_grad_(requires_grad)
        out = te.ep_dispatch(handle, xx, idx, ww)
        expert_out = out.tokens * out.weights[:, None].to(out.tokens.dtype)
        y = te.ep_combine(handle, expert_out, T)
        return out, y

    out, y_graph = run(True)
    assert out.tokens.grad_fn is not None and y_graph.grad_fn is not None, "grad mode with inputs that need grad"
    y_graph = y_graph.detach().cpu()
    out, y_plain = run(False)
    assert out.tokens.grad_fn is None and out.weights.grad_fn is None and y_plain.grad_fn is None
    check_sum("combine output, inputs without grad", y_plain.cpu(), y_graph, where, group.backend == "reference")
    with torch.no_grad():
        out, y_no_grad = run(True)
    assert out.tokens.grad_fn is None and y_no_grad.grad_fn is None
    check_sum("combine output under torch.no_grad()", y_no_grad.cpu(), y_graph, where, group.backend == "reference")
    # Which ops ep_dispatch calls: one (prepare_dispatch) without a prepared routing, with or
    # without its autograd Function; the prepared routing's dispatch alone with one.
    for requires_grad in (True, False):
        xx, ww = x.clone().requires_grad_(requires_grad), w.clone().requires_grad_(requires_grad)
        with TeEpOps() as called:
            te.ep_dispatch(handle, xx, idx, ww)
        assert called.names == ["prepare_dispatch"], f"{where}: requires_grad={requires_grad}: {called.names}"
        prepared = handle.prepare(idx)
        with TeEpOps() as called:
            te.ep_dispatch(handle, xx, idx, ww, prepared=prepared)
        assert called.names == ["dispatch"], f"{where}: requires_grad={requires_grad}, prepared: {called.names}"
    group.shutdown()
