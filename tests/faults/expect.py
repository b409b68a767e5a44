"""What a fault case must do, and the check of a measured `CaseResult` against it."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple, Union

from .runner import INJECTED_EXIT_CODE, WATCHDOG_EXIT_CODE, CaseResult


def prompt(pg_timeout_s: float) -> float:
    """An error found without waiting for a timeout: well inside the process group's timeout."""
    return 0.5 * pg_timeout_s


def within_timeout(pg_timeout_s: float) -> float:
    """One process-group timeout, plus slack for a loaded machine."""
    return 1.5 * pg_timeout_s + 2.0


Substring = Union[str, Tuple[str, ...]]  # a tuple lists accepted alternatives


@dataclasses.dataclass(frozen=True)
class Expect:
    """Per-rank behaviour of a fault case. Rank sets are "all", "faulty", "others" (every rank
    but the faulty one) or "none"; a rank that must neither raise nor exit must complete the
    faulted step, with exact outputs unless it is in `wrong`."""

    raising: str = "all"
    exiting: str = "none"  # ranks that leave on purpose (exit code INJECTED_EXIT_CODE)
    exc: Tuple[str, ...] = ("RuntimeError",)  # accepted exception classes (by name, subclasses count)
    faulty_says: Tuple[Substring, ...] = ()  # in the faulty rank's message ({E}, {H}, {faulty}, ... filled in)
    others_say: Tuple[Substring, ...] = ()  # in the other raising ranks' messages
    names_handle: Optional[bool] = None  # raising ranks' messages name the handle's id; None: not checked
    max_s: Callable[[float], float] = prompt  # fault -> failure of each raising rank, given the PG timeout
    wrong: str = "none"  # completing ranks whose output is wrong (a silent error)
    recovers: bool = False  # every step after the fault passes on every rank
    hanging: str = "none"  # ranks still running at the wall-clock limit (only the hang control expects any)
    # ranks te_ep's watchdog ends (exit code WATCHDOG_EXIT_CODE, its message in their stderr
    # naming `watchdog_op`), each within watchdog_max_s of the fault
    watchdog: str = "none"
    watchdog_op: str = ""
    watchdog_max_s: Callable[[float], float] = within_timeout
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


def evaluate(result: CaseResult, expect: Expect, fmt: dict) -> List[str]:
    """Everything in which `result` differs from `expect` (empty: it behaves as declared)."""
    W, faulty, pg = result.world_size, result.faulty, result.config.pg_timeout_s
    if result.startup_error:
        return [f"start-up failed: {result.startup_error}"]
    problems = []
    hanging = rank_set(expect.hanging, W, faulty)
    stuck = {rec.rank for rec in result.ranks if rec.status == "hang"}
    if result.hang and stuck != hanging:
        problems.append(f"hang: ranks {sorted(stuck)} were still running at the wall-clock limit (killed)")
    elif hanging and not result.hang:
        problems.append(f"expected ranks {sorted(hanging)} to hang, the case finished")
    raising = rank_set(expect.raising, W, faulty)
    exiting = rank_set(expect.exiting, W, faulty)
    watched = rank_set(expect.watchdog, W, faulty)
    wrong = rank_set(expect.wrong, W, faulty)
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
        if r in watched:
            if rec.status != "died" or rec.exit_code != WATCHDOG_EXIT_CODE:
                problems.append(f"{where}: expected te_ep's watchdog to end it (exit code {WATCHDOG_EXIT_CODE}), "
                                f"got {rec.outcome()}")
                continue
            says = f"te_ep watchdog: te_ep.{expect.watchdog_op} on handle "
            if says not in rec.message:
                problems.append(f"{where}: the watchdog's message lacks {says!r}: {rec.message!r}")
            limit = expect.watchdog_max_s(pg)
            if rec.seconds is None or rec.seconds > limit:
                problems.append(f"{where}: ended after {rec.seconds} s, expected within {limit:.2f} s of the fault")
            continue
        if r in exiting:
            if rec.status != "exited" or rec.exit_code != INJECTED_EXIT_CODE:
                problems.append(f"{where}: expected to exit with code {INJECTED_EXIT_CODE}, got {rec.outcome()}")
            continue
        if r in raising:
            if rec.status != "raised":
                problems.append(f"{where}: expected to raise, got {rec.outcome()}"
                                + (f" after {rec.seconds:.2f} s" if rec.seconds is not None else ""))
                continue
            if not set(expect.exc) & set(rec.exc_mro):
                problems.append(f"{where}: raised {rec.exc_type}, expected one of {expect.exc}")
            says = expect.faulty_says if r == faulty else expect.others_say
            missing = [s if isinstance(s, str) else " | ".join(s) for s in says if not _has(rec.message, s, fmt)]
            if missing:
                problems.append(f"{where}: message lacks {[m.format(**fmt) for m in missing]}: {rec.message!r}")
            limit = expect.max_s(pg)
            if rec.seconds is None or rec.seconds > limit:
                problems.append(f"{where}: failed after {rec.seconds} s, expected within {limit:.2f} s of the fault")
            if expect.names_handle is not None and rec.names_handle != expect.names_handle:
                problems.append(f"{where}: message {'does not name' if expect.names_handle else 'names'} the "
                                f"handle (id {rec.handle_id}): {rec.first_line!r}")
        else:
            if rec.status != "completed":
                problems.append(f"{where}: expected to complete the step, got {rec.outcome()}: {rec.first_line!r}")
            elif r in wrong and not rec.output.startswith("wrong"):
                problems.append(f"{where}: expected a wrong output (a declared silent error), got {rec.output!r}")
            elif r not in wrong and expect.outputs and rec.output != "correct":
                problems.append(f"{where}: completed with output {rec.output or 'unchecked'!r}")
    if expect.recovers:
        for rec in result.ranks:
            if rec.rank in exiting or rec.rank in watched:
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
    * ``UNEXPECTED``: differs from what is declared (``problems`` says how);
    * ``STALE``: declared a shortfall but now meets the contract (update the declaration and
      the docs' table);
    * ``measured``: nothing declared for this backend variant (``problems`` holds the
      differences from the contract, for information).
    """
    fmt = case.fmt(result.world_size)
    against_contract = evaluate(result, case.contract, fmt)
    expected = case.expected(result.config.variant)
    if not against_contract:
        if expected is not None and expected != case.contract:
            return "STALE", [f"declared to fall short ({expected.shortfall}) but meets the contract"]
        return "contract", []
    if expected is None:
        return "measured", against_contract
    problems = evaluate(result, expected, fmt)
    if problems:
        return "UNEXPECTED", problems
    meets = expected == case.contract  # declared as the contract itself (equal fields)
    return ("contract" if meets else "shortfall"), ([] if meets else against_contract)
