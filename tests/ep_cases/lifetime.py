"""Lifetime of a handle's routing and of the tensors the ops take and return: micro-batches
in flight, activation checkpointing, the expert output and the saved receive rows after
combine, and what a handle reports about its mode and memory.

A handle holds the routing of its latest prepare, and on nccl_ep's zero-copy mode the
receive rows live in the handle's windows; these cases pin down what a user may rely on
(docs/ops.md) on every backend.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

import te_ep_torch as te

from .common import Step, check_equal, expect_raises, make_group
from .dense import Layer, assert_close_scaled, dense_reference, expert_forward_zones, layer_data, moe_step

# Two micro-batches of one layer: different routing, token counts (a rank without tokens in
# the second at W >= 2) and routing mode, dropped choices in both.
MICRO_BATCHES = (
    Step(dtype="fp32", top_k=2, hidden=16, tokens=(7, 13), max_tokens=16, drop=0.1, seed=60),
    Step(dtype="fp32", top_k=2, hidden=16, tokens=(11, 0, 5), max_tokens=16, drop=0.1, seed=61, mode="skew_rank"),
)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    gy: torch.Tensor  # gradient of the layer output


def _batch(ctx, step: Step) -> _Batch:
    idx_all, w_all, xs, gys, _ = layer_data(Layer(step), ctx.world_size)
    r, dev = ctx.rank, torch.device(ctx.device)
    return _Batch(xs[r].to(dev), idx_all[r].to(dev), w_all[r].to(dev), gys[r].to(dev))


def _local_experts(ctx, step: Step) -> torch.Tensor:
    *_, experts = layer_data(Layer(step), ctx.world_size)
    El = step.experts_per_rank
    return experts[ctx.rank * El : (ctx.rank + 1) * El].to(ctx.device)


def _forward(handle, batch: _Batch, experts: torch.Tensor, checkpointed: bool = False):
    """(y, x, w): the MoE step of one micro-batch on fresh leaves x and w."""
    x = batch.x.clone().requires_grad_()
    w = batch.w.clone().requires_grad_()
    if checkpointed:
        y = checkpoint(moe_step, handle, x, batch.idx, w, experts, use_reentrant=False)
    else:
        y = moe_step(handle, x, batch.idx, w, experts)
    return y, x, w


def _same(ctx, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Bit-exact on the reference backend (deterministic, the same ops in the same order);
    elsewhere within the dtype's tolerance, as the order of rows in a zone may vary."""
    where = f"rank {ctx.rank}"
    if ctx.backend == "reference":
        check_equal(what, actual.detach().cpu(), expected.detach().cpu(), where)
    else:
        assert_close_scaled(actual, expected, dtype, f"{where}: {what}")


def case_lifetime_microbatches(ctx) -> None:
    """Two micro-batches in flight (both forwards, then both backwards). On one handle the
    second forward re-prepares it, so the first backward raises on every rank alike (no
    collective starts, nobody hangs). With a handle per micro-batch in flight, outputs and
    gradients (tokens, topk_weights, expert weights) equal those of running each
    micro-batch forward + backward in turn."""
    st = MICRO_BATCHES[0]
    dtype = st.torch_dtype()
    group = make_group(ctx, st)
    batches = [_batch(ctx, s) for s in MICRO_BATCHES]
    experts = _local_experts(ctx, st)

    def new_handle():
        return group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=dtype, alignment=st.alignment)

    shared = new_handle()
    ex = experts.clone().requires_grad_()
    (y1, _, _), _ = [_forward(shared, b, ex) for b in batches]
    msg = expect_raises(lambda: y1.backward(batches[0].gy), "prepared again")
    assert str(shared.id) in msg, msg

    def run(handles, in_flight: bool) -> list:
        """Micro-batch i on handles[i]; outputs and gradients."""
        ex = experts.clone().requires_grad_()
        fwds = []
        for h, b in zip(handles, batches):
            fwds.append(_forward(h, b, ex))
            if not in_flight:
                fwds[-1][0].backward(b.gy)
        if in_flight:
            for (y, _, _), b in zip(fwds, batches):
                y.backward(b.gy)
        return [t for y, x, w in fwds for t in (y.detach(), x.grad, w.grad)] + [ex.grad]

    in_flight = run([new_handle(), new_handle()], in_flight=True)
    # the handle whose stale backward raised serves on: the error left nothing half done
    sequential = run([shared, shared], in_flight=False)
    names = [f"micro-batch {i} {n}" for i in (1, 2) for n in ("y", "grad tokens", "grad topk_weights")]
    for name, a, b in zip(names + ["grad expert weights"], in_flight, sequential):
        _same(ctx, a, b, dtype, f"in flight vs one after the other: {name}")
    group.shutdown()


def case_lifetime_checkpoint(ctx) -> None:
    """The MoE step under torch.utils.checkpoint(use_reentrant=False) gives the output and
    gradients of the plain step, two steps in a row on the same handle. Backward runs the
    forward again, dispatch and combine included: collectives that every rank recomputes
    alike, which prepare the handle again with the same routing."""
    st = MICRO_BATCHES[0]
    dtype = st.torch_dtype()
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=dtype, alignment=st.alignment)
    batches = [_batch(ctx, s) for s in MICRO_BATCHES]
    experts = _local_experts(ctx, st)
    results = {}
    for checkpointed in (False, True):
        ex = experts.clone().requires_grad_()
        got = []
        for b in batches:
            y, x, w = _forward(handle, b, ex, checkpointed)
            y.backward(b.gy)
            got += [y.detach(), x.grad, w.grad]
        results[checkpointed] = got + [ex.grad]
    names = [f"step {i} {n}" for i in (1, 2) for n in ("y", "grad tokens", "grad topk_weights")]
    for name, a, b in zip(names + ["grad expert weights"], results[True], results[False]):
        _same(ctx, a, b, dtype, f"checkpointed vs plain: {name}")
    group.shutdown()


def case_lifetime_expert_out_after_combine(ctx) -> None:
    """The expert output passed to ep_combine and the receive rows autograd saved for the
    expert weights' gradient keep their values through combine and backward; the output and
    gradients match the dense reference.

    Where ``EpHandle.combine_buffer()`` returns a tensor (nccl_ep's zero-copy mode; None on
    the reference backend and staged handles), writing the expert output into it and
    combining the buffer gives what combining the output gives. Combine consumes the
    buffer's content (NCCL EP reduces in place), so it is written before every combine of
    it and never read back afterwards."""
    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(dtype="bf16", top_k=3, hidden=32, alignment=8, tokens=(9, 4, 13), drop=0.1, seed=63)
    dtype, layer = st.torch_dtype(), Layer(st)
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=dtype, alignment=st.alignment)
    idx_all, w_all, xs, gys, experts = layer_data(layer, W)
    El = st.experts_per_rank
    x = xs[r].to(dev, copy=True).requires_grad_()
    w = w_all[r].to(dev, copy=True).requires_grad_()
    ex = experts[r * El : (r + 1) * El].to(dev, copy=True).requires_grad_()
    T = x.shape[0]

    out = te.ep_dispatch(handle, x, idx_all[r].to(dev), w)
    recv_before = out.tokens.detach().clone()
    y = expert_forward_zones(out.tokens, out.weights, out.expert_counts, ex, dtype)
    y_before = y.detach().clone()
    z = te.ep_combine(handle, y, T)

    def unchanged(when: str) -> None:
        where = f"rank {r} {when}"
        check_equal("expert output", y.detach().cpu(), y_before.cpu(), where)
        check_equal("receive rows", out.tokens.detach().cpu(), recv_before.cpu(), where)

    unchanged("after combine")
    buf = handle.combine_buffer()
    if buf is not None:
        buf.copy_(y.detach())
        z_buf = te.ep_combine(handle, buf, T)
        assert_close_scaled(z_buf, z, dtype, f"rank {r}: combine of combine_buffer() vs combine of the expert output")
        unchanged("after a combine of combine_buffer()")
    z.backward(gys[r].to(dev))
    unchanged("after backward")

    ref_y, ref_gx, ref_gw, ref_gW = dense_reference(layer, W)
    for name, a, b in zip(("y", "grad tokens", "grad topk_weights", "grad expert weights"),
                          (z, x.grad, w.grad, ex.grad), (ref_y[r], ref_gx[r], ref_gw[r], ref_gW[r * El : (r + 1) * El])):
        assert_close_scaled(a, b, dtype, f"rank {r} {st}: {name} vs dense")
    group.shutdown()


def case_lifetime_recv_overwritten(ctx) -> None:
    """A receive buffer that autograd saved (for the expert weights' gradient) and that a
    later dispatch on the same handle overwrote: on nccl_ep's zero-copy mode the window write
    bumps the saved tensor's version counter, so backward raises "modified by an inplace
    operation" on every rank (no collective is left half done: every rank raises at the same
    saved tensor, after combine's backward and before dispatch's); the handle then serves a
    normal step. Where dispatch returns fresh tensors (the reference backend, staged
    handles), the later dispatch changes nothing and backward gives the gradients of a step
    without it. The later dispatch is the raw op on the same routing (no prepare), which is
    how a raw-op user keeps ``recv_tokens`` past the next dispatch."""
    st = MICRO_BATCHES[0]
    dtype = st.torch_dtype()
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=dtype, alignment=st.alignment)
    batch = _batch(ctx, st)
    experts = _local_experts(ctx, st)

    def step(overwrite: bool) -> list:
        ex = experts.clone().requires_grad_()
        y, x, w = _forward(handle, batch, ex)
        if overwrite:
            # other rows into the same receive buffer, on the routing of the step above
            te.ops.dispatch((2 * batch.x + 1).contiguous(), batch.w, handle.handle_mem, group.group_name, handle.id,
                            handle.config.capacity)
        y.backward(batch.gy)
        return [y.detach(), x.grad, w.grad, ex.grad]

    names = ("y", "grad tokens", "grad topk_weights", "grad expert weights")
    clean = step(overwrite=False)
    if handle.mode == "zero_copy":
        expect_raises(lambda: step(overwrite=True), "modified by an inplace operation")
        after = step(overwrite=False)  # the handle serves on
        for name, a, b in zip(names, after, clean):
            _same(ctx, a, b, dtype, f"a step after the raising backward vs a clean step: {name}")
    else:
        got = step(overwrite=True)
        for name, a, b in zip(names, got, clean):
            _same(ctx, a, b, dtype, f"{handle.mode} handle, receive rows dispatched over before backward: {name}")
    group.shutdown()


def case_handle_mode_and_memory(ctx) -> None:
    """What a handle reports: its mode ("reference" on the reference backend, "zero_copy" or
    "staged" on nccl_ep), its combine buffer (a [capacity, hidden] tensor in zero-copy mode,
    else None) and its device memory (windows only in zero-copy mode)."""
    st = Step(dtype="bf16", top_k=2, hidden=32, alignment=8, seed=62)
    dtype = st.torch_dtype()
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=dtype, alignment=st.alignment)
    modes = ("reference",) if ctx.backend == "reference" else ("zero_copy", "staged")
    assert handle.mode in modes, f"{ctx.backend} handle in mode {handle.mode!r}, expected one of {modes}"
    mem = handle.memory()
    assert set(mem) == {"window_bytes", "handle_mem_bytes"}, mem
    assert all(type(v) is int for v in mem.values()), mem
    assert mem["handle_mem_bytes"] > 0, mem
    buf = handle.combine_buffer()
    cap = handle.config.capacity
    if handle.mode == "zero_copy":
        assert mem["window_bytes"] == 2 * cap * st.hidden * dtype.itemsize, (mem, cap)
        assert buf is not None, "zero-copy handle without a combine buffer"
        assert (tuple(buf.shape), buf.dtype, buf.device) == ((cap, st.hidden), dtype, group.device), (
            tuple(buf.shape), buf.dtype, buf.device)
    else:
        assert mem["window_bytes"] == 0, mem
        assert buf is None, f"{handle.mode} handle returned a combine buffer {tuple(buf.shape)}"
    group.shutdown()
