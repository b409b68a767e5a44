"""Multi-rank test bodies for te_ep dispatch / combine, shared by every launcher.

Each case is a module-level function ``case_x(ctx, *args)`` run on every rank of a
group (``ctx`` is a `Ctx`: rank, world_size, device, backend). It raises
(AssertionError / RuntimeError) on failure and returns nothing useful. No pytest
here: the CPU launcher (test_ep_cpu.py, gloo, backend "reference") and the GPU
launcher (gpu/run_suite.py, NCCL, backend "nccl_ep" or "reference") run the same
bodies, listed in `CASES`.

How correctness is established (docs/ops.md is the contract):
* Dispatch is checked exactly: every token row is a fingerprint of (source rank,
  token index) made of small integers that bf16/fp16/fp32 all represent exactly,
  so each receive row tells where it came from. Each rank rebuilds every rank's
  inputs from (seed, rank), computes the expected expert-major layout by itself
  and compares zones, order within a zone (reference backend: source rank, then
  token index; other backends: same rows, any order), weights, padding, counts
  and total.
* Combine and both backward ops are checked exactly too, by scaling each zone by
  a power of two (exact in every dtype) and summing at most 8 such terms, which
  float32 accumulation does without rounding; the result is rounded to the
  token dtype once, exactly like the expected value.
* The full MoE step (dispatch -> per-expert linear -> weighted combine, forward
  and backward) is compared against a dense single-process float64 reference
  with the per-dtype tolerances in `TOLERANCES`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

import te_ep_torch as te

# ---------------------------------------------------------------------------
# tolerances of the dense-reference comparisons (exact checks use torch.equal)
# ---------------------------------------------------------------------------
# Compared: EP result in `dtype` vs a float64 reference computed from the same
# dtype-rounded inputs, so the difference is only the EP path's own rounding.
# That path rounds to `dtype` about four times in a row (expert matmul output,
# weighted product, combine output; in backward the grads of those), each a
# relative error of at most eps/2, and the K-term sums can cancel, so the bound
# is a few eps relative to the magnitude of the terms (hence atol scales with
# max|reference|):
#   float32  eps 1.2e-7: 1e-5 leaves ~40x headroom for H <= 64 dot products.
#   float16  eps 9.8e-4: 5e-3 = ~5 eps.
#   bfloat16 eps 7.8e-3: 3e-2 = ~4 eps.
TOLERANCES = {
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IDX_DTYPES = {"i32": torch.int32, "i64": torch.int64}


# ---------------------------------------------------------------------------
# configuration of one routing step
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """One dispatch/combine step. Sizes that depend on the world size are per-rank."""

    experts_per_rank: int = 2
    top_k: int = 2
    hidden: int = 16
    dtype: str = "bf16"
    idx_dtype: str = "i64"
    alignment: int = 1
    tokens: Sequence[int] = (7, 13)  # T of rank r is tokens[r % len(tokens)]
    max_tokens: Optional[int] = None  # default: max(tokens) + 3 (never a round number)
    mode: str = "uniform"  # see _expert_probs
    drop: float = 0.0  # probability that a choice is -1
    capacity: Optional[str] = None  # None = worst case, "plus5" = worst case + 5, "tight" = exact need
    seed: int = 0

    def num_tokens(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]

    def max_tokens_per_rank(self) -> int:
        return self.max_tokens if self.max_tokens is not None else max(self.tokens) + 3

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def torch_idx_dtype(self) -> torch.dtype:
        return IDX_DTYPES[self.idx_dtype]


def _gen(seed: int, rank: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 7919 + salt) % (2**62))


def _expert_probs(step: Step, world_size: int) -> torch.Tensor:
    """Sampling weights of the global experts for the routing mode of `step`."""
    E = step.experts_per_rank * world_size
    p = torch.ones(E, dtype=torch.float64)
    if step.mode == "uniform":
        pass
    elif step.mode == "skew_expert":  # nearly every token picks the last expert
        p[E - 1] = 1e4
    elif step.mode == "skew_rank":  # nearly all choices land on rank 0
        p[: step.experts_per_rank] = 1e4
    elif step.mode == "empty_experts":  # every third expert and all of the last rank get nothing
        p[1::3] = 0
        if world_size > 1:
            p[(world_size - 1) * step.experts_per_rank :] = 0
    elif step.mode == "only_rank0":  # every other rank receives nothing at all
        p[step.experts_per_rank :] = 0
    else:
        raise ValueError(f"unknown routing mode {step.mode!r}")
    if int((p > 0).sum()) < step.top_k:
        raise ValueError(f"mode {step.mode} leaves fewer than top_k={step.top_k} experts")
    return p


def routing(step: Step, world_size: int, src: int, seed_salt: int = 0):
    """(topk_idx [T, K] in the step's index dtype, topk_weights [T, K] float32) of rank `src`, on CPU."""
    T, K = step.num_tokens(src), step.top_k
    g = _gen(step.seed, src, 1 + seed_salt)
    p = _expert_probs(step, world_size)
    if T > 0:
        idx = torch.multinomial(p.expand(T, -1), K, replacement=False, generator=g)
    else:
        idx = torch.empty(0, K, dtype=torch.int64)
    if step.drop > 0:
        idx = torch.where(torch.rand(T, K, generator=g) < step.drop, torch.full_like(idx, -1), idx)
    w = torch.rand(T, K, generator=g, dtype=torch.float32) + 0.125
    return idx.to(step.torch_idx_dtype()), w


def fingerprint(src: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] rows that encode (src, t): column 0 = src + 1 (never 0, so a padding row
    can't look like a token), column 1 = t % 256, column 2 = t // 256, the rest a
    pattern that catches column mix-ups. All values are integers < 256: exact in
    bf16, fp16 and fp32."""
    assert H >= 4, "fingerprints need hidden >= 4"
    t = torch.arange(T, dtype=torch.int64)[:, None]
    c = torch.arange(H, dtype=torch.int64)[None, :]
    x = (src * 7 + t * 3 + c * 5) % 251
    x[:, 0] = src + 1
    x[:, 1] = t[:, 0] % 256
    x[:, 2] = t[:, 0] // 256
    return x.to(dtype)


def decode_key(rows: torch.Tensor) -> torch.Tensor:
    """(src, t) of fingerprint rows as one sortable int64 key."""
    r = rows.to(torch.float64)
    src = r[:, 0] - 1
    t = r[:, 1] + 256 * r[:, 2]
    return (src * 65536 + t).to(torch.int64)


def zone_multiplier(global_expert: int) -> float:
    """Power of two, so scaling a fingerprint by it is exact in every dtype."""
    return float(2 ** (global_expert % 4))


# ---------------------------------------------------------------------------
# expected receive layout
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    counts: list  # padded rows per local expert
    real: list  # real (unpadded) rows per local expert
    slots: list  # per slot: (src, t, k, global_expert) or None for padding / unused

    @property
    def total(self) -> int:
        return sum(self.counts)


def expected_layout(idx_all: list, rank: int, experts_per_rank: int, alignment: int, capacity: int) -> Layout:
    counts, real, slots = [], [], []
    for e in range(experts_per_rank):
        g = rank * experts_per_rank + e
        pairs = []
        for src, idx in enumerate(idx_all):
            hits = (idx.to(torch.int64) == g).nonzero().tolist()  # row-major: by t
            pairs += [(src, t, k, g) for t, k in hits]
        n = len(pairs)
        padded = -(-n // alignment) * alignment
        counts.append(padded)
        real.append(n)
        slots += pairs + [None] * (padded - n)
    slots += [None] * (capacity - len(slots))
    return Layout(counts, real, slots)


def capacity_for(step: Step, group, world_size: int, idx_all: list) -> Optional[int]:
    if step.capacity is None:
        return None
    if step.capacity == "plus5":
        return group.worst_case_capacity(step.top_k, step.alignment) + 5
    if step.capacity == "tight":  # exactly what the busiest rank needs this step
        need = 0
        for r in range(world_size):
            lay = expected_layout(idx_all, r, step.experts_per_rank, step.alignment, 0)
            need = max(need, lay.total)
        return need
    raise ValueError(step.capacity)


def _fail(what: str, actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{where}: {what} has shape {tuple(actual.shape)} {actual.dtype}, "
            f"expected {tuple(expected.shape)} {expected.dtype}"
        )
    if not torch.equal(actual, expected):
        diff = (actual != expected)
        if diff.dim() > 1:
            diff = diff.flatten(1).any(1)
        bad = diff.nonzero().flatten().tolist()
        i = bad[0]
        raise AssertionError(
            f"{where}: {what} differs in {len(bad)} rows, first at {i}: got {actual[i].tolist()}, "
            f"expected {expected[i].tolist()} (rows {bad[:20]})"
        )


def check_recv(
    where: str,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    total: torch.Tensor,
    layout: Layout,
    w_all: list,
    H: int,
    dtype: torch.dtype,
    ordered: bool,
) -> None:
    """Exact check of one rank's receive buffer against the expected layout."""
    tokens, weights = tokens.detach().cpu(), weights.detach().cpu()
    counts, total = counts.cpu(), total.cpu()
    cap = len(layout.slots)
    _fail("expert_counts", counts, torch.tensor(layout.counts, dtype=torch.int32), where)
    _fail("total", total, torch.tensor([layout.total], dtype=torch.int32), where)
    exp_tok = torch.zeros(cap, H, dtype=dtype)
    exp_w = torch.zeros(cap, dtype=torch.float32)
    for s, slot in enumerate(layout.slots):
        if slot is not None:
            src, t, k, _ = slot
            exp_tok[s] = fingerprint(src, t + 1, H, dtype)[t]
            exp_w[s] = w_all[src][t, k]
    if not ordered:
        # Same rows per zone in any order: sort the real rows of each zone by key.
        tokens, weights = tokens.clone(), weights.clone()
        off = 0
        for c, n in zip(layout.counts, layout.real):
            if n > 0:
                perm = decode_key(tokens[off : off + n]).argsort()
                tokens[off : off + n] = tokens[off : off + n][perm]
                weights[off : off + n] = weights[off : off + n][perm]
            off += c
    _fail("recv_tokens", tokens, exp_tok, where)
    _fail("recv_weights", weights, exp_w, where)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def make_group(ctx, step: Step, backend: Optional[str] = None, process_group=None):
    return te.EpGroup(
        process_group,
        num_experts=step.experts_per_rank * _ep_size(ctx, process_group),
        max_tokens_per_rank=step.max_tokens_per_rank(),
        backend=backend or ctx.backend,
        device=ctx.device,
    )


def _ep_size(ctx, process_group) -> int:
    return ctx.world_size if process_group is None else dist.get_world_size(process_group)


def all_inputs(step: Step, W: int, salt: int = 0):
    """Every rank's (topk_idx, topk_weights) on CPU, rebuilt locally from the seed."""
    pairs = [routing(step, W, r, salt) for r in range(W)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def expect_raises(fn: Callable, *substrings: str, exc=RuntimeError) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
    else:
        raise AssertionError(f"expected {exc.__name__} containing {substrings}, nothing was raised")
    missing = [s for s in substrings if s not in msg]
    if missing:
        raise AssertionError(f"{exc.__name__} message lacks {missing}: {msg!r}")
    return msg


# ---------------------------------------------------------------------------
# the exact step: dispatch layout, combine, and both backward ops
# ---------------------------------------------------------------------------
def run_exact_step(ctx, group, handle, step: Step, ep_rank: int, W: int, salt: int = 0, tag: str = "") -> None:
    """One public-API step checked exactly (see module docstring) on this rank."""
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
    _fail("prepare expert_counts", counts.cpu(), torch.tensor(layout.counts, dtype=torch.int32), where)
    _fail("prepare total", total.cpu(), torch.tensor([layout.total], dtype=torch.int32), where)

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
    y = te.ep_combine(handle, expert_out, T)

    idx64 = idx_all[ep_rank].to(torch.int64)
    valid = idx64 >= 0
    m = torch.where(valid, (2 ** (idx64.clamp(min=0) % 4)).to(torch.float32), torch.zeros(()))
    S = m.sum(1, keepdim=True)
    _fail_sum("combine output", y.detach().cpu(), (x.detach().cpu().float() * S).to(dtype), where, ordered)

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
        got_geo = _reorder_like(out.tokens.detach().cpu(), got_geo, layout)
    _fail("combine backward (grad of expert_out)", got_geo, exp_geo, where)
    _fail_sum("dispatch backward (grad of tokens)", x.grad.cpu(), (gy.float() * S).to(dtype), where, ordered)
    exp_gw = torch.where(valid, (idx64 + 1).to(torch.float32), torch.zeros(()))
    _fail("dispatch backward (grad of topk_weights)", w.grad.cpu(), exp_gw, where)


# A backend may add a rank's rows of one token before sending the partial sum
# back (nccl_ep does, in the token dtype): one extra rounding per source rank.
SUM_RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _fail_sum(what: str, actual: torch.Tensor, expected: torch.Tensor, where: str, exact: bool) -> None:
    """Combine-like sums: bit-exact on the reference backend, within SUM_RTOL elsewhere."""
    if exact or actual.shape != expected.shape or actual.dtype != expected.dtype:
        _fail(what, actual, expected, where)
        return
    rtol = SUM_RTOL[expected.dtype]
    a, e = actual.float(), expected.float()
    scale = float(e.abs().max()) if e.numel() else 0.0
    if not torch.allclose(a, e, rtol=rtol, atol=rtol * scale):
        err = float((a - e).abs().max())
        raise AssertionError(f"{where}: {what} differs by up to {err} (allowed {rtol} relative to {scale})")


def _reorder_like(recv_tokens: torch.Tensor, other: torch.Tensor, layout: Layout) -> torch.Tensor:
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
    Step(mode="uniform", top_k=3, experts_per_rank=4, hidden=24, idx_dtype="i32"),
    Step(mode="uniform", top_k=8, experts_per_rank=4, tokens=(13, 7, 0, 5)),
    Step(mode="uniform", top_k=5, experts_per_rank=3, dtype="fp16", tokens=(6, 11, 1)),
    Step(mode="skew_expert", top_k=2, tokens=(13,)),
    Step(mode="skew_rank", top_k=2, experts_per_rank=2, tokens=(13, 9)),
    Step(mode="skew_rank", top_k=4, experts_per_rank=4, dtype="fp32", idx_dtype="i32"),
    Step(mode="empty_experts", top_k=2, experts_per_rank=3),
    Step(mode="only_rank0", top_k=2, experts_per_rank=2, tokens=(7, 0)),
    Step(mode="uniform", top_k=2, drop=0.3),
    Step(mode="uniform", top_k=1, drop=0.5, idx_dtype="i32"),
    Step(mode="skew_expert", top_k=3, drop=0.9, experts_per_rank=2),  # many all-dropped tokens
    Step(mode="uniform", top_k=2, drop=1.0),  # nothing sent anywhere
    Step(mode="uniform", top_k=2, tokens=(0,)),  # every rank empty
    Step(mode="uniform", top_k=2, tokens=(0, 7)),  # one rank empty
    Step(mode="uniform", top_k=1, experts_per_rank=1, tokens=(5, 13)),
]

ALIGNMENT_STEPS = [
    Step(alignment=a, top_k=k, experts_per_rank=e, mode=mode, dtype=dt, idx_dtype=it, drop=drop, tokens=ts)
    for a in (1, 8, 16, 128)
    for (k, e, mode, dt, it, drop, ts) in [
        (2, 2, "uniform", "bf16", "i64", 0.0, (7, 13)),
        (3, 4, "empty_experts", "fp32", "i32", 0.2, (13, 0, 5)),
        (1, 2, "skew_rank", "fp16", "i64", 0.0, (1, 6)),
    ]
]

CAPACITY_STEPS = [
    Step(capacity="plus5", top_k=2),
    Step(capacity="tight", top_k=2, mode="skew_rank"),
    Step(capacity="tight", top_k=3, alignment=8, experts_per_rank=3, tokens=(7, 13, 2)),
    Step(capacity="tight", top_k=2, mode="only_rank0", dtype="fp32"),
]


# ---------------------------------------------------------------------------
# dense MoE reference: forward + backward with tolerances
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layer:
    step: Step
    salt: int = 0  # distinguishes the inputs of layers that share a step


def _layer_data(layer: Layer, W: int):
    """Every rank's inputs and the global expert weights, identical on all ranks."""
    st = layer.step
    dtype, H, E = st.torch_dtype(), st.hidden, st.experts_per_rank * W
    idx_all, w_all = all_inputs(st, W, layer.salt)
    xs, gys = [], []
    for r in range(W):
        g = _gen(st.seed, r, 100 + layer.salt)
        xs.append(torch.randn(st.num_tokens(r), H, generator=g).to(dtype))
        gys.append(torch.randn(st.num_tokens(r), H, generator=g).to(dtype))
    g = _gen(st.seed, 10_000, 200 + layer.salt)
    experts = (torch.randn(E, H, H, generator=g) / math.sqrt(H)).to(dtype)
    return idx_all, w_all, xs, gys, experts


def dense_reference(layer: Layer, W: int):
    """float64 single-process MoE over all ranks' tokens: outputs and grads."""
    idx_all, w_all, xs, gys, experts = _layer_data(layer, W)
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
        idx_all, w_all, xs, gys, experts = _layer_data(layer, W)
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
    "bf16": [Layer(Step(dtype="bf16", top_k=3, hidden=32, experts_per_rank=3, drop=0.2, tokens=(13, 7, 0)))],
    "fp16": [Layer(Step(dtype="fp16", top_k=2, hidden=16, alignment=8, mode="skew_rank", tokens=(5, 11)))],
    "fp32_topk8_align16": [
        Layer(Step(dtype="fp32", top_k=8, hidden=16, experts_per_rank=4, alignment=16, idx_dtype="i32", drop=0.1))
    ],
    # Two layers with different top_k / hidden / alignment / dtype / max_tokens interleaved:
    # dispatch A, dispatch B, combine B, combine A, one backward.
    "two_layers": [
        Layer(Step(dtype="bf16", top_k=2, hidden=32, alignment=8, tokens=(7, 13)), salt=1),
        Layer(Step(dtype="fp32", top_k=4, hidden=48, alignment=1, experts_per_rank=4, idx_dtype="i32",
                   tokens=(9, 0, 4), max_tokens=20), salt=2),
    ],
}


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
             experts_per_rank=2, mode="skew_rank")
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
        _fail(f"{name} prepare counts", counts.cpu(), torch.tensor(s["lay"].counts, dtype=torch.int32), name)
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
        _fail_sum(f"layer {name} combine", y.cpu(), (s["x"].cpu().float() * nvalid).to(step.torch_dtype()), name,
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
            got = _reorder_like(s["rt"].cpu(), got, s["lay"])
        _fail(f"layer {name} combine_bwd", got, exp, name)
        # grad of recv weight = zone's global expert + 1 (order within a zone is irrelevant)
        # (garbage on padding: dispatch_bwd must ignore it)
        gw = torch.zeros(h.config.capacity, dtype=torch.float32)
        for i, slot in enumerate(s["lay"].slots):
            gw[i] = 1000.0 + i if slot is None else slot[3] + 1
        g_tok, g_w = ops.dispatch_bwd(s["rt"], gw.to(dev), h.handle_mem, group.group_name, h.id, s["T"], step.top_k)
        idx64 = s["idx_all"][r].to(torch.int64)
        nvalid = (idx64 >= 0).sum(1, keepdim=True).float()
        _fail_sum(f"layer {name} dispatch_bwd tokens", g_tok.cpu(),
                  (s["x"].cpu().float() * nvalid).to(step.torch_dtype()), name, group.backend == "reference")
        exp_gw = torch.where(idx64 >= 0, (idx64 + 1).float(), torch.zeros(()))
        _fail(f"layer {name} dispatch_bwd weights", g_w.cpu(), exp_gw, name)
    group.shutdown()


# ---------------------------------------------------------------------------
# bad input: every rank raises, nobody hangs, the group works afterwards
# ---------------------------------------------------------------------------
ERROR_STEP = Step(top_k=2, hidden=16, dtype="bf16", tokens=(5,), max_tokens=8, experts_per_rank=2, seed=11)


@dataclasses.dataclass
class _Env:
    ctx: object
    group: object
    handle: object
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    T: int
    H: int
    K: int
    E: int


def _dispatch(env: _Env, x=None, idx=None, w=None, handle=None):
    return te.ep_dispatch(
        handle if handle is not None else env.handle,
        env.x if x is None else x,
        env.idx if idx is None else idx,
        env.w if w is None else w,
    )


def _bad_then_good_combine(env: _Env, bad: bool, make_bad: Callable):
    """A good dispatch on every rank, then a combine whose arguments are bad on the faulty rank."""
    out = _dispatch(env)
    expert_out = out.tokens.detach()
    num_tokens = env.T
    if bad:
        expert_out, num_tokens = make_bad(env, expert_out, num_tokens)
    return te.ep_combine(env.handle, expert_out, num_tokens)


def _repeat_expert(env):
    idx = env.idx.clone()
    idx[2, 1] = idx[2, 0]
    return idx


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    nc = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).t()
    nc.copy_(t)
    assert not nc.is_contiguous()
    return nc


def _too_many_tokens(env):
    T = env.group.max_tokens_per_rank + 1
    idx = torch.stack([torch.randperm(env.E)[: env.K] for _ in range(T)]).to(env.idx.device, env.idx.dtype)
    x = fingerprint(env.ctx.rank, T, env.H, env.x.dtype).to(env.x.device)
    return x, idx, torch.ones(T, env.K, device=env.w.device)


# A dtype may be spelled the c10 way (docs/ops.md's example: "BFloat16") or the torch way
# ("torch.bfloat16"); the contract asks that it be named, not how.
DT = {
    "bf16": ("BFloat16", "bfloat16"),
    "fp16": ("Half", "float16"),
    "fp32": ("Float", "float32"),
    "fp64": ("Double", "float64"),
}


# name -> (faulty rank as a function of W, the call (env, bad) -> None, substrings the
# faulty rank's message must contain (as a function of env)). The faulty rank alternates
# between the first and the last one so neither is privileged by accident.
BAD_INPUTS = {
    "weights_bf16": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, w=env.w.bfloat16() if bad else None),
        lambda env: ["topk_weights", "float32", DT["bf16"]],
    ),
    "weights_fp64": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, w=env.w.double() if bad else None),
        lambda env: ["topk_weights", "float32", DT["fp64"]],
    ),
    "expert_id_too_large": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, idx=env.idx.clone().index_fill_(0, torch.tensor([3], device=env.idx.device), env.E) if bad else None),
        lambda env: ["topk_idx", str(env.E)],
    ),
    "expert_id_below_minus_one": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, idx=env.idx.clone().fill_(-2) if bad else None),
        lambda env: ["topk_idx", "-2"],
    ),
    "repeated_expert": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, idx=_repeat_expert(env) if bad else None),
        lambda env: ["topk_idx"],
    ),
    "idx_float": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, idx=env.idx.float() if bad else None),
        lambda env: ["topk_idx", DT["fp32"]],
    ),
    "hidden_mismatch": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, x=torch.zeros(env.T, env.H + 1, dtype=env.x.dtype, device=env.x.device) if bad else None),
        lambda env: ["tokens", str(env.H), str(env.H + 1)],
    ),
    "top_k_mismatch": (
        lambda W: 0,
        lambda env, bad: _dispatch(
            env,
            idx=torch.cat([env.idx, torch.full_like(env.idx[:, :1], -1)], 1) if bad else None,
            w=torch.cat([env.w, env.w[:, :1]], 1) if bad else None,
        ),
        lambda env: ["topk_idx", str(env.K), str(env.K + 1)],
    ),
    "weights_shape": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, w=env.w[:, :1].contiguous() if bad else None),
        lambda env: ["topk_weights", str(env.K)],
    ),
    "tokens_rows_differ_from_prepare": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, x=env.x[: env.T - 1] if bad else None),
        lambda env: ["tokens", str(env.T), str(env.T - 1)],
    ),
    "tokens_dtype": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, x=env.x.half() if bad else None),
        lambda env: ["tokens", DT["bf16"], DT["fp16"]],
    ),
    "too_many_tokens": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, *(_too_many_tokens(env) if bad else (None, None, None))),
        lambda env: ["max_tokens_per_rank", str(env.group.max_tokens_per_rank), str(env.group.max_tokens_per_rank + 1)],
    ),
    "non_contiguous_tokens": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, x=_non_contiguous(env.x) if bad else None),
        lambda env: ["tokens", "contiguous"],
    ),
    "non_contiguous_idx": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, idx=_non_contiguous(env.idx) if bad else None),
        lambda env: ["topk_idx", "contiguous"],
    ),
    "non_contiguous_weights": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, w=_non_contiguous(env.w) if bad else None),
        lambda env: ["topk_weights", "contiguous"],
    ),
    "tokens_on_meta_device": (
        lambda W: 0,
        lambda env, bad: _dispatch(env, x=env.x.to("meta") if bad else None),
        lambda env: ["tokens", "meta"],
    ),
    "idx_on_meta_device": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, idx=env.idx.to("meta") if bad else None),
        lambda env: ["topk_idx", "meta"],
    ),
    "combine_num_tokens": (
        lambda W: W - 1,
        lambda env, bad: _bad_then_good_combine(env, bad, lambda env, eo, n: (eo, n + 1)),
        lambda env: ["num_tokens", str(env.T), str(env.T + 1)],
    ),
    "combine_rows": (
        lambda W: 0,
        lambda env, bad: _bad_then_good_combine(env, bad, lambda env, eo, n: (eo[:-1], n)),
        lambda env: ["expert_out", str(env.handle.config.capacity), str(env.handle.config.capacity - 1)],
    ),
    "combine_dtype": (
        lambda W: W - 1,
        lambda env, bad: _bad_then_good_combine(env, bad, lambda env, eo, n: (eo.float(), n)),
        lambda env: ["expert_out", DT["bf16"], DT["fp32"]],
    ),
}


def _error_env(ctx, group, handle) -> _Env:
    dev, st = torch.device(ctx.device), ERROR_STEP
    idx_all, w_all = all_inputs(st, ctx.world_size)
    T = st.num_tokens(ctx.rank)
    x = fingerprint(ctx.rank, T, st.hidden, st.torch_dtype()).to(dev)
    return _Env(ctx, group, handle, x, idx_all[ctx.rank].to(dev), w_all[ctx.rank].to(dev), T, st.hidden,
                st.top_k, group.num_experts)


def check_collective_error(ctx, call: Callable, faulty: set, expected: Sequence[str]) -> None:
    """`call` must raise RuntimeError on every rank: the faulty ranks with their own
    message (containing `expected`), the others naming a faulty rank."""
    try:
        call()
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError(f"rank {ctx.rank}: no error raised (faulty ranks {sorted(faulty)})")
    if ctx.rank in faulty:
        # an entry of `expected` is a substring or a tuple of alternative spellings
        missing = [s for s in expected if not any(a in msg for a in ((s,) if isinstance(s, str) else s))]
        assert not missing, f"rank {ctx.rank} (faulty): message lacks {missing}: {msg!r}"
    else:
        named = [f for f in faulty if f"rank {f}" in msg]
        assert named, f"rank {ctx.rank}: message names none of the faulty ranks {sorted(faulty)}: {msg!r}"
        assert "te_ep." in msg, f"rank {ctx.rank}: message does not name the op: {msg!r}"


def case_bad_inputs(ctx, names: Sequence[str]) -> None:
    """Each bad call raises on every rank; then a good step on the same handle is exact."""
    group = make_group(ctx, ERROR_STEP)
    handle = group.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=ERROR_STEP.torch_dtype())
    env = _error_env(ctx, group, handle)
    for name in names:
        faulty_of, call, expected = BAD_INPUTS[name]
        faulty = faulty_of(ctx.world_size)
        check_collective_error(ctx, lambda: call(env, ctx.rank == faulty), {faulty}, expected(env))
        run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, ctx.world_size, tag=f"after {name}: ")
    group.shutdown()


def case_capacity_overflow(ctx) -> None:
    """A too-small capacity raises `capacity overflow` on every rank in prepare; a step that
    fits works afterwards on the same handle."""
    W = ctx.world_size
    dev = torch.device(ctx.device)
    # Every choice goes to rank 0: 2 * W * 8 rows there, capacity 2 * W.
    hot = Step(top_k=2, hidden=16, tokens=(8,), mode="only_rank0", seed=5)
    group = make_group(ctx, hot)
    # nccl_ep needs capacity >= max_tokens_per_rank (docs/nccl_ep.md); 2 * W * 8 rows still overflow it.
    cap = max(2 * W, group.max_tokens_per_rank)
    handle = group.create_handle(top_k=2, hidden=16, dtype=torch.bfloat16, capacity=cap)
    assert handle.config.capacity == cap
    idx_all, w_all = all_inputs(hot, W)
    x = fingerprint(ctx.rank, 8, 16, torch.bfloat16).to(dev)
    expected = ["capacity", str(cap)]
    check_collective_error(ctx, lambda: handle.prepare(idx_all[ctx.rank].to(dev)), {0}, expected)
    check_collective_error(
        ctx, lambda: te.ep_dispatch(handle, x, idx_all[ctx.rank].to(dev), w_all[ctx.rank].to(dev)), {0}, expected
    )
    # T=1, K=2: at most 2 * W rows per rank, which fits.
    small = Step(top_k=2, hidden=16, tokens=(1,), seed=6)
    run_exact_step(ctx, group, handle, small, ctx.rank, W, tag="after overflow: ")

    # Overflow caused only by alignment padding: rank 0 gets 2 real rows per
    # expert from each rank (padded to 8 each) but capacity is just the real rows.
    # Enough tokens that the real rows reach max_tokens_per_rank (the nccl_ep floor for capacity),
    # and zones of a size that the alignment of 8 pads.
    pad_tokens = max(1, -(-group.max_tokens_per_rank // (2 * W)))
    while (W * pad_tokens) % 8 == 0:  # each zone gets W * pad_tokens rows: keep it unaligned
        pad_tokens += 1
    pad = Step(top_k=2, hidden=16, tokens=(pad_tokens,), mode="only_rank0", alignment=8, seed=7,
               max_tokens=group.max_tokens_per_rank)
    idx_all, _ = all_inputs(pad, W)
    real_rows = sum(int((i >= 0).sum()) for i in idx_all)
    h2 = group.create_handle(top_k=2, hidden=16, dtype=torch.bfloat16, alignment=8, capacity=real_rows)
    check_collective_error(ctx, lambda: h2.prepare(idx_all[ctx.rank].to(dev)), {0}, ["capacity"])
    group.shutdown()


def case_destroyed_handle(ctx) -> None:
    W = ctx.world_size
    group = make_group(ctx, ERROR_STEP)
    mk = lambda: group.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=ERROR_STEP.torch_dtype())
    # destroyed on every rank
    h = mk()
    env = _error_env(ctx, group, h)
    hid = h.id
    h.destroy()
    assert hid not in torch.ops.te_ep.live_handles()
    msg = expect_raises(lambda: _dispatch(env), str(hid))
    assert "handle" in msg.lower(), msg
    # the group still works
    h = mk()
    run_exact_step(ctx, group, h, ERROR_STEP, ctx.rank, W, tag="after destroyed handle: ")
    group.shutdown()


def case_destroyed_handle_one_rank(ctx) -> None:
    """A handle destroyed on one rank only (a user bug) is an argument error like any other:
    that rank names the handle, the others name that rank, nobody hangs."""
    W = ctx.world_size
    group = make_group(ctx, ERROR_STEP)
    mk = lambda: group.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=ERROR_STEP.torch_dtype())
    h = mk()
    env = _error_env(ctx, group, h)
    faulty = W - 1
    if ctx.rank == faulty:
        h.destroy()
    check_collective_error(ctx, lambda: _dispatch(env), {faulty}, ["handle", str(h.id)])
    h.destroy()
    h = mk()
    run_exact_step(ctx, group, h, ERROR_STEP, ctx.rank, W, tag="after one-rank destroyed handle: ")
    group.shutdown()


def case_dispatch_before_prepare(ctx) -> None:
    """The raw ops can be called on a handle with no routing (never prepared, or its last
    prepare failed): a user error, so a clear RuntimeError on every rank naming prepare,
    not an internal assert."""
    W, dev = ctx.world_size, torch.device(ctx.device)
    st = ERROR_STEP
    group = make_group(ctx, st)
    h = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype())
    env = _error_env(ctx, group, h)
    ops = torch.ops.te_ep
    cap = h.config.capacity
    calls = {
        "dispatch": lambda: ops.dispatch(env.x, env.w, h.handle_mem, group.group_name, h.id, cap),
        "combine": lambda: ops.combine(torch.zeros(cap, st.hidden, dtype=st.torch_dtype(), device=dev),
                                       h.handle_mem, group.group_name, h.id, env.T),
        "combine_bwd": lambda: ops.combine_bwd(env.x, h.handle_mem, group.group_name, h.id, cap),
    }
    for name, call in calls.items():
        msg = expect_raises(call, "prepare")
        assert "INTERNAL ASSERT" not in msg, f"{name} before prepare hits an internal assert: {msg!r}"
    run_exact_step(ctx, group, h, st, ctx.rank, W, tag="after dispatch before prepare: ")
    group.shutdown()


def case_config_errors(ctx) -> None:
    """Config errors are ValueErrors raised on every rank (the same config everywhere), and
    leave nothing behind: a good group + step afterwards works."""
    W = ctx.world_size
    expect_raises(
        lambda: te.EpGroup(None, num_experts=2 * W + 1, max_tokens_per_rank=8, backend=ctx.backend, device=ctx.device),
        "num_experts", str(2 * W + 1), exc=ValueError,
    )
    expect_raises(
        lambda: te.EpGroup(None, num_experts=2 * W, max_tokens_per_rank=8, backend="no_such_backend", device=ctx.device),
        "no_such_backend", exc=ValueError,
    )
    group = make_group(ctx, ERROR_STEP)
    for bad in (
        dict(alignment=3),
        dict(alignment=0),
        dict(alignment=-8),
        dict(top_k=0),
        dict(top_k=group.num_experts + 1),
        dict(hidden=0),
    ):
        kw = dict(top_k=2, hidden=16, dtype=torch.bfloat16)
        kw.update(bad)
        key, val = next(iter(bad.items()))
        expect_raises(lambda: group.create_handle(**kw), key, str(val), exc=ValueError)
    h = group.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=ERROR_STEP.torch_dtype())
    run_exact_step(ctx, group, h, ERROR_STEP, ctx.rank, W, tag="after config errors: ")
    group.shutdown()


def case_stale_backward(ctx) -> None:
    """A handle holds only its latest routing: the backward of step 1 after step 2 re-prepared
    the handle must raise (on every rank, as every rank does the same), not return wrong
    gradients. Step 2's backward and later steps are unaffected."""
    W, dev = ctx.world_size, torch.device(ctx.device)
    st = ERROR_STEP
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype())
    ys = []
    for salt in (0, 1):
        idx_all, w_all = all_inputs(st, W, salt)
        x = fingerprint(ctx.rank, st.num_tokens(ctx.rank), st.hidden, st.torch_dtype()).to(dev, copy=True).requires_grad_()
        w = w_all[ctx.rank].to(dev, copy=True).requires_grad_()
        out = te.ep_dispatch(handle, x, idx_all[ctx.rank].to(dev), w)
        ys.append((te.ep_combine(handle, (out.tokens.float() * out.weights[:, None]).to(x.dtype), x.shape[0]), x))
    msg = expect_raises(lambda: ys[0][0].sum().backward(), "prepared again")
    assert str(handle.id) in msg, msg
    ys[1][0].float().sum().backward()
    assert ys[1][1].grad is not None
    run_exact_step(ctx, group, handle, st, ctx.rank, W, tag="after stale backward: ")
    group.shutdown()


# ---------------------------------------------------------------------------
# group lifecycle
# ---------------------------------------------------------------------------
def case_group_api(ctx) -> None:
    """Attributes, worst-case capacity formula, handle config; auto backend."""
    W = ctx.world_size
    for E_local, maxT in ((1, 7), (3, 13)):
        g = te.EpGroup(None, num_experts=E_local * W, max_tokens_per_rank=maxT, backend=ctx.backend, device=ctx.device)
        assert (g.rank, g.ep_size) == (ctx.rank, W), (g.rank, g.ep_size)
        assert (g.num_experts, g.num_local_experts, g.max_tokens_per_rank) == (E_local * W, E_local, maxT)
        assert g.backend == ctx.backend, g.backend
        assert torch.device(g.device) == torch.device(ctx.device), g.device
        assert g.group_name == dist.group.WORLD.group_name, (g.group_name, dist.group.WORLD.group_name)
        for K in (1, 2, 5):
            for a in (1, 8, 128):
                want = W * maxT * min(K, E_local) + E_local * (a - 1)
                assert g.worst_case_capacity(K, a) == want, (K, a, g.worst_case_capacity(K, a), want)
                assert g.worst_case_capacity(K) == W * maxT * min(K, E_local)
        h = g.create_handle(top_k=2, hidden=24, dtype=torch.float16, alignment=16)
        cfg = h.config
        assert isinstance(cfg, te.HandleConfig)
        assert (cfg.top_k, cfg.hidden, cfg.dtype, cfg.alignment, cfg.capacity) == (
            2, 24, torch.float16, 16, g.worst_case_capacity(2, 16)), cfg
        try:
            cfg.top_k = 3
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError("HandleConfig is not frozen")
        assert h.id in torch.ops.te_ep.live_handles()
        g.shutdown()
        assert h.id not in torch.ops.te_ep.live_handles()
    if torch.device(ctx.device).type == "cpu":
        g = te.EpGroup(None, num_experts=W, max_tokens_per_rank=4, backend="auto", device=ctx.device)
        assert g.backend == "reference", f"auto on CPU chose {g.backend!r}"
        g.shutdown()


def case_shutdown_reinit(ctx) -> None:
    """shutdown() destroys the group's handles; a new group in the same process works;
    repeated cycles leak no handles."""
    W = ctx.world_size
    before = set(torch.ops.te_ep.live_handles())
    for cycle, st in enumerate([
        Step(top_k=2, hidden=16, seed=20),
        Step(top_k=3, hidden=32, experts_per_rank=4, dtype="fp32", alignment=8, seed=21),
        Step(top_k=1, hidden=16, experts_per_rank=1, seed=22),
    ]):
        group = make_group(ctx, st)
        h1 = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
        h2 = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
        run_exact_step(ctx, group, h1, st, ctx.rank, W, tag=f"cycle {cycle} h1: ")
        run_exact_step(ctx, group, h2, st, ctx.rank, W, salt=1, tag=f"cycle {cycle} h2: ")
        assert {h1.id, h2.id} <= set(torch.ops.te_ep.live_handles())
        group.shutdown()
        assert set(torch.ops.te_ep.live_handles()) == before, (torch.ops.te_ep.live_handles(), before)
        # a handle of a shut-down group is an error on every rank, not a crash or a hang
        idx_all, w_all = all_inputs(st, W)
        x = fingerprint(ctx.rank, st.num_tokens(ctx.rank), st.hidden, st.torch_dtype()).to(ctx.device)
        msg = expect_raises(
            lambda: te.ep_dispatch(h1, x, idx_all[ctx.rank].to(ctx.device), w_all[ctx.rank].to(ctx.device))
        )
        assert "handle" in msg.lower(), msg


def case_subgroups(ctx) -> None:
    """EP over sub-process-groups: halves of the world for W >= 4, else a copy of the
    world with its own name, interleaved with a WORLD group."""
    W = ctx.world_size
    if W >= 4:
        halves = [list(range(0, W // 2)), list(range(W // 2, W))]
    else:
        halves = [list(range(W))]
    subs = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = next(s for s, ranks in zip(subs, halves) if ctx.rank in ranks)
    st = Step(top_k=2, hidden=16, tokens=(7, 13, 4), seed=30)
    sub_group = make_group(ctx, st, process_group=mine)
    world_group = make_group(ctx, st)
    Wsub = dist.get_world_size(mine)
    assert sub_group.ep_size == Wsub and sub_group.rank == dist.get_rank(mine)
    assert sub_group.group_name == mine.group_name != world_group.group_name
    hs = sub_group.create_handle(top_k=2, hidden=16, dtype=torch.bfloat16)
    hw = world_group.create_handle(top_k=2, hidden=16, dtype=torch.bfloat16)
    run_exact_step(ctx, sub_group, hs, st, sub_group.rank, Wsub, tag="subgroup: ")
    run_exact_step(ctx, world_group, hw, st, ctx.rank, W, tag="world: ")
    run_exact_step(ctx, sub_group, hs, st, sub_group.rank, Wsub, salt=1, tag="subgroup again: ")
    sub_group.shutdown()
    world_group.shutdown()


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------
def case_compile(ctx, compile_backend: str) -> None:
    """dispatch -> static-shape grouped linear -> combine under torch.compile(fullgraph=True)
    matches eager, forward and backward; eager matches the dense reference."""
    import torch._dynamo

    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(dtype="fp32", top_k=2, hidden=16, tokens=(8, 5), experts_per_rank=2, alignment=4, drop=0.1, seed=40)
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=2, hidden=16, dtype=torch.float32, alignment=4)
    El = group.num_local_experts

    def f(x, idx, w, ex):
        return moe_step(handle, x, idx, w, ex, expert_forward_static)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)
    for salt in (0, 1):  # second call: new routing values, same shapes (no stale state)
        layer = Layer(st, salt=salt)
        idx_all, w_all, xs, gys, experts = _layer_data(layer, W)
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
             Step(top_k=3, hidden=16, dtype="fp32", idx_dtype="i32", tokens=(4, 0), experts_per_rank=3, seed=51))
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
        group.shutdown()


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
            idx_all, w_all, xs, gys, experts = _layer_data(layer, W)
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
        _fail("expert_counts", a[0], b[0], f"rank {r} {st}")
        _fail("total", a[1], b[1], f"rank {r} {st}")
        for e, (za, zb) in enumerate(zip(a[6], b[6])):
            assert za.shape == zb.shape and torch.allclose(za, zb, rtol=0, atol=0), f"rank {r} zone {e} rows differ"
        for name, ta, tb in zip(("y", "grad x", "grad w", "grad experts"), a[2:6], b[2:6]):
            assert_close_scaled(ta, tb, st.torch_dtype(), f"rank {r} {st}: {ctx.backend} vs reference {name}")


# ---------------------------------------------------------------------------
# CUDA graphs (GPU backends that never sync the host)
# ---------------------------------------------------------------------------
def case_cuda_graph(ctx) -> None:
    """prepare + dispatch + per-expert linear + combine captured once in a CUDA graph;
    replays on fresh tokens and routing (copied into the captured inputs) equal eager."""
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
            replayed = static_out.clone()
            eager = step(*fresh)
            torch.cuda.synchronize()
            assert torch.allclose(replayed.float(), eager.float(), rtol=2e-2, atol=2e-2), (
                f"replay {seed}: max |graph - eager| = {(replayed.float() - eager.float()).abs().max().item()}"
            )
    # A captured graph holds NCCL resources of the group: destroy it before shutdown.
    del graph, static_out
    group.shutdown()


# ---------------------------------------------------------------------------
# the case list shared by the CPU and GPU launchers
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    args: tuple = ()
    world_sizes: tuple = (2, 4)  # where the CPU suite runs it (the GPU runner runs all that fit)
    min_world: int = 2
    only_non_reference: bool = False  # needs a backend other than "reference"
    timeout: float = 60.0
    # Expects every rank to raise when one rank's input is bad: the nccl_ep
    # backend agrees on errors only with TE_EP_CHECK_ROUTING=1 (docs/nccl_ep.md).
    needs_agreement: bool = False
    # Agreement for a handle that only some ranks destroyed: reference backend only.
    reference_only: bool = False


_BAD_NAMES = sorted(BAD_INPUTS)

CASES = [
    Case("group_api", case_group_api),
    Case("routing_exact", case_exact_steps, (ROUTING_STEPS,), timeout=120),
    Case("alignment_exact", case_exact_steps, (ALIGNMENT_STEPS,), timeout=120),
    Case("capacity_exact", case_exact_steps, (CAPACITY_STEPS,)),
    *[Case(f"moe_dense_{k}", case_moe_dense, (v,)) for k, v in MOE_LAYERS.items()],
    Case("two_layers_raw_ops", case_two_layers_raw),
    # one case per bad input: a library failure on one (a crash, a hang) must not hide the others
    *[Case(f"bad_input_{n}", case_bad_inputs, ([n],), needs_agreement=True) for n in _BAD_NAMES],
    Case("bad_inputs_in_a_row", case_bad_inputs, (["weights_bf16", "expert_id_too_large", "combine_num_tokens",
                                                   "hidden_mismatch"],), needs_agreement=True),
    Case("capacity_overflow", case_capacity_overflow, needs_agreement=True),
    Case("destroyed_handle", case_destroyed_handle),
    Case("destroyed_handle_one_rank", case_destroyed_handle_one_rank, reference_only=True),
    Case("dispatch_before_prepare", case_dispatch_before_prepare),
    Case("config_errors", case_config_errors),
    Case("stale_backward", case_stale_backward),
    Case("shutdown_reinit", case_shutdown_reinit),
    Case("subgroups", case_subgroups),
    Case("opcheck", case_opcheck, (0,), timeout=120),
    Case("opcheck_empty_rank", case_opcheck, (1,), timeout=120),
    Case("compile_aot_eager", case_compile, ("aot_eager",), world_sizes=(2,), timeout=300),
    Case("compile_inductor", case_compile, ("inductor",), world_sizes=(2,), timeout=600),
    # nothing may assume <= 4 ranks
    Case("smoke_8_ranks", case_exact_steps, ([ROUTING_STEPS[0], ROUTING_STEPS[3], ALIGNMENT_STEPS[-1]],),
         world_sizes=(8,), timeout=120),
    Case("smoke_8_ranks_moe", case_moe_dense, (MOE_LAYERS["two_layers"],), world_sizes=(8,), timeout=120),
    Case("cuda_graph", case_cuda_graph, world_sizes=(), only_non_reference=True, timeout=180),
    Case("backend_agreement", case_backend_agreement,
         ([Step(top_k=2, hidden=64, dtype="bf16"), Step(top_k=4, hidden=32, dtype="fp32", alignment=16,
                                                         experts_per_rank=4, drop=0.2, tokens=(13, 0, 7))],),
         world_sizes=(), only_non_reference=True),
]
