"""The fault-injection suite (tests/faults): every case in its own fresh processes with a short
process-group timeout, on CPU (gloo, the reference backend) and, marked ``gpu``, on GPUs (NCCL,
nccl_ep in each mode and check mode at each ``--world-size``; tests/_launches.py).

Each case must behave as declared for its variant (tests/faults/cases.py): where that is the
contract, the contract; where it falls short, the measured behaviour written down there and in
docs/ops.md ("Faults and bad input"), and it must still fall short (a fixed shortfall fails as
STALE until its declaration and the docs are updated). The controls show that the runner sees
a clean step as clean, a wrong output as wrong, zeros as zeros, a raise in a step's follow-up
as a late raise and a hang as a hang, in the step or after it; the judge's own tests show that
each kind of deviation is reported, that a hang or a wrong output fails whether or not
anything is declared, and that the nccl_ep declarations accept what docs/ops.md describes and
nothing that hangs or is wrong.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import _dist
from _dist import Launch
from _launches import gpu_launches, param
from faults import cases as fault_cases
from faults.expect import Expect, evaluate, judge
from faults.runner import (DEFAULT_PG_TIMEOUT_CUDA_S, INJECTED_EXIT_CODE, TORCH_ABORT_EXIT_CODE, WATCHDOG_EXIT_CODE,
                           CaseResult, RankRecord, RunConfig, describe, run_case, summary_line)

pytestmark = pytest.mark.faults

PG_TIMEOUT_S = 5.0
CONFIG = RunConfig(backend="reference", device="cpu", pg_timeout_s=PG_TIMEOUT_S)


def _run(case, world_size: int) -> CaseResult:
    result = run_case(case, dataclasses.replace(CONFIG, world_size=world_size))
    print(describe(result))  # shown by pytest on failure
    return result


def pytest_generate_tests(metafunc):
    if metafunc.function is test_fault_case:
        params = [param(Launch(W), case, name=case.name) for case in fault_cases.CASES for W in case.world_sizes]
        # at one GPU only the cases marked one_rank (the faulty rank's side)
        params += [param(launch, case, name=case.name, quick=case.name in fault_cases.QUICK)
                   for launch in gpu_launches(metafunc.config, ["nccl_ep"])
                   for case in fault_cases.CASES if launch.world_size > 1 or case.one_rank]
        metafunc.parametrize("case,launch", params)


def _config(options, launch: Launch) -> RunConfig:
    if launch.device == "cpu":
        return dataclasses.replace(CONFIG, world_size=launch.world_size)
    return RunConfig(backend=launch.backend, device="cuda", world_size=launch.world_size,
                     pg_timeout_s=options.getoption("faults_pg_timeout") or DEFAULT_PG_TIMEOUT_CUDA_S,
                     checks=launch.checks, nccl_ep_mode=launch.nccl_ep_mode,
                     dump_after_s=tuple(float(s) for s in options.getoption("faults_dump_after").replace(",", " ")
                                        .split()),
                     keep_logs=options.getoption("faults_keep_logs"))


_WARMED: set = set()


def _warm_kernel_cache(config: RunConfig) -> None:
    """NCCL EP compiles its kernels on the first use of a shape, tens of seconds inside the op,
    which a case would count against its process-group timeout: the fault-free controls run
    first, once per world size and nccl_ep mode, with a long timeout."""
    key = (config.world_size, config.nccl_ep_mode)
    if key in _WARMED:
        return
    _WARMED.add(key)
    for name in ("control_no_fault", "control_overflow_shape"):
        warm = run_case(fault_cases.CASES_BY_NAME[name],
                        dataclasses.replace(config, pg_timeout_s=300.0, dump_after_s=(), keep_logs=""))
        print(f"warm-up {name}: {', '.join(rec.outcome() for rec in warm.ranks)} in {warm.wall_s:.0f} s"
              f"{' (HANG)' if warm.hang else ''}")


def test_fault_case(request, case, launch):
    config = _config(request.config, launch)
    if config.backend == "nccl_ep":
        _warm_kernel_cache(config)
    start = time.monotonic()
    result = run_case(case, config)
    case_s = time.monotonic() - start  # processes started to processes gone: what the case costs
    print(describe(result))  # shown by pytest on failure
    verdict, problems = judge(case, result)
    summary = request.config.getoption("faults_summary")
    if summary:
        with open(summary, "a") as f:
            f.write(summary_line(result, verdict, case_s) + "\n")
    assert verdict in ("contract", "shortfall"), (f"{case.name} ({config.variant}) at W={config.world_size}: "
                                                  f"{verdict}\n" + "\n".join(problems))
    assert not result.hang


@pytest.mark.parametrize("name", ["control_no_fault", "control_overflow_shape"])
def test_control_no_fault(name):
    case = fault_cases.CASES_BY_NAME[name]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    assert [rec.output for rec in result.ranks] == ["correct", "correct"]


def test_control_wrong_output_is_seen():
    case = fault_cases.CASES_BY_NAME["control_wrong_output"]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    assert result.ranks[0].output == "correct"
    assert result.ranks[1].output.startswith("wrong: rank 1: combine output differs in 1 rows"), result.ranks[1].output


def test_control_hang_is_killed_at_the_wall_limit():
    case = fault_cases.CASES_BY_NAME["control_hang"]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    assert result.hang
    hung = result.ranks[1]
    assert hung.status == "hang" and hung.exit_code == -9, describe(result)
    wall = case.wall_s(PG_TIMEOUT_S)
    assert wall <= result.wall_s < wall + 2.0, result.wall_s
    assert hung.seconds is not None and hung.seconds >= wall


def test_control_hang_after_the_faulted_call_is_a_hang():
    """The runner waits for a rank's whole body, not only its faulted call: a rank that never
    returns from a later step is killed at the wall limit and reported as a hang there."""
    case = fault_cases.CASES_BY_NAME["control_hang_after"]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    assert result.hang
    hung = result.ranks[1]
    assert hung.status == "completed" and hung.exit_code == -9, describe(result)
    assert hung.after == "hang in after: a step that never returns on the faulty rank", hung.after
    assert result.ranks[0].done and not result.ranks[0].after
    # the same result fails a declaration without the hang
    problems = evaluate(result, Expect(raising="none", outputs=False), case.fmt(2))
    assert any(p.startswith("hang: ranks [1]") and "after: a step that never returns" in p for p in problems), problems


def test_control_zero_output_is_seen_as_zeros():
    case = fault_cases.CASES_BY_NAME["control_zero_output"]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    assert [rec.output for rec in result.ranks] == ["zeros", "zeros"]
    # zeros are not a correct output: undeclared, they fail
    problems = evaluate(result, Expect(raising="none"), case.fmt(2))
    assert len([p for p in problems if "with output 'zeros', expected 'correct'" in p]) == 2, problems


def test_control_late_raise_is_seen_in_the_follow_up():
    """A raise in the follow-up of the faulted step (where the local and device check modes
    raise what a step recorded) is recorded as such, with the step's outputs."""
    case = fault_cases.CASES_BY_NAME["control_late_raise"]
    result = _run(case, 2)
    assert judge(case, result) == ("contract", [])
    late, other = result.ranks[1], result.ranks[0]
    assert (late.status, late.failed_in, late.output) == ("raised", "next prepare", "correct"), describe(result)
    assert (other.status, other.output) == ("completed", "correct"), describe(result)
    # a raise in the follow-up is not a raise in the step
    problems = evaluate(result, case.contract.but(fails_in="step"), case.fmt(2))
    assert any("raised in next prepare, expected in step" in p for p in problems), problems


def test_every_fault_case_declares_its_behaviour():
    """Every case declares an Expect for every variant (nccl_ep+device included), none merely
    described; every shortfall says what it is; the check modes map to the variants."""
    assert len({c.name for c in fault_cases.CASES + fault_cases.CONTROLS}) == len(fault_cases.CASES_BY_NAME)
    assert set(fault_cases.VARIANTS) == {"reference", "nccl_ep", "nccl_ep+check", "nccl_ep+device"}
    for case in fault_cases.CASES:
        assert set(case.behaviour) == set(fault_cases.VARIANTS), f"{case.name}: declares {sorted(case.behaviour)}"
        for variant in fault_cases.VARIANTS:
            expect = case.expected(variant)
            assert isinstance(expect, Expect), f"{case.name}: nothing declared for {variant}"
            if expect != case.contract:
                assert expect.shortfall, f"{case.name}: {variant} differs from the contract without saying how"
        assert not case.contract.shortfall
    nccl = dict(backend="nccl_ep", device="cuda")
    assert RunConfig(**nccl).variant == "nccl_ep"
    assert RunConfig(**nccl, checks="synchronous").variant == "nccl_ep+check"
    assert RunConfig(**nccl, checks="device").variant == "nccl_ep+device"
    assert RunConfig(backend="reference", device="cuda").variant not in fault_cases.VARIANTS


def test_docs_table_lists_every_case():
    with open(_dist.REPO / "docs" / "ops.md") as f:
        text = f.read()
    assert "## Faults and bad input" in text
    section = text.split("## Faults and bad input", 1)[1].split("\n## ", 1)[0]
    missing = [c.name for c in fault_cases.CASES if f"`{c.name}`" not in section]
    assert not missing, f"docs/ops.md, 'Faults and bad input', lacks rows for {missing}"


# ---------------------------------------------------------------------------
# the judge reports every kind of deviation (pure Python, no processes)
# ---------------------------------------------------------------------------
def _result(*ranks: RankRecord, hang: bool = False) -> CaseResult:
    return CaseResult(case="synthetic", config=CONFIG, faulty=1, ranks=list(ranks), hang=hang)


def _raised(rank: int, message: str, seconds: float = 0.01, exc=("RuntimeError", "Exception")) -> RankRecord:
    return RankRecord(rank=rank, status="raised", exc_type=exc[0], exc_mro=list(exc), message=message,
                      seconds=seconds, exit_code=0, handle_id=1)


_GOOD = ("te_ep.dispatch failed on another rank: rank 1: x", "te_ep.dispatch: tokens bad (handle 1)")
_EXPECT = Expect(raising="all", faulty_says=("te_ep.dispatch", "tokens"),
                 others_say=("te_ep.dispatch", "rank {faulty}"), names_handle=True)


def _problems(*ranks, hang=False, expect=_EXPECT):
    return evaluate(_result(*ranks, hang=hang), expect, {})


def test_judge_accepts_the_declared_behaviour():
    assert _problems(_raised(0, _GOOD[0] + " handle 1"), _raised(1, _GOOD[1])) == []


@pytest.mark.parametrize(
    "ranks,hang,needle",
    [
        ((RankRecord(rank=0, status="completed", output="correct", seconds=0.1), _raised(1, _GOOD[1])), False,
         "rank 0: expected to raise, got completed"),
        ((_raised(0, "te_ep.dispatch failed, handle 1"), _raised(1, _GOOD[1])), False, "lacks ['rank 1']"),
        ((_raised(0, _GOOD[0] + " handle 1", seconds=9.0), _raised(1, _GOOD[1])), False, "failed after 9.0 s"),
        ((_raised(0, _GOOD[0]), _raised(1, _GOOD[1])), False, "does not name the handle"),
        ((_raised(0, _GOOD[0] + " handle 1", exc=("ValueError",)), _raised(1, _GOOD[1])), False, "raised ValueError"),
        ((RankRecord(rank=0, status="hang"), _raised(1, _GOOD[1])), True, "hang: ranks [0]"),
        ((RankRecord(rank=0, status="died", exit_code=-6), _raised(1, _GOOD[1])), False, "got died(-6)"),
        ((RankRecord(rank=0, status="error", message="boom", traceback="tb"), _raised(1, _GOOD[1])), False,
         "harness error"),
    ],
)
def test_judge_reports(ranks, hang, needle):
    problems = _problems(*ranks, hang=hang)
    assert any(needle in p for p in problems), problems


def test_judge_completion_exit_and_recovery():
    done = lambda r, out: RankRecord(rank=r, status="completed", output=out, seconds=0.1)  # noqa: E731
    clean = Expect(raising="none")
    assert _problems(done(0, "correct"), done(1, "correct"), expect=clean) == []
    assert any("output 'wrong: x'" in p for p in _problems(done(0, "correct"), done(1, "wrong: x"), expect=clean))
    assert any("expected a wrong output" in p
               for p in _problems(done(0, "correct"), done(1, "correct"), expect=clean.but(wrong="faulty")))
    exits = Expect(raising="none", exiting="faulty")
    gone = RankRecord(rank=1, status="exited", exit_code=INJECTED_EXIT_CODE)
    assert _problems(done(0, "correct"), gone, expect=exits) == []
    assert any("expected to exit" in p for p in _problems(done(0, "correct"), done(1, "correct"), expect=exits))
    rec = done(0, "correct")
    rec.recovery = [["exact step", "failed: AssertionError: differs"]]
    problems = _problems(rec, done(1, "correct"), expect=clean.but(recovers=True))
    assert any("exact step: failed" in p for p in problems) and any("rank 1: no step ran" in p for p in problems)


def test_judge_watchdog_ends():
    """Ranks declared to be ended by te_ep's watchdog (nccl_ep's default mode): exit code 70, the
    watchdog's message naming the op, within the time limit; anything else is reported."""
    watched = Expect(raising="faulty", watchdog="others", watchdog_op="dispatch",
                     faulty_says=("te_ep.dispatch", "tokens"), names_handle=True)
    msg = ("te_ep watchdog: te_ep.dispatch on handle 1 of group '0' (rank 0 of 2) has not finished on GPU 0 "
           "5.0 s after it was entered on the host")
    ended = lambda **kw: RankRecord(**{**dict(rank=0, status="died", exit_code=WATCHDOG_EXIT_CODE,  # noqa: E731
                                               message=msg, seconds=5.1), **kw})
    faulty = _raised(1, _GOOD[1])
    assert _problems(ended(), faulty, expect=watched) == []
    for rec, needle in [
        (ended(exit_code=-9), "expected te_ep's watchdog to end it (exit code 70), got died(-9)"),
        (RankRecord(rank=0, status="hang"), "expected te_ep's watchdog to end it"),
        (ended(message=msg.replace("te_ep.dispatch", "te_ep.combine")), "lacks 'te_ep watchdog: te_ep.dispatch"),
        (ended(seconds=60.0), "ended after 60.0 s"),
    ]:
        problems = _problems(rec, faulty, expect=watched)
        assert any(needle in p for p in problems), (needle, problems)


def test_runner_reads_the_watchdog_message_of_a_rank_without_a_record(tmp_path):
    """A rank the watchdog ended leaves no record: its stderr's watchdog line becomes its message."""
    from faults import runner

    class Dead:
        exitcode = WATCHDOG_EXIT_CODE

    path = tmp_path / "rank0.json"
    (tmp_path / "rank0.stderr").write_text("NCCL EP: using timeout=5000ms\nte_ep watchdog: te_ep.dispatch on "
                                          "handle 3 of group '0' (rank 0 of 2) has not finished\n")
    rec, = runner._finish_records([str(path)], [Dead()], t_stop=10.0, seen_dead={0: 9.0})
    assert rec.status == "died" and rec.exit_code == WATCHDOG_EXIT_CODE and rec.t_end == 9.0
    assert rec.message.startswith("te_ep watchdog: te_ep.dispatch on handle 3")
    assert "NCCL EP: using timeout" in rec.traceback


def test_judge_flags_a_fixed_shortfall_as_stale():
    """A case declared short of the contract whose measurement meets the contract is STALE."""
    case = fault_cases.CASES_BY_NAME["rank_exits_mid_step"]
    gone = RankRecord(rank=1, status="exited", exit_code=INJECTED_EXIT_CODE)
    says = ("te_ep.dispatch on handle 1 of group '0': a collective with the other ranks failed "
            "(Connection closed by peer): rank 1 exited")
    result = _result(_raised(0, says), gone)
    assert judge(case, result)[0] == "STALE"
    result.ranks[0].message = says.replace(": rank 1 exited", "")
    assert judge(case, result)[0] == "shortfall"
    result.ranks[0].message = "Connection closed by peer"
    assert judge(case, result)[0] == "UNEXPECTED"


def test_judge_fails_a_hang_or_a_wrong_output_where_nothing_is_declared():
    """A variant without declarations (the reference backend on CUDA) is only "measured", but a
    hang or a wrong output fails it all the same."""
    case = fault_cases.CASES_BY_NAME["tokens_dtype_one_rank"]
    config = RunConfig(backend="reference", device="cuda", pg_timeout_s=20.0)
    assert case.expected(config.variant) is None
    done = lambda r, out="correct": RankRecord(rank=r, status="completed", output=out, seconds=0.1,  # noqa: E731
                                               done=True)
    quiet = CaseResult(case=case.name, config=config, faulty=1, ranks=[done(0), _raised(1, _GOOD[1])])
    assert judge(case, quiet)[0] == "measured"  # rank 0 did not raise: a difference, reported, not a failure
    for ranks, hang, needle in [
        ([RankRecord(rank=0, status="hang", failed_in="step"), _raised(1, _GOOD[1])], True, "hang: ranks [0]"),
        ([done(0), _raised(1, _GOOD[1])], False, None),
        ([done(0, "wrong: rank 0: combine output differs"), _raised(1, _GOOD[1])], False, "with output 'wrong"),
        ([done(0, "zeros"), _raised(1, _GOOD[1])], False, "with output 'zeros'"),
        ([done(0, "guarded"), _raised(1, _GOOD[1])], False, "with output 'guarded'"),
    ]:
        verdict, problems = judge(case, CaseResult(case=case.name, config=config, faulty=1, ranks=ranks, hang=hang))
        if needle is None:
            assert verdict == "measured", problems
        else:
            assert verdict == "UNEXPECTED" and any(needle in p for p in problems), (needle, verdict, problems)
    # a hang after the faulted call counts as well
    late_hang = done(0)
    late_hang.done, late_hang.after = False, "hang in after: exact step"
    verdict, problems = judge(case, CaseResult(case=case.name, config=config, faulty=1,
                                               ranks=[late_hang, _raised(1, _GOOD[1])], hang=True))
    assert verdict == "UNEXPECTED" and any("rank 0: after: exact step" in p for p in problems), problems


def test_guarded_routing_follows_the_one_rule_of_every_check_mode():
    """An id outside [-1, E), or an expert named earlier in the row, becomes -1 (choice_error_bits)."""
    idx = torch.tensor([[8, 1], [2, 2], [-3, -1], [1, 8], [-1, -1], [3, 3]])
    assert fault_cases._guarded(idx, 8).tolist() == [[-1, 1], [2, -1], [-1, -1], [1, -1], [-1, -1], [3, -1]]


# ---------------------------------------------------------------------------
# the nccl_ep declarations against what docs/ops.md ("Check modes", the faults table) and
# csrc/nccl_ep/nccl_ep_checks.cpp say each mode does (W = 2, E = 8, handle 1 of group '0',
# process-group timeout 20 s): accepted as declared, and a hang or a wrong output is not
# ---------------------------------------------------------------------------
NCCL_PG_S = 20.0
_MODES = {"nccl_ep": {}, "nccl_ep+check": dict(checks="synchronous"), "nccl_ep+device": dict(checks="device")}
_HANDLE = "\n(handle 1 of group '0')"
_LOCAL_TAIL = (". checks='device' makes a failed step move nothing on every rank and raises it on every rank; "
               "checks='synchronous' raises in the step itself" + _HANDLE)
_GUARD = ("te_ep.prepare: an earlier step of this handle on rank 1 had topk_idx[3, 0] = 8 (an expert id outside "
          "[-1, 8)). te_ep dropped every such choice before NCCL EP saw it, so that step's outputs lack them"
          + _LOCAL_TAIL)
_AGREED = ("te_ep.prepare: an earlier step of this handle failed on the device checks of every rank "
           "(checks='device'); that step sent nothing or returned zeros (from the failing op on), and no rank "
           "used its outputs as valid:"
           "\n  rank {rank}: {what}" + _HANDLE)
_OVERFLOW_18 = ("te_ep.prepare: an earlier step of this handle on rank 0 had capacity overflow: the routing needs 18 "
                "receive rows but the handle's capacity is 13 (create the handle with a larger capacity, at most "
                "EpGroup.worst_case_capacity). NCCL EP dropped the rows that did not fit" + _LOCAL_TAIL)
_TORCH_ABORT = ("[rank{r}]:[E ProcessGroupNCCL.cpp:2197] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Process group "
                "watchdog thread terminated with exception: [Rank {r}] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=9, OpType=ALLGATHER, NumelIn=1024, NumelOut=2048, Timeout(ms)=20000) ran for 20003 "
                "milliseconds before timing out.")


def _te_ep_watchdog(rank: int, op: str) -> str:
    return (f"te_ep watchdog: te_ep.{op} on handle 1 of group '0' (rank {rank} of 2) has not finished on GPU {rank} "
            f"{NCCL_PG_S:.1f} s after it was entered on the host")


def _te_ep_watchdog_host(rank: int, op: str) -> str:
    return (f"te_ep watchdog: te_ep.{op} on handle 1 of group '0' (rank {rank} of 2) has not returned on the host "
            f"{NCCL_PG_S:.1f} s after it was entered")


def _r(rank, status, message="", *, failed_in="", output="", seconds=0.05, exit_code=0, recovery=()):
    exc = ["RuntimeError", "Exception"] if status == "raised" else []
    return RankRecord(rank=rank, status=status, message=message, failed_in=failed_in, output=output,
                      seconds=seconds, exit_code=exit_code, handle_id=1, recovery=[list(x) for x in recovery],
                      exc_type=exc[0] if exc else "", exc_mro=exc, done=status in ("raised", "completed"))


_OK = [("exact step, same handle", "ok")]
_OK_BAD_STEP = [("exact step, same handle", "ok"), ("exact step, new handle", "ok"), ("group shutdown", "ok")]
_OK_BAD_STEP_DEVICE = _OK_BAD_STEP[:1] + [("tokens of the wrong dtype on rank 1: every rank raises at check()", "ok"),
                                          ("exact step, same handle, again", "ok")] + _OK_BAD_STEP[1:]

# (case, variant, every rank's record as the docs and the code describe it)
DOCUMENTED = [
    ("expert_id_out_of_range", "nccl_ep", [
        _r(0, "died", _te_ep_watchdog(0, "prepare"), failed_in="next prepare", output="guarded", seconds=20.2,
           exit_code=WATCHDOG_EXIT_CODE),
        _r(1, "raised", _GUARD, failed_in="next prepare", output="guarded")]),
    ("expert_id_out_of_range", "nccl_ep+check", [
        _r(0, "raised", "te_ep.prepare failed on another rank of group '0':\n  rank 1: te_ep.prepare: "
                        "topk_idx[3, 0] = 8 (an expert id outside [-1, 8))" + _HANDLE, failed_in="step", recovery=_OK),
        _r(1, "raised", "te_ep.prepare: topk_idx[3, 0] = 8 (an expert id outside [-1, 8))" + _HANDLE,
           failed_in="step", recovery=_OK)]),
    ("expert_id_out_of_range", "nccl_ep+device", [
        _r(r, "raised", _AGREED.format(rank=1, what="topk_idx[3, 0] = 8 (an expert id outside [-1, 8))"),
           failed_in="next prepare", output="zeros", recovery=_OK) for r in (0, 1)]),
    ("repeated_expert", "nccl_ep+device", [
        _r(r, "raised", _AGREED.format(rank=1, what="topk_idx[2, 1] = {rep} (an expert named twice in a token's row)"),
           failed_in="next prepare", output="zeros", recovery=_OK) for r in (0, 1)]),
    ("capacity_overflow_one_rank", "nccl_ep", [
        _r(0, "raised", _OVERFLOW_18, failed_in="next prepare",
           output="wrong: this rank needs 18 receive rows but the capacity is 13: no output of this step can be right"),
        _r(1, "died", _te_ep_watchdog(1, "prepare"), failed_in="next prepare", output="wrong: rank 1: combine output "
           "differs in 2 rows", seconds=20.3, exit_code=WATCHDOG_EXIT_CODE)]),
    ("capacity_overflow_one_rank", "nccl_ep+device", [
        _r(r, "raised", _AGREED.format(rank=0, what="capacity overflow: the routing needs 18 receive rows but the "
                                                    "handle's capacity is 13 (create the handle with a larger "
                                                    "capacity, at most EpGroup.worst_case_capacity)"),
           failed_in="next prepare", output="zeros", recovery=_OK) for r in (0, 1)]),
    ("topk_idx_dtype_one_rank", "nccl_ep", [
        _r(0, "died", _te_ep_watchdog(0, "prepare_dispatch"), failed_in="step", seconds=20.1, exit_code=WATCHDOG_EXIT_CODE),
        _r(1, "raised", "te_ep.prepare: topk_idx must be torch.int64 or torch.int32, got torch.float32" + _HANDLE,
           failed_in="step")]),
    ("topk_idx_dtype_one_rank", "nccl_ep+device", [
        _r(0, "raised", _AGREED.format(rank=1, what="bad arguments to te_ep.prepare (that rank's error names them)"),
           failed_in="next prepare", output="zeros", recovery=_OK),
        _r(1, "raised", _AGREED.format(rank=1, what="bad arguments to te_ep.prepare: topk_idx must be torch.int64 or "
                                                    "torch.int32, got torch.float32"),
           failed_in="next prepare", output="zeros", recovery=_OK)]),
    ("tokens_dtype_one_rank", "nccl_ep", [
        _r(0, "died", _te_ep_watchdog(0, "prepare_dispatch"), failed_in="step", seconds=20.1, exit_code=WATCHDOG_EXIT_CODE),
        _r(1, "raised", "te_ep.dispatch: tokens must be torch.bfloat16 (the handle's dtype), got torch.float16"
           + _HANDLE, failed_in="step")]),
    ("tokens_dtype_one_rank", "nccl_ep+device", [
        _r(0, "raised", _AGREED.format(rank=1, what="bad arguments to te_ep.dispatch (that rank's error names them)"),
           failed_in="check()", output="zeros", recovery=_OK),
        _r(1, "raised", _AGREED.format(rank=1, what="bad arguments to te_ep.dispatch: tokens must be torch.bfloat16 "
                                                    "(the handle's dtype), got torch.float16"),
           failed_in="check()", output="zeros", recovery=_OK)]),
    ("tokens_hidden_one_rank", "nccl_ep+device", [
        _r(0, "raised", _AGREED.format(rank=0, what="bad arguments to te_ep.dispatch: tokens.size(1) must be {H} "
                                                    "(the handle's hidden), got {H1}"),
           failed_in="check()", output="zeros", recovery=_OK),
        _r(1, "raised", _AGREED.format(rank=0, what="bad arguments to te_ep.dispatch (that rank's error names them)"),
           failed_in="check()", output="zeros", recovery=_OK)]),
    ("rank_exits_mid_step", "nccl_ep+check", [
        _r(0, "exited", exit_code=INJECTED_EXIT_CODE, seconds=0.0),
        _r(1, "died", _te_ep_watchdog_host(1, "dispatch"), failed_in="step", seconds=20.0,
           exit_code=WATCHDOG_EXIT_CODE)]),
    ("rank_exits_mid_step", "nccl_ep+device", [
        _r(0, "exited", exit_code=INJECTED_EXIT_CODE, seconds=0.0),
        _r(1, "died", _te_ep_watchdog(1, "dispatch"), failed_in="step", seconds=20.1, exit_code=WATCHDOG_EXIT_CODE)]),
    # the faulty rank's GPU had not done its part of prepare's routing exchange when it exited
    ("rank_exits_mid_step", "nccl_ep", [
        _r(0, "exited", exit_code=INJECTED_EXIT_CODE, seconds=0.0),
        _r(1, "died", _te_ep_watchdog(1, "prepare"), failed_in="step", seconds=19.9, exit_code=WATCHDOG_EXIT_CODE)]),
    ("rank_sleeps_past_timeout", "nccl_ep+check", [
        _r(0, "died", _te_ep_watchdog_host(0, "dispatch"), failed_in="step", seconds=20.0,
           exit_code=WATCHDOG_EXIT_CODE),
        _r(1, "died", _te_ep_watchdog_host(1, "dispatch"), failed_in="step", seconds=41.5,
           exit_code=WATCHDOG_EXIT_CODE)]),
    ("bad_step_then_recovery", "nccl_ep", [
        _r(0, "completed", output="correct", recovery=_OK_BAD_STEP),
        _r(1, "raised", _GUARD, failed_in="check()", output="guarded", recovery=_OK_BAD_STEP)]),
    ("bad_step_then_recovery", "nccl_ep+device", [
        _r(r, "raised", _AGREED.format(rank=1, what="topk_idx[3, 0] = 8 (an expert id outside [-1, 8))"),
           failed_in="check()", output="zeros", recovery=_OK_BAD_STEP_DEVICE) for r in (0, 1)]),
]


def _documented(name: str, variant: str, ranks) -> CaseResult:
    case = fault_cases.CASES_BY_NAME[name]
    config = RunConfig(backend="nccl_ep", device="cuda", pg_timeout_s=NCCL_PG_S, **_MODES[variant])
    assert config.variant == variant
    ranks = [dataclasses.replace(rec, message=rec.message.format(**case.fmt(2))) for rec in ranks]
    return CaseResult(case=name, config=config, faulty=case.faulty(2), ranks=ranks)


@pytest.mark.parametrize("name,variant,ranks", [pytest.param(*d, id=f"{d[0]}-{d[1]}") for d in DOCUMENTED])
def test_nccl_ep_declarations_accept_the_documented_behaviour(name, variant, ranks):
    case = fault_cases.CASES_BY_NAME[name]
    result = _documented(name, variant, ranks)
    verdict, problems = judge(case, result)
    assert verdict == "shortfall", (verdict, problems, describe(result))


@pytest.mark.parametrize("name,variant,ranks", [pytest.param(*d, id=f"{d[0]}-{d[1]}") for d in DOCUMENTED])
def test_nccl_ep_declarations_reject_a_hang_or_a_wrong_output(name, variant, ranks):
    case = fault_cases.CASES_BY_NAME[name]
    declared = case.expected(variant)
    # a rank still running at the wall-clock limit: in its step, or after it
    for r in range(2):
        result = _documented(name, variant, ranks)
        rec = result.ranks[r]
        if rec.status == "exited":
            continue
        result.ranks[r] = dataclasses.replace(rec, status="hang", exit_code=-9, message="", failed_in=rec.failed_in)
        result.hang = True
        verdict, problems = judge(case, result)
        assert verdict == "UNEXPECTED" and any(p.startswith(f"hang: ranks [{r}]") for p in problems), problems
    # an output that is not the declared one (zeros where exact ones are declared, and the other way round)
    for r in range(2):
        result = _documented(name, variant, ranks)
        rec = result.ranks[r]
        if not rec.output or r in _rank_set(declared.maybe_wrong, result) or r in _rank_set(declared.wrong, result):
            continue
        result.ranks[r] = dataclasses.replace(rec, output="correct" if rec.output == "zeros" else "zeros")
        verdict, problems = judge(case, result)
        assert verdict == "UNEXPECTED" and any(f"rank {r}" in p and "with output" in p for p in problems), problems
        result.ranks[r] = dataclasses.replace(rec, output="wrong: rank 0: recv_tokens differs in 1 rows")
        verdict, problems = judge(case, result)
        assert verdict == "UNEXPECTED" and any(f"rank {r}" in p and "with output 'wrong" in p for p in problems), \
            problems


def _rank_set(spec: str, result: CaseResult) -> set:
    from faults.expect import rank_set

    return rank_set(spec, result.world_size, result.faulty)


def test_nccl_ep_local_mode_late_raise_is_judged():
    """Check mode `local` raises a step late on the faulty rank: a raise in the step itself, a
    silent step (nothing raised at the next prepare), or the others left running are not what
    is declared."""
    name, variant, ranks = DOCUMENTED[0]
    case = fault_cases.CASES_BY_NAME[name]
    for change, needle in [
        (dict(failed_in="step"), "raised in step, expected in next prepare"),
        (dict(status="completed", message="", exc_type="", exc_mro=[]), "expected to raise in next prepare"),
        (dict(message="te_ep.prepare: something else" + _HANDLE), "message lacks"),
    ]:
        result = _documented(name, variant, ranks)
        result.ranks[1] = dataclasses.replace(result.ranks[1], **change)
        verdict, problems = judge(case, result)
        assert verdict == "UNEXPECTED" and any(needle in p for p in problems), (needle, problems)
    result = _documented(name, variant, ranks)
    result.ranks[0] = _r(0, "completed", output="guarded")
    verdict, problems = judge(case, result)
    assert verdict == "UNEXPECTED" and any("expected te_ep's watchdog to end it" in p for p in problems), problems


def test_runner_reads_torch_nccl_watchdog_message_of_a_rank_without_a_record(tmp_path):
    """A rank torch's NCCL watchdog aborted leaves no record: its stderr's line becomes its message."""
    from faults import runner

    class Aborted:
        exitcode = TORCH_ABORT_EXIT_CODE

    path = tmp_path / "rank1.json"
    (tmp_path / "rank1.stderr").write_text(_TORCH_ABORT.format(r=1) + "\nException raised from checkTimeout at "
                                           "ProcessGroupNCCL.cpp:760 (most recent call first):\nframe #0: ...\n")
    rec, = runner._finish_records([str(path)], [Aborted()], t_stop=30.0, seen_dead={0: 21.0})
    assert rec.status == "died" and rec.exit_code == TORCH_ABORT_EXIT_CODE
    assert "Process group watchdog thread terminated with exception" in rec.message, rec.message
    assert rec.ended_by == "torch PG timeout (abort)", rec.ended_by


def test_runner_records_which_limit_ended_each_rank(tmp_path):
    """Issue 35: each rank's record says which limit ended it (te_ep's watchdog on the host or on
    the GPU, torch's process-group timeout, NCCL EP's own), and the summary line says it per rank
    with the seconds from the fault."""
    from faults import runner

    class Ended:
        def __init__(self, code):
            self.exitcode = code

    paths = []
    for r, stderr in enumerate([_te_ep_watchdog_host(0, "dispatch") + " ...",
                                _te_ep_watchdog(1, "dispatch") + " ...", ""]):
        path = tmp_path / f"rank{r}.json"
        (tmp_path / f"rank{r}.stderr").write_text(stderr + "\n")
        paths.append(str(path))
    runner._write_json(paths[2], dataclasses.asdict(RankRecord(
        rank=2, status="raised", done=True, t_fault=100.0, t_end=105.0, limit_ms=5000,
        message="te_ep.dispatch on handle 1 of group '0': a collective with the other ranks failed ([...] Timed out "
                "waiting 5000ms for recv operation to complete): a rank exited or did not reach this op within the "
                "process group's timeout. ...")))
    recs = runner._finish_records(paths, [Ended(WATCHDOG_EXIT_CODE), Ended(WATCHDOG_EXIT_CODE), Ended(0)],
                                  t_stop=130.0, seen_dead={0: 120.0, 1: 120.5})
    assert [rec.ended_by for rec in recs] == ["te_ep watchdog (host)", "te_ep watchdog (GPU)",
                                              "torch PG timeout (raised)"], recs
    result = CaseResult(case="rank_exits_mid_step", config=RunConfig(world_size=3), faulty=0, ranks=recs)
    line = runner.summary_line(result)
    assert line.startswith("rank_exits_mid_step W=3 backend=reference mode=zero_copy checks=local pg_timeout=5s "
                           "group_timeout_ms=5000 | "), line
    assert "r0: te_ep watchdog (host) after" in line and "r2: torch PG timeout (raised) after 5.00 s" in line, line
    assert runner.summary_line(result, "shortfall", 12.34) == line + " | verdict shortfall | case 12.3 s"


def test_runner_does_not_read_nccl_ep_start_up_line_as_its_timeout(tmp_path):
    """NCCL EP prints "NCCL EP: using timeout=...ms" on rank 0 at every group creation: a rank that
    raised its own argument error is "raised", not ended by NCCL EP's timeout (seen on 2 x H200,
    2026-11-26, where every such rank 0 read "NCCL EP timeout"); NCCL EP's own timeout lines are."""
    from faults import runner

    class Ended:
        exitcode = 0

    start_up = "NCCL EP: using timeout=10000ms (env=unset, config.timeout_ns=10000000000, source=config.timeout_ns)"
    own_timeout = "NCCL EP timeout check failed: rank = 0, thread = 3, value = 0)"
    ended = []
    for name, stderr in (("start_up", start_up), ("own_timeout", start_up + "\n" + own_timeout)):
        path = tmp_path / f"{name}.json"
        (tmp_path / f"{name}.stderr").write_text(stderr + "\n")
        runner._write_json(str(path), dataclasses.asdict(RankRecord(
            rank=0, status="raised", done=True, t_fault=100.0, t_end=100.05, limit_ms=10000,
            message="te_ep.dispatch: tokens.size(1) must be 16 (the handle's hidden), got 17")))
        rec, = runner._finish_records([str(path)], [Ended()], t_stop=101.0, seen_dead={})
        ended.append(rec.ended_by)
    assert ended == ["raised", "NCCL EP timeout"], ended


def test_one_rank_meeting_the_contract_is_not_stale_where_the_shortfall_concerns_the_others():
    """At W=1 the faulty rank is the only rank: the local check mode's shortfall (the other ranks
    are ended by the watchdog instead of raising) can't be seen, so its faulty rank meeting the
    contract is judged as declared, not STALE; the same record at W=2 with a contract-worded
    other rank is STALE."""
    case = fault_cases.CASES_BY_NAME["tokens_dtype_one_rank"]
    says = "te_ep.dispatch: tokens must be torch.bfloat16 (the handle's dtype), got torch.float16" + _HANDLE
    one = CaseResult(case=case.name, config=RunConfig(backend="nccl_ep", device="cuda", world_size=1,
                                                      pg_timeout_s=NCCL_PG_S),
                     faulty=case.faulty(1), ranks=[_r(0, "raised", says, failed_in="step", recovery=_OK)])
    verdict, problems = judge(case, one)
    assert verdict == "shortfall" and "W >= 2" in problems[0], (verdict, problems)
    two = _documented(case.name, "nccl_ep", [
        _r(0, "raised", "te_ep.dispatch failed on another rank: rank 1: " + says, failed_in="step", recovery=_OK),
        _r(1, "raised", says, failed_in="step", recovery=_OK)])
    assert judge(case, two)[0] == "STALE"
    # at W=1 a record that breaks the declaration is still UNEXPECTED
    one.ranks[0].output, one.ranks[0].status = "wrong: rank 0: combine output differs", "completed"
    assert judge(case, one)[0] == "UNEXPECTED"
