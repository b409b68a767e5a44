"""What every case shares: tolerances, the routing step config, inputs rebuilt from a
seed, token fingerprints, the expected receive layout and its exact checks."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import te_ep_torch as te
from te_ep_torch.group import nccl_ep_capacity_floor


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

    experts_per_rank: int = 4  # a multiple of 4: nccl_ep's num_experts rule at any world size
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


def rng(seed: int, rank: int, salt: int) -> torch.Generator:
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
    g = rng(step.seed, src, 1 + seed_salt)
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
        floor = nccl_ep_capacity_floor(step.max_tokens_per_rank())
        if need < floor:
            raise ValueError(f"{step}: tight capacity {need} at W={world_size} is below nccl_ep's floor {floor}; "
                             "route more rows to the busiest rank")
        return need
    raise ValueError(step.capacity)


def check_equal(what: str, actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
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
    check_equal("expert_counts", counts, torch.tensor(layout.counts, dtype=torch.int32), where)
    check_equal("total", total, torch.tensor([layout.total], dtype=torch.int32), where)
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
    check_equal("recv_tokens", tokens, exp_tok, where)
    check_equal("recv_weights", weights, exp_w, where)


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
        **ctx.group_options(),
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



def poison_next_alloc(device, nbytes: int, copies: int = 4) -> None:
    """Leaves the caching allocator's next block of ``nbytes`` on this stream filled with 0xFF
    bytes (NaN in every float dtype), so that an op whose output is allocated next starts from
    NaN instead of whatever the block held (often zeros): rows the op leaves unwritten then fail
    the exact checks. Checks that the poison took (a probe of that size reads 0xFF) and raises
    otherwise, so a test that relies on it cannot pass without it. CUDA only; a no-op elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or nbytes <= 0:
        return
    blocks = [torch.full((nbytes,), 255, dtype=torch.uint8, device=device) for _ in range(copies)]
    del blocks
    probe = torch.empty(nbytes, dtype=torch.uint8, device=device)
    poisoned = bool(probe.eq(255).all())
    del probe
    if not poisoned:
        raise AssertionError(f"poison_next_alloc: the next {nbytes}-byte block of the caching allocator on "
                             f"{device} was not the poisoned one; the check that relies on it would be void")


class TeEpOps(TorchDispatchMode):
    """Records the names of the te_ep ops called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "te_ep":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))
