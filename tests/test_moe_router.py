"""The MoE layer's router (te_ep_torch.moe.TopKRouter) against a plain-PyTorch reference on
CPU: top-k selection and weights, selection bias and its update, aux loss, and the
expert-load statistics (local, under compile, summed over ranks in the worker pools)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _moe_common import reference_router
from te_ep_torch.moe import MoE, TopKRouter


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [None, True, False])
def test_router_matches_reference(score_func, normalize):
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 3, score_func=score_func, normalize_weights=normalize, route_scale=2.0)
    x = torch.randn(40, 16)
    out = router(x)
    idx, w, scores = reference_router(router, x)
    assert out.topk_idx.dtype == torch.int64 and out.topk_weights.dtype == torch.float32
    assert torch.equal(out.topk_idx, idx)
    torch.testing.assert_close(out.topk_weights, w)
    torch.testing.assert_close(out.scores, scores)
    assert out.aux_loss is None
    assert torch.equal(out.tokens_per_expert, torch.bincount(idx.flatten(), minlength=8).float())
    if normalize or (normalize is None and score_func == "sigmoid"):
        torch.testing.assert_close(out.topk_weights.sum(-1), torch.full((40,), 2.0))


def test_router_bfloat16_input_gives_float32_weights():
    router = TopKRouter(16, 4, 2)
    out = router(torch.randn(5, 16, dtype=torch.bfloat16))
    assert out.topk_weights.dtype == torch.float32 and out.scores.dtype == torch.float32


def test_router_bias_selects_but_does_not_weight():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, score_func="sigmoid", expert_bias=True)
    x = torch.randn(32, 16)
    router.expert_bias[5] = 10.0
    out = router(x)
    assert (out.topk_idx == 5).any(-1).all(), "a large bias must put expert 5 in every token's top-k"
    raw = out.scores.gather(1, out.topk_idx)
    torch.testing.assert_close(out.topk_weights, raw / raw.sum(-1, keepdim=True))
    assert "expert_bias" in router.state_dict() and "expert_load" not in router.state_dict()


def test_router_bias_update_moves_toward_balance():
    torch.manual_seed(0)
    router = TopKRouter(16, 4, 1, expert_bias=True, bias_update_rate=0.1)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2, 0] = 5.0
    x = torch.randn(64, 16).abs()  # positive feature 0: expert 2 wins every token
    out = router(x)
    assert (out.topk_idx == 2).all()
    load = router.update_expert_bias()
    assert torch.equal(load, torch.tensor([0.0, 0.0, 64.0, 0.0]))
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.1, 0.1, -0.1, 0.1]))
    assert router.expert_load.sum() == 0
    router.eval()
    router(x)
    assert router.expert_load.sum() == 0, "the load is only counted in training mode"


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_aux_loss(score_func):
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, score_func=score_func, aux_loss_coef=0.01)
    x = torch.randn(50, 16)
    out = router(x)
    probs = out.scores / out.scores.sum(-1, keepdim=True)
    f = torch.bincount(out.topk_idx.flatten(), minlength=8).float() / (50 * 2)
    expected = 0.01 * 8 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(out.aux_loss, expected)
    out.aux_loss.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_router_aux_loss_is_coef_when_balanced():
    router = TopKRouter(4, 4, 1, aux_loss_coef=0.5)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4) * 10)
    out = router(torch.eye(4))  # token t picks expert t; scores near one-hot
    assert torch.equal(out.topk_idx.flatten(), torch.arange(4))
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.5))


# ---- expert-load statistics ------------------------------------------------------------------


@pytest.mark.parametrize("expert_bias", [False, True])
def test_router_expert_load_counts_training_forwards(expert_bias):
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 3, expert_bias=expert_bias)
    expected = torch.zeros(8, dtype=torch.int64)
    for step in range(3):
        out = router(torch.randn(10 + step, 16))
        expected += torch.bincount(out.topk_idx.flatten(), minlength=8)
    load = router.read_expert_load()
    assert load.dtype == torch.int64 and torch.equal(load, expected)
    assert int(load.sum()) == 3 * (10 + 11 + 12)
    load.zero_()  # a copy: the counter is untouched
    assert torch.equal(router.read_expert_load(), expected)
    router.eval()
    router(torch.randn(5, 16))
    assert torch.equal(router.read_expert_load(), expected), "eval forwards are not counted"
    router.reset_expert_load()
    assert int(router.read_expert_load().sum()) == 0
    assert "expert_load" not in router.state_dict()


def test_expert_load_stats_of_a_model():
    from te_ep_torch.moe import expert_load_stats

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(16, 8, 4, 2), torch.nn.Identity(), MoE(16, 8, 8, 1))
    x = torch.randn(6, 16)
    r0 = model[0].router(x)
    r2 = model[2].router(x)
    stats = expert_load_stats(model)
    assert set(stats) == {"0", "2"}
    assert torch.equal(stats["0"], torch.bincount(r0.topk_idx.flatten(), minlength=4))
    assert torch.equal(stats["2"], torch.bincount(r2.topk_idx.flatten(), minlength=8))
    again = expert_load_stats(model, reset=True)
    assert torch.equal(again["0"], stats["0"])
    assert all(int(v.sum()) == 0 for v in expert_load_stats(model).values())


def test_router_expert_load_under_compile_has_no_graph_break():
    """The count is a device-side index_add into a buffer: fullgraph compiles it."""
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2)
    compiled = torch.compile(router, fullgraph=True, backend="aot_eager")
    x = torch.randn(12, 16)
    out = compiled(x)
    compiled(x)
    expected = 2 * torch.bincount(out.topk_idx.flatten(), minlength=8)
    assert torch.equal(router.read_expert_load(), expected)


def _global_expert_load(ctx):
    torch.manual_seed(ctx.rank)
    router = TopKRouter(16, 8, 2)
    router.process_group = dist.group.WORLD
    out = router(torch.randn(4 + ctx.rank, 16))
    mine = torch.bincount(out.topk_idx.flatten(), minlength=8)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    assert torch.equal(router.read_expert_load(), mine)
    assert torch.equal(router.read_expert_load(global_sum=True), sum(everyone))
    assert torch.equal(router.read_expert_load(), mine), "global_sum leaves the local counter alone"


@pytest.mark.parametrize("world_size", [2, 3])
def test_router_expert_load_global_sum(pools, world_size):
    pools.run(world_size, _global_expert_load)
