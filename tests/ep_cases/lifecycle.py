"""Groups and handles: attributes, shutdown and re-creation, sub-process-groups."""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

import te_ep_torch as te
from te_ep_torch.group import nccl_ep_capacity_floor

from .common import Step, all_inputs, expect_raises, expected_layout, fingerprint, make_group
from .exact import run_exact_step


def case_group_api(ctx) -> None:
    """Attributes, worst-case capacity formula, handle config; auto backend."""
    W = ctx.world_size
    for E_local, maxT in ((4, 7), (8, 13)):
        g = te.EpGroup(None, num_experts=E_local * W, max_tokens_per_rank=maxT, backend=ctx.backend, device=ctx.device,
                       **ctx.group_options())
        assert (g.rank, g.ep_size) == (ctx.rank, W), (g.rank, g.ep_size)
        assert (g.num_experts, g.num_local_experts, g.max_tokens_per_rank) == (E_local * W, E_local, maxT)
        assert g.backend == ctx.backend, g.backend
        assert torch.device(g.device) == torch.device(ctx.device), g.device
        assert g.group_name == dist.group.WORLD.group_name, (g.group_name, dist.group.WORLD.group_name)
        # NCCL EP's wait limit follows the process group's timeout unless given.
        pg_timeout = dist.group.WORLD._get_backend(torch.device(g.device.type)).options._timeout
        assert g.timeout_ms == int(pg_timeout.total_seconds() * 1000), (g.timeout_ms, pg_timeout)
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
        expected_mode = "synchronous" if g.backend == "reference" else ctx.checks
        assert h.check_mode == expected_mode, (h.check_mode, expected_mode)
        h.check()
        g.check()
        g.shutdown()
        assert h.id not in torch.ops.te_ep.live_handles()
    g = te.EpGroup(None, num_experts=4 * W, max_tokens_per_rank=4, backend=ctx.backend, device=ctx.device,
                   timeout=datetime.timedelta(seconds=42.5))
    assert g.timeout_ms == 42500, g.timeout_ms
    g.shutdown()
    # ep_group_for caches one group per configuration, timeout and NCCL EP mode included.
    shared = dict(num_experts=4 * W, max_tokens_per_rank=4, backend=ctx.backend, device=ctx.device)
    g12 = te.ep_group_for(None, timeout=12.0, **shared)
    assert g12.timeout_ms == 12000 and te.ep_group_for(None, timeout=12.0, **shared) is g12
    assert te.ep_group_for(None, timeout=13.0, **shared) is not g12
    assert te.ep_group_for(None, timeout=12.0, checks="device", **shared) is not g12
    te.shutdown_ep_groups()
    if torch.device(ctx.device).type == "cpu":
        g = te.EpGroup(None, num_experts=W, max_tokens_per_rank=4, backend="auto", device=ctx.device)
        assert g.backend == "reference", f"auto on CPU chose {g.backend!r}"
        g.shutdown()


def case_capacity_for(ctx) -> None:
    """EpGroup.capacity_for (collective): the busiest rank's receive rows for this step's
    routing, zone padding included, plus the headroom, within [nccl_ep's floor, worst case];
    a handle of the fitted capacity runs the step exactly; one row less overflows (checked on
    the reference backend, where an overflow raises on every rank in the step); bad arguments
    raise ValueError naming the argument, on every rank when one rank's topk_idx is bad."""
    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(top_k=2, hidden=16, tokens=(40, 25, 0), alignment=8, mode="skew_rank", drop=0.1, seed=71)
    group = make_group(ctx, st)
    idx_all, _ = all_inputs(st, W)
    need = max(expected_layout(idx_all, q, st.experts_per_rank, st.alignment, 0).total for q in range(W))
    floor = nccl_ep_capacity_floor(st.max_tokens_per_rank())
    worst = group.worst_case_capacity(st.top_k, st.alignment)
    assert floor < need < worst, (floor, need, worst)  # the routing exercises the formula, not its clamps
    idx = idx_all[r].to(dev)
    for headroom in (0.0, 0.1, 0.5):
        got = group.capacity_for(idx, alignment=st.alignment, headroom=headroom)
        want = min(max(floor, int(need * (1.0 + headroom)) + 1), worst)
        assert got == want, f"rank {r}: capacity_for(headroom={headroom}) = {got}, expected {want} (need {need})"
    assert group.capacity_for(idx, alignment=st.alignment, headroom=100.0) == worst  # never above the worst case
    # alignment 1: no zone padding, so never more than with alignment 8
    assert group.capacity_for(idx, alignment=1, headroom=0.0) <= group.capacity_for(idx, alignment=8, headroom=0.0)

    fitted = group.capacity_for(idx, alignment=st.alignment, headroom=0.0)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment,
                                 capacity=fitted)
    run_exact_step(ctx, group, handle, st, r, W, tag="capacity_for ")
    handle.check()
    if group.backend == "reference":
        short = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment,
                                    capacity=need - 1)
        expect_raises(lambda: short.prepare(idx), "capacity overflow")

    for call, words in (
        (lambda: group.capacity_for(idx.flatten()), "topk_idx must be 2-D"),
        (lambda: group.capacity_for(idx, alignment=3), "alignment must be a power of two, got 3"),
        (lambda: group.capacity_for(idx, headroom=-0.5), "headroom must be >= 0, got -0.5"),
    ):
        expect_raises(call, "capacity_for: ", words, exc=ValueError)
    # bad ids on one rank only: every rank raises (the verdict rides on the collective), none hangs
    bad = torch.full_like(idx, group.num_experts) if r == 0 else idx
    words = "expert ids outside [-1," if r == 0 else "rank 0"
    expect_raises(lambda: group.capacity_for(bad), "capacity_for: ", words, exc=ValueError)
    group.shutdown()


def case_shutdown_reinit(ctx) -> None:
    """shutdown() destroys the group's handles; a new group in the same process works;
    repeated cycles leak no handles."""
    W = ctx.world_size
    before = set(torch.ops.te_ep.live_handles())
    for cycle, st in enumerate([
        Step(top_k=2, hidden=16, seed=20),
        Step(top_k=3, hidden=32, experts_per_rank=8, dtype="fp32", alignment=8, seed=21),
        Step(top_k=1, hidden=16, seed=22),
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

