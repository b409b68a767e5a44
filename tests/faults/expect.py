"""What a fault case must do, and the check of a measured `CaseResult` against it."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple, Union

from .runner import (INJECTED_EXIT_CODE, TORCH_ABORT_EXIT_CODE, TORCH_WATCHDOG_SAYS, WATCHDOG_EXIT_CODE,
                     CaseResult, RankRecord)


def prompt(pg_timeout_s: float) -> float:
    """An error found without waiting for a timeout: well inside the process group's timeout."""
    return 0.5 * pg_timeout_s


def within_timeout(pg_timeout_s: float) -> float:
    """One process-group timeout, plus slack for a loaded machine."""
    return 1.5 * pg_timeout_s + 2.0


Substring = Union[str, Tuple[str, ...]]  # a tuple lists accepted alternatives


# What a completed step's outputs may be, per `Expect.output` (the runner's verdicts; see
# runner.FaultCtx.check_output): "correct" is exact for the routing as given; "guarded" exact
# for the routing with every bad choice as -1 (nccl_ep's routing guard; a rank whose outputs the
# dropped choices do not touch is "correct" as well); "zeros" every output exactly 0 (a step
# that the device checks failed on every rank).
OUTPUT_KINDS = {"correct": ("correct",), "guarded": ("guarded", "correct"), "zeros": ("zeros",)}


@dataclasses.dataclass(frozen=True)
class Expect:
    """Per-rank behaviour of a fault case. Rank sets are "all", "faulty", "others" (every rank
    but the faulty one) or "none"; a rank that must neither raise nor exit nor be ended must
    complete the faulted call, with outputs as `output` says unless it is in `wrong` or
    `maybe_wrong`. Whatever is declared, a rank that hangs (outside `hanging`) or returns an
    output that is not declared fails the case (`undeclared_failures`)."""

    raising: str = "all"
    exiting: str = "none"  # ranks that leave on purpose (exit code INJECTED_EXIT_CODE)
    exc: Tuple[str, ...] = ("RuntimeError",)  # accepted exception classes (by name, subclasses count)
    faulty_says: Tuple[Substring, ...] = ()  # in the faulty rank's message ({E}, {H}, {faulty}, ... filled in)
    others_say: Tuple[Substring, ...] = ()  # in the other raising ranks' messages
    names_handle: Optional[bool] = None  # raising ranks' messages name the handle's id; None: not checked
    max_s: Callable[[float], float] = prompt  # fault -> failure of each raising rank, given the PG timeout
    # Where the raising (and watchdog- or abort-ended) ranks fail: "step" (the faulted step
    # itself) or the follow-up a body runs after it inside the faulted call ("next prepare",
    # "check()"); in the latter case they completed the step first, so their outputs are judged too.
    fails_in: str = "step"
    output: str = "correct"  # what completed steps' outputs must be: a key of OUTPUT_KINDS
    wrong: str = "none"  # ranks whose completed output is wrong (a declared silent error)
    # ranks whose completed output may be wrong or right: the declaration says why it can't be told
    maybe_wrong: str = "none"
    recovers: bool = False  # every step after the fault passes on every rank
    hanging: str = "none"  # ranks still running at the wall-clock limit (only the hang control expects any)
    # ranks te_ep's watchdog ends (exit code WATCHDOG_EXIT_CODE, its message in their stderr
    # naming `watchdog_op`, or one of them where it is a tuple), each within watchdog_max_s of the fault
    watchdog: str = "none"
    watchdog_op: Substring = ""
    watchdog_max_s: Callable[[float], float] = within_timeout
    # ranks torch's NCCL watchdog ends (SIGABRT, its message in their stderr), within watchdog_max_s
    aborted: str = "none"
    outputs: bool = True  # completing ranks had their outputs checked
    shortfall: str = ""  # how this falls short of the contract (empty for the contract itself)

    def but(self, **changes) -> "Expect":
        return dataclasses.replace(self, **changes)


def rank_set(spec: str, world_size: int, faulty: int) -> set:
    every = set(range(world_size))
    return {"all": every, "faulty": {faulty}, "others": every - {faulty}, "none": set()}[spec]


def _has(message: str, sub: Substring, fmt: dict) -> bool:
    options = (sub,) if isinstance(sub, str) else sub
    return any(o.format(**fmt) in message for o in options)


def _output_problem(rec: RankRecord, expect: Expect, wrong: set, maybe_wrong: set) -> Optional[str]:
    """What is wrong with a rank's recorded output (non-empty), or None."""
    if rec.rank in maybe_wrong:
        return None
    if rec.rank in wrong:
        return None if rec.output.startswith("wrong") else \
            f"expected a wrong output (a declared silent error), got {rec.output!r}"
    if rec.output in OUTPUT_KINDS[expect.output]:
        return None
    return f"completed the step with output {rec.output!r}, expected {expect.output!r}"


def _stuck(result: CaseResult) -> dict:
    return {rec.rank: (rec.failed_in if rec.status == "hang" else rec.after[len("hang in "):]) or "?"
            for rec in result.ranks if rec.hung}


def _undeclared_hang(result: CaseResult, hanging: set) -> Tuple[dict, Optional[str]]:
    """(the ranks that hung, with where; a problem line if any of them is not in `hanging`)."""
    stuck = _stuck(result)
    if not set(stuck) - hanging:
        return stuck, None
    return stuck, (f"hang: ranks {sorted(set(stuck) - hanging)} were still running at the wall-clock limit "
                   f"(killed), in " + ", ".join(f"rank {r}: {stage}" for r, stage in sorted(stuck.items())))


def undeclared_failures(result: CaseResult, expect: Expect) -> List[str]:
    """The hangs and the outputs of `result` that `expect` does not declare. These fail a case
    whatever is declared for its variant, and where nothing is (the judge's "measured")."""
    if result.startup_error:
        return []
    W, faulty = result.world_size, result.faulty
    problems = []
    hanging = rank_set(expect.hanging, W, faulty)
    _, hang = _undeclared_hang(result, hanging)
    if hang:
        problems.append(hang)
    wrong = rank_set(expect.wrong, W, faulty)
    maybe_wrong = rank_set(expect.maybe_wrong, W, faulty)
    for rec in result.ranks:
        bad = _output_problem(rec, expect, wrong, maybe_wrong) if rec.output else None
        if bad:
            problems.append(f"rank {rec.rank}{' (faulty)' if rec.rank == faulty else ''}: {bad}")
    return problems


def evaluate(result: CaseResult, expect: Expect, fmt: dict) -> List[str]:
    """Everything in which `result` differs from `expect` (empty: it behaves as declared)."""
    W, faulty, pg = result.world_size, result.faulty, result.config.pg_timeout_s
    if result.startup_error:
        return [f"start-up failed: {result.startup_error}"]
    problems = []
    hanging = rank_set(expect.hanging, W, faulty)
    stuck, hang = _undeclared_hang(result, hanging)
    if hang:
        problems.append(hang)
    elif hanging - set(stuck):
        problems.append(f"expected ranks {sorted(hanging)} to hang, the case finished")
    raising = rank_set(expect.raising, W, faulty)
    exiting = rank_set(expect.exiting, W, faulty)
    watched = rank_set(expect.watchdog, W, faulty)
    aborted = rank_set(expect.aborted, W, faulty)
    wrong = rank_set(expect.wrong, W, faulty)
    maybe_wrong = rank_set(expect.maybe_wrong, W, faulty)
    failing = raising | watched | aborted
    late = expect.fails_in != "step"  # the failing ranks completed the step first
    fmt = dict(fmt, faulty=faulty, W=W)
    for rec in result.ranks:
        r = rec.rank
        where = f"rank {r}{' (faulty)' if r == faulty else ''}"
        if rec.status == "error":
            problems.append(f"{where}: harness error: {rec.message.strip().splitlines()[-1] if rec.message else ''}"
                            f"\n{rec.traceback}")
            continue
        if r in hanging:
            continue
        if rec.after and not rec.hung:  # a hang is reported above
            problems.append(f"{where}: after its faulted call, {rec.after}")
        failed_in = rec.failed_in or "step"
        status_ok = False
        if r in watched or r in aborted:
            ops = (expect.watchdog_op,) if isinstance(expect.watchdog_op, str) else expect.watchdog_op
            code, says = ((WATCHDOG_EXIT_CODE, tuple(f"te_ep watchdog: te_ep.{op} on handle " for op in ops))
                          if r in watched else (TORCH_ABORT_EXIT_CODE, TORCH_WATCHDOG_SAYS))
            who = "te_ep's watchdog" if r in watched else "torch's NCCL watchdog"
            if rec.status != "died" or rec.exit_code != code:
                problems.append(f"{where}: expected {who} to end it (exit code {code}), got {rec.outcome()}")
                continue
            status_ok = True
            if not _has(rec.message, says, fmt):
                shown = says if isinstance(says, str) else " | ".join(says)
                problems.append(f"{where}: the watchdog's message lacks {shown!r}: {rec.message!r}")
            if failed_in != expect.fails_in:
                problems.append(f"{where}: ended in {failed_in}, expected in {expect.fails_in}")
            limit = expect.watchdog_max_s(pg)
            if rec.seconds is None or rec.seconds > limit:
                problems.append(f"{where}: ended after {rec.seconds} s, expected within {limit:.2f} s of the fault")
        elif r in exiting:
            if rec.status != "exited" or rec.exit_code != INJECTED_EXIT_CODE:
                problems.append(f"{where}: expected to exit with code {INJECTED_EXIT_CODE}, got {rec.outcome()}")
            continue
        elif r in raising:
            if rec.status != "raised":
                problems.append(f"{where}: expected to raise{' in ' + expect.fails_in if late else ''}, got "
                                f"{rec.outcome()}" + (f" after {rec.seconds:.2f} s" if rec.seconds is not None else ""))
            else:
                status_ok = True
                if failed_in != expect.fails_in:
                    problems.append(f"{where}: raised in {failed_in}, expected in {expect.fails_in}")
                if not set(expect.exc) & set(rec.exc_mro):
                    problems.append(f"{where}: raised {rec.exc_type}, expected one of {expect.exc}")
                says = expect.faulty_says if r == faulty else expect.others_say
                missing = [s if isinstance(s, str) else " | ".join(s) for s in says if not _has(rec.message, s, fmt)]
                if missing:
                    problems.append(f"{where}: message lacks {[m.format(**fmt) for m in missing]}: {rec.message!r}")
                limit = expect.max_s(pg)
                if rec.seconds is None or rec.seconds > limit:
                    problems.append(f"{where}: failed after {rec.seconds} s, expected within {limit:.2f} s of the "
                                    "fault")
                if expect.names_handle is not None and rec.names_handle != expect.names_handle:
                    problems.append(f"{where}: message {'does not name' if expect.names_handle else 'names'} the "
                                    f"handle (id {rec.handle_id}): {rec.first_line!r}")
        else:
            if rec.status != "completed":
                problems.append(f"{where}: expected to complete the step, got {rec.outcome()}: {rec.first_line!r}")
            else:
                status_ok = True
        # Outputs: any recorded one is judged; a rank that completed the step must have one
        # (unless the declaration says outputs were not checked).
        if rec.output:
            bad = _output_problem(rec, expect, wrong, maybe_wrong)
            if bad:
                problems.append(f"{where}: {bad}")
        elif status_ok and (r in wrong or (expect.outputs and (r not in failing or late))):
            problems.append(f"{where}: completed the step with output 'unchecked'")
    if expect.recovers:
        for rec in result.ranks:
            if rec.rank in exiting or rec.rank in watched or rec.rank in aborted:
                continue
            if not rec.recovery:
                problems.append(f"rank {rec.rank}: no step ran after the fault")
            for name, verdict in rec.recovery:
                if verdict != "ok":
                    problems.append(f"rank {rec.rank}: after the fault, {name}: {verdict}")
    return problems


def judge(case, result: CaseResult) -> Tuple[str, List[str]]:
    """(verdict, problems) of a measured case:

    * ``contract``: meets the contract, as declared;
    * ``shortfall``: behaves as declared, and that falls short of the contract;
    * ``UNEXPECTED``: differs from what is declared (``problems`` says how), or, where nothing
      is declared, hangs or returns an output that the contract does not declare;
    * ``STALE``: declared a shortfall but now meets the contract (update the declaration and
      the docs' table);
    * ``measured``: nothing declared for this backend variant, no hang and no wrong output
      (``problems`` holds the other differences from the contract, for information).
    """
    fmt = case.fmt(result.world_size)
    against_contract = evaluate(result, case.contract, fmt)
    expected = case.expected(result.config.variant)
    if not against_contract:
        if expected is not None and expected != case.contract:
            if result.world_size == 1 and not evaluate(result, expected, fmt):
                # At W=1 there are no other ranks: a shortfall that concerns only them (their
                # wording, their fate) can't be seen, so meeting the contract proves nothing stale.
                return "shortfall", ["at W=1 the faulty rank meets the contract; the declared shortfall concerns "
                                     "the other ranks, which need W >= 2"]
            return "STALE", [f"declared to fall short ({expected.shortfall}) but meets the contract"]
        return "contract", []
    if expected is None:
        silent = undeclared_failures(result, case.contract)
        if silent:
            return "UNEXPECTED", [f"nothing is declared for {result.config.variant}, but a hang or a wrong output "
                                  "fails any case:"] + silent
        return "measured", against_contract
    problems = evaluate(result, expected, fmt)
    if problems:
        return "UNEXPECTED", problems
    meets = expected == case.contract  # declared as the contract itself (equal fields)
    return ("contract" if meets else "shortfall"), ([] if meets else against_contract)
