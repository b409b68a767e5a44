"""te_ep permutation ops against a plain-PyTorch reference (index_select / index_add).

Every test body runs on CPU and, where a GPU is present, on CUDA (test ids carry the
device, so `-k cuda` selects the GPU half).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from te_ep_torch.permutation import (
    PermuteMap,
    permute,
    permute_exact,
    sort_chunks_by_index,
    sort_chunks_by_map,
    permute_capacity,
    unpermute,
)

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROUTINGS = ["ids_int64", "ids_int32", "map"]
# Unpermute sums up to C rows in float32 and rounds once; the reference does the same,
# so differences are float32 summation order (and fma) plus one output rounding.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


# ---- reference -------------------------------------------------------------------------


def make_routing(kind, num_tokens, top_k, num_experts, device, drop=0.2, seed=0):
    """Distinct experts per token, some choices dropped (-1), some tokens fully dropped."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    ids = torch.where(torch.rand(num_tokens, top_k, generator=g) < drop, -1, ids)
    if num_tokens > 2:
        ids[1] = -1
    if kind == "map":
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        for t, k in itertools.product(range(num_tokens), range(top_k)):
            if ids[t, k] >= 0:
                routing[t, ids[t, k]] = True
        return routing.to(device)
    return ids.to(torch.int32 if kind == "ids_int32" else torch.int64).to(device)


def slot_experts(routing):
    """Expert of each slot (t * C + c), -1 where not routed."""
    if routing.dtype == torch.bool:
        cols = torch.arange(routing.shape[1], device=routing.device).expand_as(routing)
        return torch.where(routing, cols, -1).reshape(-1).long()
    return routing.reshape(-1).long()


def ref_map(routing, num_experts, capacity, alignment):
    experts = slot_experts(routing)
    routed = experts >= 0
    counts = torch.bincount(experts[routed], minlength=num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    starts = padded.cumsum(0) - padded
    order = torch.argsort(torch.where(routed, experts, num_experts), stable=True)[: int(routed.sum())]
    sorted_experts = experts[order]
    first_of_expert = counts.cumsum(0) - counts
    rows = starts[sorted_experts] + torch.arange(order.numel(), device=routing.device) - first_of_expert[sorted_experts]
    fits = rows < capacity
    row_id_map = torch.full_like(experts, -1)
    row_id_map[order[fits]] = rows[fits]
    src_slot = torch.full((capacity,), -1, dtype=torch.long, device=routing.device)
    src_slot[rows[fits]] = order[fits]
    clipped = torch.minimum(padded, (capacity - starts).clamp(min=0))
    return row_id_map.view(routing.shape), src_slot, clipped, int(padded.sum())


def ref_permute(tokens, routing, probs, num_experts, capacity, alignment):
    row_id_map, src_slot, counts, required = ref_map(routing, num_experts, capacity, alignment)
    has_row = src_slot >= 0
    token_of_row = torch.where(has_row, src_slot // routing.shape[1], 0)
    mask = has_row.unsqueeze(1).to(tokens.dtype)
    out = tokens.index_select(0, token_of_row) * mask
    pp = None
    if probs is not None:
        pp = probs.reshape(-1).index_select(0, torch.where(has_row, src_slot, 0)) * has_row
    return out, pp, row_id_map, src_slot, counts, required


def ref_unpermute(x, row_id_map, probs):
    num_tokens, num_choices = row_id_map.shape
    flat = row_id_map.reshape(-1).long()
    routed = (flat >= 0).nonzero().squeeze(1)
    rows = x.index_select(0, flat[routed]).float()
    if probs is not None:
        rows = rows * probs.reshape(-1).index_select(0, routed).unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out = out.index_add(0, routed // num_choices, rows)
    return out.to(x.dtype)


def assert_map_matches(perm_map: PermuteMap, ref):
    row_id_map, src_slot, counts, required = ref
    torch.testing.assert_close(perm_map.row_id_map.long(), row_id_map)
    torch.testing.assert_close(perm_map.src_slot.long(), src_slot)
    torch.testing.assert_close(perm_map.expert_counts.long(), counts)
    assert int(perm_map.required_rows) == required
    assert perm_map.row_id_map.dtype == perm_map.src_slot.dtype == perm_map.expert_counts.dtype == torch.int32
    assert perm_map.required_rows.dtype == torch.int64


# ---- permute / unpermute --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("with_probs", [False, True], ids=["noprobs", "probs"])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("hidden", [16, 13], ids=["h16", "h13"])
def test_permute_unpermute_match_reference(device, dtype, kind, with_probs, alignment, hidden):
    num_tokens, top_k, num_experts = 37, 3, 6
    routing = make_routing(kind, num_tokens, top_k, num_experts, device)
    num_choices = routing.shape[1]
    tokens = torch.randn(num_tokens, hidden, device=device).to(dtype).requires_grad_()
    probs = torch.rand(num_tokens, num_choices, device=device).requires_grad_() if with_probs else None
    capacity = permute_capacity(num_tokens, num_choices, num_experts, alignment)

    out, pp, perm_map = permute(tokens, routing, probs, num_experts=num_experts, capacity=capacity, alignment=alignment)
    ref = ref_permute(tokens, routing, probs, num_experts, capacity, alignment)
    assert out.shape == (capacity, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, ref[0], rtol=0, atol=0)
    assert_map_matches(perm_map, ref[2:])
    if with_probs:
        torch.testing.assert_close(pp, ref[1], rtol=0, atol=0)
    else:
        assert pp is None

    # Backward of permute, against autograd of the reference.
    g_out = torch.randn_like(out)
    g_pp = torch.randn(capacity, device=device) if with_probs else None
    inputs = [tokens] + ([probs] if with_probs else [])
    loss = (out.float() * g_out.float()).sum() + ((pp * g_pp).sum() if with_probs else 0)
    ref_loss = (ref[0].float() * g_out.float()).sum() + ((ref[1] * g_pp).sum() if with_probs else 0)
    grads = torch.autograd.grad(loss, inputs)
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL[dtype])

    # Unpermute of (a function of) the buffer, forward and backward.
    expert_out = (out.detach().float() * 1.5 + 0.25).to(dtype).requires_grad_()
    merging = torch.rand(num_tokens, num_choices, device=device).requires_grad_() if with_probs else None
    y = unpermute(expert_out, perm_map, merging)
    y_ref = ref_unpermute(expert_out, perm_map.row_id_map, merging)
    assert y.shape == (num_tokens, hidden) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    g_y = torch.randn_like(y)
    inputs = [expert_out] + ([merging] if with_probs else [])
    grads = torch.autograd.grad((y.float() * g_y.float()).sum(), inputs)
    ref_grads = torch.autograd.grad((y_ref.float() * g_y.float()).sum(), inputs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL[dtype])
    # Padding and unused rows get no gradient.
    assert (grads[0][perm_map.src_slot < 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ROUTINGS)
def test_roundtrip_counts_copies(device, kind):
    routing = make_routing(kind, 50, 4, 8, device)
    tokens = torch.randn(50, 32, device=device)
    out, _, perm_map = permute(tokens, routing, num_experts=8, alignment=8)
    copies = (perm_map.row_id_map >= 0).sum(dim=1, keepdim=True).float()
    torch.testing.assert_close(unpermute(out, perm_map), tokens * copies)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_gradients(device):
    routing = make_routing("ids_int64", 20, 3, 5, device)
    tokens = torch.randn(20, 8, device=device, requires_grad=True)
    probs = torch.rand(20, 3, device=device, requires_grad=True)
    out, pp, perm_map = permute(tokens, routing, probs, num_experts=5, alignment=2)
    routed = (perm_map.row_id_map >= 0).float()

    # Only the permuted probabilities are used: no gradient reaches the tokens.
    (pp * 2.0).sum().backward(retain_graph=True)
    assert tokens.grad is None
    torch.testing.assert_close(probs.grad, routed * 2.0)

    # Merging probabilities that do not require grad: only the buffer gets one.
    x = out.detach().requires_grad_()
    weights = torch.rand(20, 3, device=device)
    unpermute(x, perm_map, weights).sum().backward()
    want = torch.zeros_like(x)
    rows = perm_map.row_id_map.reshape(-1)
    want[rows[rows >= 0].long()] = weights.reshape(-1)[rows >= 0].unsqueeze(1).expand(-1, 8)
    torch.testing.assert_close(x.grad, want)

    # Chunk sort where only the probabilities are used.
    sizes = torch.tensor([5, 0, 7, 8], device=device)
    order = torch.tensor([3, 1, 0, 2], device=device)
    p = torch.rand(20, device=device, requires_grad=True)
    _, sorted_p, _ = sort_chunks_by_index(tokens.detach(), sizes, order, p)
    (sorted_p * torch.arange(20.0, device=device)).sum().backward()
    want_p, _ = sort_chunks_by_map(torch.arange(20.0, device=device).unsqueeze(1),
                                   sort_chunks_by_index(tokens.detach(), sizes, order)[2], inverse=True)
    torch.testing.assert_close(p.grad, want_p.squeeze(1))


@pytest.mark.parametrize("device", DEVICES)
def test_layout_is_stable_and_expert_major(device):
    # Tokens fingerprinted by their index: each zone must list its tokens in order.
    num_tokens, num_experts = 20, 4
    routing = make_routing("ids_int64", num_tokens, 2, num_experts, device, drop=0.0)
    tokens = torch.arange(num_tokens, device=device, dtype=torch.float32).unsqueeze(1).repeat(1, 8)
    out, _, perm_map = permute(tokens, routing, num_experts=num_experts, alignment=4)
    start = 0
    for e, count in enumerate(perm_map.expert_counts.tolist()):
        n_rows = int((routing == e).sum())
        zone = out[start : start + n_rows, 0]
        want = (routing == e).any(dim=1).nonzero().squeeze(1).float()
        torch.testing.assert_close(zone, want)
        assert (out[start + n_rows : start + count] == 0).all()
        assert count % 4 == 0
        start += count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ROUTINGS)
def test_edge_cases(device, kind):
    num_experts = 5
    # T = 0
    tokens = torch.randn(0, 8, device=device, requires_grad=True)
    routing = make_routing(kind, 0, 2, num_experts, device)
    probs = torch.rand(routing.shape, device=device, requires_grad=True)
    out, pp, perm_map = permute(tokens, routing, probs, num_experts=num_experts, capacity=6, alignment=2)
    assert out.shape == (6, 8) and (out == 0).all() and (pp == 0).all()
    assert (perm_map.expert_counts == 0).all() and int(perm_map.required_rows) == 0
    y = unpermute(out, perm_map, probs)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert tokens.grad.shape == (0, 8) and probs.grad.shape == probs.shape

    # Every choice dropped: zero buffer, zero output, empty experts.
    routing = make_routing(kind, 7, 2, num_experts, device, drop=1.0)
    tokens = torch.randn(7, 8, device=device)
    out, _, perm_map = permute(tokens, routing, num_experts=num_experts, capacity=4, alignment=4)
    assert (out == 0).all() and (perm_map.row_id_map == -1).all() and (perm_map.src_slot == -1).all()
    assert (unpermute(out, perm_map) == 0).all()

    # Capacity 0 with nothing routed is fine.
    out, _, perm_map = permute(tokens, routing, num_experts=num_experts, capacity=0)
    assert out.shape == (0, 8)
    assert unpermute(out, perm_map).shape == (7, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_permute_exact_sizes_to_required_rows(device):
    routing = make_routing("ids_int32", 30, 3, 7, device)
    tokens = torch.randn(30, 16, device=device)
    out, _, perm_map = permute_exact(tokens, routing, num_experts=7, alignment=4)
    _, _, counts, required = ref_map(routing, 7, 10**6, 4)
    assert out.shape[0] == required == int(perm_map.expert_counts.sum())
    torch.testing.assert_close(perm_map.expert_counts.long(), counts)


def test_capacity_overflow_raises_on_cpu():
    routing = make_routing("ids_int64", 30, 3, 7, "cpu", drop=0.0)
    tokens = torch.randn(30, 16)
    needed = int((routing >= 0).sum())
    pattern = rf"te_ep.permute: capacity overflow: the routing needs {needed} rows \(alignment 1\), capacity is 50"
    with pytest.raises(RuntimeError, match=pattern):
        permute(tokens, routing, num_experts=7, capacity=50)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_capacity_overflow_cuda_drops_rows_and_reports():
    num_tokens, num_experts, capacity = 30, 7, 50
    routing = make_routing("ids_int64", num_tokens, 3, num_experts, "cuda", drop=0.0)
    tokens = torch.randn(num_tokens, 16, device="cuda")
    out, _, perm_map = permute(tokens, routing, num_experts=num_experts, capacity=capacity)
    ref = ref_permute(tokens, routing, None, num_experts, capacity, 1)
    torch.testing.assert_close(out, ref[0], rtol=0, atol=0)
    assert_map_matches(perm_map, ref[2:])
    assert int(perm_map.required_rows) == int((routing >= 0).sum()) > capacity
    assert int(perm_map.expert_counts.sum()) == capacity
    torch.testing.assert_close(unpermute(out, perm_map), ref_unpermute(out, perm_map.row_id_map, None))
    with pytest.raises(RuntimeError, match="capacity overflow"):
        permute(tokens, routing, num_experts=num_experts, capacity=capacity, check=True)


@pytest.mark.parametrize("device", DEVICES)
def test_larger_problem_and_determinism(device):
    # Multi-block map construction and the 16-byte vector path on CUDA.
    num_tokens, top_k, num_experts, hidden = (1000, 8, 256, 512) if device == "cuda" else (300, 8, 64, 64)
    routing = make_routing("ids_int64", num_tokens, top_k, num_experts, device, drop=0.05)
    tokens = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    probs = torch.rand(num_tokens, top_k, device=device)
    runs = [permute(tokens, routing, probs, num_experts=num_experts, alignment=16) for _ in range(2)]
    ref = ref_permute(tokens, routing, probs, num_experts, runs[0][0].shape[0], 16)
    torch.testing.assert_close(runs[0][0], ref[0], rtol=0, atol=0)
    assert_map_matches(runs[0][2], ref[2:])
    ys = [unpermute(out, perm_map, probs) for out, _, perm_map in runs]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(ys[0], ys[1])
    torch.testing.assert_close(ys[0], ref_unpermute(runs[0][0], runs[0][2].row_id_map, probs), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(kind, dtype):
    routing = make_routing(kind, 200, 8, 32, "cpu")
    tokens = torch.randn(200, 72).to(dtype)
    probs = torch.rand(routing.shape)
    cpu = permute(tokens, routing, probs, num_experts=32, alignment=8)
    gpu = permute(tokens.cuda(), routing.cuda(), probs.cuda(), num_experts=32, alignment=8)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=0, atol=0)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=0, atol=0)
    for a, b in zip(gpu[2], cpu[2]):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    torch.testing.assert_close(unpermute(gpu[0], gpu[2], probs.cuda()).cpu(), unpermute(*cpu[::2], probs), **TOL[dtype])


# ---- sort_chunks_by_index -------------------------------------------------------------------


def ref_sort_chunks(x, split_sizes, sorted_index):
    sizes = split_sizes.tolist()
    total = sum(sizes)
    chunks = list(torch.split(x[:total], sizes))
    return torch.cat([chunks[j] for j in sorted_index.tolist()] + [x[total:]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("with_probs", [False, True], ids=["noprobs", "probs"])
@pytest.mark.parametrize("tail", [0, 5], ids=["full", "tail"])
def test_sort_chunks_matches_reference(device, dtype, index_dtype, with_probs, tail):
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 6, (12,), generator=g)
    sizes[3] = 0
    order = torch.randperm(12, generator=g)
    num_rows = int(sizes.sum()) + tail
    x = torch.randn(num_rows, 24, device=device).to(dtype).requires_grad_()
    probs = torch.rand(num_rows, device=device).requires_grad_() if with_probs else None
    split_sizes, sorted_index = sizes.to(device, index_dtype), order.to(device, index_dtype)

    out, pp, row_map = sort_chunks_by_index(x, split_sizes, sorted_index, probs)
    torch.testing.assert_close(out, ref_sort_chunks(x, sizes, order), rtol=0, atol=0)
    assert row_map.shape == (2, num_rows) and row_map.dtype == torch.int32
    if with_probs:
        torch.testing.assert_close(pp, ref_sort_chunks(probs.unsqueeze(1), sizes, order).squeeze(1), rtol=0, atol=0)
    again, _ = sort_chunks_by_map(x, row_map)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    undone, _ = sort_chunks_by_map(out, row_map, inverse=True)
    torch.testing.assert_close(undone, x, rtol=0, atol=0)

    g_out = torch.randn_like(out)
    inputs = [x] + ([probs] if with_probs else [])
    loss = (out * g_out).sum() + ((pp * 3).sum() if with_probs else 0)
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(grads[0], ref_sort_chunks(g_out, sizes[order], order.argsort()), rtol=0, atol=0)
    if with_probs:
        torch.testing.assert_close(grads[1], torch.full_like(probs, 3.0))

    # Backward of the map op in both directions.
    x2 = x.detach().requires_grad_()
    for inverse in (False, True):
        y, _ = sort_chunks_by_map(x2, row_map, inverse=inverse)
        (gx,) = torch.autograd.grad((y * g_out).sum(), [x2])
        back, _ = sort_chunks_by_map(g_out, row_map, inverse=not inverse)
        torch.testing.assert_close(gx, back, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sort_chunks_empty(device):
    x = torch.randn(0, 4, device=device)
    sizes = torch.zeros(3, dtype=torch.int64, device=device)
    order = torch.tensor([2, 0, 1], device=device)
    out, _, row_map = sort_chunks_by_index(x, sizes, order)
    assert out.shape == (0, 4) and row_map.shape == (2, 0)


def test_sort_chunks_invalid_raise_on_cpu():
    x = torch.randn(10, 4)
    with pytest.raises(RuntimeError, match=r"sorted_index must be a permutation of \[0, 3\), got 1 at position 1"):
        sort_chunks_by_index(x, torch.tensor([2, 3, 4]), torch.tensor([1, 1, 0]))
    with pytest.raises(RuntimeError, match=r"split_sizes sum to 11 rows, more than the 10 rows of input"):
        sort_chunks_by_index(x, torch.tensor([2, 5, 4]), torch.tensor([2, 1, 0]))
    with pytest.raises(RuntimeError, match=r"split_sizes\[1\] is negative \(-1\)"):
        sort_chunks_by_index(x, torch.tensor([2, -1, 4]), torch.tensor([2, 1, 0]))


# ---- argument errors ------------------------------------------------------------------------


def test_errors_name_argument_expected_and_actual():
    tokens = torch.randn(4, 8)
    ids = torch.tensor([[0, 1], [1, -1], [2, 0], [-1, -1]])
    probs = torch.rand(4, 2)
    cases = [
        (lambda: permute(tokens.int(), ids, num_experts=3), r"tokens must be bfloat16, float16 or float32, got Int"),
        (lambda: permute(tokens.double(), ids, num_experts=3), r"tokens must be .* got Double"),
        (lambda: permute(tokens, ids.float(), num_experts=3), r"routing must be int32 or int64 .* got Float"),
        (lambda: permute(tokens, ids, probs.bfloat16(), num_experts=3), r"probs must be Float, got BFloat16"),
        (lambda: permute(tokens, ids, probs[:, :1], num_experts=3), r"probs must have shape \[4, 2\], got \[4, 1\]"),
        (lambda: permute(tokens, ids[:3], num_experts=3), r"routing.size\(0\) must equal tokens.size\(0\) \(4\), got 3"),
        (lambda: permute(tokens, ids, num_experts=3, alignment=3), r"alignment must be a power of two >= 1, got 3"),
        (lambda: permute(tokens, ids, num_experts=3, capacity=-1), r"capacity must be in \[0, 2147483647\], got -1"),
        (lambda: permute(tokens, ids, num_experts=0), r"num_experts must be in \[1, 2147483647\], got 0"),
        (lambda: permute(tokens, ids, num_experts=2), r"routing holds expert id 2 \(token 2, choice 0\), expected ids in \[-1, 2\)"),
        (lambda: permute(tokens.t(), ids, num_experts=3), r"tokens must be contiguous"),
        (lambda: permute(tokens, ids < 0, num_experts=3), r"routing.size\(1\) must equal num_experts .* \(3\), got 2"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=r"te_ep.permute: " + pattern):
            fn()
    with pytest.raises(ValueError, match="num_experts is required"):
        permute(tokens, ids)

    out, _, perm_map = permute(tokens, ids, num_experts=3)
    with pytest.raises(RuntimeError, match=r"te_ep.unpermute: merging_probs must be Float, got Half"):
        unpermute(out, perm_map, probs.half())
    with pytest.raises(RuntimeError, match=r"te_ep.unpermute: src_slot.size\(0\) must equal input.size\(0\)"):
        unpermute(out[:3], perm_map)
    with pytest.raises(RuntimeError, match=r"te_ep.unpermute: row_id_map must be Int, got Long"):
        unpermute(out, perm_map._replace(row_id_map=perm_map.row_id_map.long()))
    with pytest.raises(RuntimeError, match=r"te_ep.sort_chunks_by_index: split_sizes must be int32 or int64, got Float"):
        sort_chunks_by_index(tokens, torch.tensor([2.0, 2.0]), torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match=r"te_ep.sort_chunks_by_map: row_map.size\(1\) must equal input.size\(0\)"):
        sort_chunks_by_map(tokens, torch.zeros(2, 3, dtype=torch.int32))


# ---- opcheck and torch.compile ----------------------------------------------------------------


def _opcheck_cases(device):
    tokens = torch.randn(9, 16, device=device, requires_grad=True)
    ids = make_routing("ids_int64", 9, 2, 4, device)
    rmap = make_routing("map", 9, 2, 4, device)
    probs = torch.rand(9, 2, device=device, requires_grad=True)
    mprobs = torch.rand(9, 4, device=device, requires_grad=True)
    out, _, row_id_map, src_slot, _, _ = torch.ops.te_ep.permute(tokens, ids, probs, 4, 20, 2)
    x = out.detach().requires_grad_()
    sizes = torch.tensor([3, 0, 4, 2], device=device)
    order = torch.tensor([2, 0, 3, 1], device=device)
    row_map = torch.ops.te_ep.sort_chunks_by_index(tokens.detach(), sizes, order, None)[2]
    pp_grad = torch.randn(20, device=device)
    return [
        (torch.ops.te_ep.permute.default, (tokens, ids, probs, 4, 20, 2)),
        (torch.ops.te_ep.permute.default, (tokens, rmap, mprobs, 4, 40, 1)),
        (torch.ops.te_ep.permute.default, (tokens, ids.int(), None, 4, 18, 1)),
        (torch.ops.te_ep.permute_bwd.default, (row_id_map, out.detach(), pp_grad)),
        (torch.ops.te_ep.permute_bwd.default, (row_id_map, out.detach(), None)),
        (torch.ops.te_ep.permute_bwd.default, (row_id_map, None, pp_grad)),
        (torch.ops.te_ep.unpermute.default, (x, row_id_map, src_slot, probs)),
        (torch.ops.te_ep.unpermute.default, (x, row_id_map, src_slot, None)),
        (torch.ops.te_ep.unpermute_bwd.default, (tokens.detach(), row_id_map, src_slot, probs.detach(), x.detach())),
        (torch.ops.te_ep.sort_chunks_by_index.default, (tokens, sizes, order, torch.rand(9, device=device))),
        (torch.ops.te_ep.sort_chunks_by_map.default, (tokens, row_map, None, True)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


class _MoeLike(torch.nn.Module):
    def __init__(self, hidden, num_experts, top_k):
        super().__init__()
        self.router = torch.nn.Linear(hidden, num_experts)
        self.expert = torch.nn.Linear(hidden, hidden)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x):
        weights, ids = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        permuted, _, perm_map = permute(x, ids, num_experts=self.num_experts, alignment=8)
        return unpermute(self.expert(permuted), perm_map, weights)


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = _MoeLike(hidden=32, num_experts=8, top_k=2)
    x = torch.randn(24, 32, requires_grad=True)
    eager = model(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), [x])
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    (g_compiled,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(g_compiled, g_eager)
    # A different token count runs through the same (dynamic) graph.
    x2 = torch.randn(17, 32)
    torch.testing.assert_close(compiled(x2), model(x2))


def test_worst_case_capacity_is_a_deprecated_alias_of_permute_capacity():
    """permutation.worst_case_capacity (rows of permute) was renamed permute_capacity: the
    name worst_case_capacity is the EP receive rows' (ops.worst_case_capacity). The old name
    still works in 0.3, with a FutureWarning naming the new one."""
    import te_ep_torch.permutation as permutation

    assert permute_capacity(37, 3, 6, 8) == 37 * 3 + 6 * 7 and permute_capacity(2, 1, 6) == 2
    with pytest.warns(FutureWarning, match=r"te_ep_torch\.permutation\.worst_case_capacity is deprecated and will "
                                           r"be removed in 0\.4: use te_ep_torch\.permutation\.permute_capacity"):
        assert permutation.worst_case_capacity(37, 3, 6, alignment=8) == permute_capacity(37, 3, 6, 8)
