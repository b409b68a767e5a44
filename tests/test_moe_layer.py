"""The MoE layer (te_ep_torch.moe) in one process on CPU: the expert implementations against
a zone-by-zone reference, the layer's options, and the EP-size-1 layer (local permutation)
against the dense reference, eager and compiled. Tolerances: tests/_moe_common.py."""

from __future__ import annotations

import copy

import pytest
import torch

from _moe_common import F32, LAYER_CONFIGS, fresh_compile, make_moe, reference_moe, swiglu
from te_ep_torch.moe import GroupedExperts, MoE


def reference_experts(x, counts, w_gate, w_up, w_down):
    """Each zone through its own expert, zone by zone (host loop over exact slices)."""
    out = torch.zeros(x.shape[0], w_down.shape[2], dtype=x.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        out[start : start + n] = swiglu(x[start : start + n], w_gate[e], w_up[e], w_down[e])
        start += n
    return out


# ---- experts -----------------------------------------------------------------------------


def _zones(counts, align, rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    padded = [(c + align - 1) // align * align for c in counts]
    x = torch.zeros(rows, hidden, dtype=dtype)
    start = 0
    for c, p in zip(counts, padded):
        x[start : start + c] = torch.randn(c, hidden, generator=g).to(dtype)
        start += p
    return x, torch.tensor(padded, dtype=torch.int32)


IMPLS = ["loop"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_experts_match_per_zone_reference(impl):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 24, impl=impl)
    x, counts = _zones([5, 0, 9, 3], 8, 48, 16, torch.float32)
    x.requires_grad_(True)
    y = experts(x, counts)
    ref_w = [p.detach().clone().requires_grad_(True) for p in (experts.w_gate, experts.w_up, experts.w_down)]
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference_experts(x_ref, counts, *ref_w)
    # Rows past the last zone are unspecified (never computed): the zones are compared.
    total = int(counts.sum())
    torch.testing.assert_close(y[:total], ref[:total], **F32)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad[:total], x_ref.grad[:total], **F32)
    for p, r in zip((experts.w_gate, experts.w_up, experts.w_down), ref_w):
        torch.testing.assert_close(p.grad, r.grad, **F32)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is not in this torch")
def test_experts_grouped_mm_bfloat16_matches_loop():
    torch.manual_seed(0)
    loop = GroupedExperts(3, 16, 32, impl="loop")
    gmm = GroupedExperts(3, 16, 32, impl="grouped_mm", dtype=torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(gmm.parameters(), loop.parameters()):
            a.copy_(b)
    x, counts = _zones([16, 32, 0], 16, 64, 16, torch.float32)
    torch.testing.assert_close(
        gmm(x.bfloat16(), counts)[:48].float(), loop(x, counts)[:48], atol=2e-2, rtol=2e-2
    )


def test_experts_auto_is_loop_on_cpu():
    experts = GroupedExperts(2, 16, 16)
    assert experts.resolved_impl(torch.device("cpu"), torch.bfloat16) == "loop"
    assert MoE(16, 16, 2, 1).zone_alignment(torch.device("cpu"), torch.float32) == 1


def test_moe_passes_router_options_to_the_router():
    options = dict(score_func="sigmoid", normalize_weights=False, route_scale=2.5, expert_bias=True,
                   bias_update_rate=0.01, aux_loss_coef=0.1)
    moe = MoE(16, 24, 8, 2, dtype=torch.bfloat16, **options)
    router = moe.router
    assert (router.score_func, router.normalize_weights, router.route_scale, router.bias_update_rate,
            router.aux_loss_coef) == ("sigmoid", False, 2.5, 0.01, 0.1)
    assert router.expert_bias is not None
    # dtype is the experts'; the router weight stays float32.
    assert router.weight.dtype == torch.float32 and moe.experts.w_gate.dtype == torch.bfloat16
    defaults = MoE(16, 24, 8, 2).router
    assert (defaults.score_func, defaults.normalize_weights, defaults.route_scale, defaults.expert_bias,
            defaults.bias_update_rate, defaults.aux_loss_coef) == ("softmax", False, 1.0, None, 1e-3, 0.0)


def test_moe_rejects_an_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword argument 'score_fn'"):
        MoE(16, 24, 8, 2, score_fn="softmax")
    with pytest.raises(TypeError, match="unexpected keyword argument 'process_group'"):
        MoE(16, 24, 8, 2, process_group=None)


# ---- EP size 1 (local permutation) ---------------------------------------------------------

def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", sorted(LAYER_CONFIGS))
def test_local_moe_matches_dense_reference(config):
    moe = make_moe(**LAYER_CONFIGS[config])
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    ref = copy.deepcopy(moe)
    x = torch.randn(3, 7, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = moe(x)
    y_ref = reference_moe(ref, x_ref)
    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref, **F32)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, **F32)
    grads, ref_grads = _grads(moe), _grads(ref)
    assert grads.keys() == ref_grads.keys() and "router.weight" in grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **F32, msg=lambda m, name=name: f"{name}: {m}")


def test_local_moe_returns_aux_loss():
    moe = make_moe(aux_loss_coef=0.1)
    y, aux = moe(torch.randn(10, 16), return_aux_loss=True)
    assert aux is moe.aux_loss and aux.dim() == 0 and aux > 0


def test_local_moe_compiles_fullgraph():
    moe = make_moe(alignment=4, shared_expert_ffn_hidden=8, aux_loss_coef=0.01)
    ref = copy.deepcopy(moe)
    compiled = fresh_compile(moe)
    x = torch.randn(24, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = compiled(x, return_aux_loss=True)
    y_ref, aux_ref = ref(x_ref, return_aux_loss=True)
    torch.testing.assert_close(y, y_ref, **F32)
    torch.testing.assert_close(aux, aux_ref, **F32)
    (y.square().sum() + aux).backward()
    (y_ref.square().sum() + aux_ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **F32)
    ref_grads = _grads(ref)
    for name, grad in _grads(moe).items():
        torch.testing.assert_close(grad, ref_grads[name], **F32, msg=lambda m, name=name: f"{name}: {m}")


def test_enable_expert_parallel_checks_the_shard():
    class FakeGroup:
        num_experts, num_local_experts = 8, 4

    moe = make_moe()
    with pytest.raises(ValueError, match="holds 8 experts"):
        moe.enable_expert_parallel(FakeGroup())
    FakeGroup.num_experts = 6
    with pytest.raises(ValueError, match="num_experts=6"):
        moe.enable_expert_parallel(FakeGroup())
