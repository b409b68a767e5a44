"""The multi-process launcher of the test suite: every test that needs several processes runs here.

A task is a module-level function and picklable arguments; every rank runs
``fn(ctx, *args, **kwargs)`` with a `Ctx` saying where it runs. Two modes run it:

* Pools (`WorkerPool`, `PoolRegistry`, the ``pools`` fixture of conftest.py): W processes
  that joined one process group (gloo on CPU; NCCL with one GPU per rank on CUDA), kept for
  the pytest session per world size and device, so the cost of starting W processes and
  creating the group is paid once. They are forked from the same server as fresh runs
  (below), which imported torch and te_ep_torch once: a pool starts, or is re-spawned after
  a failed task, without W interpreters importing torch side by side (~5 s of a core each).
  Each task says which te_ep backend, nccl_ep mode and check mode its body tests (a
  `Launch`), so one pool serves them all. For bodies that leave no process-wide state behind.
* Fresh processes (`run_fresh`, and `launch_fresh` underneath it): each run in W new
  processes (forked from a server that imported torch and te_ep_torch once, or spawned),
  with a new process group (gloo on CPU; NCCL with one GPU per rank on CUDA), a hard
  wall-clock limit after which every process of the run is killed, and per-rank records
  (what the body returned or raised, the exit code, when the process ended, its stderr).
  For bodies that patch modules or count compiled graphs, for the MoE layer's own GPU tests
  (tests/_moe_common.py), and for the fault harness (tests/faults/runner.py), which needs
  nothing of a case to survive into the next.

Scripts that are launchers of their own (torchrun) run through `run_torchrun`, with the
import path of `subprocess_env`.

Why the rules below:
* A collective op that hangs must fail the test, never stall the suite: every task has a
  deadline; on expiry the processes are killed (a pool is re-spawned lazily by the next
  task) and the test fails with "hang".
* A rank that raised may have left the others in the middle of a collective sequence, so a
  failed task also retires its pool: the next task gets fresh processes whose collectives
  are in step again. Once one rank has failed, the others get ``GRACE_AFTER_FAILURE_S`` to
  report, then they count as hung.
* Tests run W processes on a 2-core machine: workers use one intra-op thread each so they
  don't oversubscribe the cores.
* A pool worker whose pool's owner is gone (pytest killed by a time limit) exits by itself,
  so no worker is left holding a GPU.
* The ranks meet in a FileStore in the run's own temporary directory (no port), wait there
  until all of them are up (under the start-up limit), then create the process group, so
  start-up skew never counts against a task's deadline.
* The children import what the parent imports: multiprocessing hands them the parent's
  ``sys.path`` (pytest's ``pythonpath``: the repository root and tests/), and
  `subprocess_env` puts the repository root on ``PYTHONPATH`` for interpreters of their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_STARTUP_LIMIT_S = 180.0
# Longer than any task deadline: the harness, not the process group, decides that something
# hangs, and it reports it as such.
DEFAULT_PG_TIMEOUT_S = 600.0
# Once one rank has reported a failure the others get this long to report
# theirs, then they are treated as hung (they usually wait in a collective the
# failed rank will never join).
GRACE_AFTER_FAILURE_S = 10.0
# A fresh rank that has finished waits at most this long for the others before it exits anyway.
_LINGER_LIMIT_S = 600.0
_FORKSERVER_PRELOAD = ("torch", "torch.distributed", "te_ep_torch")


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a test body learns about where it runs (same on CPU and GPU)."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:<local rank>"
    backend: str  # te_ep backend under test: "reference", "nccl_ep" or "auto"
    nccl_ep_mode: Optional[str] = None  # EpGroup's nccl_ep_mode under test (None: EpGroup's default)
    checks: str = "local"  # EpGroup's checks under test
    tmp_dir: str = ""  # a directory every rank of the run (fresh) or of the pool shares

    def group_options(self) -> dict:
        """The EpGroup options under test, for every group a case makes."""
        mode = {} if self.nccl_ep_mode is None else {"nccl_ep_mode": self.nccl_ep_mode}
        return {**mode, "checks": self.checks}


# The CPU deadlines of a task, stretched on GPUs for the first CUDA/NCCL set-up and NCCL EP's
# kernel compilation on the first use of a shape; TE_EP_SUITE_TIMEOUT_FACTOR overrides.
GPU_TIMEOUT_FACTOR = float(os.environ.get("TE_EP_SUITE_TIMEOUT_FACTOR", "2.0"))


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where a multi-rank body runs and what it tests: W ranks on CPU (gloo) or on W GPUs
    (NCCL), the te_ep backend, and for nccl_ep its mode and check mode (``Ctx`` carries them
    to the body)."""

    world_size: int
    device: str = "cpu"  # "cpu" or "cuda"
    backend: str = "reference"
    nccl_ep_mode: Optional[str] = None
    checks: str = "local"

    @property
    def id(self) -> str:
        """The pytest id: ``cpu-W2``, ``cuda-W2-reference``, ``cuda-W4-nccl_ep-zero_copy-checks_device``."""
        parts = [self.device, f"W{self.world_size}"]
        if self.device != "cpu" or self.backend != "reference":
            parts.append(self.backend)
        if self.backend == "nccl_ep":
            parts += [self.nccl_ep_mode or "default_mode", f"checks_{self.checks}"]
        return "-".join(parts)

    def timeout(self, cpu_seconds: float) -> float:
        return cpu_seconds * (GPU_TIMEOUT_FACTOR if self.device == "cuda" else 1.0)

    def unavailable(self) -> str:
        """Why this machine cannot run it ("" where it can)."""
        if self.device == "cuda":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < self.world_size:
                return f"needs {self.world_size} CUDA GPUs, found {n}"
        if self.backend == "nccl_ep":
            from te_ep_torch import _nccl_ep

            why = _nccl_ep.availability()
            if why:
                return f"nccl_ep unavailable: {why}"
        return ""


class HangError(AssertionError):
    pass


class RankFailure(AssertionError):
    pass


def _join_group(rank: int, world_size: int, tmp_dir: str, device: str, backend: str, pg_timeout_s: float,
                startup_limit_s: float) -> Ctx:
    """This process's part of a run's start-up: one thread, the rank's GPU, the process group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device == "cuda":
        # NVLink multicast stays off on shared machines; it isn't what the tests are about.
        for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp_dir, "store"), world_size)
    store.set_timeout(datetime.timedelta(seconds=startup_limit_s))
    store.set(f"up{rank}", "1")
    store.wait([f"up{r}" for r in range(world_size)])
    kwargs = {}
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
        device = str(dev)
    dist.init_process_group("nccl" if device != "cpu" else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
    import te_ep_torch  # noqa: F401  (a broken build must fail loudly here)

    return Ctx(rank=rank, world_size=world_size, device=device, backend=backend, tmp_dir=tmp_dir)


def _format_failures(what: str, failures: dict) -> str:
    parts = [f"{what} failed on ranks {sorted(failures)}:"]
    for r in sorted(failures):
        parts.append(f"---- rank {r} ----\n{failures[r]}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class _Reply:
    task_id: int
    rank: int
    ok: bool
    value: Any  # return value if ok, else the formatted traceback (str)


def _exit_with_owner(owner) -> None:
    """Ends this worker when the process that made its pool is gone (a pool's owner killed by a
    time limit never sends the worker its stop). ``owner`` is the read end of a pipe whose write
    end only the owner holds: it reads end-of-file once the owner is gone, however it ended.
    (Not the parent process: a worker's parent is the fork server, which outlives the owner
    for as long as any process it forked does.)"""

    def watch():
        try:
            owner.poll(None)
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="te_ep_owner_watch").start()


def _worker_main(rank: int, world_size: int, tmp_dir: str, device: str, tasks, replies, owner) -> None:
    _exit_with_owner(owner)
    try:
        ctx = _join_group(rank, world_size, tmp_dir, device, "reference", DEFAULT_PG_TIMEOUT_S,
                          DEFAULT_STARTUP_LIMIT_S)
    except BaseException:
        replies.put(_Reply(-1, rank, False, traceback.format_exc()))
        return
    replies.put(_Reply(-1, rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, launch, fn, args, kwargs = item
        try:
            task_ctx = dataclasses.replace(ctx, backend=launch.backend, nccl_ep_mode=launch.nccl_ep_mode,
                                           checks=launch.checks)
            value = fn(task_ctx, *args, **kwargs)
            if device == "cuda":
                import torch

                torch.cuda.synchronize()  # the task is done when its GPU work is
            reply = _Reply(task_id, rank, True, value)
        except BaseException:
            reply = _Reply(task_id, rank, False, traceback.format_exc())
        try:
            replies.put(reply)
        except Exception:  # an unpicklable return value must not kill the worker silently
            replies.put(_Reply(task_id, rank, False, traceback.format_exc()))
    import torch.distributed as dist

    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, device: str = "cpu", start_timeout_s: float = DEFAULT_STARTUP_LIMIT_S):
        self.world_size = world_size
        self.device = device
        self._mp = _mp_context("forkserver", ())
        self._tmpdir = tempfile.TemporaryDirectory(prefix=f"te_ep_pool{world_size}{device}_")
        self._tasks = [self._mp.Queue() for _ in range(world_size)]
        self._replies = self._mp.Queue()
        owner, self._owner = self._mp.Pipe(duplex=False)  # see _exit_with_owner
        self._procs = [
            self._mp.Process(
                target=_worker_main,
                args=(r, world_size, self._tmpdir.name, device, self._tasks[r], self._replies, owner),
                daemon=True,
                name=f"te_ep_worker{r}of{world_size}{device}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        owner.close()
        self._next_task = 0
        self.alive = True
        self._stopping = False
        got = self._collect(-1, start_timeout_s, what="pool start-up")
        bad = {r: v for r, (ok, v) in got.items() if not ok}
        if bad:
            self.kill()
            raise RankFailure(_format_failures("pool start-up", bad))

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S, launch: Optional[Launch] = None,
            **kwargs) -> list:
        """Runs ``fn(ctx, *args, **kwargs)`` on every rank, with ``ctx`` saying the backend, nccl_ep
        mode and check mode of ``launch`` (default: the reference backend); returns the per-rank
        results."""
        if not self.alive:
            raise RuntimeError("worker pool is dead")
        launch = launch or Launch(self.world_size, self.device)
        task_id = self._next_task
        self._next_task += 1
        for q in self._tasks:
            q.put((task_id, launch, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        got = self._collect(task_id, timeout, what=name)
        bad = {r: v for r, (ok, v) in got.items() if not ok}
        if bad:
            # See the module docstring: a failed task leaves the group out of step.
            self.kill()
            raise RankFailure(_format_failures(name, bad))
        return [got[r][1] for r in range(self.world_size)]

    def _collect(self, task_id: int, timeout: float, what: str) -> dict:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                failures = {r: v for r, (ok, v) in got.items() if not ok}
                self.kill()
                raise _stopped(what, failures, missing, self.world_size, timeout, "pool")
            try:
                reply = self._replies.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    failures = {r: v for r, (ok, v) in got.items() if not ok}
                    self.kill()
                    raise _died(what, codes, failures)
                continue
            if reply.task_id != task_id:
                continue  # a late reply of an earlier task that timed out
            got[reply.rank] = (reply.ok, reply.value)
            if not reply.ok:
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        return got

    def kill(self) -> None:
        self.alive = False
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for q in self._tasks + [self._replies]:
            q.cancel_join_thread()
            q.close()
        self._owner.close()
        self._tmpdir.cleanup()

    def stop(self) -> None:
        """Asks every worker to leave (its process group destroyed); `close` waits for them."""
        if self.alive and not self._stopping:
            self._stopping = True
            for q in self._tasks:
                q.put(None)

    def close(self) -> None:
        if not self.alive:
            return
        self.stop()
        for p in self._procs:
            p.join(timeout=10)
        self.kill()


def _stopped(what: str, failures: dict, missing: list, world_size: int, timeout: float, which: str) -> AssertionError:
    """The error of a task stopped at its deadline: a failure if a rank failed, else a hang."""
    if failures:
        # Not a hang of the library: the others wait for a rank that failed.
        return RankFailure(
            _format_failures(what, failures)
            + f"\n(ranks {missing} were still running, probably waiting in a collective "
            f"the failed rank never joined; {which} killed)"
        )
    return HangError(f"hang: {what} did not finish on ranks {missing} of {world_size} "
                     f"within {timeout:.0f} s ({which} killed)")


def _died(what: str, codes: dict, failures: dict) -> RankFailure:
    msg = f"{what}: worker process(es) died, exit codes {codes}"
    if failures:
        msg += "\n" + _format_failures(what, failures)
    return RankFailure(msg)


class PoolRegistry:
    """One live pool per world size and device; a killed pool is replaced on next use. On CUDA
    one pool lives at a time: pools of different sizes would share GPUs."""

    def __init__(self):
        self._pools: dict[tuple, WorkerPool] = {}

    def get(self, world_size: int, device: str = "cpu") -> WorkerPool:
        key = (world_size, device)
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            if device == "cuda":
                for other in [k for k in self._pools if k[1] == "cuda" and k != key]:
                    self._pools.pop(other).close()
            pool = WorkerPool(world_size, device)
            self._pools[key] = pool
        return pool

    def run(self, where, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
        """Runs ``fn(ctx, *args, **kwargs)`` on the pool of ``where``: a world size (CPU, the
        reference backend) or a `Launch`."""
        launch = where if isinstance(where, Launch) else Launch(where)
        return self.get(launch.world_size, launch.device).run(fn, *args, timeout=timeout, launch=launch, **kwargs)

    def close(self) -> None:
        # Every pool's workers leave side by side: each pays its process group's teardown and
        # its interpreter's exit, seconds on a small machine, and pools wait for nothing of
        # each other's.
        for pool in self._pools.values():
            pool.stop()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


# ---------------------------------------------------------------------------
# fresh processes
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class RankRun:
    """What one rank of a fresh run did."""

    rank: int
    # "returned", "raised" (the body), "start-up failed" (joining the group), "died" (the
    # process ended without a result: a signal, an abort, os._exit), "hang" (still running
    # when the run stopped; killed).
    outcome: str = "hang"
    value: Any = None  # what the body returned
    error: str = ""  # the formatted traceback of a raise
    exitcode: Optional[int] = None  # negative: the signal that ended it (-9: killed at the deadline)
    ended_at: Optional[float] = None  # time.time() when the launcher first saw the process gone
    stderr: str = ""


@dataclasses.dataclass
class FreshRun:
    ranks: List[RankRun]
    started: bool = False  # every rank had its process group
    startup_failed: List[int] = dataclasses.field(default_factory=list)  # ranks that ended before that
    hang: bool = False  # stopped at the deadline (or the grace after a failure), not every rank done
    wall_s: float = 0.0  # from "every rank has its process group" to the stop
    stopped_at: Optional[float] = None  # time.time() of the stop


def _result_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.result")


def _write_result(run_dir: str, rank: int, result: dict) -> str:
    """Writes a rank's result where the launcher reads it; returns the outcome written."""
    path = _result_path(run_dir, rank)
    try:
        data = pickle.dumps(result)
    except Exception:  # an unpicklable return value must not be lost silently
        result = {"outcome": "raised", "error": traceback.format_exc()}
        data = pickle.dumps(result)
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp", path)
    return result["outcome"]


def _read_result(run_dir: str, rank: int) -> Optional[dict]:
    try:
        with open(_result_path(run_dir, rank), "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return pickle.loads(data)
    except Exception:  # e.g. a returned object whose class this process can't import
        return {"outcome": "raised", "error": "its result could not be read back:\n" + traceback.format_exc()}


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _fresh_main(fn: Callable, args: tuple, kwargs: dict, rank: int, world_size: int, run_dir: str, device: str,
                backend: str, pg_timeout_s: float, startup_limit_s: float, preload: Sequence[str],
                self_deadline: float) -> None:
    # Never outlive a launcher that died: leave after the deadline whatever happens.
    killer = threading.Timer(max(1.0, self_deadline - time.time()), lambda: os._exit(124))
    killer.daemon = True
    killer.start()
    # This rank's stderr, for the launcher: a process that ends without a result (te_ep's
    # watchdog, an abort) leaves its last words there.
    err_fd = os.open(os.path.join(run_dir, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err_fd, 2)
    os.close(err_fd)
    try:
        for module in preload:  # at start-up, so that the body starts as soon as the run does
            importlib.import_module(module)
        ctx = _join_group(rank, world_size, run_dir, device, backend, pg_timeout_s, startup_limit_s)
        _touch(os.path.join(run_dir, f"ready{rank}"))
    except BaseException:
        _write_result(run_dir, rank, {"outcome": "start-up failed", "error": traceback.format_exc()})
        os._exit(1)
    try:
        result = {"outcome": "returned", "value": fn(ctx, *args, **kwargs)}
    except BaseException:
        result = {"outcome": "raised", "error": traceback.format_exc()}
    code = 0 if _write_result(run_dir, rank, result) == "returned" else 1
    # Linger until the launcher has heard from every rank, so a rank that finished early never
    # changes what the others see by closing its connections (a rank that dies does).
    release = os.path.join(run_dir, "release")
    stop = time.time() + _LINGER_LIMIT_S
    while not os.path.exists(release) and time.time() < stop:
        time.sleep(0.02)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_mp_contexts: dict = {}


def _mp_context(method: str, preload: Sequence[str]):
    """The start method's context; forkserver's server imports torch, te_ep_torch and ``preload``
    once (the first caller's list: there is one server per process), and every run forks fresh
    processes from it. CUDA is never initialised there (importing torch does not), so children
    may use it."""
    if method not in _mp_contexts:
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([*_FORKSERVER_PRELOAD, *preload])
        _mp_contexts[method] = ctx
    return _mp_contexts[method]


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


def launch_fresh(world_size: int, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, *,
                 wall_s: float, device: str = "cpu", backend: str = "reference",
                 pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S, startup_limit_s: float = DEFAULT_STARTUP_LIMIT_S,
                 start_method: str = "forkserver", preload: Sequence[str] = (),
                 finished: Optional[Callable[[int], bool]] = None, grace_after_failure_s: Optional[float] = None,
                 run_dir: Optional[str] = None, name: str = "te_ep_fresh") -> FreshRun:
    """Runs ``fn(ctx, *args, **kwargs)`` on ``world_size`` new processes and records what each
    did; never hangs and never raises for what a rank did.

    Start-up (``startup_limit_s``) lasts until every rank has its process group (timeout
    ``pg_timeout_s``); a rank that ends before that fails it. Then the run lasts until every
    rank is done (its body returned or raised, ``finished(rank)`` says so, or its process
    ended), at most ``wall_s``; with ``grace_after_failure_s``, at most that long after a
    rank's body raised or its process ended with a non-zero code. A run stopped early is a
    hang: the processes still running are killed. A rank that is done lingers until the run
    stops. A child also exits by itself after both limits and a margin, so no orphan
    outlives a launcher that died.

    Each child imports ``preload`` before it joins the group (forkserver's server imports them
    once, with torch and te_ep_torch, if this is the run that starts it).

    The ranks share ``run_dir`` (``ctx.tmp_dir``; a new temporary directory, removed at the
    end, unless the caller passes its own), where rank r's stderr goes to ``rank<r>.stderr``.

    As with any multiprocessing start method but fork, a script that calls this must keep its
    top-level code under ``if __name__ == "__main__":`` (the children import the main module).
    """
    own_dir = run_dir is None
    run_dir = tempfile.mkdtemp(prefix=f"{name}_") if own_dir else run_dir
    ctx = _mp_context(start_method, preload)
    self_deadline = time.time() + startup_limit_s + wall_s + 60.0
    procs = [
        ctx.Process(target=_fresh_main,
                    args=(fn, tuple(args), dict(kwargs or {}), r, world_size, run_dir, device, backend, pg_timeout_s,
                          startup_limit_s, tuple(preload), self_deadline),
                    name=f"{name}_r{r}", daemon=True)
        for r in range(world_size)
    ]
    run = FreshRun(ranks=[RankRun(rank=r) for r in range(world_size)])
    ready = [os.path.join(run_dir, f"ready{r}") for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + startup_limit_s
        while not all(os.path.exists(path) for path in ready):
            failed = [r for r in range(world_size) if not procs[r].is_alive() and not os.path.exists(ready[r])]
            if failed or time.monotonic() > deadline:
                _kill(procs)
                run.startup_failed = failed
                _fill_ranks(run, procs, run_dir, {})
                return run
            time.sleep(0.01)
        run.started = True
        t0 = time.monotonic()
        deadline = t0 + wall_s
        seen_dead: dict = {}
        results: dict = {}  # rank -> its result, once written (final)
        while True:
            for r, p in enumerate(procs):
                if r not in results:
                    result = _read_result(run_dir, r)
                    if result is not None:
                        results[r] = result
                if r not in seen_dead and not p.is_alive():
                    seen_dead[r] = time.time()
            if all(r in results or r in seen_dead or (finished is not None and finished(r))
                   for r in range(world_size)):
                break
            failed = any(res["outcome"] != "returned" for res in results.values()) or any(
                procs[r].exitcode != 0 for r in seen_dead)
            if failed and grace_after_failure_s is not None:
                deadline = min(deadline, time.monotonic() + grace_after_failure_s)
            if time.monotonic() > deadline:
                run.hang = True
                break
            time.sleep(0.01)
        run.stopped_at = time.time()
        run.wall_s = time.monotonic() - t0
        _touch(os.path.join(run_dir, "release"))
        if not run.hang:
            for p in procs:
                p.join(timeout=10)
        _kill(procs)
        _fill_ranks(run, procs, run_dir, seen_dead)
        return run
    finally:
        _kill(procs)
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _fill_ranks(run: FreshRun, procs, run_dir: str, seen_dead: dict) -> None:
    for r, rec in enumerate(run.ranks):
        rec.exitcode = procs[r].exitcode
        rec.ended_at = seen_dead.get(r)
        result = _read_result(run_dir, r)
        if result is not None:
            rec.outcome = result["outcome"]
            rec.value = result.get("value")
            rec.error = result.get("error", "")
        elif r in seen_dead or r in run.startup_failed:
            rec.outcome = "died"
        try:
            with open(os.path.join(run_dir, f"rank{r}.stderr"), errors="replace") as f:
                rec.stderr = f.read()
        except OSError:
            pass


def run_fresh(world_size: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
              backend: Optional[str] = None, **kwargs) -> list:
    """Runs ``fn(ctx, *args, **kwargs)`` on ``world_size`` fresh processes (`launch_fresh`);
    returns the per-rank results, or raises as `WorkerPool.run` does (with each failed rank's
    stderr). ``device="cuda"``: NCCL, one GPU per rank; ``backend`` (the ``ctx.backend``):
    "reference" on CPU, "auto" on CUDA unless given."""
    backend = backend or ("reference" if device == "cpu" else "auto")
    what = getattr(fn, "__qualname__", repr(fn))
    run = launch_fresh(world_size, fn, args, kwargs, wall_s=timeout, device=device, backend=backend,
                       grace_after_failure_s=GRACE_AFTER_FAILURE_S, name=f"te_ep_{what}")

    def said(rec: RankRun) -> str:
        tail = rec.stderr.strip()[-4000:]
        return rec.error + (f"\n-- stderr --\n{tail}" if tail else "")

    failures = {rec.rank: said(rec) for rec in run.ranks
                if rec.outcome in ("raised", "start-up failed") or (rec.outcome == "died" and rec.stderr.strip())}
    dead = {rec.rank: rec.exitcode for rec in run.ranks if rec.outcome == "died"}
    if run.hang:
        raise _stopped(what, failures, [rec.rank for rec in run.ranks if rec.outcome == "hang"], world_size,
                       timeout, "processes")
    if dead:
        raise _died(what, dead, failures)
    if failures:
        raise RankFailure(_format_failures(what, failures))
    if not run.started:
        raise HangError(f"hang: {what}: not every rank was up within {DEFAULT_STARTUP_LIMIT_S:.0f} s")
    return [rec.value for rec in run.ranks]


# ---------------------------------------------------------------------------
# interpreters of their own
# ---------------------------------------------------------------------------
def subprocess_env(**extra: str) -> dict:
    """``os.environ`` for an interpreter of its own: the repository root (an in-place build of
    te_ep_torch) first on ``PYTHONPATH``, then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_torchrun(script, *args, nprocs: int, timeout: float, cwd=REPO, expect_ok: bool = True, **env: str) -> str:
    """Runs ``script`` under torchrun on ``nprocs`` local ranks (environment: `subprocess_env`
    with ``env``); returns its output (stdout and stderr). Fails the test if it does not finish
    within ``timeout`` (then every process torchrun started is killed: it runs in a session of
    its own), or if it exits non-zero (with ``expect_ok=False``: if it exits with 0)."""
    import pytest

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", str(script),
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    name = Path(script).name
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} timed out after {timeout}s:\n{out[-6000:]}")
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{name} exited with {proc.returncode}:\n{out[-6000:]}")
    if not expect_ok and proc.returncode == 0:
        pytest.fail(f"{name} exited with 0, expected a failure:\n{out[-6000:]}")
    return out
