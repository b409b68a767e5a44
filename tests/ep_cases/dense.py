"""The MoE step (dispatch -> per-expert linear -> weighted combine) forward and backward
against a dense single-process float64 reference, within the per-dtype tolerances."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

import te_ep_torch as te

from .common import TOLERANCES, Step, all_inputs, make_group, rng


@dataclasses.dataclass(frozen=True)
class Layer:
    step: Step
    salt: int = 0  # distinguishes the inputs of layers that share a step


def layer_data(layer: Layer, W: int):
    """Every rank's inputs and the global expert weights, identical on all ranks."""
    st = layer.step
    dtype, H, E = st.torch_dtype(), st.hidden, st.experts_per_rank * W
    idx_all, w_all = all_inputs(st, W, layer.salt)
    xs, gys = [], []
    for r in range(W):
        g = rng(st.seed, r, 100 + layer.salt)
        xs.append(torch.randn(st.num_tokens(r), H, generator=g).to(dtype))
        gys.append(torch.randn(st.num_tokens(r), H, generator=g).to(dtype))
    g = rng(st.seed, 10_000, 200 + layer.salt)
    experts = (torch.randn(E, H, H, generator=g) / math.sqrt(H)).to(dtype)
    return idx_all, w_all, xs, gys, experts


def dense_reference(layer: Layer, W: int):
    """float64 single-process MoE over all ranks' tokens: outputs and grads."""
    idx_all, w_all, xs, gys, experts = layer_data(layer, W)
    Wt = experts.double().requires_grad_()
    xs64 = [x.double().requires_grad_() for x in xs]
    ws64 = [w.double().requires_grad_() for w in w_all]
    ys = []
    for x, w, idx in zip(xs64, ws64, idx_all):
        idx = idx.to(torch.int64)
        y = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            valid = idx[:, k] >= 0
            h = torch.einsum("th,tho->to", x, Wt[idx[:, k].clamp(min=0)])
            y = y + torch.where(valid[:, None], w[:, k : k + 1] * h, torch.zeros(()))
        ys.append(y)
    loss = sum((y * gy.double()).sum() for y, gy in zip(ys, gys))
    loss.backward()
    return ys, [x.grad for x in xs64], [w.grad for w in ws64], Wt.grad


def expert_forward_zones(recv: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, experts_local, dtype):
    """Eager grouped linear: each zone [offs[e-1], offs[e]) times its expert; weighted."""
    segs, off = [], 0
    for e, c in enumerate(counts.tolist()):
        segs.append(recv[off : off + c] @ experts_local[e])
        off += c
    segs.append(torch.zeros(recv.shape[0] - off, recv.shape[1], dtype=dtype, device=recv.device))
    h = torch.cat(segs)
    return (h.float() * weights[:, None]).to(dtype)


def expert_forward_static(recv: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, experts_local, dtype):
    """Static-shape grouped linear for torch.compile: each row's expert comes from
    bucketize(row, cumsum(counts)); rows past the last zone match no expert."""
    cap = recv.shape[0]
    offs = counts.cumsum(0)
    eid = torch.bucketize(torch.arange(cap, device=recv.device, dtype=offs.dtype), offs, right=True)
    h = torch.zeros(cap, recv.shape[1], dtype=torch.float32, device=recv.device)
    for e in range(experts_local.shape[0]):
        h = h + (eid == e)[:, None].float() * (recv @ experts_local[e]).float()
    return (h * weights[:, None]).to(dtype)


def moe_step(handle, x, idx, w, experts_local, expert_fn=expert_forward_zones):
    out = te.ep_dispatch(handle, x, idx, w)
    expert_out = expert_fn(out.tokens, out.weights, out.expert_counts, experts_local, x.dtype)
    return te.ep_combine(handle, expert_out, x.shape[0])


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCES[dtype]
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def case_moe_dense(ctx, layers: Sequence[Layer], interleave: bool = True) -> None:
    """All layers' dispatches, then their combines in reverse order, then one backward
    over all of them; every output and gradient vs the dense reference."""
    dev, r, W = torch.device(ctx.device), ctx.rank, ctx.world_size
    groups, handles, leaves, ys = {}, [], [], []
    for layer in layers:
        st = layer.step
        key = (st.experts_per_rank, st.max_tokens_per_rank())
        if key not in groups:
            groups[key] = make_group(ctx, st)
        group = groups[key]
        handles.append(
            group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
        )
    # Forward: dispatch every layer first, so their routing states coexist.
    pending = []
    for layer, handle in zip(layers, handles):
        st = layer.step
        idx_all, w_all, xs, gys, experts = layer_data(layer, W)
        x = xs[r].to(dev, copy=True).requires_grad_()
        w = w_all[r].to(dev, copy=True).requires_grad_()
        El = st.experts_per_rank
        ex = experts[r * El : (r + 1) * El].to(dev, copy=True).requires_grad_()
        out = te.ep_dispatch(handle, x, idx_all[r].to(dev), w)
        pending.append((out, x))
        leaves.append((x, w, ex, gys[r]))
    order = range(len(layers) - 1, -1, -1) if interleave else range(len(layers))
    ys = [None] * len(layers)
    for i in order:
        out, x = pending[i]
        ex = leaves[i][2]
        expert_out = expert_forward_zones(out.tokens, out.weights, out.expert_counts, ex, x.dtype)
        ys[i] = te.ep_combine(handles[i], expert_out, x.shape[0])
    loss = sum((y.float() * leaf[3].to(dev).float()).sum() for y, leaf in zip(ys, leaves))
    loss.backward()
    for i, layer in enumerate(layers):
        st = layer.step
        dtype = st.torch_dtype()
        ref_y, ref_gx, ref_gw, ref_gW = dense_reference(layer, W)
        x, w, ex, _ = leaves[i]
        El = st.experts_per_rank
        what = f"rank {r} layer {i} {st}"
        assert ys[i].dtype == dtype and ys[i].shape == ref_y[r].shape, (ys[i].dtype, ys[i].shape)
        assert_close_scaled(ys[i], ref_y[r], dtype, f"{what}: y")
        assert_close_scaled(x.grad, ref_gx[r], dtype, f"{what}: grad tokens")
        # topk_weights are float32, but their grads are sums of dtype products
        assert_close_scaled(w.grad, ref_gw[r], dtype, f"{what}: grad topk_weights")
        assert_close_scaled(ex.grad, ref_gW[r * El : (r + 1) * El], dtype, f"{what}: grad expert weights")
    for g in groups.values():
        g.shutdown()


MOE_LAYERS = {
    "fp32": [Layer(Step(dtype="fp32", top_k=2, hidden=32, tokens=(7, 13)))],
    "bf16": [Layer(Step(dtype="bf16", top_k=3, hidden=32, experts_per_rank=8, drop=0.2, tokens=(13, 7, 0)))],
    "fp16": [Layer(Step(dtype="fp16", top_k=2, hidden=16, alignment=8, mode="skew_rank", tokens=(5, 11)))],
    "fp32_topk8_align16": [
        Layer(Step(dtype="fp32", top_k=8, hidden=16, alignment=16, idx_dtype="i32", drop=0.1))
    ],
    # Two layers with different top_k / hidden / alignment / dtype / experts / max_tokens interleaved:
    # dispatch A, dispatch B, combine B, combine A, one backward.
    "two_layers": [
        Layer(Step(dtype="bf16", top_k=2, hidden=32, alignment=8, tokens=(7, 13)), salt=1),
        Layer(Step(dtype="fp32", top_k=4, hidden=48, alignment=1, experts_per_rank=8, idx_dtype="i32",
                   tokens=(9, 0, 4), max_tokens=20), salt=2),
    ],
}

