"""Self-launching multi-process harness for the CPU (gloo) test suite.

A `WorkerPool` holds W spawned processes that joined one gloo process group.
A test sends a task (a module-level function plus picklable arguments); every
rank runs ``fn(ctx, *args)`` and sends back its return value or its formatted
exception. The pool is spawned once per pytest session per world size, so the
cost of starting W interpreters and importing torch is paid once.

Why the rules below:
* A collective op that hangs must fail the test, never stall the suite: every
  task has a deadline; on expiry the pool is killed (and re-spawned lazily by
  the next task) and the test fails with "hang".
* A rank that raised may have left the others in the middle of a collective
  sequence, so a failed task also retires the pool: the next task gets fresh
  processes whose collectives are in step again.
* Tests run W processes on a 2-core machine: workers use one intra-op thread
  each so they don't oversubscribe the cores.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0
# Once one rank has reported a failure the others get this long to report
# theirs, then they are treated as hung (they usually wait in a collective the
# failed rank will never join).
GRACE_AFTER_FAILURE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a test body learns about where it runs (same on CPU and GPU)."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:<local rank>"
    backend: str  # te_ep backend under test: "reference" or "nccl_ep"
    nccl_ep_mode: str = "staged"  # EpGroup's nccl_ep_mode under test
    checks: str = "local"  # EpGroup's checks under test

    def group_options(self) -> dict:
        """The EpGroup options under test, for every group a case makes."""
        return {"nccl_ep_mode": self.nccl_ep_mode, "checks": self.checks}


class HangError(AssertionError):
    pass


class RankFailure(AssertionError):
    pass


@dataclasses.dataclass
class _Reply:
    task_id: int
    rank: int
    ok: bool
    value: Any  # return value if ok, else the formatted traceback (str)


def _worker_main(rank: int, world_size: int, init_file: str, backend: str, tasks, replies) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            # Longer than any task deadline: the harness, not gloo, decides
            # that something hangs, and it reports it as such.
            timeout=__import__("datetime").timedelta(seconds=600),
        )
        import te_ep_torch  # noqa: F401  (a broken build must fail loudly here)
    except BaseException:
        replies.put(_Reply(-1, rank, False, traceback.format_exc()))
        return
    replies.put(_Reply(-1, rank, True, "ready"))
    ctx = Ctx(rank=rank, world_size=world_size, device="cpu", backend=backend)
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            value = fn(ctx, *args, **kwargs)
            reply = _Reply(task_id, rank, True, value)
        except BaseException:
            reply = _Reply(task_id, rank, False, traceback.format_exc())
        try:
            replies.put(reply)
        except Exception:  # an unpicklable return value must not kill the worker silently
            replies.put(_Reply(task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, backend: str = "reference", start_timeout_s: float = 180.0):
        self.world_size = world_size
        self.backend = backend
        self._mp = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix=f"te_ep_pool{world_size}_")
        init_file = os.path.join(self._tmpdir.name, "store")
        self._tasks = [self._mp.Queue() for _ in range(world_size)]
        self._replies = self._mp.Queue()
        self._procs = [
            self._mp.Process(
                target=_worker_main,
                args=(r, world_size, init_file, backend, self._tasks[r], self._replies),
                daemon=True,
                name=f"te_ep_worker{r}of{world_size}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_task = 0
        self.alive = True
        got = self._collect(-1, start_timeout_s, what="pool start-up")
        bad = {r: v for r, (ok, v) in got.items() if not ok}
        if bad:
            self.kill()
            raise RankFailure(_format_failures("pool start-up", bad))

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
        """Runs ``fn(ctx, *args, **kwargs)`` on every rank; returns the per-rank results."""
        if not self.alive:
            raise RuntimeError("worker pool is dead")
        task_id = self._next_task
        self._next_task += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
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
                if failures:
                    # Not a hang of the library: the others wait for a rank that failed.
                    raise RankFailure(
                        _format_failures(what, failures)
                        + f"\n(ranks {missing} were still running, probably waiting in a collective "
                        f"the failed rank never joined; pool killed)"
                    )
                raise HangError(
                    f"hang: {what} did not finish on ranks {missing} of {self.world_size} "
                    f"within {timeout:.0f} s (pool killed)"
                )
            try:
                reply = self._replies.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    failures = {r: v for r, (ok, v) in got.items() if not ok}
                    self.kill()
                    msg = f"{what}: worker process(es) died, exit codes {codes}"
                    if failures:
                        msg += "\n" + _format_failures(what, failures)
                    raise RankFailure(msg)
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
        self._tmpdir.cleanup()

    def close(self) -> None:
        if not self.alive:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()


def _format_failures(what: str, failures: dict) -> str:
    parts = [f"{what} failed on ranks {sorted(failures)}:"]
    for r in sorted(failures):
        parts.append(f"---- rank {r} ----\n{failures[r]}")
    return "\n".join(parts)


class PoolRegistry:
    """One live pool per world size; a killed pool is replaced on next use."""

    def __init__(self, backend: str = "reference"):
        self.backend = backend
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = WorkerPool(world_size, self.backend)
            self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
        return self.get(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
