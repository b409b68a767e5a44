"""The fault cases: one fault injected on one rank, the rest of the group running the same
step, and what the contract asks of each (docs/ops.md, "Errors" and "Faults and bad input").

Each body runs on every rank of a fresh group (runner.run_case). It sets up a group and a
handle, marks the fault point, runs the faulted step through `FaultCtx.faulted` (the
faulty rank with the fault, the others with their correct inputs), and, on a rank where
the step completes, checks its outputs exactly against a local reference built the way
tests/ep_cases/exact.py does (fingerprinted tokens: every received row tells where it came
from, so a wrong row, a dropped row or a row from the wrong step is seen), or, where the
outputs are not those of the step as given, exactly against what the check mode makes of it
(the step without the bad choices, or zeros). The routing and overflow bodies then run a
follow-up in the same faulted call (the handle's next prepare, or `EpHandle.check()`), where
the check modes that record an error instead of raising it in the step raise it: that late
raise is measured and judged like any other.

`Case.contract` is what the contract asks; `Case.behaviour` maps every variant of `VARIANTS`
("reference"; "nccl_ep": checks='local'; "nccl_ep+check": checks='synchronous'; "nccl_ep+device":
checks='device') to what the code does,
an `Expect` with its `shortfall` where that differs from the contract. The nccl_ep ones are
declared from the code (csrc/nccl_ep/nccl_ep_checks.cpp, comm_ops.cpp, csrc/watchdog/core/watchdog.h)
and docs/ops.md, "Check modes", and say where GPU runs measured them (every case at W=2 and W=4:
MEASURED); this CPU run measures the reference backend. tests/test_faults.py holds the reference
backend to its declared behaviour and checks that each declared shortfall is still one.
Whatever is declared, a rank that hangs or returns an output that is not declared fails the
case (expect.undeclared_failures).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, Optional

import torch

import te_ep_torch as te
from ep_cases.common import (
    Step,
    all_inputs,
    check_recv,
    expect_raises,
    expected_layout,
    fingerprint,
    make_group,
    nccl_ep_capacity_floor,
)
from ep_cases.errors import check_collective_error
from ep_cases.exact import check_sum, run_exact_step

from .expect import Expect, Substring, within_timeout

# One small step, valid on nccl_ep at any W (4 experts per rank, 32-byte bf16 rows,
# capacity floor 8); ranks pass different token counts.
STEP = Step(top_k=2, hidden=16, dtype="bf16", tokens=(5, 7), max_tokens=8, seed=21)
E_LOCAL = STEP.experts_per_rank
H = STEP.hidden


# Backend variants with declared behaviour: "reference" is measured here (CPU, gloo); the
# nccl_ep ones (runner.RunConfig.variant: checks 'synchronous' gives "nccl_ep+check",
# checks 'device' "nccl_ep+device") are declared from the code and docs/ops.md and measured on
# GPUs (MEASURED). Any other run (e.g. the reference backend on NCCL) is only
# measured, and still fails on a hang or a wrong output.
VARIANTS = ("reference", "nccl_ep", "nccl_ep+check", "nccl_ep+device")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fault: str  # the fault, in words
    body: Callable  # body(f: runner.FaultCtx)
    faulty: Callable[[int], int]  # the faulty rank, given W
    contract: Expect
    behaviour: Dict[str, Expect] = dataclasses.field(default_factory=dict)  # every variant of VARIANTS
    world_sizes: tuple = (2,)  # where tests/test_faults.py runs it on CPU (on GPUs: at each --world-size)
    wall: Callable[[float], float] = lambda pg: 2 * pg + 10
    control: bool = False  # checks the harness (no fault, or a fault of the harness's own)
    # Meaningful at W = 1 (one GPU; the other cases do not run there): the
    # fault is on the only rank, so what is measured is the faulty rank's side (where it raises,
    # its message, its outputs, recovery); what the other ranks do needs W >= 2.
    one_rank: bool = False

    def wall_s(self, pg_timeout_s: float) -> float:
        return self.wall(pg_timeout_s)

    def expected(self, variant: str) -> Optional[Expect]:
        """The declared behaviour for `variant`; None where none is declared."""
        if self.control:
            return self.contract
        if variant not in VARIANTS:
            return None
        return self.behaviour.get(variant, self.contract)

    def fmt(self, world_size: int) -> dict:
        """Values the message substrings refer to."""
        idx_all, _ = all_inputs(STEP, world_size)
        return dict(E=E_LOCAL * world_size, H=H, H2=2 * H, H1=H + 1, cap=_overflow_capacity(world_size),
                    # the expert that repeated_expert's faulty rank (the last) names twice in row 2
                    rep=int(idx_all[world_size - 1][2, 0]))


# ---------------------------------------------------------------------------
# the step and its exact check
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Env:
    group: object
    handle: object
    idx_all: list  # every rank's routing of the step, as this rank rebuilds it
    w_all: list
    x: torch.Tensor  # this rank's fingerprinted tokens
    idx: torch.Tensor
    w: torch.Tensor


def _env(f, capacity: Optional[int] = None, idx_all: Optional[list] = None) -> Env:
    dev = torch.device(f.device)
    group = make_group(f, STEP)
    handle = group.create_handle(top_k=STEP.top_k, hidden=H, dtype=STEP.torch_dtype(), capacity=capacity)
    f.record.handle_id = handle.id
    f.record.limit_ms = group.timeout_ms
    clean_idx, w_all = all_inputs(STEP, f.world_size)
    idx_all = idx_all if idx_all is not None else clean_idx
    x = fingerprint(f.rank, STEP.num_tokens(f.rank), H, STEP.torch_dtype()).to(dev)
    return Env(group, handle, idx_all, w_all, x, idx_all[f.rank].to(dev), w_all[f.rank].to(dev))


def _forward(env: Env, x=None, idx=None, w=None, prepared=None):
    """dispatch (prepare included unless given) and combine of the received rows, unweighted."""
    x = env.x if x is None else x
    out = te.ep_dispatch(env.handle, x, env.idx if idx is None else idx, env.w if w is None else w, prepared=prepared)
    y = te.ep_combine(env.handle, out.tokens, x.shape[0])
    return out, y


def _check(f, env: Env, out, y, idx_all: list) -> None:
    """Exact check of a completed step on this rank, for the routing `idx_all` of every rank."""
    cap = env.handle.config.capacity
    layout = expected_layout(idx_all, f.rank, E_LOCAL, 1, cap)
    if layout.total > cap:
        raise AssertionError(f"this rank needs {layout.total} receive rows but the capacity is {cap}: no output "
                             "of this step can be right")
    where = f"rank {f.rank}"
    ordered = env.group.backend == "reference"
    check_recv(where, out.tokens, out.weights, out.expert_counts, out.total, layout, env.w_all, H,
               STEP.torch_dtype(), ordered)
    nvalid = (idx_all[f.rank].to(torch.int64) >= 0).sum(1, keepdim=True).float()
    expected = (fingerprint(f.rank, STEP.num_tokens(f.rank), H, torch.float32) * nvalid).to(STEP.torch_dtype())
    check_sum("combine output", y.detach().cpu(), expected, where, ordered)


def _check_zeros(out, y) -> None:
    """Exact check that a step moved nothing: its received tokens and weights and its combine
    output are all exactly 0 (the device check mode's failed step; its expert_counts and total
    are not asked: an overflowing step keeps them)."""
    nonzero = {name: int(torch.count_nonzero(t.detach())) for name, t in
               (("received tokens", out.tokens), ("received weights", out.weights), ("combine output", y))}
    if any(nonzero.values()):
        raise AssertionError(f"not all zero: nonzero elements {nonzero}")


def _check_outputs(f, env: Env, out, y, idx_all: list, guarded_all: Optional[list] = None) -> None:
    """Records this rank's verdict on a completed step: "correct" for `idx_all`, else "guarded"
    (exact for `guarded_all`, the routing without the bad choices), else "zeros", else wrong."""
    alternatives = []
    if guarded_all is not None:
        alternatives.append(("guarded", lambda: _check(f, env, out, y, guarded_all)))
    alternatives.append(("zeros", lambda: _check_zeros(out, y)))
    f.check_output(lambda: _check(f, env, out, y, idx_all), *alternatives)


def _input_fault(f, make_bad: Callable[[Env], dict]) -> None:
    """The faulty rank passes the arguments `make_bad` returns; the others pass their own. A
    rank whose step completes checks its outputs and calls EpHandle.check() (where the device
    check mode raises what it agreed on); a rank that raised then runs an exact step."""
    env = _env(f)
    kwargs = make_bad(env) if f.is_faulty else {}

    def call():
        out, y = _forward(env, **kwargs)
        f.sync()
        _check_outputs(f, env, out, y, env.idx_all)
        f.stage(CHECK)
        env.handle.check()

    ok, _ = f.faulted(call)
    _exact_after_raise(f, env, ok)


# The follow-ups of the faulted step (run inside the faulted call, on every rank whose step
# completed): where an error recorded in the step instead of raised is raised.
NEXT_PREPARE = "next prepare"  # the handle's next prepare, with the seed's routing (valid, fits)
CHECK = "check()"  # EpHandle.check(): no collective, waits for the GPU


def _faulted_step(f, env: Env, step_idx_all: list, expected_all: list, guarded_all: Optional[list],
                  follow_up: str) -> bool:
    """The faulted call of the routing and overflow cases: a step with this rank's routing of
    `step_idx_all`; where it completes, its outputs checked (exact for `expected_all`, or for
    `guarded_all`, or zeros) before the follow-up; then the follow-up. Returns whether the call
    completed."""
    idx = step_idx_all[f.rank].to(env.idx.device)

    def call():
        out, y = _forward(env, idx=idx)
        f.sync()
        _check_outputs(f, env, out, y, expected_all, guarded_all)
        f.stage(follow_up)
        if follow_up == NEXT_PREPARE:
            env.handle.prepare(env.idx)
        else:
            env.handle.check()

    ok, _ = f.faulted(call)
    return ok


def _exact_after_raise(f, env: Env, ok: bool) -> None:
    """A rank whose faulted call raised runs an exact step on the same handle: every rank raised
    (the contract; the synchronous and device check modes), so the handle must work again.
    Not in the check mode `local`, where only the faulty rank raises and the others are left
    inside NCCL EP by then (docs/ops.md, "Check modes")."""
    if not ok and env.handle.check_mode != "local":
        f.recover("exact step, same handle",
                  lambda: run_exact_step(f, env.group, env.handle, STEP, f.rank, f.world_size, tag="after the fault: "))


# ---------------------------------------------------------------------------
# the faults
# ---------------------------------------------------------------------------
def _with(idx: torch.Tensor, t: int, k: int, value) -> torch.Tensor:
    idx = idx.clone()
    idx[t, k] = idx[t, 0] if value == "repeat" else value
    return idx


def _guarded(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`idx` with every bad choice as -1, by the one rule of every check mode
    (choice_error_bits in csrc/nccl_ep/core/nccl_ep_kernels.cu): an id outside [-1, E), or an expert
    already named earlier in the token's row."""
    out = idx.clone()
    for t, row in enumerate(idx.tolist()):
        for k, e in enumerate(row):
            if e < -1 or e >= num_experts or (e >= 0 and e in row[:k]):
                out[t, k] = -1
    return out


def _routing_fault(f, make_bad: Callable[[torch.Tensor, int], torch.Tensor], follow_up: str = NEXT_PREPARE):
    """The faulty rank's routing is `make_bad(its routing, E)`; every rank runs the step, checks
    a completed step's outputs (exact as if there were no fault, or without the bad choices, or
    zeros) and runs the follow-up; a rank that raised then runs an exact step."""
    env = _env(f)
    E = env.group.num_experts
    bad_all = list(env.idx_all)
    bad_all[f.faulty] = make_bad(env.idx_all[f.faulty], E)
    guarded_all = [_guarded(i, E) for i in bad_all]
    ok = _faulted_step(f, env, bad_all, env.idx_all, guarded_all, follow_up)
    _exact_after_raise(f, env, ok)
    return env


def body_expert_id_out_of_range(f) -> None:
    _routing_fault(f, lambda idx, E: _with(idx, 3, 0, E))


def body_expert_id_negative(f) -> None:
    _routing_fault(f, lambda idx, E: _with(idx, 1, 1, -3))


def _repeat_in_row_2(idx: torch.Tensor, E: int) -> torch.Tensor:
    assert int(idx[2, 0]) >= 0, "the case needs token 2's first choice to be an expert"
    return _with(idx, 2, 1, "repeat")


def body_repeated_expert(f) -> None:
    _routing_fault(f, _repeat_in_row_2)


def body_tokens_dtype(f) -> None:
    _input_fault(f, lambda env: dict(x=env.x.half()))


def body_tokens_hidden(f) -> None:
    _input_fault(f, lambda env: dict(x=torch.zeros(env.x.shape[0], H + 1, dtype=env.x.dtype, device=env.x.device)))


def body_topk_idx_dtype(f) -> None:
    """The faulty rank's topk_idx is float32, an argument error of prepare; a rank whose step
    completes checks its outputs and runs the handle's next prepare; a rank that raised runs
    an exact step."""
    env = _env(f)
    idx = env.idx.float() if f.is_faulty else env.idx

    def call():
        out, y = _forward(env, idx=idx)
        f.sync()
        _check_outputs(f, env, out, y, env.idx_all)
        f.stage(NEXT_PREPARE)
        env.handle.prepare(env.idx)

    ok, _ = f.faulted(call)
    _exact_after_raise(f, env, ok)


def _overflow_routing(world_size: int):
    """(every rank's routing, capacity): the capacity fits every rank's need under the
    seed's routing, but the last rank sends all its choices to rank 0's experts, so rank 0
    (and only rank 0) needs more rows than the capacity."""
    idx_all, _ = all_inputs(STEP, world_size)
    clean = max(expected_layout(idx_all, r, E_LOCAL, 1, 0).total for r in range(world_size))
    cap = max(clean, nccl_ep_capacity_floor(STEP.max_tokens_per_rank()))
    hot = world_size - 1
    T = STEP.num_tokens(hot)
    idx_all[hot] = torch.tensor([[t % E_LOCAL, (t + 1) % E_LOCAL] for t in range(T)], dtype=idx_all[hot].dtype)
    return idx_all, cap


def _overflow_capacity(world_size: int) -> int:
    return _overflow_routing(world_size)[1]


def body_capacity_overflow(f) -> None:
    """The overflowing step, then the handle's next prepare with the seed's routing (which
    fits the capacity: `_env`'s routing)."""
    idx_all, cap = _overflow_routing(f.world_size)
    needs = [expected_layout(idx_all, r, E_LOCAL, 1, 0).total for r in range(f.world_size)]
    assert needs[0] > cap and all(n <= cap for n in needs[1:]), f"rows needed per rank {needs}, capacity {cap}"
    env = _env(f, capacity=cap)
    ok = _faulted_step(f, env, idx_all, idx_all, None, NEXT_PREPARE)
    _exact_after_raise(f, env, ok)


def body_handle_config_mismatch(f) -> None:
    group = make_group(f, STEP)
    hidden = 2 * H if f.is_faulty else H
    f.faulted(lambda: group.create_handle(top_k=STEP.top_k, hidden=hidden, dtype=STEP.torch_dtype()))

    def good_handle():
        h = group.create_handle(top_k=STEP.top_k, hidden=H, dtype=STEP.torch_dtype())
        run_exact_step(f, group, h, STEP, f.rank, f.world_size, tag="after a config mismatch: ")

    f.recover("a handle of one config everywhere, exact step", good_handle)


def body_rank_exits_mid_step(f) -> None:
    env = _env(f)
    prepared = env.handle.prepare(env.idx)
    f.fault_point()
    if f.is_faulty:
        f.exit_now()
    ok, res = f.faulted(lambda: _forward(env, prepared=prepared))
    if ok:
        _check_outputs(f, env, *res, env.idx_all)


# The ops te_ep's watchdog may name on the survivors of rank_exits_mid_step (see its declaration).
EXITS_LATE_OPS = ("dispatch", "prepare")

SLEEP_PAST_TIMEOUT_S = 1.5  # how far past the process group's timeout the faulty rank sleeps


def body_rank_sleeps_past_timeout(f) -> None:
    env = _env(f)
    prepared = env.handle.prepare(env.idx)
    f.fault_point()
    if f.is_faulty:
        time.sleep(f.pg_timeout_s + SLEEP_PAST_TIMEOUT_S)
    ok, res = f.faulted(lambda: _forward(env, prepared=prepared))
    if ok:
        _check_outputs(f, env, *res, env.idx_all)


def body_bad_step_then_recovery(f) -> None:
    """Bad routing on the faulty rank, followed by EpHandle.check() in the faulted call; an exact
    step on the same handle; where argument errors of dispatch are agreed (the check modes
    `synchronous`, raised in the step, and `device`, raised by check(); in `local` the other
    ranks would be ended by te_ep's watchdog, as in tokens_dtype_one_rank), bad tokens on the
    faulty rank and another exact step; an exact step on a new handle; shutdown."""
    W, faulty = f.world_size, f.faulty
    env = _env(f)
    E = env.group.num_experts
    bad_all = list(env.idx_all)
    bad_all[faulty] = _with(env.idx_all[faulty], 3, 0, E)
    _faulted_step(f, env, bad_all, env.idx_all, [_guarded(i, E) for i in bad_all], CHECK)
    exact = lambda h, tag: run_exact_step(f, env.group, h, STEP, f.rank, W, tag=tag)  # noqa: E731
    f.recover("exact step, same handle", lambda: exact(env.handle, "after bad routing: "))
    bad_tokens = lambda: _forward(env, x=env.x.half() if f.is_faulty else None)  # noqa: E731
    mode = env.handle.check_mode
    if mode == "synchronous":
        f.recover(f"tokens of the wrong dtype on rank {faulty}: every rank raises",
                  lambda: check_collective_error(f, bad_tokens, {faulty}, ["tokens", "torch.float16"]))
    elif mode == "device":
        def then_check():
            bad_tokens()  # nothing raised in the step
            expect_raises(env.handle.check, f"rank {faulty}: bad arguments to te_ep.dispatch",
                          f"handle {env.handle.id}")

        f.recover(f"tokens of the wrong dtype on rank {faulty}: every rank raises at check()", then_check)
    if mode in ("synchronous", "device"):
        f.recover("exact step, same handle, again", lambda: exact(env.handle, "after bad tokens: "))

    def new_handle():
        env.handle.destroy()
        h = env.group.create_handle(top_k=STEP.top_k, hidden=H, dtype=STEP.torch_dtype())
        exact(h, "new handle: ")

    f.recover("exact step, new handle", new_handle)
    f.recover("group shutdown", env.group.shutdown)


# ---------------------------------------------------------------------------
# controls: the harness sees a clean step as clean, a wrong output as wrong, zeros as zeros,
# a hang as a hang (in the step or after it), and a raise in a follow-up as a late raise
# ---------------------------------------------------------------------------
def body_no_fault(f) -> None:
    _input_fault(f, lambda env: {})


def body_control_overflow_shape(f) -> None:
    """The capacity of capacity_overflow_one_rank with the seed's routing, which fits."""
    env = _env(f, capacity=_overflow_capacity(f.world_size))
    ok, res = f.faulted(lambda: _forward(env))
    if ok:
        _check_outputs(f, env, *res, env.idx_all)


def body_control_wrong_output(f) -> None:
    """A correct step whose output the faulty rank corrupts itself before the check (what a
    backend that returns a wrong row silently would look like)."""
    env = _env(f)
    ok, res = f.faulted(lambda: _forward(env))
    if ok:
        out, y = res
        if f.is_faulty:
            y = y.clone()
            y[1, 3] += 1
        _check_outputs(f, env, out, y, env.idx_all)


def body_control_zero_output(f) -> None:
    """A correct step whose outputs every rank zeroes before the check (what the device check
    mode makes of a failed step): seen as zeros, not as correct or as merely wrong."""
    env = _env(f)
    ok, res = f.faulted(lambda: _forward(env))
    if ok:
        out, y = res
        out = out._replace(tokens=torch.zeros_like(out.tokens), weights=torch.zeros_like(out.weights))
        _check_outputs(f, env, out, torch.zeros_like(y), env.idx_all)


def body_control_late_raise(f) -> None:
    """A correct step on every rank, then a follow-up in which the faulty rank raises (no
    collective in it): recorded as raised in the follow-up, with the step's outputs."""
    env = _env(f)

    def call():
        out, y = _forward(env)
        f.sync()
        _check_outputs(f, env, out, y, env.idx_all)
        f.stage(NEXT_PREPARE)
        if f.is_faulty:
            raise RuntimeError(f"injected late error on rank {f.rank} (handle {env.handle.id})")

    f.faulted(call)


def body_control_hang(f) -> None:
    """The faulty rank never returns from its step (no collective involved)."""
    f.faulted(lambda: time.sleep(3600) if f.is_faulty else None)


def body_control_hang_after(f) -> None:
    """Every rank completes its faulted call; then the faulty rank never returns from a
    recovery step (no collective involved): a hang all the same."""
    f.faulted(lambda: None)
    f.recover("a step that never returns on the faulty rank", lambda: time.sleep(3600) if f.is_faulty else None)


# ---------------------------------------------------------------------------
# expectations
# ---------------------------------------------------------------------------
# What the contract asks of an argument or routing error: every rank raises a RuntimeError
# before any data moves; the faulty rank's message names the op, the argument and the
# values; the others name the op and the faulty rank; every message names the layer's
# handle; nobody waits for a timeout.
def _arg_error(op: str, *faulty_says) -> Expect:
    return Expect(raising="all", faulty_says=(f"te_ep.{op}",) + faulty_says,
                  others_say=(f"te_ep.{op}", "rank {faulty}"), names_handle=True)


# Every nccl_ep declaration is measured on GPUs at W=2 and W=4 (2 and 4 x H200, 10 s PG timeout: every
# case in every check mode x both nccl_ep modes, as declared, no UNEXPECTED verdict; the lost-rank cases
# also at a 20 s timeout); docs/results/, "every fault case at 4 GPUs" (2026-11-27-8ed2ccc-*), "every fault
# case at 2 GPUs" (2026-11-26-34442f7-faults-w2.md) and "a lost or stalled rank" (2026-11-26-*-lost-rank-*).
MEASURED = "measured on GPUs at W=2 and W=4 (docs/results/, 'every fault case'): "
NCCL_EP_WATCHDOG_SHORTFALL = (MEASURED + "no Python exception on the waiting ranks; te_ep's watchdog ends them "
                              "(exit code 70) with a message naming the op, the handle, the group and the rank, but "
                              "not the rank at fault")
NCCL_EP_LOCAL_SHORTFALL = (MEASURED + "check mode `local`: nothing is raised in the step, which completes on "
                           "every rank; only the faulty rank raises, a step late (at its next prepare, or "
                           "EpHandle.check()); where that is its next prepare, the others are inside NCCL EP's "
                           "prepare by then, waiting for it, until te_ep's watchdog ends them (exit code 70)")
NCCL_EP_DEVICE_SHORTFALL = (MEASURED + "check mode `device`: nothing is raised in the step, which moves nothing "
                            "on every rank (its outputs are exactly zero); every rank raises the same agreed message, "
                            "naming the faulty rank and the value, a step late (at the handle's next prepare, or "
                            "EpHandle.check()), and the handle then runs exact steps")
NCCL_EP_LOST_RANK_SHORTFALL = (MEASURED + "no Python exception on the waiting ranks; te_ep's watchdog ends them "
                               "(exit code 70) one process-group timeout after they entered the op, with a message "
                               "naming the op, the handle, the group and the rank, but not the rank at fault")
NCCL_EP_SYNC_LOST_SHORTFALL = (MEASURED + "checks='synchronous' agrees on errors through the NCCL process group "
                               "at the start of every op; the survivors wait in that all-reduce, inside the op on the "
                               "host, and te_ep's watchdog ends them (exit code 70) one limit after they entered the "
                               "op, before torch's NCCL watchdog (whose limit counts from the all-reduce's start) would "
                               "abort them: no Python exception; the message names the op, the handle, the group and "
                               "the rank, not the rank at fault")
# torch's NCCL watchdog may wait for its debug dump (TORCH_NCCL_DUMP_ON_TIMEOUT) before it aborts
TORCH_ABORT_SLACK_S = 20.0


def _watchdog_ends(expect: Expect, op: Substring, shortfall: str = NCCL_EP_WATCHDOG_SHORTFALL, **changes) -> Expect:
    """Ranks that wait for a lost peer, in `op` on the host or in its kernels, are ended by
    te_ep's watchdog (csrc/watchdog/core/watchdog.h) one process-group timeout after they entered `op`
    (a tuple: the message names one of these ops)."""
    return expect.but(watchdog_op=op, shortfall=shortfall, **changes)


NCCL_EP_CHECK_WORDING = (MEASURED + "every rank raises as the contract asks; the faulty rank's message has the "
                         "device check's wording (`topk_idx[t, k] = v (an expert id outside [-1, E))`)")


def _check_routing(expect: Expect, *faulty_says) -> Expect:
    """checks='synchronous' on nccl_ep: the reference backend's agreement (agree_on_host in
    csrc/comm/agreement.cpp), so every rank raises in the op as the contract asks; a finding of
    the device's detection kernel is worded by the one message builder (`faulty_says`)."""
    if not faulty_says:
        return expect
    return expect.but(faulty_says=faulty_says, shortfall=NCCL_EP_CHECK_WORDING)


# The messages of a bad routing value recorded in the step (NcclEpChecks::message in
# csrc/nccl_ep/nccl_ep_checks.cpp): check mode local's (on the faulty rank) and device's (the
# same on every rank).
GUARD_SAYS = "te_ep.prepare: an earlier step of this handle on rank {faulty} had "
DEVICE_SAYS = ("te_ep.prepare: an earlier step of this handle failed on the device checks of every rank "
               "(checks='device')")


def _local(contract: Expect, follow_up: str, *faulty_says, **changes) -> Expect:
    """Check mode `local` for a value recorded in the step: the faulty rank raises `faulty_says`
    in the follow-up; after a next prepare, the others are ended by te_ep's watchdog there."""
    others = dict(watchdog="others", watchdog_op="prepare") if follow_up == NEXT_PREPARE else {}
    return contract.but(raising="faulty", fails_in=follow_up, faulty_says=faulty_says, others_say=(),
                        recovers=contract.recovers and follow_up != NEXT_PREPARE,
                        shortfall=NCCL_EP_LOCAL_SHORTFALL, **others, **changes)


def _device(contract: Expect, follow_up: str, *says) -> Expect:
    """Check mode `device`: zeros on every rank, then the agreed error on every rank in the follow-up."""
    return contract.but(raising="all", fails_in=follow_up, faulty_says=(DEVICE_SAYS,) + says,
                        others_say=(DEVICE_SAYS,) + says, output="zeros", recovers=True,
                        shortfall=NCCL_EP_DEVICE_SHORTFALL)


def _device_arg(contract: Expect, follow_up: str, op: str, own: str) -> Expect:
    """Check mode `device` for an argument error of `op` on the faulty rank: zeros on every rank,
    then every rank raises the agreed message in the follow-up, the faulty rank with its own
    error `own`."""
    bad = "rank {faulty}: bad arguments to te_ep." + op
    return _device(contract, follow_up, bad).but(faulty_says=(DEVICE_SAYS, f"{bad}: {own}"),
                                                 others_say=(DEVICE_SAYS, f"{bad} (that rank's error names them)"))


_ROUTING_FAULTS = [
    # name, fault, body, faulty rank, the contract's words, check mode local's, check mode device's
    ("expert_id_out_of_range", "topk_idx holds an expert id >= num_experts on one rank",
     body_expert_id_out_of_range, lambda W: W - 1, ("topk_idx[3, 0] = {E}", "out of range", "[0, {E})"),
     (GUARD_SAYS + "topk_idx[3, 0] = {E} (an expert id outside [-1, {E}))",),
     ("rank {faulty}: topk_idx[3, 0] = {E} (an expert id outside [-1, {E}))",)),
    ("expert_id_negative", "topk_idx holds a negative id other than -1 on one rank",
     body_expert_id_negative, lambda W: 0, ("topk_idx[1, 1] = -3", "out of range"),
     (GUARD_SAYS + "topk_idx[1, 1] = -3 (an expert id outside [-1, {E}))",),
     ("rank {faulty}: topk_idx[1, 1] = -3 (an expert id outside [-1, {E}))",)),
    ("repeated_expert", "a token names the same expert twice on one rank",
     body_repeated_expert, lambda W: W - 1, ("topk_idx row 2", "twice"),
     (GUARD_SAYS + "topk_idx[2, 1] = {rep} (an expert named twice in a token's row)",),
     ("rank {faulty}: topk_idx[2, 1] = {rep} (an expert named twice in a token's row)",)),
]


def _routing_case(name, fault, body, faulty, says, guard_says, device_says, world_sizes=(2,)) -> Case:
    contract = _arg_error("prepare", *says).but(recovers=True)
    check_says = ("te_ep.prepare", "topk_idx[", "an expert named twice" if name == "repeated_expert"
                  else "outside [-1, {E})")
    return Case(
        name, fault + "; then the handle's next prepare", body, faulty, contract,
        behaviour={
            "reference": contract,
            # the guard drops the bad choice: the step is exact without it on every rank
            "nccl_ep": _local(contract, NEXT_PREPARE, *guard_says, output="guarded"),
            "nccl_ep+check": _check_routing(contract, *check_says),
            "nccl_ep+device": _device(contract, NEXT_PREPARE, *device_says),
        },
        world_sizes=world_sizes,
        one_rank=True,
    )


_PREPARE_ARG_CONTRACT = _arg_error("prepare", "topk_idx must be torch.int64 or torch.int32, got torch.float32").but(
    recovers=True)


def _arg_case(name, fault, body, faulty, op, says, own, world_sizes=(2,)) -> Case:
    """An argument error of `op`, a step op after a good prepare: `says`, the contract's words
    for the faulty rank; `own`, its whole message (the device check mode repeats it)."""
    contract = _arg_error(op, *says).but(recovers=True)
    return Case(
        name, fault + "; then EpHandle.check()", body, faulty, contract,
        behaviour={
            "reference": contract,
            # the faulty rank raises its own message at once; the others go on into NCCL EP
            # (the step's one op, prepare_dispatch: ep_dispatch was given no prepared
            # routing), whose kernels wait for it without a limit, until te_ep's watchdog ends
            # them one process-group timeout after they entered the op
            "nccl_ep": _watchdog_ends(contract, "prepare_dispatch", raising="faulty", watchdog="others",
                                      recovers=False),
            "nccl_ep+check": contract,
            # agreed on the device by the op itself (NcclEpChecks::agree_on_arguments): the
            # faulty rank's op runs on zero substitutes, every rank's outputs of the step are
            # zeros, and check() raises on every rank; the faulty rank's message holds its own error
            "nccl_ep+device": _device_arg(contract, CHECK, op, own),
        },
        world_sizes=world_sizes,
        one_rank=True,
    )


# gloo's own errors, raised from the all-reduce of the error agreement that opens every step op
GLOO_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")
GLOO_TIMEOUT = "Timed out waiting"
GLOO_SHORTFALL = ("the ranks raise `te_ep.<op> on handle <id> of group '<name>': a collective with the other "
                  "ranks failed (<gloo's transport error>)` and what to do, but not which rank is at fault: "
                  "gloo's error (`Connection closed by peer`, `Timed out waiting <ms> for recv operation`) "
                  "does not say")

_EXIT_CONTRACT = Expect(raising="others", exiting="faulty", others_say=("te_ep.dispatch", "rank {faulty}"),
                        names_handle=True, max_s=within_timeout)
_SLEEP_CONTRACT = Expect(raising="all", faulty_says=("te_ep.dispatch",), others_say=("te_ep.dispatch",),
                         names_handle=True, max_s=lambda pg: 2 * pg + SLEEP_PAST_TIMEOUT_S + 3)

_CONFIG_CONTRACT = Expect(raising="all", exc=("ValueError",),
                          faulty_says=("create_handle", "disagree on hidden", "rank 0: {H}", "rank {faulty}: {H2}"),
                          others_say=("create_handle", "disagree on hidden", "rank 0: {H}", "rank {faulty}: {H2}"),
                          recovers=True)
_OVERFLOW_CONTRACT = _arg_error("prepare", "capacity overflow", "capacity is {cap}").but(recovers=True)
_BAD_STEP_CONTRACT = _arg_error("prepare", "topk_idx[3, 0] = {E}", "out of range").but(recovers=True)
# A lost rank under checks='synchronous' (the exit and sleep cases).

CASES = [
    *[_routing_case(*spec, world_sizes=(2, 3) if spec[0] == "expert_id_out_of_range" else (2,))
      for spec in _ROUTING_FAULTS],
    Case(
        "capacity_overflow_one_rank",
        "one rank's receive rows exceed an explicit capacity (the last rank sends everything to rank 0); then the "
        "handle's next prepare, with a routing that fits",
        body_capacity_overflow, lambda W: 0,
        _OVERFLOW_CONTRACT,
        behaviour={
            "reference": _OVERFLOW_CONTRACT,
            # NCCL EP's DROP policy below the worst-case capacity: the rows that do not fit on
            # rank 0 are dropped, so rank 0's receive buffer is wrong. Which rows NCCL EP drops,
            # and so which other ranks' tokens lose rows in their combine outputs, is NCCL EP's
            # choice, not predicted here: the other ranks' outputs may be wrong or right.
            "nccl_ep": _local(_OVERFLOW_CONTRACT, NEXT_PREPARE, "te_ep.prepare: an earlier step of this handle on "
                              "rank 0 had capacity overflow", "capacity is {cap}", wrong="faulty",
                              maybe_wrong="others"),
            "nccl_ep+check": _OVERFLOW_CONTRACT,
            "nccl_ep+device": _device(_OVERFLOW_CONTRACT, NEXT_PREPARE, "rank 0: capacity overflow: the routing needs",
                                      "the handle's capacity is {cap}"),
        },
        world_sizes=(2, 3),
    ),
    Case(
        "topk_idx_dtype_one_rank",
        "topk_idx of a float dtype on one rank (an argument error of prepare); then the handle's next prepare",
        body_topk_idx_dtype, lambda W: W - 1, _PREPARE_ARG_CONTRACT,
        behaviour={
            "reference": _PREPARE_ARG_CONTRACT,
            # the faulty rank raises at once; the others go on into NCCL EP's routing exchange
            # (in prepare_dispatch, the step's one op)
            "nccl_ep": _watchdog_ends(_PREPARE_ARG_CONTRACT, "prepare_dispatch", raising="faulty", watchdog="others",
                                      recovers=False),
            "nccl_ep+check": _PREPARE_ARG_CONTRACT,
            # agreed with the routing (NcclEpChecks::check_routing): zeros, then every rank
            # raises at the next prepare; the faulty rank's message holds its own error
            "nccl_ep+device": _device_arg(_PREPARE_ARG_CONTRACT, NEXT_PREPARE, "prepare",
                                          "topk_idx must be torch.int64 or torch.int32, got torch.float32"),
        },
        one_rank=True,
    ),
    _arg_case("tokens_dtype_one_rank", "tokens of the wrong dtype (float16 for a bfloat16 handle) on one rank",
              body_tokens_dtype, lambda W: W - 1, "dispatch", ("tokens", "torch.bfloat16", "torch.float16"),
              "tokens must be torch.bfloat16 (the handle's dtype), got torch.float16", world_sizes=(1, 2)),
    _arg_case("tokens_hidden_one_rank", "tokens of the wrong hidden size on one rank",
              body_tokens_hidden, lambda W: 0, "dispatch", ("tokens.size(1)", "{H}", "{H1}"),
              "tokens.size(1) must be {H} (the handle's hidden), got {H1}"),
    Case(
        "handle_config_mismatch",
        "create_handle with a different hidden on one rank",
        body_handle_config_mismatch, lambda W: W - 1, _CONFIG_CONTRACT,
        # the configuration agreement is a Python collective before any NCCL EP call: the
        # contract in every variant
        behaviour={v: _CONFIG_CONTRACT for v in VARIANTS},
    ),
    Case(
        "rank_exits_mid_step",
        "one rank exits (os._exit) after prepare, before dispatch",
        body_rank_exits_mid_step, lambda W: 0, _EXIT_CONTRACT,
        behaviour={
            "reference": _EXIT_CONTRACT.but(others_say=("te_ep.dispatch", "collective with the other ranks failed",
                                                        GLOO_LOST_PEER), shortfall=GLOO_SHORTFALL),
            # Measured on GPUs (4 x H200, 2026-11-26, docs/results/*-lost-rank-*): every survivor ends by te_ep's
            # watchdog (host) 20.2 s after the fault at W=2 (20 s PG timeout) and 10.2-10.5 s at W=4
            # (10 s), in every check mode and both nccl_ep modes. No torch collective in the step: the survivors' dispatch waits for the
            # lost rank without a limit until te_ep's watchdog ends them one process-group
            # timeout after they entered dispatch (the device mode's agreement runs inside
            # prepare, which every rank completed on the host before the exit). The faulty rank
            # exits as soon as prepare returns on its host, so its GPU may not have done its part
            # of prepare's routing exchange: then the survivors' prepare is the op whose GPU work
            # is late, and the watchdog names it (EXITS_LATE_OPS).
            "nccl_ep": _watchdog_ends(_EXIT_CONTRACT, EXITS_LATE_OPS, NCCL_EP_LOST_RANK_SHORTFALL, raising="none",
                                      watchdog="others"),
            # the survivors wait in dispatch's agreement (a torch all-reduce); te_ep's watchdog
            # counts from their entry into dispatch, so it ends them before torch's would
            "nccl_ep+check": _watchdog_ends(_EXIT_CONTRACT, EXITS_LATE_OPS, NCCL_EP_SYNC_LOST_SHORTFALL,
                                            raising="none", watchdog="others"),
            "nccl_ep+device": _watchdog_ends(_EXIT_CONTRACT, EXITS_LATE_OPS, NCCL_EP_LOST_RANK_SHORTFALL, raising="none",
                                             watchdog="others"),
        },
        world_sizes=(2, 3),
        wall=lambda pg: 2 * pg + TORCH_ABORT_SLACK_S + 10,
    ),
    Case(
        "rank_sleeps_past_timeout",
        "one rank sleeps past the process group's timeout after prepare, before dispatch",
        body_rank_sleeps_past_timeout, lambda W: W - 1, _SLEEP_CONTRACT,
        behaviour={
            # the waiting ranks time out in the error agreement; gloo then closes the connection, so the
            # late rank fails at once when it arrives
            # (the message does not name the late rank; the contract does not ask it to)
            "reference": _SLEEP_CONTRACT,
            # Measured on GPUs (4 x H200, 2026-11-26, docs/results/*-lost-rank-*): the waiting ranks end by te_ep's
            # watchdog (host) one PG timeout after the fault (20.1 s at W=2, 10.2-10.4 s at W=4), the
            # late rank at 41.7 s / 21.7 s, in every check mode and both nccl_ep modes. No torch collective in a default-mode step: the waiting ranks' dispatch kernels spin
            # until te_ep's watchdog ends them one PG timeout after they entered dispatch; the late
            # rank then finds no peers, and its own watchdog ends it one timeout after it arrives
            # (in the synchronous mode both wait on the host, in dispatch's agreement).
            "nccl_ep": _watchdog_ends(_SLEEP_CONTRACT, "dispatch", NCCL_EP_LOST_RANK_SHORTFALL, raising="none",
                                      watchdog="all", watchdog_max_s=_SLEEP_CONTRACT.max_s),
            "nccl_ep+check": _watchdog_ends(_SLEEP_CONTRACT, "dispatch", NCCL_EP_SYNC_LOST_SHORTFALL,
                                            raising="none", watchdog="all", watchdog_max_s=_SLEEP_CONTRACT.max_s),
            "nccl_ep+device": _watchdog_ends(_SLEEP_CONTRACT, "dispatch", NCCL_EP_LOST_RANK_SHORTFALL, raising="none",
                                             watchdog="all", watchdog_max_s=_SLEEP_CONTRACT.max_s),
        },
        wall=lambda pg: 3 * pg + SLEEP_PAST_TIMEOUT_S + TORCH_ABORT_SLACK_S + 10,
    ),
    Case(
        "bad_step_then_recovery",
        "bad routing on one rank, then EpHandle.check(); good steps on the same handle (with bad tokens on one rank "
        "between them in the check mode `synchronous`) and on a new handle",
        body_bad_step_then_recovery, lambda W: W - 1,
        _BAD_STEP_CONTRACT,
        behaviour={
            "reference": _BAD_STEP_CONTRACT,
            # EpHandle.check() raises on the faulty rank only and clears its record, without a
            # collective: the handle then runs exact steps on every rank
            "nccl_ep": _local(_BAD_STEP_CONTRACT, CHECK,
                              GUARD_SAYS + "topk_idx[3, 0] = {E} (an expert id outside [-1, {E}))", output="guarded"),
            "nccl_ep+check": _check_routing(_BAD_STEP_CONTRACT, "te_ep.prepare", "topk_idx[3, 0] = {E}",
                                            "outside [-1, {E})"),
            "nccl_ep+device": _device(_BAD_STEP_CONTRACT, CHECK,
                                      "rank {faulty}: topk_idx[3, 0] = {E} (an expert id outside [-1, {E}))"),
        },
        world_sizes=(1, 2),
        one_rank=True,
    ),
]

CONTROLS = [
    Case("control_no_fault", "no fault: every rank completes with exact outputs", body_no_fault, lambda W: 0,
         Expect(raising="none"), control=True),
    Case("control_overflow_shape", "no fault, at the small capacity of capacity_overflow_one_rank: exact",
         body_control_overflow_shape, lambda W: 0, Expect(raising="none"), control=True),
    Case("control_wrong_output", "a rank's output corrupted before the check: seen as wrong",
         body_control_wrong_output, lambda W: W - 1, Expect(raising="none", wrong="faulty"), control=True),
    Case("control_zero_output", "every rank's outputs zeroed before the check: seen as zeros",
         body_control_zero_output, lambda W: 0, Expect(raising="none", output="zeros"), control=True),
    Case("control_late_raise", "a correct step, then a raise on one rank in the follow-up: a late raise",
         body_control_late_raise, lambda W: W - 1,
         Expect(raising="faulty", fails_in=NEXT_PREPARE, faulty_says=("injected late error on rank {faulty}",),
                names_handle=True), control=True),
    Case("control_hang", "a rank that never returns: killed at the wall limit, reported as a hang",
         body_control_hang, lambda W: W - 1, Expect(raising="none", hanging="faulty", outputs=False), control=True,
         wall=lambda pg: 3.0),
    Case("control_hang_after", "a rank that never returns from a step after its faulted call: a hang as well",
         body_control_hang_after, lambda W: W - 1, Expect(raising="none", hanging="faulty", outputs=False),
         control=True, wall=lambda pg: 3.0),
]

CASES_BY_NAME = {case.name: case for case in CASES + CONTROLS}

# In the quick GPU selection (pytest -m "gpu and quick"): a bad expert id (the routing guard), a
# bad dtype on one rank (an argument error of the op) and a rank that exits mid-step (the
# watchdog's host side).
QUICK = ("expert_id_out_of_range", "tokens_dtype_one_rank", "rank_exits_mid_step")
