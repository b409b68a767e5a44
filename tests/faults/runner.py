"""Runs one fault case in W fresh processes and records what every rank did.

Processes. Each case runs in the fresh-processes mode of the suite's launcher
(tests/_dist.py, ``launch_fresh``): W new processes (multiprocessing ``forkserver`` by
default: a server that imported torch and te_ep_torch once forks them, so a case starts in a
fraction of a second instead of paying ~5 s of imports per rank on a small machine; ``spawn``
starts bare interpreters). Nothing of a case survives into the next: new process group, new
te_ep handle registry, new NCCL/gloo connections. The ranks meet in a FileStore in the case's
own temporary directory, wait there until all of them are up (with the long start-up limit),
then create the process group with the case's short timeout, so start-up skew never counts
against it.

Limits. ``startup_limit_s`` from launch until every rank has its process group; then the
case's wall-clock limit (``Case.wall_s``): when it passes, every process of the case is
killed and the case is a hang, with the ranks that had not finished marked ``hang``. A
child also exits by itself after both limits and a margin, so no orphan outlives a runner
that died.

Records. A rank writes its record (JSON) when it has one: at the fault point (so a rank
that is killed still has its fault time), at each stage of the case (the faulted step, the
follow-up a body runs after it inside the faulted call, each recovery step), when it exits
on purpose, and when the case body returns (``done``). The runner waits for the *whole*
body of every rank, not only its faulted call: a rank that is still running at the
wall-clock limit is a hang wherever it is (in the faulted step, its follow-up, an output
check or a recovery step), and a rank that dies after its faulted call is recorded as such
(``after``). Then it lingers until the runner has heard from every rank, so a rank that
finished early never changes what the others see by closing its connections (a rank that
*dies* does, and that is what the exit case measures). Exit codes: 0 the body returned, 1 it
raised outside `FaultCtx.faulted` (a harness error), the injected code for a deliberate
exit, 70 te_ep's watchdog, negative for a signal (-9: killed by the runner; -6: an abort,
e.g. by torch's NCCL watchdog). A rank's stderr (the launcher's ``rank<r>.stderr``) gives
the last words of a rank that ended without a record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, List, Optional, Tuple

import _dist

DEFAULT_PG_TIMEOUT_S = 5.0  # on CPU; on CUDA tests/test_faults.py defaults to DEFAULT_PG_TIMEOUT_CUDA_S
DEFAULT_PG_TIMEOUT_CUDA_S = 20.0
DEFAULT_STARTUP_LIMIT_S = _dist.DEFAULT_STARTUP_LIMIT_S
# The exit code of a rank that leaves on purpose (the rank_exits_mid_step case).
INJECTED_EXIT_CODE = 3
WATCHDOG_EXIT_CODE = 70  # a rank te_ep's watchdog ended (csrc/watchdog/core/watchdog.h)
# A rank torch's NCCL watchdog ended: it rethrows the collective's timeout (or NCCL's error)
# from its own thread, so std::terminate aborts the process (SIGABRT), after this line in stderr.
TORCH_ABORT_EXIT_CODE = -6
TORCH_WATCHDOG_SAYS = "watchdog thread terminated with exception"


# ---------------------------------------------------------------------------
# configuration and records
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunConfig:
    backend: str = "reference"  # te_ep backend: "reference" or "nccl_ep"
    device: str = "cpu"  # "cpu" (gloo process group) or "cuda" (NCCL process group, one GPU per rank)
    world_size: int = 2
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    checks: str = "local"  # EpGroup's checks in the ranks
    nccl_ep_mode: Optional[str] = None  # EpGroup's nccl_ep_mode in the ranks (None: EpGroup's default)
    start_method: str = "forkserver"
    startup_limit_s: float = DEFAULT_STARTUP_LIMIT_S
    # Diagnostics (issue 35): seconds after a rank's body starts at which it dumps the Python
    # stack of every thread and the kernel's view of every thread (/proc: state, wait channel,
    # system call) to its stderr; and a directory where each case's rank stderr files are kept.
    dump_after_s: Tuple[float, ...] = ()
    keep_logs: str = ""

    @property
    def mode(self) -> str:
        """The nccl_ep mode the ranks' groups ask for (EpGroup's default where none is given)."""
        if self.nccl_ep_mode is not None:
            return self.nccl_ep_mode
        from te_ep_torch.group import DEFAULT_NCCL_EP_MODE
        return DEFAULT_NCCL_EP_MODE

    @property
    def variant(self) -> str:
        """Which declared behaviour applies (cases.VARIANTS): "reference" (on CPU), "nccl_ep"
        (checks='local'), "nccl_ep+check" (checks='synchronous'), "nccl_ep+device"
        (checks='device');
        "reference+cuda" has none (judged only for undeclared hangs and wrong outputs)."""
        if self.backend == "nccl_ep":
            return {"synchronous": "nccl_ep+check", "device": "nccl_ep+device"}.get(self.checks, "nccl_ep")
        return self.backend if self.device == "cpu" else f"{self.backend}+{self.device}"


@dataclasses.dataclass
class RankRecord:
    rank: int
    # "completed": the faulted call returned; "raised": it raised; "exited": the rank left on
    # purpose; "hang": killed at the wall limit; "died": the process ended without a record
    # (a signal, an abort); "error": the case body failed outside the faulted call (harness).
    status: str = "died"
    # Where the rank is: "set-up", "step" (the faulted step), a follow-up the body names inside
    # the faulted call ("next prepare", "check()"), "after: <recovery step>", "done".
    stage: str = "set-up"
    # The stage in which the faulted call raised, or the rank died or hung inside it.
    failed_in: str = ""
    done: bool = False  # the case body returned (or failed as a harness error): the record is final
    # A rank whose faulted call returned or raised but whose body did not finish:
    # "died(<exit code>) in <stage>" or "hang in <stage>".
    after: str = ""
    exc_type: str = ""
    exc_mro: List[str] = dataclasses.field(default_factory=list)
    message: str = ""
    t_fault: Optional[float] = None  # time.time() at this rank's fault point
    t_end: Optional[float] = None  # ... when the faulted call raised or returned (or the rank was killed)
    seconds: Optional[float] = None  # t_end - the case's fault time (the earliest t_fault of any rank)
    exit_code: Optional[int] = None
    # The completed faulted step's outputs: "correct" (exact for the routing as given), the name
    # of an alternative the body offered that they match exactly ("guarded": the step without
    # the bad choices; "zeros": every output exactly 0), "wrong: ..." (none of these), or ""
    # where no completed output was checked.
    output: str = ""
    recovery: List[List[str]] = dataclasses.field(default_factory=list)  # [step, "ok" | "failed: ..."]
    handle_id: Optional[int] = None
    traceback: str = ""
    limit_ms: Optional[int] = None  # the EpGroup's timeout on this rank (the watchdog's and NCCL EP's limit)
    # Which limit ended the rank's faulted call (ended_by; see `_ended_by`), after `seconds`.
    ended_by: str = ""

    @property
    def first_line(self) -> str:
        return self.message.strip().splitlines()[0] if self.message.strip() else ""

    @property
    def names_handle(self) -> Optional[bool]:
        """Whether the message names the handle (``handle 3`` / ``handle_id 3``); None without one."""
        if self.handle_id is None or not self.message:
            return None
        return re.search(rf"\bhandle(?:_id)? {self.handle_id}\b", self.message) is not None

    @property
    def hung(self) -> bool:
        """Still running at the wall-clock limit (in its faulted call or after it)."""
        return self.status == "hang" or self.after.startswith("hang")

    def outcome(self) -> str:
        late = f" in {self.failed_in}" if self.failed_in and self.failed_in != "step" else ""
        out = {"": "", "correct": ":ok"}.get(self.output, ":WRONG" if self.output.startswith("wrong") else
                                             f":{self.output}")
        if self.status == "completed":
            text = "completed" + out
        elif self.status == "exited":
            text = f"exited({self.exit_code})"
        elif self.status == "died":
            text = f"died({self.exit_code}){late}" + (f" (step{out})" if out else "")
        elif self.status == "raised":
            text = f"raised{late}" + (f" (step{out})" if out else "")
        else:
            text = self.status + late
        return text + (f", then {self.after}" if self.after else "")


@dataclasses.dataclass
class CaseResult:
    case: str
    config: RunConfig
    faulty: int
    ranks: List[RankRecord]
    hang: bool = False
    startup_error: str = ""
    wall_s: float = 0.0  # from "every rank has its process group" to the end

    @property
    def world_size(self) -> int:
        return self.config.world_size


# ---------------------------------------------------------------------------
# inside a rank
# ---------------------------------------------------------------------------
class FaultCtx:
    """What a case body gets on its rank. Duck-types tests/_dist.Ctx (rank, world_size,
    device, backend, group_options) so the ep_cases helpers (make_group, run_exact_step) take it."""

    def __init__(self, rank: int, config: RunConfig, faulty: int, record_path: str):
        self.rank = rank
        self.world_size = config.world_size
        self.backend = config.backend
        self.nccl_ep_mode = config.mode
        self.checks = config.checks
        self.config = config
        self.pg_timeout_s = config.pg_timeout_s
        self.faulty = faulty
        self.is_faulty = rank == faulty
        if config.device == "cuda":
            import torch

            self.device = f"cuda:{torch.cuda.current_device()}"
        else:
            self.device = "cpu"
        self.record = RankRecord(rank=rank, status="running")
        self._path = record_path
        self._faulted_done = False

    def group_options(self) -> dict:
        return {"nccl_ep_mode": self.nccl_ep_mode, "checks": self.checks}

    # -- the body calls these ---------------------------------------------------
    def fault_point(self) -> None:
        """Marks the moment of the fault on this rank (first call only); every rank calls it
        where the faulted step starts, the faulty rank right before it injects the fault."""
        if self.record.t_fault is None:
            self.record.t_fault = time.time()
            self.write()

    def stage(self, name: str) -> None:
        """Marks the part of the case the rank is in (e.g. the follow-up of the faulted step,
        "next prepare"), so a raise, a death or a hang is attributed to it."""
        self.record.stage = name
        self.write()

    def sync(self) -> None:
        """Waits for this rank's GPU work (a no-op on CPU): a step whose kernels wait for a lost
        peer hangs (or is ended) here, in the stage that launched it."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def faulted(self, call: Callable):
        """Runs the faulted call: the faulted step, and any follow-up the body runs after it
        (marked with `stage`). Returns ``(True, value)`` if it returned, ``(False, None)`` if it
        raised (the exception and the stage it was raised in are recorded; the body may go on
        with recovery steps)."""
        assert not self._faulted_done, "one faulted call per case"
        self._faulted_done = True
        self.fault_point()
        self.stage("step")
        try:
            value = call()
            # The call is done when the GPU is: a step whose kernels wait for a lost peer
            # hangs (or is ended) here, inside the faulted call.
            self.sync()
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the expectation
            self.record.t_end = time.time()
            self.record.status = "raised"
            self.record.failed_in = self.record.stage
            self._set_exception(exc)
            self.write()
            return False, None
        self.record.t_end = time.time()
        self.record.status = "completed"
        self.write()
        return True, value

    def check_output(self, check: Callable, *alternatives) -> None:
        """Compares a completed step's outputs with the local reference; records the verdict.

        `check` raises unless the outputs are exact for the routing as given ("correct");
        `alternatives` are ``(name, check)`` pairs tried in order when it fails (e.g. "guarded",
        "zeros"): the first that passes names the outputs; if none does, "wrong: <why check
        failed>". What each rank's outputs must be is the case's declaration (expect.Expect)."""
        try:
            check()
        except Exception as exc:  # noqa: BLE001
            verdict = f"wrong: {_first_line(exc)}"
            for name, alternative in alternatives:
                try:
                    alternative()
                except Exception:  # noqa: BLE001 - not this one either
                    continue
                verdict = name
                break
            self.record.output = verdict
        else:
            self.record.output = "correct"
        self.write()

    def recover(self, name: str, step: Callable) -> None:
        """A step after the fault (same or new handle); records "ok" or why not."""
        self.stage(f"after: {name}")
        try:
            step()
            self.sync()
        except Exception as exc:  # noqa: BLE001
            self.record.recovery.append([name, f"failed: {type(exc).__name__}: {_first_line(exc)}"])
        else:
            self.record.recovery.append([name, "ok"])
        self.write()

    def exit_now(self, code: int = INJECTED_EXIT_CODE) -> None:
        """The injected crash: leaves without cleanup, as a killed or crashed rank would."""
        self.fault_point()
        self.record.status = "exited"
        self.record.t_end = time.time()
        self.write()
        os._exit(code)

    # -- plumbing ---------------------------------------------------------------
    def _set_exception(self, exc: BaseException) -> None:
        self.record.exc_type = _qualname(type(exc))
        self.record.exc_mro = [c.__name__ for c in type(exc).__mro__]
        self.record.message = str(exc)
        self.record.traceback = "".join(traceback.format_exception(exc))

    def write(self) -> None:
        tmp = f"{self._path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self.record), f)
        os.replace(tmp, self._path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _qualname(t: type) -> str:
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _case_main(ctx, case_name: str, config: RunConfig) -> None:
    """One rank of a fault case, in a fresh process of tests/_dist.py whose process group has
    the case's timeout. Raises (exit code 1) where the body failed outside the faulted call."""
    # Nothing else bounds a wait inside NCCL EP on CUDA: its high-throughput kernels spin
    # without a limit, and te_ep's watchdog ends a rank whose op has not returned, or whose op's
    # GPU work has not finished, one process-group timeout after the host entered the op
    # (EpGroup's default timeout; docs/nccl_ep.md, "Timeouts").
    record_path = os.path.join(ctx.tmp_dir, f"rank{ctx.rank}.json")
    if config.dump_after_s:
        import faulthandler

        # faulthandler's own thread needs no GIL: the Python stacks come even where a thread
        # waits inside a call that holds it; repeated every first interval while the rank lives.
        faulthandler.dump_traceback_later(config.dump_after_s[0], repeat=True, file=sys.stderr)
    for after_s in config.dump_after_s:
        timer = threading.Timer(after_s, _dump_threads, args=(ctx.rank, after_s))
        timer.daemon = True
        timer.start()
    try:
        from .cases import CASES_BY_NAME

        case = CASES_BY_NAME[case_name]
        f = FaultCtx(ctx.rank, config, case.faulty(config.world_size), record_path)
    except BaseException:
        rec = RankRecord(rank=ctx.rank, status="error", traceback=traceback.format_exc(),
                         message="start-up failed: " + traceback.format_exc().strip().splitlines()[-1])
        _write_json(record_path, dataclasses.asdict(rec))
        raise
    error = None
    try:
        case.body(f)
        if f.record.status == "running":  # the body never reached its faulted call
            raise AssertionError("case body returned without calling FaultCtx.faulted")
    except BaseException as exc:  # a harness error: the body failed outside the faulted call
        f.record.status = "error"
        f.record.t_end = f.record.t_end or time.time()
        f._set_exception(exc)
        error = exc
    f.record.done = True
    f.record.stage = "done"
    f.write()
    if error is not None:
        raise error


def _dump_threads(rank: int, after_s: float) -> None:
    """Where every native thread of this rank is, as the kernel sees it: name (te_ep's watchdog
    threads are te_ep_wd_check and te_ep_wd_poll), state, wait channel, system call (``ioctl``:
    inside the CUDA driver; ``futex``: waiting for a lock or a condition). The Python stacks come
    from faulthandler (see _case_main)."""
    lines = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"/proc/self/task/{tid}/{name}") as f:
                    fields.append(f"{name}={f.read().strip().split(' ')[0]}")
            except OSError:
                fields.append(f"{name}=?")
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields.append("state=" + f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
        lines.append(f"  tid {tid}: " + " ".join(fields))
    sys.stderr.write(f"\n=== rank {rank}: native threads {after_s:g} s after the body started (syscall number: 16 "
                     "ioctl, 202 futex, 7 poll, 230 clock_nanosleep, 232 epoll_wait) ===\n" + "\n".join(lines)
                     + "\n=== end ===\n")
    sys.stderr.flush()


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------
def _read_record(path: str) -> Optional[RankRecord]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return RankRecord(**data)


def _finished(rec: Optional[RankRecord]) -> bool:
    """The rank's record is final: its body returned (or failed as a harness error), or it left
    on purpose. A rank whose faulted call returned is *not* finished: its follow-up, output
    check or recovery steps may still hang."""
    return rec is not None and (rec.done or rec.status in ("exited", "error"))


def run_case(case, config: RunConfig) -> CaseResult:
    """Runs `case` (a cases.Case) on ``config.world_size`` fresh processes; never hangs.

    As with any multiprocessing start method but fork, a script that calls this must keep its
    top-level code under ``if __name__ == "__main__":`` (the children import the main module).
    """
    W = config.world_size
    case_dir = tempfile.mkdtemp(prefix=f"te_ep_fault_{case.name}_")
    paths = [os.path.join(case_dir, f"rank{r}.json") for r in range(W)]
    result = CaseResult(case=case.name, config=config, faulty=case.faulty(W), ranks=[])
    try:
        run = _dist.launch_fresh(
            W, _case_main, (case.name, config), wall_s=case.wall_s(config.pg_timeout_s), device=config.device,
            backend=config.backend, pg_timeout_s=config.pg_timeout_s, startup_limit_s=config.startup_limit_s,
            start_method=config.start_method, preload=("faults.cases",),
            finished=lambda r: _finished(_read_record(paths[r])), run_dir=case_dir, name=f"te_ep_fault_{case.name}")
        if not run.started:
            recs = [_read_record(paths[r]) or _startup_record(rank) for r, rank in enumerate(run.ranks)]
            why = "; ".join(f"rank {rec.rank}: {rec.message or rec.status}" for rec in recs
                            if rec.rank in run.startup_failed)
            result.startup_error = why or f"not every rank was up within {config.startup_limit_s:.0f} s"
            result.ranks = recs
            return result
        result.hang = run.hang
        result.wall_s = run.wall_s
        seen_dead = {rank.rank: rank.ended_at for rank in run.ranks if rank.ended_at is not None}
        result.ranks = _finish_records(paths, run.ranks, run.stopped_at, seen_dead)
        return result
    finally:
        if config.keep_logs:
            kept = os.path.join(config.keep_logs, f"{case.name}.{config.variant}.{config.mode}."
                                                  f"w{W}")
            os.makedirs(kept, exist_ok=True)
            for r in range(W):
                src = os.path.join(case_dir, f"rank{r}.stderr")
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(kept, f"rank{r}.stderr"))
        shutil.rmtree(case_dir, ignore_errors=True)


def _startup_record(rank: "_dist.RankRun") -> RankRecord:
    """The record of a rank that did not get its process group."""
    if rank.error:
        return RankRecord(rank=rank.rank, status="error", traceback=rank.error,
                          message="start-up failed: " + rank.error.strip().splitlines()[-1])
    return RankRecord(rank=rank.rank, status="died", exit_code=rank.exitcode)


def _stderr_of(path: str) -> str:
    try:
        with open(path.replace(".json", ".stderr"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _last_words(err: str) -> str:
    """What a process that ended without a record said last: te_ep's watchdog's message, else
    torch's NCCL watchdog's (the collective that timed out or failed), else nothing."""
    lines = err.splitlines()
    said = [line for line in lines if line.startswith("te_ep watchdog: ")]
    said = said or [line.strip() for line in lines if TORCH_WATCHDOG_SAYS in line]
    return said[-1] if said else ""


def _finish_records(paths: List[str], procs, t_stop: float, seen_dead: dict) -> List[RankRecord]:
    recs = []
    for r, path in enumerate(paths):
        rec = _read_record(path) or RankRecord(rank=r, status="running")
        rec.exit_code = procs[r].exitcode
        if rec.status == "running":  # no final record: it died, or it was killed at the wall limit
            rec.failed_in = rec.stage if rec.stage != "set-up" else ""
            if r in seen_dead:
                rec.status, rec.t_end = "died", seen_dead[r]
                # A process that ended without a record: its own last words (the watchdog's
                # message where it ended the process) stand in for an exception's.
                err = _stderr_of(path)
                rec.message = _last_words(err)
                rec.traceback = err[-4000:]
            else:
                rec.status, rec.t_end = "hang", t_stop
        elif not _finished(rec):  # past its faulted call, but the body did not return
            if r in seen_dead:
                err = _stderr_of(path)
                words = _last_words(err)
                rec.after = f"died({rec.exit_code}) in {rec.stage}" + (f": {words}" if words else "")
                rec.traceback = rec.traceback or err[-4000:]
            else:
                rec.after = f"hang in {rec.stage}"
        recs.append(rec)
    t_fault = min((rec.t_fault for rec in recs if rec.t_fault is not None), default=None)
    for r, rec in enumerate(recs):
        if t_fault is not None and rec.t_end is not None:
            rec.seconds = rec.t_end - t_fault
        rec.ended_by = _ended_by(rec, _stderr_of(paths[r]))
    return recs


# What each limit leaves behind (issue 35: which limit ended each rank).
TE_EP_HOST_SAYS = "has not returned on the host"
# What NCCL EP prints when one of its limits passes ("NCCL EP timeout check failed ...",
# "Warning: NCCL EP timeout for dispatch receive ...", "NCCL EP clean barrier timeout ...").
# Not its start-up line on rank 0, "NCCL EP: using timeout=600000ms (...)", which every
# group creation prints and which says nothing about how a rank ended.
NCCL_EP_TIMEOUT_SAYS = re.compile(r"NCCL EP (?:clean barrier )?timeout")


def _ended_by(rec: RankRecord, stderr: str) -> str:
    """Which limit ended the rank's faulted call: "te_ep watchdog (host)" (an op that had not
    returned on the host), "te_ep watchdog (GPU)" (an op's GPU work that had not finished),
    "torch PG timeout (abort)" (torch's NCCL watchdog took the process down), "torch PG timeout
    (raised)" (a torch collective inside the op timed out, raised in the op; "torch collective lost
    its peer (raised)" where it failed before its timeout),
    "NCCL EP timeout" (NCCL EP's own limit, in an exception or its stderr), or what happened
    where no limit did: "completed", "raised" (an error found without waiting), "exited"
    (the injected exit), "hang" (killed at the wall limit), "died(<code>)"."""
    said = rec.message or _last_words(stderr)
    if rec.status == "completed" and not rec.after:
        return "completed"
    if rec.status == "exited":
        return "exited"
    if rec.hung:
        return "hang"
    if rec.exit_code == WATCHDOG_EXIT_CODE or "te_ep watchdog: " in said:
        return "te_ep watchdog (host)" if TE_EP_HOST_SAYS in (said + stderr) else "te_ep watchdog (GPU)"
    if rec.exit_code == TORCH_ABORT_EXIT_CODE and TORCH_WATCHDOG_SAYS in stderr:
        return "torch PG timeout (abort)"
    if NCCL_EP_TIMEOUT_SAYS.search(said) or NCCL_EP_TIMEOUT_SAYS.search(stderr):
        return "NCCL EP timeout"
    if rec.status == "raised" or rec.after.startswith("died"):
        failed = re.search(r"collective with the other ranks failed \((.*)\): a rank exited", said, re.S)
        if failed:  # what the transport said: a timeout, or a peer that went away first
            transport = failed.group(1).lower()
            timed_out = "timed out" in transport or "timeout" in transport
            return "torch PG timeout (raised)" if timed_out else "torch collective lost its peer (raised)"
        return "raised"
    return f"{rec.status}({rec.exit_code})"


def summary_line(result: CaseResult, verdict: str = "", case_s: Optional[float] = None) -> str:
    """One line per case: which limit ended each rank, after how many seconds from the fault;
    then the verdict and the case's own seconds (start of its processes to their end), where given."""
    cfg = result.config
    limits = sorted({rec.limit_ms for rec in result.ranks if rec.limit_ms is not None})
    ranks = "; ".join(f"r{rec.rank}: {rec.ended_by or rec.status} after {_secs(rec)} s" for rec in result.ranks)
    line = (f"{result.case} W={result.world_size} backend={cfg.backend} mode={cfg.mode} checks={cfg.checks} "
            f"pg_timeout={cfg.pg_timeout_s:g}s group_timeout_ms={','.join(map(str, limits)) or '?'}"
            f"{' HANG' if result.hang else ''} | {ranks}")
    if verdict:
        line += f" | verdict {verdict}"
    if case_s is not None:
        line += f" | case {case_s:.1f} s"
    return line


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------
def _secs(rec: RankRecord) -> str:
    if rec.seconds is None:
        return "-"
    return (">" if rec.status == "hang" else "") + f"{rec.seconds:.2f}"


def describe(result: CaseResult) -> str:
    """Every rank's record in full (for failures and --verbose)."""
    lines = [f"{result.case} ({result.config.variant}, W={result.world_size}, faulty rank {result.faulty}, "
             f"PG timeout {result.config.pg_timeout_s:g} s){' HANG' if result.hang else ''}"
             f"{' start-up: ' + result.startup_error if result.startup_error else ''}"]
    for rec in result.ranks:
        lines.append(f"  rank {rec.rank}: {rec.outcome()} after {_secs(rec)} s, exit code {rec.exit_code}, "
                     f"{rec.exc_type or 'no exception'}; handle {rec.handle_id} named: {rec.names_handle}; "
                     f"ended by: {rec.ended_by or '-'} (limit {rec.limit_ms} ms)")
        if rec.message:
            lines.append("    message: " + rec.message.strip().replace("\n", "\n             "))
        if rec.output:
            lines.append(f"    output: {rec.output}")
        for name, verdict in rec.recovery:
            lines.append(f"    after: {name}: {verdict}")
        if rec.status == "error" and rec.traceback:
            lines.append("    " + rec.traceback.strip().replace("\n", "\n    "))
    return "\n".join(lines)
