"""Groups and handles: attributes, shutdown and re-creation, sub-process-groups."""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

import te_ep_torch as te
from te_ep_torch.group import nccl_ep_capacity_floor

from .common import (
    Step,
    all_inputs,
    check_equal,
    decode_key,
    expect_raises,
    expected_layout,
    fingerprint,
    make_group,
    zone_multiplier,
)
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


def _zone_step(ctx, handle, step: Step, idx_all: list, w_all: list, r: int) -> dict:
    """One dispatch -> expert (a power-of-two scale per zone) -> combine -> backward on
    ``handle``; what must not depend on the capacity: the rows of every zone (sorted by token
    where the backend does not order them), their weights, combine's output and the grads."""
    dev, dtype, El = torch.device(ctx.device), step.torch_dtype(), step.experts_per_rank
    x = fingerprint(r, step.num_tokens(r), step.hidden, dtype).to(dev).requires_grad_()
    w = w_all[r].to(dev, copy=True).requires_grad_()
    out = te.ep_dispatch(handle, x, idx_all[r].to(dev), w)
    counts = out.expert_counts.cpu()
    scale = torch.tensor([zone_multiplier(r * El + e) for e in range(El)]).repeat_interleave(counts.to(torch.int64))
    mult = torch.zeros(handle.config.capacity, 1)
    mult[: scale.numel(), 0] = scale
    y = te.ep_combine(handle, out.tokens * mult.to(dev, dtype), x.shape[0])
    y.backward(fingerprint(r + 50, x.shape[0], step.hidden, dtype).to(dev))
    total = int(out.total)
    rows, weights = out.tokens.detach()[:total].cpu(), out.weights.detach()[:total].cpu()
    if ctx.backend != "reference":  # nccl_ep may order a zone's rows differently
        off = 0
        for c in counts.tolist():
            real = int((rows[off: off + c, 0] != 0).sum())  # a fingerprint's column 0 is never 0
            zone = slice(off, off + real)
            perm = decode_key(rows[zone]).argsort()
            rows[zone], weights[zone] = rows[zone][perm], weights[zone][perm]
            off += c
    return {"expert_counts": counts, "total": out.total.cpu(), "zone rows": rows, "zone weights": weights,
            "combine output": y.detach().cpu(), "tokens grad": x.grad.cpu(), "weights grad": w.grad.cpu()}


def case_capacity_factor(ctx) -> None:
    """capacity_factor (docs/ops.md, "Capacity"): a multiplier of a rank's mean receive load,
    top_k * max_tokens_per_rank rows, plus zone padding, the same at every EP size; a handle of
    that capacity runs a step exactly as the worst-case handle does; ExpertParallel forwards
    it; bad values raise ValueError on every rank, the old fractional ones saying what changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel

    W, r, dev = ctx.world_size, ctx.rank, torch.device(ctx.device)
    st = Step(top_k=2, hidden=16, tokens=(24, 17), alignment=8, seed=83)  # max_tokens_per_rank 27, 4 experts a rank
    group = make_group(ctx, st)
    # By hand: 1.5 x (2 x 27) = 81 rows, plus 4 zones x 7 padding rows; worst case W x 27 x 2 + 28.
    fitted, worst = 81 + 28, W * 54 + 28
    assert group.capacity_for_factor(2, 8, 1.5) == fitted, group.capacity_for_factor(2, 8, 1.5)
    assert group.capacity_for_factor(2, 8, 1.0) == 54 + 28
    assert group.capacity_for_factor(2, 1, 1.01) == 55  # ceil(1.01 x 54), no padding
    assert group.capacity_for_factor(2, 8, 100.0) == worst == group.worst_case_capacity(2, 8)  # never above it
    assert group.capacity_for_factor(1, 1, 1.0) == 28  # 27 rows lifted to NCCL EP's floor (27 rounded up to 4)
    idx_all, w_all = all_inputs(st, W)
    need = max(expected_layout(idx_all, q, st.experts_per_rank, st.alignment, 0).total for q in range(W))
    assert need <= fitted < worst, (need, fitted, worst)

    kw = dict(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
    fit = group.create_handle(capacity_factor=1.5, **kw)
    full = group.create_handle(**kw)
    assert (fit.config.capacity, full.config.capacity) == (fitted, worst), (fit.config, full.config)
    got, want = _zone_step(ctx, fit, st, idx_all, w_all, r), _zone_step(ctx, full, st, idx_all, w_all, r)
    for what in want:
        if ctx.backend == "reference" or what not in ("combine output", "tokens grad", "weights grad"):
            check_equal(what, got[what], want[what], f"rank {r} capacity_factor=1.5 vs worst case")
        else:
            torch.testing.assert_close(got[what], want[what], atol=3e-2, rtol=3e-2, msg=what)
    run_exact_step(ctx, group, fit, st, r, W, tag="capacity_factor=1.5 ")

    # Refused on every rank (the ranks agree on create_handle's arguments).
    old_rows = 27 * W + 28  # what 0.5 meant: half of W x 27 x 2 token rows, plus padding
    for kwargs, words in (
        (dict(capacity=fitted, capacity_factor=1.5), ["pass capacity (rows) or capacity_factor", "not both"]),
        (dict(capacity_factor=0.5), ["capacity_factor is now a multiplier of the mean receive load", "got 0.5",
                                     "removed in te_ep_torch 0.3.0", f"pass capacity={old_rows} instead"]),
        (dict(capacity_factor=0.0), ["capacity_factor must be None (the worst case) or >= 1.0", "got 0.0"]),
        (dict(capacity_factor=True), ["capacity_factor must be None (the worst case) or a finite number", "True"]),
        (dict(capacity_factor="1.5"), ["finite number", "got '1.5'"]),
    ):
        expect_raises(lambda: group.create_handle(**kwargs, **kw), "create_handle: ", *words, exc=ValueError)
    bad = dict(capacity_factor=0.75) if r == 0 else dict(capacity_factor=1.5)
    expect_raises(lambda: group.create_handle(**bad, **kw), "create_handle", "got 0.75" if r == 0 else "rank 0",
                  exc=ValueError)
    group.shutdown()

    # te.MoE through ExpertParallel: the same capacity for the layer's handle.
    moe = te.MoE(st.hidden, 8, st.experts_per_rank * W, st.top_k, alignment=st.alignment).to(dev)
    mesh = init_device_mesh(dev.type, (W,), mesh_dim_names=("ep",))
    parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=27, options=te.EpOptions(
        backend=ctx.backend, capacity_factor=1.5, **ctx.group_options())))
    assert [h.config.capacity for h in moe.handles.values()] == [fitted], moe.handles
    moe(torch.randn(st.num_tokens(r), st.hidden, device=dev)).sum().backward()
    te.shutdown_ep_groups()


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



def _drop_by_hand(idx_all: list, share: int, num_experts: int) -> tuple:
    """The routing with the choices past each expert's share set to -1, in the global order
    (source rank, token, choice), and the choices each rank dropped per expert: written
    out here, apart from the library's device code."""
    seen = [0] * num_experts
    kept, dropped = [], []
    for idx in idx_all:
        idx = idx.clone()
        mine = torch.zeros(num_experts, dtype=torch.int64)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                if seen[e] >= share:
                    idx[t, k] = -1
                    mine[e] += 1
                seen[e] += 1
        kept.append(idx)
        dropped.append(mine)
    return kept, dropped


def case_overflow_drop(ctx) -> None:
    """overflow="drop" (docs/ops.md, "Capacity"): with a capacity below the worst case, the
    choices past each expert's share (capacity // E_local, rounded down to the alignment) in
    the order (source rank, token, choice) are dropped: the step equals a worst-case handle
    fed the routing without them (zone rows, weights, combine output and both gradients: a
    dropped choice contributes nothing and gets a zero weight gradient), and EpHandle.dropped
    counts them. With the worst case nothing is dropped; a bad value raises on every rank."""
    W, r = ctx.world_size, ctx.rank
    st = Step(top_k=2, hidden=16, tokens=(24, 17), alignment=8, seed=91)  # max_tokens_per_rank 27
    idx_all, w_all = all_inputs(st, W)
    num_experts = st.experts_per_rank * W
    for idx in idx_all:  # a hot expert: every token's first choice is expert 0
        idx[:, 1] = torch.where(idx[:, 1] == 0, 1, idx[:, 1])
        idx[:, 0] = 0
    group = make_group(ctx, st)
    kw = dict(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), alignment=st.alignment)
    drop = group.create_handle(capacity_factor=1.0, overflow="drop", **kw)
    full = group.create_handle(**kw)
    # By hand: 1.0 x (2 x 27) + 4 zones x 7 padding = 82 rows; 82 // 4 = 20, down to 8: 16.
    assert drop.config.capacity == 82 and drop.expert_share == 16, (drop.config, drop.expert_share)
    kept, dropped = _drop_by_hand(idx_all, 16, num_experts)
    assert sum(int(d.sum()) for d in dropped) > 0, "the hot expert must overflow its share"
    got = _zone_step(ctx, drop, st, idx_all, w_all, r)
    want = _zone_step(ctx, full, st, kept, w_all, r)
    for what in want:
        if ctx.backend == "reference" or what not in ("combine output", "tokens grad", "weights grad"):
            check_equal(what, got[what], want[what], f"rank {r} overflow='drop'")
        else:
            torch.testing.assert_close(got[what], want[what], atol=3e-2, rtol=3e-2, msg=what)
    check_equal("dropped", drop.dropped.cpu(), dropped[r], f"rank {r} overflow='drop'")
    # Dropped choices get a zero weight gradient.
    assert bool((got["weights grad"][kept[r] < 0] == 0).all())

    # The worst case never overflows: overflow="drop" drops nothing there.
    none = group.create_handle(overflow="drop", **kw)
    assert none.expert_share is None
    check_equal("worst case", _zone_step(ctx, none, st, idx_all, w_all, r)["combine output"],
                _zone_step(ctx, full, st, idx_all, w_all, r)["combine output"], f"rank {r}")
    assert int(none.dropped.sum()) == 0
    bad = "sometimes" if r == 0 else "drop"
    expect_raises(lambda: group.create_handle(capacity_factor=1.0, overflow=bad, **kw), "create_handle",
                  "overflow must be one of ('raise', 'drop')" if r == 0 else "rank 0", exc=ValueError)
    group.shutdown()

    # te.MoE through ExpertParallel: the option reaches the layer's handle, and the drops are
    # in the layer's expert-load statistics.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel

    dev = torch.device(ctx.device)
    moe = te.MoE(st.hidden, 8, num_experts, st.top_k, alignment=st.alignment).to(dev)
    mesh = init_device_mesh(dev.type, (W,), mesh_dim_names=("ep",))
    parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=27, options=te.EpOptions(
        backend=ctx.backend, capacity_factor=1.0, overflow="drop", **ctx.group_options())))
    (handle,) = moe.handles.values()
    assert handle.config.overflow == "drop" and handle.expert_share == 16, handle
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, :] = 10.0  # expert 0 wins every token with positive inputs
    moe(torch.rand(st.num_tokens(r), st.hidden, device=dev) + 0.1).sum().backward()
    stats = te.moe.expert_load_stats(moe)
    assert set(stats) == {"", ".dropped"}, stats
    # Each expert keeps its first 16 choices in rank order: this rank's choices past that.
    loads = [torch.zeros_like(stats[""]) for _ in range(W)]
    dist.all_gather(loads, stats[""].contiguous())
    before = sum(loads[:r], torch.zeros_like(stats[""]))
    expected = (before + stats[""] - 16).clamp_min(0).minimum(stats[""])
    assert int(stats[".dropped"][0]) > 0 or r > 0, stats
    check_equal("MoE dropped", stats[".dropped"].cpu(), expected.cpu(), f"rank {r}")
    te.shutdown_ep_groups()
