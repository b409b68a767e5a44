"""DTensor sharding of the permutation ops on a CPU gloo mesh (2 and 4 processes).

Each test runs every scenario on the worker pool of its world size (tests/_dist.py), so a
plain `pytest` exercises the multi-process path. A deadline per test turns a hang into a
failure.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

DEADLINE_S = 120
NUM_EXPERTS, TOP_K, HIDDEN, ALIGN = 8, 2, 16, 4


def _routing(kind, num_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    ids = torch.where(torch.rand(num_tokens, TOP_K, generator=g) < 0.2, -1, ids)
    if kind == "map":
        routing = torch.zeros(num_tokens, NUM_EXPERTS, dtype=torch.bool)
        routing.scatter_(1, ids.clamp(min=0), ids >= 0)
        return routing
    return ids


def _check_permute_roundtrip(mesh, placements, kind, num_tokens):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from te_ep_torch.permutation import permute, permute_capacity, unpermute

    torch.manual_seed(0)
    tokens = torch.randn(num_tokens, HIDDEN)
    routing = _routing(kind, num_tokens, seed=1)
    probs = torch.rand(routing.shape)
    merging = torch.rand(routing.shape)
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    shards = 1
    for i in sharded:
        shards *= mesh.size(i)
    capacity = permute_capacity(-(-num_tokens // shards), routing.shape[1], NUM_EXPERTS, ALIGN)

    d_tokens = distribute_tensor(tokens, mesh, placements).requires_grad_()
    d_routing = distribute_tensor(routing, mesh, placements)
    d_probs = distribute_tensor(probs, mesh, placements).requires_grad_()
    d_merging = distribute_tensor(merging, mesh, placements).requires_grad_()
    out, pp, perm_map = permute(
        d_tokens, d_routing, d_probs, num_experts=NUM_EXPERTS, capacity=capacity, alignment=ALIGN, check=True
    )

    for t in (out, pp, *perm_map):
        assert isinstance(t, DTensor) and tuple(t.placements) == tuple(placements), (type(t), t.placements)
    assert out.shape == (capacity * shards, HIDDEN)
    assert pp.shape == perm_map.src_slot.shape == (capacity * shards,)
    assert perm_map.row_id_map.shape == routing.shape
    assert perm_map.expert_counts.shape == (NUM_EXPERTS * shards,)
    assert perm_map.required_rows.shape == (shards,)

    # Per-shard meaning: the local result is the unsharded op on the local shard.
    local = permute(
        d_tokens.to_local().detach(), d_routing.to_local(), d_probs.to_local().detach(),
        num_experts=NUM_EXPERTS, capacity=capacity, alignment=ALIGN,
    )
    torch.testing.assert_close(out.to_local(), local[0], rtol=0, atol=0)
    torch.testing.assert_close(pp.to_local(), local[1], rtol=0, atol=0)
    for got, want in zip(perm_map, local[2]):
        torch.testing.assert_close(got.to_local(), want, rtol=0, atol=0)
    # Globally: block r of the buffer is the permute of token shard r.
    full_out = out.full_tensor()
    token_blocks = torch.tensor_split(tokens, shards) if sharded else [tokens]
    routing_blocks = torch.tensor_split(routing, shards) if sharded else [routing]
    for r, (tok, rou) in enumerate(zip(token_blocks, routing_blocks)):
        want, _, _ = permute(tok, rou, num_experts=NUM_EXPERTS, capacity=capacity, alignment=ALIGN)
        torch.testing.assert_close(full_out[r * capacity : (r + 1) * capacity], want, rtol=0, atol=0)

    # Round trip equals the unsharded op, forward and backward.
    expert_out = out * 2.0 + 1.0
    y = unpermute(expert_out, perm_map, d_merging)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements)
    g = torch.randn(num_tokens, HIDDEN)
    (y * distribute_tensor(g, mesh, placements)).sum().backward(retain_graph=True)

    tokens_ref = tokens.clone().requires_grad_()
    probs_ref = probs.clone().requires_grad_()
    merging_ref = merging.clone().requires_grad_()
    ref_out, _, ref_map = permute(
        tokens_ref, routing, probs_ref, num_experts=NUM_EXPERTS, capacity=capacity * shards, alignment=ALIGN
    )
    y_ref = unpermute(ref_out * 2.0 + 1.0, ref_map, merging_ref)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y.full_tensor(), y_ref)
    torch.testing.assert_close(d_tokens.grad.full_tensor(), tokens_ref.grad)
    torch.testing.assert_close(d_merging.grad.full_tensor(), merging_ref.grad)

    # Probabilities permuted alongside get their gradient back through permute_bwd.
    d_probs.grad = None
    (pp * 3.0).sum().backward()
    assert isinstance(d_probs.grad, DTensor)
    routed = (perm_map.row_id_map.full_tensor() >= 0).float()
    torch.testing.assert_close(d_probs.grad.full_tensor(), routed * 3.0)


def _check_sort_chunks(mesh, rank):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from te_ep_torch.permutation import sort_chunks_by_index, sort_chunks_by_map

    world = mesh.size()
    rows_per_rank, num_chunks = 10, 4
    torch.manual_seed(0)
    x = torch.randn(rows_per_rank * world, HIDDEN)
    probs = torch.rand(rows_per_rank * world)
    # Each rank has its own chunk sizes (what it received), here with a common order.
    all_sizes = torch.stack([torch.tensor([r % 3, 4, 0, 3]) for r in range(world)])
    order = torch.tensor([2, 0, 3, 1])

    d_x = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    d_probs = distribute_tensor(probs, mesh, [Shard(0)]).requires_grad_()
    d_sizes = DTensor.from_local(all_sizes[rank], mesh, [Shard(0)])
    d_order = DTensor.from_local(order, mesh, [Shard(0)])
    out, pp, row_map = sort_chunks_by_index(d_x, d_sizes, d_order, d_probs)
    assert tuple(out.placements) == (Shard(0),) and tuple(row_map.placements) == (Shard(1),)
    assert row_map.shape == (2, rows_per_rank * world)
    full = out.full_tensor()
    for r in range(world):
        block = slice(r * rows_per_rank, (r + 1) * rows_per_rank)
        want, want_pp, _ = sort_chunks_by_index(x[block], all_sizes[r], order, probs[block])
        torch.testing.assert_close(full[block], want, rtol=0, atol=0)
        torch.testing.assert_close(pp.full_tensor()[block], want_pp, rtol=0, atol=0)
    back, _ = sort_chunks_by_map(out, row_map, inverse=True)
    torch.testing.assert_close(back.full_tensor(), x, rtol=0, atol=0)
    g = torch.randn_like(x)
    ((out * distribute_tensor(g, mesh, [Shard(0)])).sum() + pp.sum()).backward()
    g_want = torch.cat([
        sort_chunks_by_map(g[r * rows_per_rank : (r + 1) * rows_per_rank],
                           sort_chunks_by_index(x[:rows_per_rank], all_sizes[r], order)[2], inverse=True)[0]
        for r in range(world)
    ])
    torch.testing.assert_close(d_x.grad.full_tensor(), g_want, rtol=0, atol=0)
    torch.testing.assert_close(d_probs.grad.full_tensor(), torch.ones_like(probs))

    # Replicated inputs: every rank computes the whole op.
    r_x = distribute_tensor(x, mesh, [Replicate()])
    r_sizes = distribute_tensor(all_sizes[0].repeat(world), mesh, [Replicate()])
    r_order = distribute_tensor(torch.arange(num_chunks * world).flip(0), mesh, [Replicate()])
    r_out, _, _ = sort_chunks_by_index(r_x, r_sizes, r_order)
    assert tuple(r_out.placements) == (Replicate(),)
    want, _, _ = sort_chunks_by_index(x, all_sizes[0].repeat(world), torch.arange(num_chunks * world).flip(0))
    torch.testing.assert_close(r_out.to_local(), want, rtol=0, atol=0)


def _check_errors(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from te_ep_torch.permutation import permute

    tokens = distribute_tensor(torch.randn(8, HIDDEN), mesh, [Shard(0)])
    routing = _routing("ids", 8, seed=2)
    try:
        permute(tokens, routing, num_experts=NUM_EXPERTS)
    except RuntimeError as exc:
        assert "tokens, routing and probs must all be DTensors" in str(exc), exc
    else:
        raise AssertionError("mixing DTensor and plain tensors must raise")
    # Every shard overflows, so every rank raises (errors are per shard: no communication).
    d_routing = distribute_tensor(torch.zeros(8, TOP_K, dtype=torch.int64), mesh, [Shard(0)])
    try:
        permute(tokens, d_routing, num_experts=NUM_EXPERTS, capacity=2, check=True)
    except RuntimeError as exc:
        assert "capacity overflow" in str(exc), exc
    else:
        raise AssertionError("overflow with check=True must raise on every rank")


def _check_all(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import te_ep_torch.permutation  # noqa: F401  (registers the ops and rules)

    rank, world = ctx.rank, ctx.world_size
    mesh = init_device_mesh("cpu", (world,))
    for kind in ("ids", "map"):
        _check_permute_roundtrip(mesh, [Shard(0)], kind, num_tokens=6 * world)
        _check_permute_roundtrip(mesh, [Replicate()], kind, num_tokens=9)
    # Uneven shards: torch.tensor_split sizes, e.g. 4 + 3 on 2 ranks.
    _check_permute_roundtrip(mesh, [Shard(0)], "ids", num_tokens=4 * world - 1)
    if world == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        _check_permute_roundtrip(mesh_2d, [Shard(0), Replicate()], "ids", num_tokens=10)
        _check_permute_roundtrip(mesh_2d, [Shard(0), Shard(0)], "ids", num_tokens=12)
    _check_sort_chunks(mesh, rank)
    _check_errors(mesh)


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_matches_unsharded(pools, world):
    pools.run(world, _check_all, timeout=DEADLINE_S)
