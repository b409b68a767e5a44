"""Smoke test of the nccl_ep backend on real GPUs, against a torch reference.

    torchrun --nproc-per-node=2 tests/gpu/smoke_nccl_ep.py [--no-graph]

Drives the ``torch.ops.te_ep`` ops directly (no EpGroup), so it checks the
backend and the op contract alone. Every rank gathers all ranks' routing and
tokens, works out what it must receive, and compares. Tokens are fingerprinted
(columns 0 and 1 hold source rank + 1 and token index + 1) so each received
row names the (source, token) pair it came from. Prints one PASS/FAIL line per
check (rank 0) and exits non-zero if any check failed on any rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

# NVLink multicast must stay off on shared machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

# A script torchrun starts: the repository root (an in-place build) first on the import path,
# as tests/gpu/run_suite.py puts it, so that every part of run_all.sh tests this tree rather
# than whatever te_ep_torch the environment holds.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from te_ep_torch.group import DEFAULT_NCCL_EP_MODE  # noqa: E402

OPS = None
RANK = 0
WORLD = 1
DEVICE = None
GROUP = ""
RESULTS = []
# The nccl_ep mode every handle of the smoke test uses (docs/nccl_ep.md, "Modes"; --nccl-ep-mode).
MODE = DEFAULT_NCCL_EP_MODE


def log(msg: str) -> None:
    print(f"[rank {RANK}] {msg}", flush=True)


def run_check(name: str, fn) -> None:
    """Runs fn on every rank; the check passes only if it passed everywhere."""
    log(f"RUNNING {name}")
    error = ""
    try:
        fn()
    except Exception as exc:  # a failing check must not stop the others
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    errors = [None] * WORLD
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    RESULTS.append((name, not failed))
    if RANK == 0:
        if failed:
            for r, e in failed:
                print(f"FAIL {name} (rank {r}): {e}", flush=True)
        else:
            print(f"PASS {name}", flush=True)


class Case:
    """One handle plus the torch reference of one step's routing."""

    def __init__(self, *, num_experts, max_tokens, top_k, hidden, dtype, alignment, tokens_per_rank, drop_every=0,
                 capacity=None, seed=0, idx=None, checks="local"):
        self.E = num_experts
        self.El = num_experts // WORLD
        self.maxT = max_tokens
        self.K = top_k
        self.H = hidden
        self.dtype = dtype
        self.align = alignment
        self.capacity = capacity or (WORLD * max_tokens * min(top_k, self.El) + self.El * (alignment - 1))
        self.T = tokens_per_rank[RANK]
        self.all_T = list(tokens_per_rank)
        self.id, self.mem = OPS.create_handle(GROUP, "nccl_ep", self.E, self.maxT, self.K, self.H, self.capacity,
                                              self.align, self.dtype, DEVICE, MODE, checks=checks)
        gen = torch.Generator().manual_seed(seed * 1000 + RANK)
        scores = torch.rand(self.T, self.E, generator=gen)
        idx = scores.topk(self.K, dim=1).indices if idx is None else idx
        if drop_every:
            drop = torch.arange(self.T * self.K).view(self.T, self.K) % drop_every == 0
            idx = idx.masked_fill(drop, -1)
        self.idx = idx.to(torch.int64)
        self.weights = torch.rand(self.T, self.K, generator=gen, dtype=torch.float32) + 0.5
        x = torch.randn(self.T, self.H, generator=gen).to(self.dtype)
        x[:, 0] = RANK + 1
        x[:, 1] = torch.arange(self.T, dtype=torch.float32).to(self.dtype) + 1
        self.x = x
        # Expert e scales its input by this; combine must bring each slot back
        # to its own token with its own expert's factor.
        self.scale = 1.0 + 0.0625 * torch.arange(self.E, dtype=torch.float32)
        self._gather()

    def destroy(self):
        OPS.destroy_handle(self.id)

    def _gather(self):
        def pad(t, fill):
            out = torch.full((self.maxT,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
            out[: t.shape[0]] = t
            return out.to(DEVICE)

        gathered = {}
        for name, t, fill in (("idx", self.idx, -1), ("w", self.weights, 0.0), ("x", self.x, 0.0)):
            parts = [torch.empty_like(pad(t, fill)) for _ in range(WORLD)]
            dist.all_gather(parts, pad(t, fill))
            gathered[name] = [p.cpu()[: self.all_T[r]] for r, p in enumerate(parts)]
        self.g = gathered
        # Pairs each local expert must receive: (src, token, k).
        self.expected = []
        for le in range(self.El):
            e = RANK * self.El + le
            pairs = []
            for src in range(WORLD):
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
        return OPS.prepare(idx.to(DEVICE), self.mem, GROUP, self.id, self.El)

    def dispatch(self, x=None):
        x = self.x if x is None else x
        return OPS.dispatch(x.to(DEVICE), self.weights.to(DEVICE), self.mem, GROUP, self.id, self.capacity)

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
                self.slot_pairs[slot] = (src, t, k, RANK * self.El + le)
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
        return out.to(self.dtype).to(DEVICE)

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


def check_forward_backward(case: Case) -> None:
    counts, total = case.prepare()
    case.check_counts(counts, total)
    recv, recv_w = case.dispatch()
    case.check_dispatch(recv, recv_w)
    # In the zero-copy mode recv lives in the handle's window until its next
    # dispatch (docs/ops.md), and this check dispatches again below.
    recv = recv.clone()

    y = OPS.combine(case.expert_out(recv, recv_w), case.mem, GROUP, case.id, case.T)
    tol = case.tolerance()
    torch.testing.assert_close(y.float().cpu(), case.combine_reference(), rtol=tol, atol=tol)

    # combine_bwd is a dispatch of the gradient: same slots as the forward.
    g = case.x.clone()
    g[:, 2:] = torch.randn(case.T, case.H - 2, generator=torch.Generator().manual_seed(7 + RANK)).to(case.dtype)
    grad_recv = OPS.combine_bwd(g.to(DEVICE), case.mem, GROUP, case.id, case.capacity)
    again, _ = case.dispatch(g)
    assert torch.equal(grad_recv.cpu(), again.cpu()), "combine_bwd differs from a dispatch of the same tensor"

    # dispatch_bwd: token gradients combine; weight gradients return to (t, k).
    grad_w = torch.full((case.capacity,), 11.0)
    for slot, pair in enumerate(case.slot_pairs):
        if pair is not None:
            src, t, k, e = pair
            grad_w[slot] = (t + 1) * 0.5 + e * 100.0
    gt, gw = OPS.dispatch_bwd(case.expert_out(recv, torch.ones(case.capacity)), grad_w.to(DEVICE), case.mem, GROUP,
                              case.id, case.T, case.K)
    ref_gt = torch.zeros(case.T, case.H)
    ref_gw = torch.zeros(case.T, case.K)
    for t in range(case.T):
        for k in range(case.K):
            e = int(case.idx[t, k])
            if e >= 0:
                ref_gt[t] += (case.x[t].float() * case.scale[e]).to(case.dtype).float()
                ref_gw[t, k] = (t + 1) * 0.5 + e * 100.0
    torch.testing.assert_close(gt.float().cpu(), ref_gt, rtol=tol, atol=tol)
    assert gw.dtype == torch.float32 and gw.shape == (case.T, case.K), f"grad_topk_weights {gw.dtype} {gw.shape}"
    torch.testing.assert_close(gw.cpu(), ref_gw, rtol=0, atol=0)


def check_capacity_overflow() -> None:
    # Every token of every rank goes to experts 0 and 1 (rank 0's): rank 0
    # needs 2 * WORLD * T rows, at least twice its capacity. checks='synchronous'
    # raises on all.
    # The routing the case checks at the end fits: each rank keeps its tokens,
    # one of its own experts per token.
    fits = torch.stack([RANK * 4 + torch.arange(32) % 2, torch.full((32,), -1)], dim=1)
    case = Case(num_experts=4 * WORLD, max_tokens=32, top_k=2, hidden=256, dtype=torch.bfloat16, alignment=1,
                tokens_per_rank=[32] * WORLD, capacity=32, seed=3, idx=fits, checks="synchronous")
    try:
        try:
            case.prepare(torch.arange(2).repeat(32, 1))
        except RuntimeError as exc:
            assert "capacity overflow" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("prepare did not raise on a capacity overflow")
        bad = fits.clone()
        if RANK == WORLD - 1:
            bad[5, 0] = 10_000
        try:
            case.prepare(bad)
        except RuntimeError as exc:
            assert "topk_idx[5, 0] = 10000" in str(exc) or f"rank {WORLD - 1}" in str(exc), f"unexpected error: {exc}"
        else:
            raise AssertionError("prepare did not raise on an out-of-range expert id")
        counts, total = case.prepare()
        case.check_counts(counts, total)
        recv, recv_w = case.dispatch()
        case.check_dispatch(recv, recv_w)
    finally:
        case.destroy()


def check_graph_capture(case: Case) -> None:
    counts, total = case.prepare()
    recv, recv_w = case.dispatch()
    case.check_dispatch(recv, recv_w)
    expert_in = case.expert_out(recv, recv_w)
    eager = OPS.combine(expert_in, case.mem, GROUP, case.id, case.T)
    idx, x, w = case.idx.to(DEVICE), case.x.to(DEVICE), case.weights.to(DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            g_counts, g_total = OPS.prepare(idx, case.mem, GROUP, case.id, case.El)
            g_recv, g_recv_w = OPS.dispatch(x, w, case.mem, GROUP, case.id, case.capacity)
            g_out = OPS.combine(expert_in, case.mem, GROUP, case.id, case.T)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_counts.cpu(), counts.cpu()) and torch.equal(g_total.cpu(), total.cpu()), "graph counts"
    assert torch.equal(g_recv.cpu(), recv.cpu()) and torch.equal(g_recv_w.cpu(), recv_w.cpu()), "graph dispatch"
    assert torch.equal(g_out.cpu(), eager.cpu()), "graph combine"


def main() -> int:
    global OPS, RANK, WORLD, DEVICE, GROUP, MODE
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA graph capture check")
    parser.add_argument("--nccl-ep-mode", default=DEFAULT_NCCL_EP_MODE, choices=("staged", "zero_copy", "auto"))
    args = parser.parse_args()
    MODE = args.nccl_ep_mode

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    DEVICE = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=DEVICE)
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    GROUP = dist.group.WORLD.group_name

    import te_ep_torch  # noqa: F401  (loads the op library)
    from te_ep_torch import _nccl_ep

    OPS = torch.ops.te_ep
    reason = _nccl_ep.availability()
    if reason:
        log(f"nccl_ep unavailable: {reason}")
        if RANK == 0:
            print(f"FAIL availability: {reason}", flush=True)
        dist.destroy_process_group()
        return 1
    if RANK == 0:
        print(f"loaded: {_nccl_ep.load()}", flush=True)
    else:
        _nccl_ep.load()

    cases = {}

    def make(name, **kw):
        def build():
            cases[name] = Case(**kw)

        run_check(f"create_handle {name}", build)

    make("bf16/k2/align1", num_experts=4 * WORLD, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16,
         alignment=1, tokens_per_rank=[64] * WORLD, seed=1)
    make("fp32/k4/align16/uneven/dropped", num_experts=8 * WORLD, max_tokens=64, top_k=4, hidden=128,
         dtype=torch.float32, alignment=16, tokens_per_rank=[48 + 16 * (r % 2) for r in range(WORLD)],
         drop_every=5, seed=2)
    for name, case in list(cases.items()):
        run_check(f"fwd+bwd {name}", lambda case=case: check_forward_backward(case))

    run_check("capacity overflow and bad routing raise on every rank (checks='synchronous')",
              check_capacity_overflow)

    if not args.no_graph and "bf16/k2/align1" in cases:
        run_check("CUDA graph capture of prepare/dispatch/combine",
                  lambda: check_graph_capture(cases["bf16/k2/align1"]))

    make("bf16/empty-rank", num_experts=4 * WORLD, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16,
         alignment=1, tokens_per_rank=[0 if r == WORLD - 1 else 64 for r in range(WORLD)], seed=4)
    if "bf16/empty-rank" in cases:
        run_check("fwd+bwd with a rank sending no tokens",
                  lambda: check_forward_backward(cases["bf16/empty-rank"]))

    def lifecycle():
        for case in cases.values():
            case.destroy()
        cases.clear()
        _nccl_ep.release_group(GROUP)
        again = Case(num_experts=4 * WORLD, max_tokens=64, top_k=2, hidden=256, dtype=torch.bfloat16, alignment=1,
                     tokens_per_rank=[64] * WORLD, seed=5)
        check_forward_backward(again)
        again.destroy()
        _nccl_ep.release_group(GROUP)

    run_check("destroy handles, release the group, recreate", lifecycle)

    failed = [name for name, ok in RESULTS if not ok]
    if RANK == 0:
        print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed", flush=True)
        print("SMOKE PASS" if not failed else "SMOKE FAIL: " + "; ".join(failed), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
