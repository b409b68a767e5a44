"""The MoE layer with expert parallelism (te_ep_torch.parallel) on several ranks against the
single-process dense reference: forward and every gradient at EP 2 and 4, FSDP2 x EP gradient
scaling, DCP across EP sizes, and torch.compile. Workers in fresh processes on CPU, and on
GPUs in the tests marked ``gpu`` (tests/_moe_common.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _moe_common import (F32, LAYER_CONFIGS, assert_close, fresh_compile, make_moe, need_gpus, reference_moe,
                         run_workers)
from te_ep_torch.moe import MoE
from te_ep_torch.options import EpOptions


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- expert parallelism vs dense reference ----------------------------------------------


def _worker_ep_vs_dense(ctx, config: str, dtype: str = "float32") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = torch.device(ctx.device), getattr(torch, dtype)
    moe = make_moe(seed=1, dtype=dt, **LAYER_CONFIGS[config]).to(device)
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    ref = copy.deepcopy(moe)
    # Uneven token counts per rank; the same global batch everywhere.
    counts = [6 + 3 * r for r in range(world)]
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(sum(counts), 16, generator=g).to(device, dt)
    grad_all = torch.randn(sum(counts), 16, generator=g).to(device, dt)
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=max(counts),
                                                 options=EpOptions(backend=ctx.backend)))

    e_local = 8 // world
    for name in ("w_gate", "w_up", "w_down"):
        p = getattr(moe.experts, name)
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, type(p))
        assert p.shape == getattr(ref.experts, name).shape and p.to_local().shape[0] == e_local
        torch.testing.assert_close(p.to_local(), getattr(ref.experts, name)[rank * e_local : (rank + 1) * e_local])
    assert not isinstance(moe.router.weight, DTensor)
    assert moe.ep_size == world
    allowed = ("reference",) if device.type == "cpu" else ("reference", "nccl_ep")
    assert moe.ep_group.backend in allowed, moe.ep_group.backend
    print(f"rank {rank}: backend {moe.ep_group.backend}, experts {moe.experts.resolved_impl(device, dt)}", flush=True)

    x = x_all[lo:hi].clone().requires_grad_(True)
    y = moe(x)
    y.backward(grad_all[lo:hi])

    x_ref = x_all.clone().requires_grad_(True)
    y_ref = reference_moe(ref, x_ref)
    y_ref.backward(grad_all)

    assert_close(y, y_ref[lo:hi].detach(), "output", dt)
    assert_close(x.grad, x_ref.grad[lo:hi], "input grad", dt)
    for name, p in moe.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        if isinstance(p, DTensor):
            # Expert shard: its local backward already sums the losses of all ranks' tokens.
            assert_close(p.grad.to_local(), ref_grad[rank * e_local : (rank + 1) * e_local], name, dt)
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_close(grad, ref_grad, name, dt)


@pytest.mark.parametrize(
    "nprocs,config", [(2, "softmax"), (4, "softmax-aligned-shared"), (4, "sigmoid-bias-scaled")]
)
def test_expert_parallel_matches_dense(nprocs, config):
    run_workers(_worker_ep_vs_dense, nprocs, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("config,dtype", [("softmax-aligned-shared", "float32"), ("sigmoid-bias-scaled", "bfloat16")])
def test_expert_parallel_matches_dense_gpu(nprocs, config, dtype):
    need_gpus(nprocs)
    run_workers(_worker_ep_vs_dense, nprocs, device="cuda", config=config, dtype=dtype)


# ---- FSDP2 x EP gradients -------------------------------------------------------------------


class TinyModel(torch.nn.Module):
    """Dense layer -> MoE -> dense layer, enough to have both kinds of parameters."""

    def __init__(self, seed: int, **moe_kw):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 16)
        self.moe = MoE(16, 24, 8, 2, **moe_kw)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def _loss(model, x, target):
    out = model(x)
    return F.mse_loss(out, target) + model.moe.aux_loss, out


def _worker_fsdp_grads(ctx, dp: int, ep: int) -> None:
    from torch.distributed.tensor import DTensor

    from te_ep_torch.parallel import init_moe_mesh, parallelize_moe_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(ctx.device)
    moe_kw = dict(aux_loss_coef=0.05, shared_expert_ffn_hidden=8)
    model = TinyModel(3, **moe_kw).to(device)
    ref = copy.deepcopy(model)
    tokens = 10
    g = torch.Generator().manual_seed(11)
    x_all = torch.randn(world * tokens, 16, generator=g).to(device)
    t_all = torch.randn(world * tokens, 4, generator=g).to(device)

    mesh = init_moe_mesh(device.type, dp=dp, ep=ep)
    parallelize_moe_model(model, mesh, max_tokens_per_rank=tokens, options=EpOptions(backend=ctx.backend),
                          blocks=[model.moe])
    w = model.moe.experts.w_gate
    assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("dp", "ep"), w
    assert [type(p).__name__ + str(getattr(p, "dim", "")) for p in w.placements] == ["Shard1", "Shard0"]
    assert isinstance(model.inp.weight, DTensor) and model.inp.weight.device_mesh.size() == world

    sl = slice(rank * tokens, (rank + 1) * tokens)
    loss, out = _loss(model, x_all[sl], t_all[sl])
    loss.backward()
    ref_loss, ref_out = _loss(ref, x_all, t_all)
    ref_loss.backward()

    assert_close(out, ref_out[sl].detach(), "output")
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    assert_close(mean_loss / world, ref_loss.detach(), "loss")
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), (names, list(ref_params))
    for name, p in model.named_parameters():
        assert_close(_full(p.grad), ref_params[name].grad, name)


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4)])
def test_fsdp_expert_parallel_gradients_equal_unsharded(dp, ep):
    run_workers(_worker_fsdp_grads, dp * ep, dp=dp, ep=ep)


@pytest.mark.gpu
@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4), (1, 2)])
def test_fsdp_expert_parallel_gradients_equal_unsharded_gpu(dp, ep):
    need_gpus(dp * ep)
    run_workers(_worker_fsdp_grads, dp * ep, device="cuda", dp=dp, ep=ep)


# ---- distributed checkpoint -------------------------------------------------------------------


def _build_parallel(seed: int, dp: int, ep: int, lr: float = 0.0):
    from te_ep_torch.parallel import init_moe_mesh, parallelize_moe_model

    model = TinyModel(seed, expert_bias=True, score_func="sigmoid")
    mesh = init_moe_mesh("cpu", dp=dp, ep=ep)
    parallelize_moe_model(model, mesh, max_tokens_per_rank=8, options=EpOptions(backend="reference"))
    return model, torch.optim.Adam(model.parameters(), lr=lr or 1e-2)


def _full_state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {f"model.{k}": _full(v).clone() for k, v in get_model_state_dict(model).items()}
    for pname, state in get_optimizer_state_dict(model, optim)["state"].items():
        for k, v in state.items():
            out[f"optim.{pname}.{k}"] = _full(v).clone()
    return out


def _train_step(model, optim, seed):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    loss = model(torch.randn(8, 16, generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    model.moe.update_expert_bias()


def _worker_dcp(ctx, layouts) -> None:
    from te_ep_torch.parallel import load_checkpoint, save_checkpoint

    for i, ((dp_a, ep_a), (dp_b, ep_b)) in enumerate(layouts):
        path = os.path.join(ctx.tmp_dir, f"ckpt{i}")
        a, opt_a = _build_parallel(10 + i, dp_a, ep_a)
        _train_step(a, opt_a, seed=i)  # non-trivial optimizer state and expert bias
        assert a.moe.router.expert_bias.abs().sum() > 0
        save_checkpoint(path, a, opt_a)
        expected = _full_state(a, opt_a)

        b, opt_b = _build_parallel(20 + i, dp_b, ep_b)
        _train_step(b, opt_b, seed=100 + i)
        assert any(not torch.equal(v, expected[k]) for k, v in _full_state(b, opt_b).items())
        load_checkpoint(path, b, opt_b)
        got = _full_state(b, opt_b)
        assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        # Same weights, same tokens: same outputs under both layouts.
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        torch.testing.assert_close(b(x), a(x), **F32)
        # And training goes on identically.
        _train_step(a, opt_a, seed=1000)
        _train_step(b, opt_b, seed=1000)
        a_state = _full_state(a, opt_a)
        for k, v in _full_state(b, opt_b).items():
            torch.testing.assert_close(v, a_state[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_dcp_round_trip_across_ep_sizes():
    # EP=4 -> EP=2 x dp 2, and EP=2 x dp 2 -> EP=4.
    run_workers(_worker_dcp, 4, layouts=[[(1, 4), (2, 2)], [(2, 2), (1, 4)]])


def test_dcp_round_trip_ep2_to_ep1():
    # EP=2 -> dp 2 (EP=1: every rank holds all experts).
    run_workers(_worker_dcp, 2, layouts=[[(1, 2), (2, 1)]])


# ---- compile with expert parallelism ----------------------------------------------------------


def _worker_compile(ctx, dtype: str = "float32", chunks: int = 1) -> None:
    """A compiled layer (``fullgraph=True``; its step in ``chunks`` chunks) gives the eager
    unchunked layer's results, in one graph."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch import EpOptions
    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = torch.device(ctx.device), getattr(torch, dtype)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    models = []
    for n in (1, chunks):
        # alignment None: 16 rows where the experts run torch._grouped_mm (CUDA bf16), else 1.
        moe = make_moe(seed=5, shared_expert_ffn_hidden=8, aux_loss_coef=0.01, dtype=dt).to(device)
        parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=12,
                                                     options=EpOptions(backend=ctx.backend, chunks=n)))
        moe.router.process_group = dist.group.WORLD  # global aux loss: a functional all-reduce in the graph
        models.append(moe)
    eager, to_compile = models
    compiled = fresh_compile(to_compile)
    results = []
    for model in (eager, compiled):
        for step in range(2):  # the second step reuses the handles and the compiled graph
            x = torch.randn(12, 16, generator=torch.Generator().manual_seed(rank * 10 + step)).to(device, dt)
            x.requires_grad_(True)
            y, aux = model(x, return_aux_loss=True)
            (y.square().sum() + aux).backward()
            results.append((y.detach(), x.grad))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])
    for (y_e, gx_e), (y_c, gx_c) in zip(results[:2], results[2:]):
        assert_close(y_c, y_e, "output", dt)
        assert_close(gx_c, gx_e, "input grad", dt)
    for (name, p_e), (_, p_c) in zip(eager.named_parameters(), to_compile.named_parameters()):
        g_e, g_c = p_e.grad, p_c.grad
        if isinstance(g_e, DTensor):
            g_e, g_c = g_e.to_local(), g_c.to_local()
        # The compute dtype sets the tolerance: the float32 router's gradient flows
        # back through bfloat16 expert outputs, which inductor rounds differently.
        assert_close(g_c, g_e, name, dt)


def test_compile_fullgraph_with_expert_parallel():
    """On CPU the compiled layer runs a chunked step (tests/test_moe_chunks.py): the unchunked
    step is its one-chunk case, compiled on GPUs below."""
    run_workers(_worker_compile, 2, timeout=480, chunks=2)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_fullgraph_with_expert_parallel_gpu(dtype, chunks):
    need_gpus(2)
    run_workers(_worker_compile, 2, timeout=400, device="cuda", dtype=dtype, chunks=chunks)
