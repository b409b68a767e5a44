"""The fault cases: one fault injected on one rank, the rest of the group running the same
step, and what the contract asks of each (docs/ops.md, "Errors" and "Faults and bad input").

Each body runs on every rank of a fresh group (runner.run_case). It sets up a group and a
handle, marks the fault point, runs the faulted step through `FaultCtx.faulted` (the
faulty rank with the fault, the others with their correct inputs), and, on a rank where
the step completes, checks its outputs exactly against a local reference built the way
tests/ep_cases/exact.py does (fingerprinted tokens: every received row tells where it came
from, so a wrong row, a dropped row or a row from the wrong step is seen).

`Case.contract` is what the contract asks; `Case.behaviour` maps a variant ("reference",
"nccl_ep", "nccl_ep+check") to what the code does today where that differs (an `Expect`
with its `shortfall`), or to None where nothing is declared (not measured; `documented`
then says what docs/nccl_ep.md and the code say). tests/test_faults.py holds the reference
backend to its declared behaviour and checks that each declared shortfall is still one.
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
    expected_layout,
    fingerprint,
    make_group,
    nccl_ep_capacity_floor,
)
from ep_cases.errors import check_collective_error
from ep_cases.exact import check_sum, run_exact_step

from .expect import Expect, within_timeout

# One small step, valid on nccl_ep at any W (4 experts per rank, 32-byte bf16 rows,
# capacity floor 8); ranks pass different token counts.
STEP = Step(top_k=2, hidden=16, dtype="bf16", tokens=(5, 7), max_tokens=8, seed=21)
E_LOCAL = STEP.experts_per_rank
H = STEP.hidden


# Backend variants with declared behaviour: "reference" is measured here (CPU, gloo); the
# nccl_ep ones are declared from the code and docs/nccl_ep.md (not measured here). Any other
# run (e.g. the reference backend on NCCL) is only measured.
VARIANTS = ("reference", "nccl_ep", "nccl_ep+check")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fault: str  # the fault, in words
    body: Callable  # body(f: runner.FaultCtx)
    faulty: Callable[[int], int]  # the faulty rank, given W
    contract: Expect
    behaviour: Dict[str, Optional[Expect]] = dataclasses.field(default_factory=dict)
    documented: Dict[str, str] = dataclasses.field(default_factory=dict)
    world_sizes: tuple = (2,)  # where tests/test_faults.py runs it on CPU
    wall: Callable[[float], float] = lambda pg: 2 * pg + 10
    control: bool = False  # checks the harness (no fault, or a fault of the harness's own)

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
        return dict(E=E_LOCAL * world_size, H=H, H2=2 * H, H1=H + 1, cap=_overflow_capacity(world_size))


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


def _input_fault(f, make_bad: Callable[[Env], dict]) -> None:
    """The faulty rank passes the arguments `make_bad` returns; the others pass their own."""
    env = _env(f)
    kwargs = make_bad(env) if f.is_faulty else {}
    ok, res = f.faulted(lambda: _forward(env, **kwargs))
    if ok:
        f.check_output(lambda: _check(f, env, *res, env.idx_all))


# ---------------------------------------------------------------------------
# the faults
# ---------------------------------------------------------------------------
def _with(idx: torch.Tensor, t: int, k: int, value) -> torch.Tensor:
    idx = idx.clone()
    idx[t, k] = idx[t, 0] if value == "repeat" else value
    return idx


def body_expert_id_out_of_range(f) -> None:
    _input_fault(f, lambda env: dict(idx=_with(env.idx, 3, 0, env.group.num_experts)))


def body_expert_id_negative(f) -> None:
    _input_fault(f, lambda env: dict(idx=_with(env.idx, 1, 1, -3)))


def body_repeated_expert(f) -> None:
    _input_fault(f, lambda env: dict(idx=_with(env.idx, 2, 1, "repeat")))


def body_tokens_dtype(f) -> None:
    _input_fault(f, lambda env: dict(x=env.x.half()))


def body_tokens_hidden(f) -> None:
    _input_fault(f, lambda env: dict(x=torch.zeros(env.x.shape[0], H + 1, dtype=env.x.dtype, device=env.x.device)))


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
    idx_all, cap = _overflow_routing(f.world_size)
    needs = [expected_layout(idx_all, r, E_LOCAL, 1, 0).total for r in range(f.world_size)]
    assert needs[0] > cap and all(n <= cap for n in needs[1:]), f"rows needed per rank {needs}, capacity {cap}"
    env = _env(f, capacity=cap, idx_all=idx_all)
    ok, res = f.faulted(lambda: _forward(env))
    if ok:
        f.check_output(lambda: _check(f, env, *res, idx_all))


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
        f.check_output(lambda: _check(f, env, *res, env.idx_all))


SLEEP_PAST_TIMEOUT_S = 1.5  # how far past the process group's timeout the faulty rank sleeps


def body_rank_sleeps_past_timeout(f) -> None:
    env = _env(f)
    prepared = env.handle.prepare(env.idx)
    f.fault_point()
    if f.is_faulty:
        time.sleep(f.pg_timeout_s + SLEEP_PAST_TIMEOUT_S)
    ok, res = f.faulted(lambda: _forward(env, prepared=prepared))
    if ok:
        f.check_output(lambda: _check(f, env, *res, env.idx_all))


def body_bad_step_then_recovery(f) -> None:
    """Bad routing on the faulty rank; an exact step on the same handle; bad tokens on the
    faulty rank; another exact step; an exact step on a new handle; shutdown."""
    W, faulty = f.world_size, f.faulty
    env = _env(f)
    bad_idx = _with(env.idx, 3, 0, env.group.num_experts) if f.is_faulty else env.idx
    f.faulted(lambda: _forward(env, idx=bad_idx))
    exact = lambda h, tag: run_exact_step(f, env.group, h, STEP, f.rank, W, tag=tag)  # noqa: E731
    f.recover("exact step, same handle", lambda: exact(env.handle, "after bad routing: "))
    f.recover(
        f"tokens of the wrong dtype on rank {faulty}: every rank raises",
        lambda: check_collective_error(f, lambda: _forward(env, x=env.x.half() if f.is_faulty else None), {faulty},
                                       ["tokens", "torch.float16"]),
    )
    f.recover("exact step, same handle, again", lambda: exact(env.handle, "after bad tokens: "))

    def new_handle():
        env.handle.destroy()
        h = env.group.create_handle(top_k=STEP.top_k, hidden=H, dtype=STEP.torch_dtype())
        exact(h, "new handle: ")

    f.recover("exact step, new handle", new_handle)
    f.recover("group shutdown", env.group.shutdown)


# ---------------------------------------------------------------------------
# controls: the harness sees a clean step as clean, a wrong output as wrong, a hang as a hang
# ---------------------------------------------------------------------------
def body_no_fault(f) -> None:
    _input_fault(f, lambda env: {})


def body_control_overflow_shape(f) -> None:
    """The capacity of capacity_overflow_one_rank with the seed's routing, which fits."""
    env = _env(f, capacity=_overflow_capacity(f.world_size))
    ok, res = f.faulted(lambda: _forward(env))
    if ok:
        f.check_output(lambda: _check(f, env, *res, env.idx_all))


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
        f.check_output(lambda: _check(f, env, out, y, env.idx_all))


def body_control_hang(f) -> None:
    """The faulty rank never returns from its step (no collective involved)."""
    f.faulted(lambda: time.sleep(3600) if f.is_faulty else None)


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



NCCL_EP_ROUTING_DEFAULT = ("the routing guard drops the bad choice on the faulty rank before NCCL EP sees it "
                           "(no host sync); the step completes on every rank without it, and the faulty rank's next "
                           "prepare (or EpHandle.check()) raises `te_ep.prepare: the routing of an earlier step on rank "
                           "r had ...`; the others then wait in that prepare until te_ep's watchdog ends them")
NCCL_EP_ARG_DEFAULT = ("the faulty rank raises its own message at once; the others go on into NCCL EP's "
                       "dispatch, whose kernels wait for the faulty rank without a limit, until te_ep's watchdog "
                       "ends them (exit code 70) one process-group timeout after the launch")
NCCL_EP_WATCHDOG_SHORTFALL = ("declared from the code, not yet measured on GPUs: no Python exception on the waiting "
                              "ranks; te_ep's watchdog ends them (exit code 70) with a message naming the op, the "
                              "handle, the group and the rank, but not the rank at fault")


def _watchdog_ends(expect: Expect, op: str, **changes) -> Expect:
    """nccl_ep's default mode: ranks whose kernels wait for a lost peer are ended by te_ep's
    watchdog (csrc/common/watchdog.h) one process-group timeout after `op` was launched."""
    return expect.but(watchdog_op=op, shortfall=NCCL_EP_WATCHDOG_SHORTFALL, **changes)


NCCL_EP_CHECK_WORDING = ("declared from the code, not measured here (needs GPUs): every rank raises as the contract "
                         "asks, with the checking mode's own wording (`te_ep.<op> failed on rank r: ...`)")


def _check_routing(expect: Expect, *faulty_says, others: str) -> Expect:
    """The TE_EP_CHECK_ROUTING=1 agreement of the nccl_ep backend (agree() in nccl_ep_backend.cpp):
    every rank raises, the others with `te_ep.<op> failed on rank r: <message>`; the op adapter
    (run_op in comm_ops.cpp) appends the handle and its group."""
    return expect.but(faulty_says=faulty_says or expect.faulty_says, others_say=(others,),
                      shortfall=NCCL_EP_CHECK_WORDING)


_ROUTING_FAULTS = [
    ("expert_id_out_of_range", "topk_idx holds an expert id >= num_experts on one rank",
     body_expert_id_out_of_range, lambda W: W - 1, ("topk_idx[3, 0] = {E}", "out of range", "[0, {E})")),
    ("expert_id_negative", "topk_idx holds a negative id other than -1 on one rank",
     body_expert_id_negative, lambda W: 0, ("topk_idx[1, 1] = -3", "out of range")),
    ("repeated_expert", "a token names the same expert twice on one rank",
     body_repeated_expert, lambda W: W - 1, ("topk_idx row 2", "twice")),
]


def _routing_case(name, fault, body, faulty, says, world_sizes=(2,)) -> Case:
    contract = _arg_error("prepare", *says)
    check_says = ("te_ep.prepare", "topk_idx[", "names the same expert twice" if name == "repeated_expert"
                  else "outside [-1, {E})")
    return Case(
        name, fault, body, faulty, contract,
        behaviour={
            "reference": contract,
            "nccl_ep": None,
            "nccl_ep+check": _check_routing(contract.but(others_say=()), *check_says,
                                            others="te_ep.prepare failed on rank {faulty}"),
        },
        documented={"nccl_ep": NCCL_EP_ROUTING_DEFAULT,
                    "nccl_ep+check": "every rank raises in prepare (a device sync, then agreement)"},
        world_sizes=world_sizes,
    )


def _arg_case(name, fault, body, faulty, op, says) -> Case:
    contract = _arg_error(op, *says)
    return Case(
        name, fault, body, faulty, contract,
        behaviour={
            "reference": contract,
            "nccl_ep": _watchdog_ends(contract, op, raising="faulty", watchdog="others"),
            "nccl_ep+check": _check_routing(contract, others=f"te_ep.{op} failed on rank {{faulty}}"),
        },
        documented={"nccl_ep": NCCL_EP_ARG_DEFAULT,
                    "nccl_ep+check": f"every rank raises in {op} (agreement through the process group)"},
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

CASES = [
    *[_routing_case(*spec, world_sizes=(2, 3) if spec[0] == "expert_id_out_of_range" else (2,))
      for spec in _ROUTING_FAULTS],
    Case(
        "capacity_overflow_one_rank",
        "one rank's receive rows exceed an explicit capacity (the last rank sends everything to rank 0)",
        body_capacity_overflow, lambda W: 0,
        _arg_error("prepare", "capacity overflow", "capacity is {cap}"),
        behaviour={
            "reference": _arg_error("prepare", "capacity overflow", "capacity is {cap}"),
            "nccl_ep": None,
            "nccl_ep+check": _check_routing(_arg_error("prepare"), "te_ep.prepare: capacity overflow on rank 0",
                                            others="te_ep.prepare failed on rank 0"),
        },
        documented={"nccl_ep": "no error in the step (NCCL EP's DROP policy below the worst-case capacity): the rows "
                               "that do not fit on rank 0 are dropped, so rank 0's receive buffer and the combine "
                               "outputs of the tokens whose rows were dropped are wrong; the next prepare of the "
                               "handle raises on rank 0 only, and the others then wait in NCCL EP until te_ep's "
                               "watchdog ends them (exit code 70) one process-group timeout later",
                    "nccl_ep+check": "every rank raises in the overflowing prepare"},
        world_sizes=(2, 3),
    ),
    _arg_case("tokens_dtype_one_rank", "tokens of the wrong dtype (float16 for a bfloat16 handle) on one rank",
              body_tokens_dtype, lambda W: W - 1, "dispatch", ("tokens", "torch.bfloat16", "torch.float16")),
    _arg_case("tokens_hidden_one_rank", "tokens of the wrong hidden size on one rank",
              body_tokens_hidden, lambda W: 0, "dispatch", ("tokens.size(1)", "{H}", "{H1}")),
    Case(
        "handle_config_mismatch",
        "create_handle with a different hidden on one rank",
        body_handle_config_mismatch, lambda W: W - 1,
        Expect(raising="all", exc=("ValueError",),
               faulty_says=("create_handle", "disagree on hidden", "rank 0: {H}", "rank {faulty}: {H2}"),
               others_say=("create_handle", "disagree on hidden", "rank 0: {H}", "rank {faulty}: {H2}"),
               recovers=True),
        documented={"nccl_ep": "configuration agreement in Python, before any NCCL EP call: as on reference",
                    "nccl_ep+check": "as on reference"},
    ),
    Case(
        "rank_exits_mid_step",
        "one rank exits (os._exit) after prepare, before dispatch",
        body_rank_exits_mid_step, lambda W: 0, _EXIT_CONTRACT,
        behaviour={
            "reference": _EXIT_CONTRACT.but(others_say=("te_ep.dispatch", "collective with the other ranks failed",
                                                        GLOO_LOST_PEER), shortfall=GLOO_SHORTFALL),
            "nccl_ep": _watchdog_ends(_EXIT_CONTRACT, "dispatch", raising="none", watchdog="others"),
            "nccl_ep+check": None,
        },
        documented={"nccl_ep": "the survivors' dispatch kernels wait for the lost rank without a limit (no torch "
                               "collective in the step); te_ep's watchdog ends them (exit code 70) one "
                               "process-group timeout after the launch",
                    "nccl_ep+check": "the survivors wait in the agreement all-gather on the NCCL process group; "
                                     "by torch's defaults its NCCL watchdog ends the process when the collective "
                                     "times out or NCCL reports the lost peer (no Python exception)"},
        world_sizes=(2, 3),
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
            # No torch collective in a default-mode step: the waiting ranks' dispatch kernels spin
            # until te_ep's watchdog ends them one PG timeout after the launch; the late rank then
            # finds no peers, and its own watchdog ends it one timeout after it arrives.
            "nccl_ep": _watchdog_ends(_SLEEP_CONTRACT, "dispatch", raising="none", watchdog="all",
                                      watchdog_max_s=_SLEEP_CONTRACT.max_s),
            "nccl_ep+check": None,
        },
        documented={"nccl_ep": "no torch collective in the step; the waiting ranks' dispatch kernels spin until te_ep's "
                               "watchdog ends them (exit code 70) one process-group timeout after the launch; the "
                               "late rank, finding no peers, is ended one timeout after it arrives",
                    "nccl_ep+check": "the waiting ranks time out in the agreement all-gather on the NCCL process "
                                     "group; by torch's defaults its NCCL watchdog ends them (no Python exception)"},
        wall=lambda pg: 3 * pg + SLEEP_PAST_TIMEOUT_S + 10,
    ),
    Case(
        "bad_step_then_recovery",
        "a bad step (routing, then tokens) on one rank, each followed by good steps on the same and a new handle",
        body_bad_step_then_recovery, lambda W: W - 1,
        _arg_error("prepare", "topk_idx[3, 0] = {E}", "out of range").but(recovers=True),
        behaviour={
            "reference": _arg_error("prepare", "topk_idx[3, 0] = {E}", "out of range").but(recovers=True),
            "nccl_ep": None,
            "nccl_ep+check": _check_routing(_arg_error("prepare").but(recovers=True), "te_ep.prepare", "topk_idx[3]",
                                            "outside [-1, {E})", others="te_ep.prepare failed on rank {faulty}"),
        },
        documented={"nccl_ep": NCCL_EP_ROUTING_DEFAULT + "; recovery then depends on NCCL EP's state",
                    "nccl_ep+check": "every rank raises at each bad step; later steps are exact"},
    ),
]

CONTROLS = [
    Case("control_no_fault", "no fault: every rank completes with exact outputs", body_no_fault, lambda W: 0,
         Expect(raising="none"), control=True),
    Case("control_overflow_shape", "no fault, at the small capacity of capacity_overflow_one_rank: exact",
         body_control_overflow_shape, lambda W: 0, Expect(raising="none"), control=True),
    Case("control_wrong_output", "a rank's output corrupted before the check: seen as wrong",
         body_control_wrong_output, lambda W: W - 1, Expect(raising="none", wrong="faulty"), control=True),
    Case("control_hang", "a rank that never returns: killed at the wall limit, reported as a hang",
         body_control_hang, lambda W: W - 1, Expect(raising="none", hanging="faulty", outputs=False), control=True,
         wall=lambda pg: 3.0),
]

CASES_BY_NAME = {case.name: case for case in CASES + CONTROLS}
