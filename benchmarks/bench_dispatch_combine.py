"""Dispatch / combine latency and bandwidth: te_ep on NCCL EP vs NCCL EP alone vs all_to_all.

    torchrun --nproc-per-node=4 benchmarks/bench_dispatch_combine.py [--csv out.csv]
    torchrun --nproc-per-node=2 benchmarks/bench_dispatch_combine.py --device cpu --shapes small --iters 3

For each shape (tokens per rank, hidden, top_k, experts; bf16) the same routing,
with the same receive capacity and zone alignment, runs through

* ``te_ep/MODE``   te_ep_torch's NCCL EP backend,
  ``EpGroup(backend="nccl_ep", nccl_ep_mode=MODE)`` for each of ``--modes``:
  ``staged`` (NCCL EP's own staging buffers, outputs from the caching
  allocator) and ``zero_copy`` (receive and combine rows in NCCL symmetric
  windows the handle owns). A row is labelled with the mode the handle runs in
  (``handle.mode``), as ``te_ep/REQUESTED->ACTUAL`` where that differs;
* ``nccl.ep/MODE`` NCCL EP alone through its own Python API (``nccl.ep`` and
  nccl4py's ``nccl.core``, benchmarks/_nccl_ep_alone.py) in the same NCCL EP
  configuration, once per mode (``auto`` counts as ``zero_copy``); skipped,
  saying why, where those packages don't import;
* ``nccl.ep+floor/MODE`` (only with ``--backends ... nccl_ep_floor``) NCCL EP alone
  plus the CUDA calls te_ep's checks and watchdog make around it in the zero-copy
  mode, and nothing else of te_ep: a small kernel before ``ncclEpUpdateHandle``
  (te_ep's routing guard) and one after it (its finish kernel), one after each of
  ``ncclEpDispatch`` and ``ncclEpCombine`` (its row zeroing), and an event recorded
  after each op (its watchdog's marker); ``dispatch`` (prepare included) follows
  te_ep's one op for both (``prepare_dispatch``): the guard, NCCL EP's two calls, one
  kernel (finish and zeroing), one marker. Each of these goes through
  Python (``torch.cuda._sleep(0)``, ``Event.record``), about a microsecond more
  than te_ep's own C++ call. Its ``x alone`` is the most te_ep's op structure
  allows; a te_ep row's ``x alone`` below it is what te_ep's wrapper costs
  (Python, torch's dispatcher, argument checks, allocations);
* ``nccl.ep-drop/MODE`` (only with ``--backends ... nccl_ep_drop``) NCCL EP alone
  with te_ep's overflow policy: DROP below the worst-case capacity (TRAP at it),
  where nccl.ep runs TRAP. Its ``x alone`` is what that policy costs NCCL EP
  itself; a te_ep row's ``x alone`` below it is what te_ep adds beyond it;
* ``nccl.ep-flat/MODE`` (only with ``--backends ... nccl_ep_flat``) the other
  route NCCL EP offers to expert-major rows: its FLAT layout (one slot per token
  and destination rank) and then te_ep's ``permute`` into the same rows; combine
  is te_ep's ``unpermute`` (summing each slot's local expert rows) and NCCL EP's
  combine. Those te_ep kernels are inside the timed ops;
* ``te_ep/reference`` te_ep_torch's torch.distributed backend (only with
  ``--backends ... reference``);
* ``te_ep-fp8/MODE`` (with ``--fp8``, next to each te_ep row) the same handle
  configuration dispatching block-scaled FP8 (``te.ep_dispatch_fp8``: e4m3 values
  and a float32 scale per 128 values, ``quantize_fp8`` inside the timed
  ``dispatch``); its ``quantize`` row is the quantizer alone, its ``x bf16``
  column the bf16 row of the same mode over this one. Combine stays bf16;
* ``all_to_all``   the baseline a user would write (TorchTitan style): sort
  (token, expert) pairs by expert, exchange per-expert counts with
  ``all_to_all_single``, ``.tolist()`` the splits, ``all_to_all_single`` one
  row per pair, regroup expert-major; combine is the reverse plus a sum;
* ``a2a_dedup``    each token sent once per destination rank: the per-rank
  token counts exchanged with ``all_to_all_single`` and ``.tolist()``-ed, then
  ``all_to_all_single`` of those tokens and of their (local expert ids,
  weights), then te_ep_torch's local ``te.permute`` into the expert-major layout
  (same capacity and alignment as te_ep). Combine is ``te.unpermute`` (summing
  a token's local expert rows), ``all_to_all_single`` back, and a sum over
  ranks.

Rows (ops), each the median over barrier-aligned iterations of the slowest rank:

* ``prepare``      the routing exchange alone (te_ep: ``handle.prepare``;
  nccl.ep: ``ncclEpUpdateHandle`` with per-expert counts and their total);
* ``dispatch_op``  the dispatch op on already-prepared routing: the token
  transport, whose NVLink figure is the one to hold against the copy bandwidth;
* ``dispatch``     prepare + dispatch_op in te_ep's one op (``te.ep_dispatch``, which runs
  ``prepare_dispatch``); for the baselines
  everything from the routing to the expert-major tokens, count exchange and
  host syncs included;
* ``combine``      expert outputs back to their tokens, summed. In zero-copy
  mode the expert output is already in the combine window
  (``handle.combine_buffer()``, for nccl.ep its combine window), written there
  with ``copy_`` before each iteration, outside the timed region: combine
  consumes that buffer;
* ``combine_copy`` (zero-copy te_ep only) combine from a plain tensor, which
  te_ep first copies into its window;
* ``quantize``     (FP8 rows only) ``te.quantize_fp8`` of the tokens; its GB/s
  column is bytes read + written over the time (HBM traffic), to hold against the
  device's copy bandwidth.

A round builds every variant and checks it, then times them together, op by op:
the variants that have the op take turns call by call (in the reverse order every
other iteration), so a drift of the machine during the iterations weighs on every
variant alike and a ratio of two variants holds it out. Every timed call starts
after a barrier and a device synchronisation and is timed with CUDA events
(``--device cpu``: wall clock); the GPU is idle when the timed call starts, so a
row's time includes the op's host path up to its first kernel.
``host ms`` is the median wall time of the call on the host alone (Python, argument
checks, launches, no synchronisation): the share of the row that a CPU running
ahead of the GPU hides in a training step. ``queued`` is the median time of the
same call issued while the GPU still spins for 2 ms (``torch.cuda._sleep``),
timed from the end of the spin: the op's GPU time when the CPU runs ahead, free of
the host path and of host noise (a host sync inside the op, as in the baselines'
``.tolist()``, still exposes what follows it). Ratios use ``ms``, except the column
``queued`` after ``x alone``: nccl.ep's queued time over the row's. Before timing, each variant
round-trips once with identity experts: combine(dispatch(x)) must equal
top_k * x up to bf16 rounding (``check``, largest error relative to max |top_k * x|
on any rank; FP8 rows: up to e4m3 rounding, at most 2^-4 per value); a failed check
is reported, not fatal.

Ratios (time of the other / time of the row; > 1: the row is faster):
``x a2a`` and ``x dedup`` hold dispatch against the baseline's dispatch and
combine / combine_copy against its combine; ``x alone`` holds a te_ep row (and
the nccl.ep+floor and nccl.ep-drop rows) against nccl.ep's row of the same op and mode
(combine_copy against nccl.ep's zero-copy combine, so it prices te_ep's copy into the window). Below the
worst-case capacity te_ep runs NCCL EP with the DROP overflow policy (in the
staged mode NCCL EP then zero-fills the receive buffer on every dispatch) while
nccl.ep uses TRAP; te_ep also zeroes receive rows past the last zone and the
combine output rows of tokens without any valid choice. ``x alone`` includes all
of that.

Bandwidth follows DeepEP's convention: a token sent to a rank counts once per
destination rank, however many of that rank's experts it goes to.
``logical GB/s`` = all bytes a rank receives (its own tokens included) / time;
``NVLink GB/s`` = bytes received from other ranks / time, averaged over ranks.
``% copy`` relates the NVLink figure to a plain GPU-to-GPU copy measured in the
same run (one peer copy, cuda:0 -> cuda:1, one direction); all-to-all receives
from several peers at once, so it can exceed 100%. ``prepare`` moves no tokens
and gets no bandwidth.

``--nccl-ep-env SPEC ...`` times te_ep and nccl.ep once per environment
setting in the same run (e.g. ``default NCCL_EP_COMM_SMS=32
NCCL_EP_DISABLE_GUARD=1``): each variable is set while that variant's group
is created, when NCCL EP reads it. Each new NCCL EP configuration compiles its
kernels on first use. Rows and ratios are printed per shape as soon as it is
done, and ``--csv`` is rewritten then (one line per variant and op).

``--rounds R`` repeats the whole set of variants R times, each round building them afresh,
every other round in the reverse order. Each number is then the median over the rounds of
that round's median, and each ratio the median of the rounds' own ratios (two variants timed
within one round); the lowest and highest ``x alone`` (and its queued ratio) of the rounds are
printed under the table. New variants of a round (new groups, buffers and windows) can run
faster or slower than those of the last, so use several rounds for a verdict on a ratio close
to 1 (docs/benchmarks.md). Every variant of a round is alive at once: its memory is the sum of
theirs.

``--device cpu`` runs on gloo (reference and the baselines; the NCCL EP
variants are skipped): it tests the script, its numbers mean nothing. NVLink
multicast is never used: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are the defaults.
"""

from __future__ import annotations

# _common first: it sets the environment NCCL reads when it initialises. Run as a script
# (python3 or torchrun), this folder is on the import path; imported (the tests import
# benchmarks.bench_dispatch_combine), the modules beside it are in its package.
if __package__:
    from . import _common, _nccl_ep_alone
    from ._common import Column, Timing
else:
    import _common
    import _nccl_ep_alone
    from _common import Column, Timing

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

DTYPE = torch.bfloat16
MODES = ("staged", "zero_copy", "auto")
# Execution order: the variants least likely to take the process down first, so
# that their numbers are printed (progress lines) whatever happens later.
BACKENDS = ("all_to_all", "a2a_dedup", "reference", "nccl_ep", "nccl_ep_alone", "nccl_ep_floor", "nccl_ep_drop",
            "nccl_ep_flat")
# The backends that drive NCCL EP through nccl.ep (NcclEpAloneVariant).
ALONE_BACKENDS = ("nccl_ep_alone", "nccl_ep_floor", "nccl_ep_drop", "nccl_ep_flat")
# The alone variants whose rows are held against nccl.ep's (an x alone of their own).
PRICED_BACKENDS = ("nccl_ep_floor", "nccl_ep_drop")
DEFAULT_BACKENDS = ["nccl_ep", "nccl_ep_alone", "all_to_all", "a2a_dedup"]
OPS = ("prepare", "quantize", "dispatch_op", "dispatch", "combine", "combine_copy")
CHECK_TOLERANCE = 1e-2  # relative to max |top_k * x|; bf16 keeps 8 significant bits
# FP8 rows: e4m3 keeps 4 significant bits (a rounding error of at most 2^-4), plus bf16's.
CHECK_TOLERANCE_FP8 = 2**-4 + 1e-2


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    top_k: int
    experts: int

    def label(self) -> str:
        return f"T={self.tokens} H={self.hidden} K={self.top_k} E={self.experts}"


SHAPES = {
    "main": Shape(4096, 7168, 8, 256),
    "small": Shape(1024, 7168, 8, 256),
    "large": Shape(16384, 7168, 8, 256),
    "top2": Shape(4096, 4096, 2, 256),
}


@dataclass
class Routing:
    topk_idx: torch.Tensor  # [T, K] int64, on the device
    topk_weights: torch.Tensor  # [T, K] float32
    tokens: torch.Tensor  # [T, H] bf16
    recv_rows: int  # (token, local expert) pairs this rank receives
    recv_bytes: int  # DeepEP convention: (token, destination rank) pairs * row bytes
    recv_bytes_remote: int  # the same, from other ranks only


def make_routing(shape: Shape, rank: int, world: int, device: torch.device) -> Routing:
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    scores = torch.rand(shape.tokens, shape.experts, generator=gen)
    topk_idx = scores.topk(shape.top_k, dim=1).indices
    topk_weights = torch.rand(shape.tokens, shape.top_k, generator=gen) + 0.5
    tokens = torch.randn(shape.tokens, shape.hidden, generator=gen).to(DTYPE)

    local = shape.experts // world
    dest_rank = topk_idx // local
    # Per destination: (token, expert) pairs, and tokens counted once per rank.
    pairs = torch.bincount(dest_rank.flatten(), minlength=world)
    unique_tokens = torch.zeros(world, dtype=torch.int64)
    for r in range(world):
        unique_tokens[r] = (dest_rank == r).any(dim=1).sum()
    stats = torch.stack([pairs, unique_tokens]).to(device)
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    row_bytes = shape.hidden * DTYPE.itemsize
    recv_rows = sum(int(g[0, rank]) for g in gathered)
    recv_tokens = [int(g[1, rank]) for g in gathered]
    return Routing(
        topk_idx=topk_idx.to(device),
        topk_weights=topk_weights.to(device),
        tokens=tokens.to(device),
        recv_rows=recv_rows,
        recv_bytes=sum(recv_tokens) * row_bytes,
        recv_bytes_remote=(sum(recv_tokens) - recv_tokens[rank]) * row_bytes,
    )


# ---- timing ------------------------------------------------------------------


@dataclass
class Op:
    fn: Callable[[], object]
    setup: Optional[Callable[[], object]] = None  # before each iteration, outside the timed region

    def run(self):
        if self.setup is not None:
            self.setup()
        return self.fn()


def peer_copy_gbps(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> Optional[float]:
    """One-direction cuda:i -> cuda:i+1 copy bandwidth, measured by rank 0 alone."""
    if device.type != "cuda":
        return None
    value = torch.zeros(1, device=device)
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=peer)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        torch.cuda.synchronize(peer)
        value[0] = nbytes * iters / (start.elapsed_time(end) * 1e-3) / 1e9
        del src, dst
        torch.cuda.empty_cache()
    dist.broadcast(value, src=0)
    return float(value.item()) or None


# ---- variants ------------------------------------------------------------------
# Each variant dispatches the routing's tokens into an expert-major buffer,
# takes an expert output of that layout (set_expert_output) and combines it;
# ops() names what is timed, in an order in which each op finds the state it
# needs (prepared routing, dispatched rows).


class Skip(Exception):
    """A variant that can't run here; the message says why (not an error of the benchmark)."""


class Variant:
    kind = ""  # "te_ep", "nccl.ep" or "baseline"
    mode = ""  # te_ep and nccl.ep: the mode they run in
    capacity = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.expert_out: Optional[torch.Tensor] = None

    def dispatch(self) -> torch.Tensor:
        raise NotImplementedError

    def set_expert_output(self, expert_out: torch.Tensor) -> None:
        self.expert_out = expert_out

    def ops(self) -> Dict[str, Op]:
        raise NotImplementedError

    def close(self) -> None:
        self.expert_out = None


class TeEp(Variant):
    """te_ep_torch through its public API (EpGroup / ep_dispatch / ep_combine)."""

    kind = "te_ep"

    def __init__(self, spec: VariantSpec, shape: Shape, routing: Routing, capacity: int, alignment: int) -> None:
        import te_ep_torch as te

        if spec.backend == "nccl_ep" and routing.tokens.device.type != "cuda":
            raise Skip("the nccl_ep backend needs --device cuda")
        self.te = te
        self.group = te.EpGroup(num_experts=shape.experts, max_tokens_per_rank=shape.tokens, **spec.group_options())
        try:
            self.handle = self.group.create_handle(
                top_k=shape.top_k, hidden=shape.hidden, dtype=DTYPE, alignment=alignment, capacity=capacity,
                dispatch_dtype=torch.float8_e4m3fn if spec.fp8 else None,
            )
        except Exception:
            # e.g. zero_copy where windows can't be had: every rank fails alike (the mode is agreed).
            self.group.shutdown()
            raise
        self.mode = self.handle.mode
        self.capacity = capacity
        super().__init__(spec.row_label(self.mode))
        self.routing = routing
        self.combine_buffer: Optional[torch.Tensor] = None

    def dispatch(self) -> torch.Tensor:
        r = self.routing
        return self.te.ep_dispatch(self.handle, r.tokens, r.topk_idx, r.topk_weights).tokens

    def prepare(self):
        return self.handle.prepare(self.routing.topk_idx)

    def dispatch_op(self):
        """The dispatch op alone on the prepared routing: the transport itself."""
        r, h = self.routing, self.handle
        return self.te.ops.dispatch(
            r.tokens, r.topk_weights, h.handle_mem, self.group.group_name, h.id, h.config.capacity
        )

    def combine_from(self, expert_out: torch.Tensor) -> torch.Tensor:
        return self.te.ep_combine(self.handle, expert_out, self.routing.tokens.shape[0])

    def fill_combine_buffer(self) -> None:
        self.combine_buffer = self.handle.combine_buffer()
        self.combine_buffer.copy_(self.expert_out)

    def ops(self) -> Dict[str, Op]:
        ops = {"prepare": Op(self.prepare), "dispatch_op": Op(self.dispatch_op), "dispatch": Op(self.dispatch)}
        if self.mode == "zero_copy":
            ops["combine"] = Op(lambda: self.combine_from(self.combine_buffer), setup=self.fill_combine_buffer)
            ops["combine_copy"] = Op(lambda: self.combine_from(self.expert_out))
        else:
            ops["combine"] = Op(lambda: self.combine_from(self.expert_out))
        return ops

    def close(self) -> None:
        super().close()
        self.combine_buffer = None
        self.group.shutdown()


class TeEpFp8(TeEp):
    """te_ep_torch's FP8 dispatch (te.ep_dispatch_fp8) on a handle of the same configuration."""

    kind = "te_ep-fp8"

    def __init__(self, spec: VariantSpec, shape: Shape, routing: Routing, capacity: int, alignment: int) -> None:
        super().__init__(spec, shape, routing, capacity, alignment)
        self.quantized = self.te.quantize_fp8(routing.tokens)

    def dispatch(self) -> torch.Tensor:
        r = self.routing
        return self.te.ep_dispatch_fp8(self.handle, r.tokens, r.topk_idx, r.topk_weights).dequantize()

    def dispatch_fp8(self):
        r = self.routing
        return self.te.ep_dispatch_fp8(self.handle, r.tokens, r.topk_idx, r.topk_weights)

    def dispatch_op(self):
        r, h = self.routing, self.handle
        values, scales = self.quantized
        return self.te.ops.dispatch_fp8(values, scales, r.topk_weights, h.handle_mem, self.group.group_name, h.id,
                                        h.config.capacity)

    def ops(self) -> Dict[str, Op]:
        ops = super().ops()
        ops["dispatch"] = Op(self.dispatch_fp8)
        ops["quantize"] = Op(lambda: self.te.quantize_fp8(self.routing.tokens))
        return ops


class NcclEpAloneVariant(Variant):
    """NCCL EP through nccl.ep / nccl.core alone (benchmarks/_nccl_ep_alone.py); with the
    nccl_ep_flat backend its FLAT layout + te_ep's permute / unpermute (the other route to
    expert-major rows); with nccl_ep_floor, plus the CUDA calls te_ep's checks and watchdog
    add; with nccl_ep_drop, te_ep's overflow policy (see the module's docstring)."""

    kind = "nccl.ep"

    def __init__(self, spec: VariantSpec, shape: Shape, routing: Routing, capacity: int, alignment: int,
                 world: int) -> None:
        if routing.tokens.device.type != "cuda":
            raise Skip("NCCL EP needs --device cuda")
        reason = _nccl_ep_alone.unavailable()
        if reason:
            raise Skip(reason)
        self.mode = spec.mode
        self.capacity = capacity
        super().__init__(spec.row_label())
        self.floor = spec.backend == "nccl_ep_floor"
        self.marker = torch.cuda.Event() if self.floor else None
        self.alone = _nccl_ep_alone.NcclEpAlone(
            tokens=routing.tokens, topk_idx=routing.topk_idx, topk_weights=routing.topk_weights,
            num_experts=shape.experts, capacity=capacity, alignment=alignment, zero_copy=spec.mode == "zero_copy",
            flat=spec.backend == "nccl_ep_flat",
            overflow_drop=spec.backend == "nccl_ep_drop" and capacity < worst_case_capacity(shape, world, alignment),
        )

    def dispatch(self) -> torch.Tensor:
        return self.alone.dispatch()

    def set_expert_output(self, expert_out: torch.Tensor) -> None:
        super().set_expert_output(expert_out)
        self.alone.set_expert_output(expert_out)

    def ops(self) -> Dict[str, Op]:
        a = self.alone
        fill = a.fill_combine_window if a.zero_copy else None
        if not self.floor:
            return {"prepare": Op(a.prepare), "dispatch_op": Op(a.dispatch_op), "dispatch": Op(a.dispatch),
                    "combine": Op(a.combine, setup=fill)}
        return {"prepare": Op(self.floor_prepare), "dispatch_op": Op(self.floor_dispatch_op),
                "dispatch": Op(self.floor_dispatch), "combine": Op(self.floor_combine, setup=fill)}

    # nccl_ep_floor: te_ep's CUDA calls around NCCL EP's, in te_ep's order (a 0-cycle
    # torch.cuda._sleep stands for each of te_ep's small kernels).
    def floor_tail(self) -> None:
        """What follows each of NCCL EP's calls: te_ep's kernel (prepare's finish, or the
        zeroing of dispatch's rows past the total and of combine's unrouted rows), its marker."""
        torch.cuda._sleep(0)
        self.marker.record()

    def floor_prepare(self) -> None:
        torch.cuda._sleep(0)  # the routing guard
        self.alone.prepare()
        self.floor_tail()

    def floor_dispatch_op(self) -> torch.Tensor:
        rows = self.alone.dispatch_op()
        self.floor_tail()
        return rows

    def floor_dispatch(self) -> torch.Tensor:
        """As te_ep's ep_dispatch runs it (prepare_dispatch): the guard, NCCL EP's two calls
        back to back, then one kernel (prepare's finish and the rows' zeroing) and one marker."""
        torch.cuda._sleep(0)  # the routing guard
        self.alone.prepare()
        rows = self.alone.dispatch_op()
        self.floor_tail()
        return rows

    def floor_combine(self) -> torch.Tensor:
        out = self.alone.combine()
        self.floor_tail()
        return out

    def close(self) -> None:
        super().close()
        self.alone.close()


class Baseline(Variant):
    """A baseline written with torch.distributed: dispatch keeps what its combine needs in ``state``."""

    kind = "baseline"
    state = None

    def combine(self) -> torch.Tensor:
        raise NotImplementedError

    def ops(self) -> Dict[str, Op]:
        return {"dispatch": Op(self.dispatch), "combine": Op(self.combine)}

    def close(self) -> None:
        super().close()
        self.state = None


class AllToAll(Baseline):
    """One row per (token, expert) pair through all_to_all_single, as in TorchTitan."""

    def __init__(self, shape: Shape, routing: Routing, world: int) -> None:
        super().__init__("all_to_all")
        self.shape, self.routing, self.world = shape, routing, world
        self.local = shape.experts // world

    def dispatch(self) -> torch.Tensor:
        r, shape, world, local = self.routing, self.shape, self.world, self.local
        flat = r.topk_idx.flatten()
        order = torch.argsort(flat, stable=True)
        send = r.tokens.index_select(0, order // shape.top_k)
        counts = torch.bincount(flat, minlength=shape.experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        send_splits = counts.view(world, local).sum(1).tolist()
        recv_splits = recv_counts.view(world, local).sum(1).tolist()
        recv = send.new_empty(sum(recv_splits), shape.hidden)
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        # Rows arrive grouped by (source rank, local expert); regroup by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=recv.device).repeat(world), recv_counts.view(-1), output_size=recv.shape[0]
        )
        regroup = torch.argsort(expert_of_row, stable=True)
        self.state = (order, send_splits, recv_splits, regroup)
        return recv.index_select(0, regroup)

    def combine(self) -> torch.Tensor:
        order, send_splits, recv_splits, regroup = self.state
        shape, expert_out = self.shape, self.expert_out
        back = torch.empty_like(expert_out)
        back.index_copy_(0, regroup, expert_out)
        returned = expert_out.new_empty(sum(send_splits), shape.hidden)
        dist.all_to_all_single(returned, back, send_splits, recv_splits)
        out = torch.zeros(shape.tokens, shape.hidden, dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, order // shape.top_k, returned.float())
        return out.to(DTYPE)


class AllToAllDedup(Baseline):
    """Each token sent once per destination rank, then te_ep_torch's local permute."""

    def __init__(self, shape: Shape, routing: Routing, world: int, capacity: int, alignment: int) -> None:
        import te_ep_torch as te

        super().__init__("a2a_dedup")
        self.te = te
        self.shape, self.routing, self.world = shape, routing, world
        self.local = shape.experts // world
        self.capacity, self.alignment = capacity, alignment

    def dispatch(self) -> torch.Tensor:
        r, shape, world, local = self.routing, self.shape, self.world, self.local
        num_tokens, top_k = r.topk_idx.shape
        dest = r.topk_idx // local
        to_rank = torch.zeros(num_tokens, world, dtype=torch.bool, device=dest.device).scatter_(1, dest, True)
        send_counts = to_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        # Selected (rank, token) pairs first, rank-major, tokens ascending; the
        # splits' .tolist() is the one host sync, and it also sizes the slice.
        order = torch.argsort((~to_rank).t().reshape(-1).to(torch.int8), stable=True)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()
        picked = order[: sum(send_splits)]
        send_rank, send_token = picked // num_tokens, picked % num_tokens
        ids = r.topk_idx.index_select(0, send_token)
        mine = (ids // local) == send_rank.unsqueeze(1)
        local_ids = torch.where(mine, ids - send_rank.unsqueeze(1) * local, -1).to(torch.int32)
        weights = torch.where(mine, r.topk_weights.index_select(0, send_token), 0.0)
        # One exchange for both: ids and the weights' bits side by side as int32.
        meta = torch.cat([local_ids, weights.view(torch.int32)], dim=1)
        recv_meta = meta.new_empty(sum(recv_splits), 2 * top_k)
        dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits)
        send = r.tokens.index_select(0, send_token)
        recv = send.new_empty(sum(recv_splits), shape.hidden)
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        recv_ids = recv_meta[:, :top_k].contiguous()
        recv_weights = recv_meta[:, top_k:].contiguous().view(torch.float32)
        expert_major, _, perm_map = self.te.permute(
            recv, recv_ids, recv_weights, num_experts=local, capacity=self.capacity, alignment=self.alignment
        )
        self.state = (send_token, send_splits, recv_splits, perm_map)
        return expert_major

    def combine(self) -> torch.Tensor:
        send_token, send_splits, recv_splits, perm_map = self.state
        shape = self.shape
        per_token = self.te.unpermute(self.expert_out, perm_map)
        returned = per_token.new_empty(sum(send_splits), shape.hidden)
        dist.all_to_all_single(returned, per_token, send_splits, recv_splits)
        out = torch.zeros(shape.tokens, shape.hidden, dtype=torch.float32, device=returned.device)
        out.index_add_(0, send_token, returned.float())
        return out.to(DTYPE)


# ---- driver -------------------------------------------------------------------


@dataclass
class VariantSpec:
    """One variant to run: everything its row label and its EpGroup arguments come from."""

    backend: str  # a BACKENDS entry
    mode: str = ""  # nccl_ep: the nccl_ep_mode asked for; ALONE_BACKENDS: the mode
    env_spec: str = "default"
    env: Dict[str, str] = field(default_factory=dict)
    fp8: bool = False
    checks: str = "local"  # nccl_ep: EpGroup's checks

    @property
    def suffix(self) -> str:
        tags = [t for t in (self.env_spec != "default" and self.env_spec, self.checks != "local" and self.checks) if t]
        return f"[{','.join(tags)}]" if tags else ""

    def group_options(self) -> Dict[str, object]:
        """The EpGroup arguments of a te_ep variant."""
        options: Dict[str, object] = {"backend": self.backend}
        if self.backend == "nccl_ep":
            options["nccl_ep_mode"] = self.mode
            options["checks"] = self.checks
        return options

    def row_label(self, actual_mode: str = "") -> str:
        """The row label; a te_ep row shows the mode its handle runs in (``actual_mode``) where it
        differs from the one asked for, as ``ASKED->ACTUAL``."""
        if self.backend in ("nccl_ep", "reference"):
            asked = self.mode or self.backend
            shown = asked if actual_mode in ("", asked) else f"{asked}->{actual_mode}"
            return f"{'te_ep-fp8' if self.fp8 else 'te_ep'}/{shown}{self.suffix}"
        if self.backend in ALONE_BACKENDS:
            name = {"nccl_ep_alone": "nccl.ep", "nccl_ep_floor": "nccl.ep+floor", "nccl_ep_drop": "nccl.ep-drop",
                    "nccl_ep_flat": "nccl.ep-flat"}
            return f"{name[self.backend]}/{self.mode}{self.suffix}"
        return self.backend


def variant_specs(args) -> List[VariantSpec]:
    """What to run, in execution order (BACKENDS)."""
    envs = [(spec, parse_env(spec)) for spec in (args.nccl_ep_env or ["default"])]
    # NCCL EP alone has no 'auto': te_ep's auto is zero-copy wherever windows work.
    alone_modes = list(dict.fromkeys("zero_copy" if m == "auto" else m for m in args.modes))
    out = []
    for backend in (b for b in BACKENDS if b in args.backends):
        fp8 = (False, True) if args.fp8 else (False,)
        if backend == "nccl_ep":
            out += [VariantSpec(backend, mode, spec, env, f, checks) for spec, env in envs for mode in args.modes
                    for f in fp8 for checks in args.checks]
        elif backend == "reference":
            out += [VariantSpec(backend, fp8=f) for f in fp8]
        elif backend in ALONE_BACKENDS:
            # The floor follows te_ep's zero-copy op structure only.
            modes = [m for m in alone_modes if backend != "nccl_ep_floor" or m == "zero_copy"]
            out += [VariantSpec(backend, mode, spec, env) for spec, env in envs for mode in modes]
        else:
            out.append(VariantSpec(backend))
    return out


def parse_env(spec: str) -> Dict[str, str]:
    """'default' or 'NAME=VALUE[,NAME=VALUE...]' -> {NAME: VALUE}."""
    if spec == "default":
        return {}
    env = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--nccl-ep-env: expected NAME=VALUE[,NAME=VALUE...] or 'default', got {spec!r}")
        env[name] = value
    return env


@contextlib.contextmanager
def env_setting(env: Dict[str, str]):
    """Set env while the variant's group is created (NCCL EP and te_ep read it then)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_variant(spec: VariantSpec, shape: Shape, routing: Routing, capacity: int, args, world: int) -> Variant:
    if spec.backend == "all_to_all":
        return AllToAll(shape, routing, world)
    if spec.backend == "a2a_dedup":
        return AllToAllDedup(shape, routing, world, capacity, args.alignment)
    with env_setting(spec.env):
        if spec.backend in ALONE_BACKENDS:
            return NcclEpAloneVariant(spec, shape, routing, capacity, args.alignment, world)
        make = TeEpFp8 if spec.fp8 else TeEp
        return make(spec, shape, routing, capacity, args.alignment)


def on_every_rank(what: Callable[[], object]) -> Tuple[object, str, bool]:
    """(what(), '', True) where it succeeded on every rank, else (None, the first rank's error, everywhere).

    A failing rank prints its traceback (a Skip only its message) and the run
    goes on with the next variant. ``everywhere``: whether every rank failed
    (then each can clean up what it made, collectively).
    """
    try:
        result, error = what(), ""
    except Skip as exc:
        result, error = None, str(exc)
    except Exception as exc:  # reported in the table and on stderr; the remaining variants still run
        traceback.print_exc()
        message = str(exc).strip()
        result, error = None, f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"
    errors: List[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return result, "", True
    everywhere = len(failed) == len(errors)
    if everywhere and all(e == failed[0][1] for _, e in failed):
        return None, failed[0][1], True
    return None, f"rank {failed[0][0]}: {failed[0][1]}", everywhere


def roundtrip_error(op: Op, routing: Routing, top_k: int, device: torch.device) -> float:
    """Largest |combine(dispatch(x)) - top_k * x| / max |top_k * x| with identity experts, on any rank."""
    expected = routing.tokens.float() * top_k
    err = (op.run().float() - expected).abs().max() / expected.abs().max()
    result = torch.tensor([float(err)], dtype=torch.float64, device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result.item())


def check_variant(variant: Variant, routing: Routing, shape: Shape) -> float:
    """The variant's round trip error (roundtrip_error, the largest over its combine ops)."""
    # Identity experts: the expert output is what arrived, in a tensor of its own.
    variant.set_expert_output(variant.dispatch().clone())
    device = routing.tokens.device
    return max(roundtrip_error(op, routing, shape.top_k, device) for name, op in variant.ops().items()
               if name.startswith("combine"))


def time_variants(variants: List[Variant], args, device: torch.device) -> List[Dict[str, Timing]]:
    """{op: its times} of each variant (_common.interleaved_median_ms, every iteration
    barrier-aligned): op by op in OPS order, the variants that have the op taking turns
    call by call, so that the ratio of two variants holds the machine's drift out. Each
    variant's ops run in the order in which each finds the state it needs. With
    ``--nvtx``, each timed call inside an NVTX range named '<variant> <op>'."""
    ops = [v.ops() for v in variants]
    timings: List[Dict[str, Timing]] = [{} for _ in variants]
    for name in OPS:
        having = [i for i, o in enumerate(ops) if name in o]
        calls = [_common.Call(ops[i][name].fn, ops[i][name].setup,
                              f"{variants[i].label} {name}" if args.nvtx else None) for i in having]
        if not calls:
            continue
        for i, t in zip(having, _common.interleaved_median_ms(calls, device, args.warmup, args.iters, ranks=True,
                                                              queued=True)):
            timings[i][name] = t
    return timings


def trace_path(trace_dir: str, label: str, op: str, rank: int) -> str:
    """Where ``--trace`` writes one rank's trace of one op of one variant."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")
    return os.path.join(trace_dir, f"{safe}.{op}.rank{rank}.json.gz")


def profile_ops(label: str, ops: Dict[str, "Op"], iters: int, device: torch.device,
                trace_dir: Optional[str] = None) -> None:
    """``--profile N``: N more calls of each op under torch.profiler (every rank runs them, rank 0
    prints): the host calls (self CPU time: the op, te_ep's and NCCL EP's CUDA API calls) and the
    kernels (self device time) behind one op's time, per call, in this variant. ``trace_dir``
    (``--trace``): every rank also writes its trace there, each call in a range named
    '<variant> <op>' (benchmarks/trace_ranges.py reads them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, op in ops.items():
        dist.barrier()
        with profile(activities=activities) as prof:
            for _ in range(iters):
                if op.setup is not None:
                    op.setup()
                    _common.synchronize(device)
                dist.barrier()
                _common.synchronize(device)
                with record_function(f"{label} {name}"):
                    op.fn()
                _common.synchronize(device)
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(trace_path(trace_dir, label, name, dist.get_rank()))
        if dist.get_rank() != 0:
            continue
        events = prof.key_averages()
        print(f"\n-- profile {label} {name}: {iters} calls; us per call (rank 0; setup between calls included)")
        for title, key in (("host", "self_cpu_time_total"), ("device", "self_device_time_total")):
            if title == "device" and device.type != "cuda":
                continue
            rows = sorted((e for e in events if getattr(e, key, 0) > 0), key=lambda e: -getattr(e, key))[:12]
            total = sum(getattr(e, key) for e in events) / iters
            print(f"   {title}: {total:.1f} us per call in all")
            for e in rows:
                print(f"     {getattr(e, key) / iters:9.1f} us  x{e.count / iters:4.1f}  {e.key[:90]}")


def worst_case_capacity(shape: Shape, world: int, alignment: int) -> int:
    """The receive rows no routing of ``shape`` can overflow (te_ep's own rule)."""
    from te_ep_torch import ops

    return ops.worst_case_capacity(world, shape.tokens, shape.top_k, shape.experts // world, alignment)


def fit_capacity(routing: Routing, shape: Shape, world: int, args, device: torch.device) -> int:
    local = shape.experts // world
    if args.worst_case_capacity:
        return worst_case_capacity(shape, world, args.alignment)
    need = torch.tensor([routing.recv_rows], device=device)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    # NCCL EP's receive budget may not be below its send budget (T rounded up to 4).
    floor = -(-shape.tokens // _nccl_ep_alone.SEND_BUDGET_MULTIPLE) * _nccl_ep_alone.SEND_BUDGET_MULTIPLE
    # 10% headroom, as a capacity factor would give; padding on top.
    return max(floor, math.ceil(int(need.item()) * 1.1) + local * (args.alignment - 1))


@dataclass
class Result:
    label: str
    kind: str
    mode: str
    spec: VariantSpec
    capacity: object
    timings: Dict[str, Timing]
    check: float

    def ms(self, op: str) -> Optional[float]:
        return self.timings[op].ms if op in self.timings else None


def run_shape(shape: Shape, args, world: int, rank: int, device: torch.device, copy_gbps
              ) -> Tuple[List[Dict], List[Tuple[str, str]]]:
    """(table rows, [(label, why)] of the variants that did not run)."""
    routing = make_routing(shape, rank, world, device)
    capacity = fit_capacity(routing, shape, world, args, device)
    volumes = torch.tensor([routing.recv_bytes, routing.recv_bytes_remote], dtype=torch.float64, device=device)
    dist.all_reduce(volumes)
    logical_bytes, remote_bytes = (float(v) / world for v in volumes.tolist())
    rounds, skipped = [], {}
    for i in range(args.rounds):
        # Every other round runs the variants in the reverse order, so that a drift of the
        # machine (clocks, other load) over a round weighs on every variant alike.
        specs = variant_specs(args)
        if i % 2:
            specs.reverse()
        if rank == 0 and args.rounds > 1:
            print(f" round {i + 1} of {args.rounds}", flush=True)
        results = run_variants(specs, shape, routing, capacity, args, world, rank, device, skipped)
        rounds.append(table_rows(shape, results, logical_bytes, remote_bytes, copy_gbps))
    return merge_rounds(rounds), list(skipped.items())


def run_variants(specs: List[VariantSpec], shape: Shape, routing: Routing, capacity: int, args, world: int,
                 rank: int, device: torch.device, skipped: Dict[str, str]) -> List["Result"]:
    """Builds and checks each variant in turn, times them all together (time_variants), then
    closes them; the ones that did not run go to `skipped`."""
    built: List[Tuple[VariantSpec, Variant, float]] = []

    def skip(label: str, error: str) -> None:
        skipped.setdefault(label, error)
        if rank == 0:
            print(f"  {label}: not run: {error}", flush=True)

    def close(variant: Variant) -> None:
        variant.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for spec in specs:
        variant, error, everywhere = on_every_rank(lambda: make_variant(spec, shape, routing, capacity, args, world))
        if variant is None:
            skip(spec.row_label(), error)
            continue
        with torch.no_grad():
            check, error, everywhere = on_every_rank(lambda: check_variant(variant, routing, shape))
        if error:
            # Teardown is collective: not where some rank failed (it would not join).
            if everywhere:
                close(variant)
            skip(variant.label, error)
            continue
        built.append((spec, variant, check))
    variants = [variant for _, variant, _ in built]

    def time_and_profile() -> List[Dict[str, Timing]]:
        timed = time_variants(variants, args, device)
        for variant in variants if args.profile else ():
            profile_ops(variant.label, variant.ops(), args.profile, device, args.trace)
        return timed

    with torch.no_grad():
        timed, error, everywhere = on_every_rank(time_and_profile)
    results = []
    for (spec, variant, check), timings in zip(built, timed or [None] * len(built)):
        if error:
            skip(variant.label, error)
        else:
            results.append(Result(variant.label, variant.kind, variant.mode, spec, variant.capacity, timings, check))
            if rank == 0:
                ms = "  ".join(f"{op} {t.ms:.3f}" for op, t in timings.items())
                print(f"  {variant.label}: {ms} ms; check {check:.1e}", flush=True)
        if everywhere:
            close(variant)
    return results


def merge_rounds(rounds: List[List[Dict]]) -> List[Dict]:
    """One row per (shape, variant, op) from the rows of each round (``--rounds``).

    Every number is the median over the rounds that have the row; a ratio (``x alone``,
    ``x a2a``, ...) is so the median of each round's own ratio, of two variants timed in the
    same round. The round trip's error is the largest of any round. ``rounds`` says how many
    rounds had the row and ``x_alone_min`` / ``x_alone_max`` the range of its ``x alone``
    (``x_alone_queued_min`` / ``_max``: of its queued ratio).
    One round's rows are returned as they are, with ``rounds`` = 1.
    """
    merged: Dict[Tuple[str, str, str], List[Dict]] = {}
    for rows in rounds:
        for row in rows:
            merged.setdefault((row["shape"], row["variant"], row["op"]), []).append(row)
    out = []
    for same in merged.values():
        row = dict(same[0])
        for key, value in row.items():
            if key == "check_rel_err":
                row[key] = max(r[key] for r in same)
            elif isinstance(value, float):
                values = [r[key] for r in same if not math.isnan(r[key])]
                row[key] = statistics.median(values) if values else math.nan
        for key in ("x_alone", "x_alone_queued"):
            ratios = [r[key] for r in same if not math.isnan(r.get(key, math.nan))]
            row[f"{key}_min"] = min(ratios) if ratios else math.nan
            row[f"{key}_max"] = max(ratios) if ratios else math.nan
        row["rounds"] = len(same)
        out.append(row)
    return out


def table_rows(shape: Shape, results: List[Result], logical_bytes: float, remote_bytes: float,
               copy_gbps: Optional[float]) -> List[Dict]:
    """One row per (variant, op), with bandwidths and ratios."""
    by_label = {r.label: r for r in results}

    def ratio(other: Optional[Result], op: str, t: float) -> float:
        if other is None or other.ms(op) is None:
            return float("nan")
        return other.ms(op) / t

    def queued_ratio(other: Optional[Result], op: str, t: float) -> float:
        if other is None or op not in other.timings:
            return float("nan")
        return other.timings[op].queued_ms / t

    kind_order = {"te_ep": 0, "te_ep-fp8": 1, "nccl.ep": 2, "baseline": 3}

    def fastest_checks(r: Result, op: str) -> Optional[float]:
        """The fastest check mode's ms of `op` among the variants that differ from `r` only in checks."""
        same = [o.ms(op) for o in results if o.kind == r.kind and o.mode == r.mode and o.spec.env_spec ==
                r.spec.env_spec and o.spec.backend == r.spec.backend and o.ms(op) is not None]
        return min(same) if len(same) > 1 else None

    rows = []
    for r in sorted(results, key=lambda r: kind_order[r.kind]):
        bf16 = by_label.get(r.label.replace("te_ep-fp8/", "te_ep/", 1)) if r.kind == "te_ep-fp8" else None
        alone = None
        if (r.kind == "te_ep" or r.spec.backend in PRICED_BACKENDS) and r.mode in ("staged", "zero_copy"):
            alone = by_label.get(VariantSpec("nccl_ep_alone", r.mode, r.spec.env_spec).row_label())
        for op in OPS:
            if op not in r.timings:
                continue
            t = r.timings[op].ms
            base_op = "combine" if op == "combine_copy" else op
            moves_tokens = op not in ("prepare", "quantize")
            nvlink = remote_bytes / (t * 1e-3) / 1e9 if moves_tokens else float("nan")
            # quantize: HBM bytes read (bf16) and written (e4m3 + a float32 per 128 values)
            hbm = shape.tokens * shape.hidden * (2 + 1 + 4 / 128) / (t * 1e-3) / 1e9 if op == "quantize" else None
            rows.append({
                "shape": shape.label(),
                "variant": r.label,
                "mode": r.mode,
                "env": r.spec.env_spec,
                "capacity": r.capacity,
                "op": op,
                "ms": t,
                "host_ms": r.timings[op].host_ms,
                "queued_ms": r.timings[op].queued_ms,
                "logical_GBps": hbm if hbm is not None else (logical_bytes / (t * 1e-3) / 1e9 if moves_tokens
                                                             else float("nan")),
                "nvlink_GBps": nvlink,
                "pct_copy": 100.0 * nvlink / copy_gbps if copy_gbps else float("nan"),
                "x_a2a": ratio(by_label.get("all_to_all"), base_op, t) if base_op in ("dispatch", "combine")
                else float("nan"),
                "x_dedup": ratio(by_label.get("a2a_dedup"), base_op, t) if base_op in ("dispatch", "combine")
                else float("nan"),
                "x_alone": ratio(alone, base_op, t),
                "x_alone_queued": queued_ratio(alone, base_op, r.timings[op].queued_ms),
                "x_bf16": ratio(bf16, base_op, t) if op in ("dispatch_op", "dispatch") else float("nan"),
                "checks": r.spec.checks,
                "x_fastest_checks": t / fastest_checks(r, op) if fastest_checks(r, op) else float("nan"),
                "check_rel_err": r.check,
                "check_tolerance": CHECK_TOLERANCE_FP8 if r.kind == "te_ep-fp8" else CHECK_TOLERANCE,
            })
    return rows


def print_table(rows: List[Dict], skipped: List[Tuple[str, str]]) -> None:
    width = max([len("variant")] + [len(row["variant"]) for row in rows] + [len(label) for label, _ in skipped])
    _common.print_table([
        Column("shape", "<30", "shape"), Column("variant", f"<{width}", "variant"), Column("op", "<12", "op"),
        Column("ms", ">8", "ms", ".3f"), Column("host ms", ">8", "host_ms", ".3f"),
        Column("queued", ">8", "queued_ms", ".3f"), Column("logical GB/s", ">13", "logical_GBps", ".1f"),
        Column("NVLink GB/s", ">12", "nvlink_GBps", ".1f"), Column("% copy", ">7", "pct_copy", ".1f"),
        Column("x a2a", ">6", "x_a2a", ".2f"), Column("x dedup", ">7", "x_dedup", ".2f"),
        Column("x alone", ">7", "x_alone", ".2f"), Column("queued", ">6", "x_alone_queued", ".2f"),
        Column("x bf16", ">6", "x_bf16", ".2f"),
        Column("/ fastest checks", ">16", "x_fastest_checks", ".3f"),
    ], rows)
    checks = dict.fromkeys((row["variant"], row["check_rel_err"], row["check_tolerance"]) for row in rows)
    print("check, combine(dispatch(x)) with identity experts vs top_k * x (largest error / max |top_k * x|):")
    for label, err, tolerance in checks:
        print(f"  {label:<{width}} {'ok  ' if err <= tolerance else 'FAIL'} {err:.1e}")
    for label, reason in skipped:
        print(f"  {label:<{width}} not run: {reason}")
    spread = [row for row in rows if row.get("rounds", 1) > 1 and not math.isnan(row["x_alone"])]
    if spread:
        print("x alone per round (median, lowest-highest of the rounds' own ratios), ms and queued:")
        for row in spread:
            print(f"  {row['variant']:<{width}} {row['op']:<12} {row['x_alone']:.2f} "
                  f"({row['x_alone_min']:.2f}-{row['x_alone_max']:.2f}), queued {row['x_alone_queued']:.2f} "
                  f"({row['x_alone_queued_min']:.2f}-{row['x_alone_queued_max']:.2f}) over {row['rounds']} rounds")


def nccl_ep_versions(args) -> List[str]:
    """What te_ep and nccl.ep run on. te_ep loads NCCL EP first, as it would in a te_ep process."""
    from te_ep_torch import _nccl_ep as te_nccl_ep

    try:
        lines = [f"te_ep: {te_nccl_ep.availability() or te_nccl_ep.load()}"]
    except RuntimeError as exc:
        lines = [f"te_ep: NCCL EP does not load: {exc}"]
    if any(b in args.backends for b in ALONE_BACKENDS):
        lines.append(f"nccl.ep: {_nccl_ep_alone.unavailable() or _nccl_ep_alone.describe()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, choices=list(BACKENDS),
                        help="nccl_ep: te_ep on NCCL EP, once per --modes entry; nccl_ep_alone: NCCL EP through "
                             "nccl.ep alone; nccl_ep_floor: NCCL EP alone plus the CUDA calls te_ep's checks and "
                             "watchdog add (zero_copy only); nccl_ep_drop: NCCL EP alone with te_ep's overflow policy "
                             "(DROP below the worst-case capacity); nccl_ep_flat: NCCL EP's FLAT layout and te_ep's "
                             "permute; "
                             "reference: te_ep's torch.distributed backend; all_to_all, a2a_dedup: the baselines")
    parser.add_argument("--modes", nargs="+", default=["staged", "zero_copy"], choices=list(MODES),
                        help="nccl_ep_mode of the te_ep rows (and the modes of the nccl.ep rows)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: NCCL, one GPU per rank; cpu: gloo, tests the script (NCCL EP rows skipped)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (the first compiles NCCL EP kernels)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--alignment", type=int, default=1,
                        help="per-expert zone alignment of te_ep, nccl.ep and a2a_dedup (all_to_all doesn't pad)")
    parser.add_argument("--worst-case-capacity", action="store_true",
                        help="size receive buffers for the worst case instead of this routing + 10%%")
    parser.add_argument("--nccl-ep-env", nargs="+", default=None, metavar="SPEC",
                        help="time te_ep and nccl.ep once per SPEC: 'default', or NAME=VALUE[,NAME=VALUE...] set "
                             "while their groups are created (e.g. NCCL_EP_COMM_SMS=32 or "
                             "NCCL_EP_HT_EM_LOCAL_DUP=1); rows are labelled te_ep/MODE[SPEC], nccl.ep/MODE[SPEC]")
    parser.add_argument("--checks", nargs="+", default=["local"], choices=["local", "device", "synchronous"],
                        help="nccl_ep: EpGroup(checks=...) of the te_ep rows, one row each; with several, the column "
                             "'/ fastest checks' gives each op's time over the fastest mode's (docs/ops.md, "
                             "'Check modes')")
    parser.add_argument("--fp8", action="store_true",
                        help="also time each te_ep row with FP8 dispatch (te_ep-fp8/MODE rows, quantize included)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant this many times, each round building them afresh and in the reverse "
                             "order of the round before; each number is the median over the rounds, each ratio the "
                             "median of the rounds' own ratios (see the module's docstring)")
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0), rewritten after each shape")
    parser.add_argument("--nvtx", action="store_true",
                        help="name each timed call with an NVTX range '<variant> <op>' (for nsys: the host calls "
                             "inside an op's range are that op's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing each variant, N more calls of each op under torch.profiler: rank 0 prints "
                             "the host calls and kernels behind each op (not part of the timed rows)")
    parser.add_argument("--trace", metavar="DIR",
                        help="with --profile: every rank writes its torch.profiler trace of each op there "
                             "(<variant>.<op>.rank<r>.json.gz, each call in a range '<variant> <op>'); "
                             "benchmarks/trace_ranges.py gives each range's host calls, other threads and kernels")
    args = parser.parse_args()
    if args.trace and not args.profile:
        parser.error("--trace needs --profile N (the traced calls are the profiled ones)")
    if args.warmup < 0 or args.iters < 1 or args.profile < 0 or args.rounds < 1:
        parser.error(f"--warmup must be >= 0, --iters >= 1, --profile >= 0 and --rounds >= 1, got {args.warmup}, "
                     f"{args.iters}, {args.profile} and {args.rounds}")
    if args.alignment < 1 or args.alignment & (args.alignment - 1):
        parser.error(f"--alignment must be a power of two, got {args.alignment}")
    for spec in args.nccl_ep_env or []:
        parse_env(spec)

    device = _common.init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    copy_gbps = peer_copy_gbps(device)
    if rank == 0:
        import te_ep_torch

        print(f"{world} ranks on {device.type}; torch {torch.__version__}; te_ep_torch from "
              f"{os.path.dirname(te_ep_torch.__file__)}")
        if device.type == "cuda":
            print("\n".join(nccl_ep_versions(args)))
        print(f"GPU-to-GPU copy (cuda:0 -> cuda:1, one direction): {copy_gbps or float('nan'):.1f} GB/s", flush=True)
    all_rows = []
    for key in args.shapes:
        shape = SHAPES[key]
        if rank == 0:
            print(f"running {shape.label()} ...", flush=True)
        rows, skipped = run_shape(shape, args, world, rank, device, copy_gbps)
        all_rows += rows
        if rank == 0:
            print_table(rows, skipped)
            if args.csv and all_rows:
                _common.write_csv(args.csv, all_rows)
            sys.stdout.flush()
    _common.close_distributed()


if __name__ == "__main__":
    main()
