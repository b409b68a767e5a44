"""The communication ops driven directly (``torch.ops.te_ep``, no EpGroup) against a torch
reference, so they check a backend and the op contract alone.

Every rank gathers all ranks' routing and tokens, works out what it must receive, and
compares. Tokens are fingerprinted (columns 0 and 1 hold source rank + 1 and token index + 1),
so each received row names the (source, token) pair it came from. One body, `case_raw_ops`,
runs the checks in order (handles made for one check are used by the next); a failed check
raises with its name. On CUDA it also captures prepare, dispatch and combine in a CUDA graph;
on nccl_ep it ends by releasing the NCCL EP group and creating it again.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

OPS = torch.ops.te_ep


@dataclasses.dataclass(frozen=True)
class _Rank:
    """Where the checks run: this rank, the group's name, the backend and its nccl_ep mode."""

    rank: int
    world: int
    device: torch.device
    group: str
    backend: str
    mode: str


class _Handle:
    """One handle plus the torch reference of one step's routing."""

    def __init__(self, r: _Rank, *, num_experts, max_tokens, top_k, hidden, dtype, alignment, tokens_per_rank,
                 drop_every=0, capacity=None, seed=0, idx=None, checks="local"):
        self.r = r
        self.E = num_experts
        self.El = num_experts // r.world
        self.maxT = max_tokens
        self.K = top_k
        self.H = hidden
        self.dtype = dtype
        self.align = alignment
        self.capacity = capacity or (r.world * max_tokens * min(top_k, self.El) + self.El * (alignment - 1))
        self.T = tokens_per_rank[r.rank]
        self.all_T = list(tokens_per_rank)
        self.id, self.mem = OPS.create_handle(r.group, r.backend, self.E, self.maxT, self.K, self.H, self.capacity,
                                              self.align, self.dtype, r.device, r.mode, checks=checks)
        gen = torch.Generator().manual_seed(seed * 1000 + r.rank)
        scores = torch.rand(self.T, self.E, generator=gen)
        idx = scores.topk(self.K, dim=1).indices if idx is None else idx
        if drop_every:
            drop = torch.arange(self.T * self.K).view(self.T, self.K) % drop_every == 0
            idx = idx.masked_fill(drop, -1)
        self.idx = idx.to(torch.int64)
        self.weights = torch.rand(self.T, self.K, generator=gen, dtype=torch.float32) + 0.5
        x = torch.randn(self.T, self.H, generator=gen).to(self.dtype)
        x[:, 0] = r.rank + 1
        x[:, 1] = torch.arange(self.T, dtype=torch.float32).to(self.dtype) + 1
        self.x = x
        # Expert e scales its input by this; combine must bring each slot back
        # to its own token with its own expert's factor.
        self.scale = 1.0 + 0.0625 * torch.arange(self.E, dtype=torch.float32)
        self._gather()

    def destroy(self):
        OPS.destroy_handle(self.id)

    def _gather(self):
        r = self.r

        def pad(t, fill):
            out = torch.full((self.maxT,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
            out[: t.shape[0]] = t
            return out.to(r.device)

        gathered = {}
        for name, t, fill in (("idx", self.idx, -1), ("w", self.weights, 0.0), ("x", self.x, 0.0)):
            parts = [torch.empty_like(pad(t, fill)) for _ in range(r.world)]
            dist.all_gather(parts, pad(t, fill))
            gathered[name] = [p.cpu()[: self.all_T[src]] for src, p in enumerate(parts)]
        self.g = gathered
        # Pairs each local expert must receive: (src, token, k).
        self.expected = []
        for le in range(self.El):
            e = r.rank * self.El + le
            pairs = []
            for src in range(r.world):
                rows = gathered["idx"][src]
                for t in range(rows.shape[0]):
                    for k in range(self.K):
                        if int(rows[t, k]) == e:
                            pairs.append((src, t, k))
            self.expected.append(pairs)
        self.exp_counts = [((len(p) + self.align - 1) // self.align) * self.align for p in self.expected]

    # ---- ops -----------------------------------------------------------------
    def prepare(self, idx=None):
        idx = self.idx if idx is None else idx
        return OPS.prepare(idx.to(self.r.device), self.mem, self.r.group, self.id, self.El)

    def dispatch(self, x=None):
        x = self.x if x is None else x
        return OPS.dispatch(x.to(self.r.device), self.weights.to(self.r.device), self.mem, self.r.group, self.id,
                            self.capacity)

    # ---- reference checks ----------------------------------------------------
    def check_counts(self, counts, total):
        counts = counts.cpu().tolist()
        assert counts == self.exp_counts, f"expert_counts {counts}, expected {self.exp_counts}"
        assert int(total.cpu()[0]) == sum(self.exp_counts), f"total {int(total.cpu()[0])}, expected {sum(counts)}"

    def check_dispatch(self, recv, recv_w):
        recv, recv_w = recv.cpu(), recv_w.cpu()
        assert recv.shape == (self.capacity, self.H) and recv.dtype == self.dtype, f"recv {recv.shape} {recv.dtype}"
        assert recv_w.shape == (self.capacity,) and recv_w.dtype == torch.float32, f"recv_w {recv_w.shape}"
        self.slot_pairs = [None] * self.capacity
        start = 0
        for le, pairs in enumerate(self.expected):
            n, padded = len(pairs), self.exp_counts[le]
            want = {(s, t): k for s, t, k in pairs}
            seen = set()
            for slot in range(start, start + n):
                src, t = int(recv[slot, 0]) - 1, int(recv[slot, 1]) - 1
                assert (src, t) in want, f"slot {slot} (expert {le}) holds ({src}, {t}), not routed there"
                assert (src, t) not in seen, f"({src}, {t}) received twice by expert {le}"
                seen.add((src, t))
                k = want[(src, t)]
                assert torch.equal(recv[slot], self.g["x"][src][t]), f"slot {slot}: row differs from source"
                assert recv_w[slot] == self.g["w"][src][t, k], f"slot {slot}: weight {recv_w[slot]}"
                self.slot_pairs[slot] = (src, t, k, self.r.rank * self.El + le)
            assert not recv[start + n : start + padded].any(), f"padding rows of expert {le} are not zero"
            assert not recv_w[start + n : start + padded].any(), f"padding weights of expert {le} are not zero"
            start += padded
        assert not recv[start:].any(), "rows after the last zone are not zero"
        assert not recv_w[start:].any(), "weights after the last zone are not zero"

    def expert_out(self, recv, recv_w, garbage=3.0):
        """Expert e's output: scale[e] * weight * token; padding rows get garbage (must be ignored)."""
        out = torch.full((self.capacity, self.H), garbage, dtype=torch.float32)
        for slot, pair in enumerate(self.slot_pairs):
            if pair is not None:
                out[slot] = recv[slot].float().cpu() * self.scale[pair[3]] * recv_w[slot].cpu()
        return out.to(self.dtype).to(self.r.device)

    def combine_reference(self):
        ref = torch.zeros(self.T, self.H, dtype=torch.float32)
        for t in range(self.T):
            for k in range(self.K):
                e = int(self.idx[t, k])
                if e >= 0:
                    ref[t] += (self.x[t].float() * self.scale[e] * self.weights[t, k]).to(self.dtype).float()
        return ref

    def tolerance(self):
        return {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[self.dtype]


def _forward_backward(h: _Handle) -> None:
    r = h.r
    counts, total = h.prepare()
    h.check_counts(counts, total)
    recv, recv_w = h.dispatch()
    h.check_dispatch(recv, recv_w)
    # In the zero-copy mode recv lives in the handle's window until its next
    # dispatch (docs/ops.md), and this check dispatches again below.
    recv = recv.clone()

    y = OPS.combine(h.expert_out(recv, recv_w), h.mem, r.group, h.id, h.T)
    tol = h.tolerance()
    torch.testing.assert_close(y.float().cpu(), h.combine_reference(), rtol=tol, atol=tol)

    # combine_bwd is a dispatch of the gradient: same slots as the forward.
    g = h.x.clone()
    g[:, 2:] = torch.randn(h.T, h.H - 2, generator=torch.Generator().manual_seed(7 + r.rank)).to(h.dtype)
    grad_recv = OPS.combine_bwd(g.to(r.device), h.mem, r.group, h.id, h.capacity)
    again, _ = h.dispatch(g)
    assert torch.equal(grad_recv.cpu(), again.cpu()), "combine_bwd differs from a dispatch of the same tensor"

    # dispatch_bwd: token gradients combine; weight gradients return to (t, k).
    grad_w = torch.full((h.capacity,), 11.0)
    for slot, pair in enumerate(h.slot_pairs):
        if pair is not None:
            src, t, k, e = pair
            grad_w[slot] = (t + 1) * 0.5 + e * 100.0
    gt, gw = OPS.dispatch_bwd(h.expert_out(recv, torch.ones(h.capacity)), grad_w.to(r.device), h.mem, r.group, h.id,
                              h.T, h.K)
    ref_gt = torch.zeros(h.T, h.H)
    ref_gw = torch.zeros(h.T, h.K)
    for t in range(h.T):
        for k in range(h.K):
            e = int(h.idx[t, k])
            if e >= 0:
                ref_gt[t] += (h.x[t].float() * h.scale[e]).to(h.dtype).float()
                ref_gw[t, k] = (t + 1) * 0.5 + e * 100.0
    torch.testing.assert_close(gt.float().cpu(), ref_gt, rtol=tol, atol=tol)
    assert gw.dtype == torch.float32 and gw.shape == (h.T, h.K), f"grad_topk_weights {gw.dtype} {gw.shape}"
    torch.testing.assert_close(gw.cpu(), ref_gw, rtol=0, atol=0)


def _capacity_overflow(r: _Rank) -> None:
    # Every token of every rank goes to experts 0 and 1 (rank 0's): rank 0
    # needs 2 * world * T rows, at least twice its capacity. checks='synchronous'
    # raises on all.
    # The routing the check ends with fits: each rank keeps its tokens,
    # one of its own experts per token.
    fits = torch.stack([r.rank * 4 + torch.arange(32) % 2, torch.full((32,), -1)], dim=1)
    h = _Handle(r, num_experts=4 * r.world, max_tokens=32, top_k=2, hidden=256, dtype=torch.bfloat16, alignment=1,
                tokens_per_rank=[32] * r.world, capacity=32, seed=3, idx=fits, checks="synchronous")
    try:
        try:
            h.prepare(torch.arange(2).repeat(32, 1))
        except RuntimeError as exc:
            assert "capacity overflow" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("prepare did not raise on a capacity overflow")
        bad = fits.clone()
        if r.rank == r.world - 1:
            bad[5, 0] = 10_000
        try:
            h.prepare(bad)
        except RuntimeError as exc:
            assert "topk_idx[5, 0] = 10000" in str(exc) or f"rank {r.world - 1}" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("prepare did not raise on an out-of-range expert id")
        counts, total = h.prepare()
        h.check_counts(counts, total)
        recv, recv_w = h.dispatch()
        h.check_dispatch(recv, recv_w)
    finally:
        h.destroy()


def _graph_capture(h: _Handle) -> None:
    r = h.r
    counts, total = h.prepare()
    recv, recv_w = h.dispatch()
    h.check_dispatch(recv, recv_w)
    expert_in = h.expert_out(recv, recv_w)
    eager = OPS.combine(expert_in, h.mem, r.group, h.id, h.T)
    idx, x, w = h.idx.to(r.device), h.x.to(r.device), h.weights.to(r.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            g_counts, g_total = OPS.prepare(idx, h.mem, r.group, h.id, h.El)
            g_recv, g_recv_w = OPS.dispatch(x, w, h.mem, r.group, h.id, h.capacity)
            g_out = OPS.combine(expert_in, h.mem, r.group, h.id, h.T)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_counts.cpu(), counts.cpu()) and torch.equal(g_total.cpu(), total.cpu()), "graph counts"
    assert torch.equal(g_recv.cpu(), recv.cpu()) and torch.equal(g_recv_w.cpu(), recv_w.cpu()), "graph dispatch"
    assert torch.equal(g_out.cpu(), eager.cpu()), "graph combine"


def _check(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:
        raise AssertionError(f"{name}: {type(exc).__name__}: {exc}") from exc


def case_raw_ops(ctx) -> None:
    from te_ep_torch import _nccl_ep
    from te_ep_torch.group import DEFAULT_NCCL_EP_MODE

    nccl_ep = ctx.backend == "nccl_ep"
    if nccl_ep:
        reason = _nccl_ep.availability()
        assert not reason, f"nccl_ep unavailable: {reason}"
        _nccl_ep.load()
    r = _Rank(ctx.rank, ctx.world_size, torch.device(ctx.device), dist.group.WORLD.group_name, ctx.backend,
              ctx.nccl_ep_mode or DEFAULT_NCCL_EP_MODE)
    W = r.world
    handles = {}

    def make(name, **kw):
        _check(f"create_handle {name}", lambda: handles.__setitem__(name, _Handle(r, **kw)))

    try:
        make("bf16/k2/align1", num_experts=4 * W, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16,
             alignment=1, tokens_per_rank=[64] * W, seed=1)
        make("fp32/k4/align16/uneven/dropped", num_experts=8 * W, max_tokens=64, top_k=4, hidden=128,
             dtype=torch.float32, alignment=16, tokens_per_rank=[48 + 16 * (s % 2) for s in range(W)],
             drop_every=5, seed=2)
        for name, h in list(handles.items()):
            _check(f"fwd+bwd {name}", lambda h=h: _forward_backward(h))
        _check("capacity overflow and bad routing raise on every rank (checks='synchronous')",
               lambda: _capacity_overflow(r))
        if r.device.type == "cuda":
            _check("CUDA graph capture of prepare/dispatch/combine", lambda: _graph_capture(handles["bf16/k2/align1"]))
        make("bf16/empty-rank", num_experts=4 * W, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16,
             alignment=1, tokens_per_rank=[0 if s == W - 1 else 64 for s in range(W)], seed=4)
        _check("fwd+bwd with a rank sending no tokens", lambda: _forward_backward(handles["bf16/empty-rank"]))
    finally:
        for h in handles.values():
            h.destroy()
    if nccl_ep:
        def release_and_recreate():
            _nccl_ep.release_group(r.group)
            again = _Handle(r, num_experts=4 * W, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16,
                            alignment=1, tokens_per_rank=[64] * W, seed=5)
            try:
                _forward_backward(again)
            finally:
                again.destroy()
            _nccl_ep.release_group(r.group)

        _check("destroy handles, release the group, recreate", release_and_recreate)
