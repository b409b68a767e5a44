"""The harness itself: a failure is reported with the rank's traceback, a hang becomes a
failure within the deadline, and the pool recovers after both; a task's launch reaches its
body; a worker whose parent is gone exits."""

import os
import subprocess
import sys
import time

import pytest

import _dist


def _rank_and_size(ctx):
    import torch.distributed as dist

    return ctx.rank, ctx.world_size, dist.get_rank(), dist.get_world_size()


def _fail_on_last_rank(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("deliberate failure on the last rank")
    return ctx.rank


def _hang_unless_rank0(ctx):
    import torch.distributed as dist

    if ctx.rank != 0:
        dist.barrier()  # rank 0 never joins: every other rank waits forever
    return ctx.rank


def test_runs_on_every_rank(pools):
    assert pools.run(2, _rank_and_size) == [(0, 2, 0, 2), (1, 2, 1, 2)]


def test_failure_names_rank_and_pool_recovers(pools):
    with pytest.raises(_dist.RankFailure, match=r"(?s)ranks \[1\].*deliberate failure on the last rank"):
        pools.run(2, _fail_on_last_rank)
    assert pools.run(2, _rank_and_size) == [(0, 2, 0, 2), (1, 2, 1, 2)]


def test_hang_is_a_failure_and_pool_recovers(pools):
    with pytest.raises(_dist.HangError, match=r"hang: .* ranks \[1\]"):
        pools.run(2, _hang_unless_rank0, timeout=5)
    assert pools.run(2, _rank_and_size) == [(0, 2, 0, 2), (1, 2, 1, 2)]


def _launch_seen(ctx):
    return ctx.backend, ctx.nccl_ep_mode, ctx.checks, ctx.device


def test_a_launch_reaches_the_body(pools):
    launch = _dist.Launch(2, backend="nccl_ep", nccl_ep_mode="staged", checks="device")
    assert pools.run(launch, _launch_seen) == [("nccl_ep", "staged", "device", "cpu")] * 2
    assert pools.run(2, _launch_seen) == [("reference", None, "local", "cpu")] * 2  # same pool, the default


PARENT = """
import sys, time
sys.path[:0] = [{tests!r}]
import _dist
if __name__ == "__main__":
    pool = _dist.WorkerPool(1)
    print(pool._procs[0].pid, flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it holds nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_a_worker_whose_parent_died_exits(tmp_path):
    """pytest killed by a time limit never stops its pools: their workers must not stay (on GPUs,
    holding them)."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(tests=str(_dist.REPO / "tests")))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=_dist.subprocess_env())
    try:
        worker = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not _gone(worker)
    if alive:
        os.kill(worker, 9)
    assert not alive, "the worker outlived its parent"
