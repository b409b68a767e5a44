"""The fault-injection suite (tests/faults) on CPU: gloo process groups, the reference
backend, every case in its own fresh processes with a short process-group timeout.

Each case must behave as declared for the reference backend (tests/faults/cases.py): where
that is the contract, the contract; where it falls short, the measured behaviour written
down there and in docs/ops.md ("Faults and bad input"), and it must still fall short (a
fixed shortfall fails as STALE until its declaration and the docs are updated). The
controls show that the runner sees a clean step as clean, a wrong output as wrong and a hang
as a hang; the judge's own tests show that each kind of deviation is reported.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from faults import cases as fault_cases
from faults.expect import Expect, evaluate, judge
from faults.runner import (INJECTED_EXIT_CODE, WATCHDOG_EXIT_CODE, CaseResult, RankRecord, RunConfig, describe,
                           run_case)

PG_TIMEOUT_S = 5.0
CONFIG = RunConfig(backend="reference", device="cpu", pg_timeout_s=PG_TIMEOUT_S)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(case, world_size: int) -> CaseResult:
    result = run_case(case, dataclasses.replace(CONFIG, world_size=world_size))
    print(describe(result))  # shown by pytest on failure
    return result


@pytest.mark.parametrize(
    "case,world_size",
    [pytest.param(c, W, id=f"{c.name}-W{W}") for c in fault_cases.CASES for W in c.world_sizes],
)
def test_fault_case(case, world_size):
    result = _run(case, world_size)
    verdict, problems = judge(case, result)
    assert verdict in ("contract", "shortfall"), f"{case.name} at W={world_size}: {verdict}\n" + "\n".join(problems)
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


def test_every_fault_case_declares_its_behaviour():
    """Declared for the reference backend (measured here); for nccl_ep either declared or
    described in words; every shortfall says what it is."""
    assert len({c.name for c in fault_cases.CASES + fault_cases.CONTROLS}) == len(fault_cases.CASES_BY_NAME)
    for case in fault_cases.CASES:
        assert case.expected("reference") is not None, case.name
        for variant in fault_cases.VARIANTS:
            expect = case.expected(variant)
            if expect is None:
                assert case.documented.get(variant), f"{case.name}: nothing declared or documented for {variant}"
            elif expect != case.contract:
                assert expect.shortfall, f"{case.name}: {variant} differs from the contract without saying how"
        assert not case.contract.shortfall


def test_docs_table_lists_every_case():
    with open(os.path.join(_ROOT, "docs", "ops.md")) as f:
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
           "5.0 s after it was launched")
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


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------
def test_command_line():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults", "--backend", "reference", "--world-size", "2",
         "-k", "handle_config_mismatch", "tokens_hidden"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"^handle_config_mismatch +reference +2 +r0 raised, r1 raised .* contract ", out, re.M), out
    assert re.search(r"^tokens_hidden_one_rank +reference +2 +r0 raised, r1 raised .* contract ", out, re.M), out
    assert "2 cases in" in out, out
