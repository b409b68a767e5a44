"""Bad input and misuse: every rank raises a clear error, nobody hangs, and the group
works afterwards."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

import te_ep_torch as te
from te_ep_torch.group import NCCL_EP_EXPERT_MULTIPLE

from .common import (
    Step,
    all_inputs,
    expect_raises,
    fingerprint,
    make_group,
    nccl_ep_capacity_floor,
)
from .exact import run_exact_step

ERROR_STEP = Step(top_k=2, hidden=16, dtype="bf16", tokens=(5,), max_tokens=8, seed=11)


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
    "idx_one_dim": (
        lambda W: W - 1,
        lambda env, bad: _dispatch(env, idx=env.idx.reshape(-1) if bad else None),
        lambda env: ["topk_idx must be 2-D [num_tokens, top_k]", f"got shape [{env.T * env.K}]"],
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
    # Every choice goes to rank 0: 2 * W * 8 rows there, more than the capacity below.
    hot = Step(top_k=2, hidden=16, tokens=(8,), mode="only_rank0", seed=5)
    group = make_group(ctx, hot)
    # nccl_ep refuses a capacity below its floor (docs/ops.md); 2 * W * 8 rows still overflow that.
    cap = max(2 * W, nccl_ep_capacity_floor(group.max_tokens_per_rank))
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

    # Overflow caused only by alignment padding: every token picks all experts of rank 0, so
    # each zone there gets W * pad_tokens real rows, and an alignment above that pads every
    # zone; the capacity is just the real rows, enough tokens for them to reach nccl_ep's floor.
    E_local = group.num_local_experts
    pad_tokens = -(-nccl_ep_capacity_floor(group.max_tokens_per_rank) // (E_local * W))
    alignment = 1 << (W * pad_tokens).bit_length()
    pad = Step(top_k=E_local, hidden=16, tokens=(pad_tokens,), mode="only_rank0", alignment=alignment, seed=7,
               max_tokens=group.max_tokens_per_rank)
    idx_all, _ = all_inputs(pad, W)
    real_rows = sum(int((i >= 0).sum()) for i in idx_all)
    h2 = group.create_handle(top_k=E_local, hidden=16, dtype=torch.bfloat16, alignment=alignment,
                             capacity=real_rows)
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
        lambda: te.EpGroup(None, num_experts=4 * W, max_tokens_per_rank=8, backend="no_such_backend", device=ctx.device),
        "no_such_backend", exc=ValueError,
    )
    if ctx.backend == "nccl_ep":
        _check_nccl_ep_size_rules(ctx)
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


def case_config_mismatch(ctx) -> None:
    """Ranks that pass different configurations, or an invalid one on one rank only, to
    EpGroup or create_handle: every rank raises (no rank is left waiting in a collective),
    the message names the field and the values each rank passed; a good group and step
    afterwards work. The fields include the backend, the NCCL EP mode and the check mode (of
    EpGroup, and of the group whose create_handle each rank calls, and a handle's own)."""
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    last = r == W - 1
    dt = ERROR_STEP.torch_dtype()

    def group(**kw):
        args = dict(num_experts=ERROR_STEP.experts_per_rank * W, max_tokens_per_rank=8, backend=ctx.backend,
                    device=dev)
        args.update(kw)
        return te.EpGroup(None, **args)

    # EpGroup: a value that differs on the last rank (valid on every rank by itself).
    ne = ERROR_STEP.experts_per_rank * W
    expect_raises(lambda: group(num_experts=2 * ne if last else ne), "disagree on num_experts",
                  f"rank 0: {ne}", f"rank {W - 1}: {2 * ne}", exc=ValueError)
    expect_raises(lambda: group(max_tokens_per_rank=16 if last else 8), "max_tokens_per_rank",
                  f"rank {W - 1}: 16", exc=ValueError)
    # EpGroup: an invalid value on rank 0 only raises on every rank, naming rank 0.
    expect_raises(lambda: group(max_tokens_per_rank=0 if r == 0 else 8), "rank 0", "max_tokens_per_rank",
                  exc=ValueError)
    # The NCCL EP wait limit is part of the group's configuration; an invalid one names itself.
    expect_raises(lambda: group(timeout=30.0 if last else 20.0), "disagree on timeout_ms", f"rank {W - 1}: 30000",
                  exc=ValueError)
    expect_raises(lambda: group(timeout=-1.0), "timeout must be a positive number of seconds", exc=ValueError)
    # The NCCL EP mode and the backend are part of it too.
    expect_raises(lambda: group(nccl_ep_mode="zero_copy" if last else "staged"), "disagree on nccl_ep_mode",
                  "rank 0: 'staged'", f"rank {W - 1}: 'zero_copy'", exc=ValueError)
    expect_raises(lambda: group(checks="synchronous" if last else "local"), "disagree on checks",
                  "rank 0: 'local'", f"rank {W - 1}: 'synchronous'", exc=ValueError)
    expect_raises(lambda: group(checks="off"), "EpGroup: checks must be one of", "'off'", exc=ValueError)
    if torch.device(dev).type == "cpu":
        # nccl_ep can't serve a CPU group: the rank that asks for it fails, and every rank raises, naming it
        expect_raises(lambda: group(backend="nccl_ep" if last else ctx.backend), "EpGroup: failed on 1 of",
                      f"rank {W - 1}: EpGroup: backend 'nccl_ep' needs a CUDA device", exc=ValueError)
    elif ctx.backend == "nccl_ep":
        expect_raises(lambda: group(backend="reference" if last else "nccl_ep"), "disagree on backend",
                      "rank 0: 'nccl_ep'", f"rank {W - 1}: 'reference'", exc=ValueError)

    # create_handle agrees on its group's NCCL EP mode and backend as well: two EpGroups over one
    # process group (each created on every rank), and the last rank calls the other one's
    # create_handle. Without that agreement, ranks would create handles of different kinds and
    # then wait for each other inside NCCL EP.
    kw = dict(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=dt)
    pair = {"nccl_ep_mode": ("staged", "zero_copy")}
    if ctx.backend == "nccl_ep":
        pair["backend"] = ("nccl_ep", "reference")
    for name, (first, other) in pair.items():
        groups = [group(**{name: v}) for v in (first, other)]
        expect_raises(lambda: groups[1 if last else 0].create_handle(**kw), "create_handle", f"disagree on {name}",
                      f"rank 0: {first!r}", f"rank {W - 1}: {other!r}", exc=ValueError)
        for made in groups:
            assert not made._handles, f"rank {r}: a handle was made although create_handle raised"
            made.shutdown()

    g = make_group(ctx, ERROR_STEP)
    base = dict(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=dt, alignment=1, capacity=64)
    for name, other in (("hidden", 2 * ERROR_STEP.hidden), ("top_k", 1), ("dtype", torch.float32),
                        ("alignment", 8), ("capacity", 128)):
        kw = dict(base)
        if last:
            kw[name] = other
        expect_raises(lambda: g.create_handle(**kw), f"disagree on {name}", f"rank {W - 1}: {other}",
                      exc=ValueError)
    _check_mode_agreement(ctx, g, base)
    fp8 = torch.float8_e4m3fn if last else None
    expect_raises(lambda: g.create_handle(**dict(base, hidden=128, dispatch_dtype=fp8)),
                  "disagree on dispatch_dtype", f"rank {W - 1}: torch.float8_e4m3fn", exc=ValueError)
    # create_handle: an invalid argument on rank 0 only.
    kw = dict(base)
    if r == 0:
        kw["alignment"] = 3
    expect_raises(lambda: g.create_handle(**kw), "rank 0", "alignment", exc=ValueError)
    # Nothing was left half-made: a good handle and step work.
    h = g.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=dt)
    run_exact_step(ctx, g, h, ERROR_STEP, ctx.rank, W, tag="after config mismatches: ")
    g.shutdown()


def _check_mode_agreement(ctx, g, base: dict) -> None:
    """The check mode is an argument (EpGroup's `checks`, a handle's override) that create_handle
    agrees on: ranks that pass different modes would run different collectives in every op, so
    every rank raises, naming each rank's mode. A bad name raises ValueError naming the argument.
    Each mode makes a handle of that mode on nccl_ep; the reference backend raises in the op on
    every rank whatever is asked ("synchronous")."""
    W, last = ctx.world_size, ctx.rank == ctx.world_size - 1
    expect_raises(lambda: g.create_handle(**base, checks="device" if last else "local"), "create_handle",
                  "disagree on checks", "rank 0: 'local'", f"rank {W - 1}: 'device'", exc=ValueError)
    expect_raises(lambda: g.create_handle(**base, checks="strict"), "checks must be 'local', 'device' or "
                  "'synchronous', got 'strict'", exc=ValueError)
    for mode in te.CHECKS:
        h = g.create_handle(**base, checks=mode)
        expected = mode if g.backend == "nccl_ep" else "synchronous"
        assert h.check_mode == expected, (mode, h.check_mode, expected)
        assert h.config.checks == mode, h.config
        h.destroy()


def _check_nccl_ep_size_rules(ctx) -> None:
    """nccl_ep's size rules (docs/ops.md, last table) are RuntimeErrors of create_handle,
    raised on every rank alike before any communication."""
    W, dt, m = ctx.world_size, torch.bfloat16, NCCL_EP_EXPERT_MULTIPLE
    if W % m:  # at the other W, every num_experts divisible by W is a multiple of m
        g = te.EpGroup(None, num_experts=W, max_tokens_per_rank=8, backend="nccl_ep", device=ctx.device)
        expect_raises(lambda: g.create_handle(top_k=1, hidden=16, dtype=dt), f"multiple of {m}", f"num_experts={W}")
        g.shutdown()
    g = make_group(ctx, ERROR_STEP)
    floor = nccl_ep_capacity_floor(g.max_tokens_per_rank)
    expect_raises(lambda: g.create_handle(top_k=2, hidden=4, dtype=dt), "multiple of 16", "hidden=4")
    expect_raises(lambda: g.create_handle(top_k=2, hidden=16, dtype=dt, capacity=floor - 1), f"capacity={floor - 1}")
    g.shutdown()


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


def case_routing_guard(ctx) -> None:
    """nccl_ep's default check mode, "local" (docs/ops.md, "Check modes"): a bad expert id
    (out of range, or repeated in its row) on one rank never reaches NCCL EP: the step runs on
    every rank exactly as if that choice were -1, and the faulty rank's EpHandle.check(), or
    its next prepare, raises the first bad choice with its token, choice and value; the other
    ranks have nothing to raise. Good steps before and after are exact."""
    W, last = ctx.world_size, ctx.rank == ctx.world_size - 1
    dev = torch.device(ctx.device)
    group = make_group(ctx, ERROR_STEP)
    handle = group.create_handle(top_k=ERROR_STEP.top_k, hidden=ERROR_STEP.hidden, dtype=ERROR_STEP.torch_dtype(),
                                 checks="local")
    assert handle.check_mode == "local", handle.check_mode
    run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag="routing guard, before: ")
    handle.check()  # nothing to raise

    idx_all, w_all = all_inputs(ERROR_STEP, W)
    E = group.num_experts
    x = fingerprint(ctx.rank, idx_all[ctx.rank].shape[0], ERROR_STEP.hidden, ERROR_STEP.torch_dtype()).to(dev)
    w = w_all[ctx.rank].to(dev)

    def step(idx):
        out = te.ep_dispatch(handle, x, idx.to(dev), w)
        y = te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), x.shape[0])
        return out.total.item(), y

    for bad_value, message in ((E, f"an expert id outside [-1, {E})"), (-3, f"an expert id outside [-1, {E})"),
                               (None, "an expert named twice")):
        bad = idx_all[ctx.rank].clone()
        clean = bad.clone()
        if bad_value is None:  # a repeat: choice 1 of token 3 names choice 0's expert
            bad[3, 1] = bad[3, 0]
            clean[3, 1] = -1
            where = f"topk_idx[3, 1] = {int(bad[3, 0])}"
        else:
            bad[3, 0] = bad_value
            clean[3, 0] = -1
            where = f"topk_idx[3, 0] = {bad_value}"
        assert int(idx_all[ctx.rank][3, 0]) >= 0, "the case needs token 3's first choice to be an expert"
        if not last:
            bad = clean = idx_all[ctx.rank]
        total_bad, y_bad = step(bad)  # runs on every rank, nothing raised in the step
        # Raised before the next prepare of the faulty rank would raise it (and leave the others waiting).
        if last:
            expect_raises(handle.check, f"on rank {W - 1}", message, where, f"handle {handle.id}")
        handle.check()  # raised once: nothing left (on any rank)
        total_clean, y_clean = step(clean)
        assert total_bad == total_clean, (total_bad, total_clean)
        torch.testing.assert_close(y_bad, y_clean, atol=0, rtol=0,
                                   msg=lambda m: f"rank {ctx.rank}: the guarded step differs from the one without "
                                                 f"the bad choice: {m}")
        run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag=f"routing guard, after {where}: ")

    # Every rank bad in the same step: every rank's next prepare raises, so none waits for another.
    bad = idx_all[ctx.rank].clone()
    bad[0, 0] = E + ctx.rank
    step(bad)
    expect_raises(lambda: handle.prepare(idx_all[ctx.rank].to(dev)), f"on rank {ctx.rank}",
                  f"topk_idx[0, 0] = {E + ctx.rank}", f"handle {handle.id}")
    run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag="routing guard, after prepare raised: ")
    group.shutdown()


def _device_checked(ctx, st: Step):
    """(group, handle) for `st` with the handle in the device check mode."""
    group = make_group(ctx, st)
    handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), checks="device")
    assert handle.check_mode == "device", handle.check_mode
    return group, handle


def case_device_checks_arguments(ctx) -> None:
    """nccl_ep with checks='device': bad arguments to prepare on one rank (more tokens
    than max_tokens_per_rank; then topk_idx of a float dtype) are agreed with the routing on
    the device (docs/ops.md, "Check modes"). No rank raises in the step; every op of it
    (dispatch, combine and both backward ops) completes on every rank and returns zeros; every
    rank raises at the next check() or prepare, naming the faulty rank, and the faulty rank's
    message holds its own error; exact steps follow. Bad arguments while an earlier agreed
    error is pending raise that error and leave nothing behind."""
    W, r, last = ctx.world_size, ctx.rank, ctx.rank == ctx.world_size - 1
    dev, st = torch.device(ctx.device), ERROR_STEP
    group, handle = _device_checked(ctx, st)
    idx_all, w_all = all_inputs(st, W)
    too_many = group.max_tokens_per_rank + 3

    def bad_inputs(kind: str):
        idx, w = idx_all[r], w_all[r]
        if last and kind == "rows":
            idx = torch.cat([idx, idx[:1].expand(too_many - idx.shape[0], -1)])
            w = torch.cat([w, w[:1].expand(too_many - w.shape[0], -1)])
        if last and kind == "dtype":
            idx = idx.to(torch.float32)
        x = fingerprint(r, idx.shape[0], st.hidden, st.torch_dtype()).to(dev).requires_grad_()
        return x, idx.to(dev), w.to(dev).requires_grad_()

    mine = {"rows": f"topk_idx.size(0) (num_tokens) must be at most {group.max_tokens_per_rank}",
            "dtype": "topk_idx must be torch.int64 or torch.int32, got torch.float32"}
    for kind, follow_up in (("rows", "check"), ("dtype", "prepare")):
        run_exact_step(ctx, group, handle, st, r, W, tag=f"device-checked arguments, before {kind}: ")
        x, idx, w = bad_inputs(kind)
        out = te.ep_dispatch(handle, x, idx, w)  # no rank raises in the failed step
        y = te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), x.shape[0])
        y.float().sum().backward()
        assert y.shape == x.shape, (y.shape, x.shape)
        for name, t in (("total", out.total), ("received tokens", out.tokens), ("received weights", out.weights),
                        ("combine output", y), ("grad tokens", x.grad), ("grad weights", w.grad)):
            assert not t.any(), f"rank {r} {kind}: {name} of a failed step must be zeros"
        says = [f"handle {handle.id}", f"rank {W - 1}: bad arguments to te_ep.prepare"
                + (f": {mine[kind]}" if last else " (that rank's error names them)")]
        if follow_up == "check":
            expect_raises(handle.check, *says)
        else:
            expect_raises(lambda: handle.prepare(idx_all[r].to(dev)), *says)
        run_exact_step(ctx, group, handle, st, r, W, tag=f"device-checked arguments, after {kind}: ")

    # Bad arguments on a rank while an agreed error is pending: that prepare raises the earlier
    # error on every rank, and the bad arguments leave nothing behind (the next step is exact).
    E, bad_idx = group.num_experts, idx_all[r].clone()
    if last:
        bad_idx[3, 0] = E
    x = fingerprint(r, bad_idx.shape[0], st.hidden, st.torch_dtype()).to(dev)
    te.ep_dispatch(handle, x, bad_idx.to(dev), w_all[r].to(dev))
    _, idx, _ = bad_inputs("dtype")
    expect_raises(lambda: handle.prepare(idx), f"rank {W - 1}: topk_idx[3, 0] = {E}", f"handle {handle.id}")
    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked arguments, after a pending error: ")
    group.shutdown()


def case_device_checks_op_arguments(ctx) -> None:
    """nccl_ep with checks='device': bad arguments on one rank to an op after a good
    prepare (dispatch, dispatch_fp8, also through ep_dispatch_fp8's tokens, combine, combine_bwd)
    are agreed on the device by that op
    (docs/ops.md, "Check modes"). No rank raises in the step; that op and every later op of the
    step return zeros on every rank (gradients included), the ops before it are exact; every
    rank raises at check(), or else at the handle's prepare after next (the next prepare and its
    step are exact), naming the faulty rank and the op, the faulty rank with its own error; the
    first error of a handle is the one raised; exact steps follow."""
    W, r, last = ctx.world_size, ctx.rank, ctx.rank == ctx.world_size - 1
    dev, st = torch.device(ctx.device), ERROR_STEP
    group, handle = _device_checked(ctx, st)
    idx_all, w_all = all_inputs(st, W)
    idx, w0 = idx_all[r].to(dev), w_all[r].to(dev)
    T, H, dtype = idx.shape[0], st.hidden, st.torch_dtype()
    x0 = fingerprint(r, T, H, dtype).to(dev)

    def says(h, op: str, mine: str):
        return [f"handle {h.id}", f"rank {W - 1}: bad arguments to te_ep.{op}"
                + (f": {mine}" if last else " (that rank's error names them)")]

    def zeros(where: str, **tensors) -> None:
        for name, t in tensors.items():
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            assert not t.any(), f"rank {r} {where}: {name} must be zeros"

    def step(x=x0, prepared=None, num_tokens=T):
        out = te.ep_dispatch(handle, x, idx, w0, prepared=prepared)
        y = te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), num_tokens)
        return out, y

    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked op arguments, before: ")
    clean_out, clean_y = step()
    clean_recv, clean_y = clean_out.tokens.clone(), clean_y.clone()

    # dispatch: tokens of the wrong dtype on the faulty rank. The whole step and its backward are zeros.
    x = (x0.half() if last else x0.clone()).requires_grad_()
    w = w0.clone().requires_grad_()
    out = te.ep_dispatch(handle, x, idx, w)
    y = te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), T)
    y.float().sum().backward()
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    zeros("bad dispatch", received_tokens=out.tokens, received_weights=out.weights, combine_output=y,
          grad_tokens=x.grad, grad_weights=w.grad)
    bad_dtype = "tokens must be torch.bfloat16 (the handle's dtype), got torch.float16"
    expect_raises(handle.check, *says(handle, "dispatch", bad_dtype))
    handle.check()  # raised once
    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked op arguments, after dispatch: ")

    # combine: a wrong num_tokens on the faulty rank. Dispatch is exact, the combine zeros; the
    # next prepare does not know yet (its record was copied before the combine's verdict): its
    # step is exact, and the prepare after it raises.
    out, y = step(num_tokens=T + 1 if last else T)
    # (the order of rows within an expert's zone is NCCL EP's: compare each column's values)
    torch.testing.assert_close(out.tokens.float().sort(dim=0).values, clean_recv.float().sort(dim=0).values,
                               atol=0, rtol=0, msg=lambda m: f"rank {r}: dispatch before a bad combine: {m}")
    assert y.shape == (T + 1 if last else T, H), y.shape
    zeros("bad combine", combine_output=y)
    _, y = step(prepared=handle.prepare(idx))
    torch.testing.assert_close(y, clean_y, atol=0, rtol=0, msg=lambda m: f"rank {r}: the step after: {m}")
    expect_raises(lambda: handle.prepare(idx), *says(handle, "combine", f"num_tokens must be {T} (tokens of the "
                                                                        f"last prepare), got {T + 1}"))
    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked op arguments, after combine: ")

    # combine_bwd, called as the op: grad_out of the wrong hidden on the faulty rank
    step()
    grad = torch.ones(T, H + 1 if last else H, dtype=dtype, device=dev)
    grad_recv = te.ops.combine_bwd(grad, handle.handle_mem, group.group_name, handle.id, handle.config.capacity)
    assert grad_recv.shape == (handle.config.capacity, grad.shape[1]), grad_recv.shape
    zeros("bad combine_bwd", grad_expert_out=grad_recv)
    expect_raises(handle.check, *says(handle, "combine_bwd", f"grad_out.size(1) must be {H} (the handle's hidden), "
                                                             f"got {H + 1}"))
    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked op arguments, after combine_bwd: ")

    # The first error of the handle is raised: a bad dispatch, then bad arguments to the next prepare.
    step(x=x0.half() if last else x0)
    handle.prepare(idx.float() if last else idx)
    expect_raises(lambda: handle.prepare(idx), *says(handle, "dispatch", bad_dtype))
    run_exact_step(ctx, group, handle, st, r, W, tag="device-checked op arguments, after two errors: ")

    # dispatch_fp8: scales of the wrong shape on the faulty rank (nccl_ep's FP8 needs hidden % 512 == 0)
    st8 = dataclasses.replace(st, hidden=512)
    h8 = group.create_handle(top_k=st8.top_k, hidden=st8.hidden, dtype=dtype, dispatch_dtype=torch.float8_e4m3fn,
                             checks="device")
    values, scales = te.quantize_fp8(fingerprint(r, T, st8.hidden, dtype).to(dev))
    if last:
        scales = torch.cat([scales, scales[:, :1]], dim=1)
    out8 = te.ep_dispatch_fp8(h8, values, idx, w0, scales=scales)
    zeros("bad dispatch_fp8", received_values=out8.values, received_scales=out8.scales, received_weights=out8.weights)
    expect_raises(h8.check, *says(h8, "dispatch_fp8", "scales.size(1) must be 4 (one scale per 128 values), got 5"))
    # ep_dispatch_fp8 with float32 tokens on the faulty rank: checked by the op, agreed the same way
    x8 = fingerprint(r, T, st8.hidden, dtype).to(dev)
    out8 = te.ep_dispatch_fp8(h8, x8.float() if last else x8, idx, w0)
    zeros("float32 tokens to ep_dispatch_fp8", received_values=out8.values, received_scales=out8.scales,
          received_weights=out8.weights)
    expect_raises(h8.check, *says(h8, "dispatch_fp8", "values must be torch.float8_e4m3fn (FP8 dispatch), got "
                                                      "torch.float32"))
    run_exact_step(ctx, group, h8, st8, r, W, tag="device-checked op arguments, after dispatch_fp8: ")
    group.shutdown()


def case_device_checks(ctx) -> None:
    """nccl_ep with checks='device' (docs/ops.md, "Faults and bad input"): a step whose
    routing is bad on one rank runs on every rank without raising, sends nothing (zero
    outputs), and the agreed error is raised on every rank by EpHandle.check() or by the
    next prepare, naming the rank and the value; a capacity overflow on one rank zeroes the
    step's outputs everywhere and is raised the same way; good steps before and after are
    exact."""
    W, last = ctx.world_size, ctx.rank == ctx.world_size - 1
    dev = torch.device(ctx.device)
    group, handle = _device_checked(ctx, ERROR_STEP)
    run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag="device checks, before: ")
    handle.check()  # nothing to raise

    idx_all, w_all = all_inputs(ERROR_STEP, W)
    E = group.num_experts
    idx = idx_all[ctx.rank].clone()
    if last:
        idx[3, 0] = E
    x = fingerprint(ctx.rank, idx.shape[0], ERROR_STEP.hidden, ERROR_STEP.torch_dtype()).to(dev)

    def bad_step():
        out = te.ep_dispatch(handle, x, idx.to(dev), w_all[ctx.rank].to(dev))
        y = te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), x.shape[0])
        return out, y

    out, y = bad_step()  # no rank raises in the bad step itself
    assert int(out.total.item()) == 0 and not out.tokens.any() and not y.any(), "a failed step must move nothing"
    expected = [f"rank {W - 1}: topk_idx[3, 0] = {E}", f"outside [-1, {E})", f"handle {handle.id}"]
    expect_raises(handle.check, *expected)  # the same agreed message on every rank
    run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag="device checks, after check(): ")

    bad_step()
    expect_raises(lambda: handle.prepare(idx_all[ctx.rank].to(dev)), *expected)  # the next call raises
    run_exact_step(ctx, group, handle, ERROR_STEP, ctx.rank, W, tag="device checks, after prepare raised: ")

    # Capacity overflow on rank 0 only (every choice goes there): zeros everywhere, then the error.
    hot = Step(top_k=2, hidden=16, tokens=(8,), mode="only_rank0", seed=5, max_tokens=ERROR_STEP.max_tokens)
    cap = max(2 * W, nccl_ep_capacity_floor(group.max_tokens_per_rank))
    small = group.create_handle(top_k=2, hidden=16, dtype=torch.bfloat16, capacity=cap, checks="device")
    idx_all, w_all = all_inputs(hot, W)
    x = fingerprint(ctx.rank, 8, 16, torch.bfloat16).to(dev)
    out = te.ep_dispatch(small, x, idx_all[ctx.rank].to(dev), w_all[ctx.rank].to(dev))
    y = te.ep_combine(small, out.tokens * out.weights[:, None].to(out.tokens.dtype), x.shape[0])
    assert not out.tokens.any() and not out.weights.any() and not y.any(), "an overflowing step must return zeros"
    expect_raises(small.check, "rank 0: capacity overflow", f"capacity is {cap}")
    group.shutdown()


def case_check_modes(ctx) -> None:
    """What each check mode does with a step whose routing is bad on the last rank (an expert id
    of E), pinned by behaviour, not by the mode's name (docs/ops.md, "Check modes"):

    * the reference backend, whatever is asked: every rank raises in the step itself;
    * nccl_ep ``synchronous``: the same;
    * nccl_ep ``device``: no rank raises in the step, whose outputs are zeros on every rank;
      every rank raises the same error at ``check()``;
    * nccl_ep ``local``: no rank raises in the step; the bad choice was dropped (the step equals
      the one with that choice -1); only the faulty rank raises, at ``check()``.

    Exact steps follow on the same handle in every mode."""
    W, r, last = ctx.world_size, ctx.rank, ctx.rank == ctx.world_size - 1
    dev, st = torch.device(ctx.device), ERROR_STEP
    idx_all, w_all = all_inputs(st, W)
    group = make_group(ctx, st)
    E = group.num_experts
    x = fingerprint(r, idx_all[r].shape[0], st.hidden, st.torch_dtype()).to(dev)
    w = w_all[r].to(dev)
    bad, clean = idx_all[r].clone(), idx_all[r].clone()
    if last:
        bad[3, 0], clean[3, 0] = E, -1

    def step(idx):
        out = te.ep_dispatch(handle, x, idx.to(dev), w)
        return out, te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), x.shape[0])

    for mode in te.CHECKS:
        handle = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), checks=mode)
        run_exact_step(ctx, group, handle, st, r, W, tag=f"checks={mode}, before: ")
        says = (f"topk_idx[3, 0] = {E}", f"handle {handle.id}")
        behaviour = "in the step" if group.backend == "reference" or mode == "synchronous" else mode
        if behaviour == "in the step":
            expect_raises(lambda: step(bad), *(says if last else ("te_ep.prepare", f"rank {W - 1}")))
        else:
            out, y = step(bad)  # nothing raised in the step on any rank
            if behaviour == "device":
                assert not out.tokens.any() and not out.weights.any() and not y.any(), \
                    f"rank {r}: checks={mode}: the failed step's outputs must be zeros on every rank"
                expect_raises(handle.check, f"rank {W - 1}: " + says[0], says[1])
            else:
                if last:  # before the next prepare, which would raise it too
                    expect_raises(handle.check, f"on rank {W - 1}", *says)
                handle.check()  # nothing left to raise, on any rank
                out_clean, y_clean = step(clean)
                torch.testing.assert_close(y, y_clean, atol=0, rtol=0)
        run_exact_step(ctx, group, handle, st, r, W, tag=f"checks={mode}, after: ")
        handle.destroy()
    group.shutdown()


def case_handle_mismatch(ctx) -> None:
    """Ranks that run an op on different handles of one group (here the last rank on a layer of
    another hidden size): every rank raises a te_ep error naming what each rank ran, in the op,
    before any data moves; no rank aborts or waits. On nccl_ep this holds in the modes that agree
    on the host (synchronous) and, on the device, in the device mode (raised at check());
    docs/ops.md, "Check modes", says what the local mode does."""
    W, r, last = ctx.world_size, ctx.rank, ctx.rank == ctx.world_size - 1
    dev, st = torch.device(ctx.device), ERROR_STEP
    group = make_group(ctx, st)
    checks = "synchronous" if group.backend == "nccl_ep" else ctx.checks
    a = group.create_handle(top_k=st.top_k, hidden=st.hidden, dtype=st.torch_dtype(), checks=checks)
    b = group.create_handle(top_k=st.top_k, hidden=2 * st.hidden, dtype=st.torch_dtype(), checks=checks)
    idx_all, w_all = all_inputs(st, W)
    mine = b if last else a
    x = fingerprint(r, idx_all[r].shape[0], mine.config.hidden, st.torch_dtype()).to(dev)
    msg = expect_raises(lambda: te.ep_dispatch(mine, x, idx_all[r].to(dev), w_all[r].to(dev)),
                        "ran different ops or handles", "rank 0: te_ep.prepare on the group's handle #",
                        f"rank {W - 1}: te_ep.prepare on the group's handle #", f"hidden={2 * st.hidden}",
                        f"hidden={st.hidden}", f"handle {mine.id}")
    assert "INTERNAL ASSERT" not in msg, msg
    run_exact_step(ctx, group, a, st, r, W, tag="after a handle mismatch: ")
    group.shutdown()


def case_nccl_ep_topology(ctx) -> None:
    """What NCCL EP would assert on (aborting the process) is a ValueError of EpGroup on every
    rank, naming the rule and each host's ranks, before NCCL EP is called: ranks spread unevenly
    over hosts, ranks not in host-major order. Hosts are simulated (group._host_name); with a
    valid layout the group gets past the check (on CPU it then fails for want of a GPU)."""
    from te_ep_torch import group as group_module

    W, r = ctx.world_size, ctx.rank
    E = 4 * W
    real = group_module._host_name
    try:
        for hosts, says in (
            (["a"] * (W - 1) + ["b"], ("same number of ranks on every host", f"host 'a': ranks {list(range(W - 1))}",
                                       f"host 'b': ranks [{W - 1}]")),
            (["a", "b"] * (W // 2), ("host-major order", "host 'a': ranks [0, 2", "host 'b': ranks [1, 3")),
        ):
            group_module._host_name = lambda: hosts[r]
            expect_raises(lambda: te.EpGroup(None, num_experts=E, max_tokens_per_rank=8, backend="nccl_ep",
                                             device=ctx.device), "EpGroup: backend 'nccl_ep'", *says, exc=ValueError)
            # backend="auto" falls back to the reference backend instead, saying why
            if torch.device(ctx.device).type == "cuda":
                g = te.EpGroup(None, num_experts=E, max_tokens_per_rank=8, backend="auto", device=ctx.device)
                assert g.backend == "reference", g.backend
                g.shutdown()
        group_module._host_name = lambda: "ab"[r * 2 // W]  # two hosts, host-major, W / 2 ranks each
        if torch.device(ctx.device).type == "cpu":
            expect_raises(lambda: te.EpGroup(None, num_experts=E, max_tokens_per_rank=8, backend="nccl_ep",
                                             device=ctx.device), "needs a CUDA device", exc=ValueError)
    finally:
        group_module._host_name = real
    assert te.group.nccl_ep_topology_error(["x"] * W, E + 1).startswith("NCCL EP needs num_experts divisible")
