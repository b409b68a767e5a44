"""The harness itself: a failure is reported with the rank's traceback, a hang becomes a
failure within the deadline, and the pool recovers after both."""

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
