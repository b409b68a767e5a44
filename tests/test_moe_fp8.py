"""The MoE layer with FP8 dispatch (``dispatch_dtype="fp8"``): on several ranks against the
dense reference whose experts see the FP8 round trip of their input, compiled, on GPUs
(tests marked ``gpu``), at EP size 1, and its option errors (tests/_moe_common.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _moe_common import assert_close, fresh_compile, make_moe, need_gpus, reference_moe, run_workers
from te_ep_torch.moe import MoE


# ---- FP8 dispatch -----------------------------------------------------------------------------

# Relative error (Frobenius) of the FP8-dispatch layer's output against the same layer with a
# plain dispatch: e4m3 keeps 3 mantissa bits, a rounding error of at most 2^-4 of each value
# (about 2^-4 / sqrt(3) = 3.6% RMS for uniformly spread mantissas), which the experts' sums
# average down; 0.05 leaves headroom. Measured on CPU: about 0.02.
FP8_LAYER_REL_ERROR = 0.05


def _worker_fp8_dispatch(ctx, dtype: str = "float32", compile: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import te_ep_torch as te
    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = torch.device(ctx.device), getattr(torch, dtype)
    hidden = 512  # a multiple of 512: what nccl_ep's FP8 dispatch needs
    kw = dict(seed=3, hidden=hidden, ffn=32, experts=8, top_k=2, shared_expert_ffn_hidden=16, dtype=dt)
    counts = [5 + 4 * r for r in range(world)]
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    fp8 = make_moe(dispatch_dtype="fp8", **kw).to(device)
    plain = make_moe(**kw).to(device)
    ref = copy.deepcopy(plain)
    for m in (fp8, plain):
        parallelize_module(m, mesh, ExpertParallel(max_tokens_per_rank=max(counts),
                                                   options=te.EpOptions(backend=ctx.backend)))
    g = torch.Generator().manual_seed(11)
    x_all = torch.randn(sum(counts), hidden, generator=g).to(device, dt)
    grad_all = torch.randn(sum(counts), hidden, generator=g).to(device, dt)
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])

    def run(model, steps=1):
        for step in range(steps):
            x = x_all[lo:hi].clone().requires_grad_(True)
            y = model(x)
            y.backward(grad_all[lo:hi])
        return y.detach(), x.grad

    if compile:
        eager = run(fp8, 2)
        fp8_c = make_moe(dispatch_dtype="fp8", **kw).to(device)
        parallelize_module(fp8_c, mesh, ExpertParallel(max_tokens_per_rank=max(counts),
                                                       options=te.EpOptions(backend=ctx.backend)))
        got = run(fresh_compile(fp8_c), 2)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])
        assert_close(got[0], eager[0], "compiled output", dt)
        assert_close(got[1], eager[1], "compiled input grad", dt)
        return

    y, gx = run(fp8)
    # The FP8 layer is the dense reference whose experts see the FP8 round trip of x
    # (straight through in backward); router and shared expert see x itself.
    x_ref = x_all.clone().requires_grad_(True)
    q, scales = te.quantize_fp8(x_ref.detach())
    x_q = x_ref + (te.dequantize_fp8(q, scales, dt) - x_ref).detach()
    y_ref = reference_moe(ref, x_ref, expert_input=x_q)
    y_ref.backward(grad_all)
    assert_close(y, y_ref[lo:hi].detach(), "output", dt)
    assert_close(gx, x_ref.grad[lo:hi], "input grad", dt)
    ref_params = dict(ref.named_parameters())
    for name, p in fp8.named_parameters():
        if isinstance(p, DTensor):
            e_local = 8 // world
            assert_close(p.grad.to_local(), ref_params[name].grad[rank * e_local : (rank + 1) * e_local], name, dt)
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_close(grad, ref_params[name].grad, name, dt)
    # Against the plain dispatch: the error FP8 costs.
    y_plain, _ = run(plain)
    err = torch.tensor([float((y - y_plain).float().square().sum()), float(y_plain.float().square().sum())],
                       device=device, dtype=torch.float64)
    dist.all_reduce(err)
    rel = float(err[0].sqrt() / err[1].sqrt())
    print(f"rank {rank}: FP8 dispatch vs plain: relative output error {rel:.4f}", flush=True)
    assert 0 < rel <= FP8_LAYER_REL_ERROR, f"FP8 dispatch layer differs from the plain one by {rel:.4f}"


@pytest.mark.parametrize("nprocs", [2, 4])
def test_fp8_dispatch_layer_matches_quantized_reference(nprocs):
    run_workers(_worker_fp8_dispatch, nprocs)


def test_fp8_dispatch_layer_compiles_fullgraph():
    run_workers(_worker_fp8_dispatch, 2, timeout=300, compile=True)


@pytest.mark.gpu
@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_dispatch_layer_gpu(dtype):
    need_gpus(2)
    run_workers(_worker_fp8_dispatch, 2, timeout=300, device="cuda", dtype=dtype)


def test_fp8_dispatch_without_expert_parallel_rounds_the_expert_inputs():
    """EP size 1 dispatches nothing, but the experts see the same FP8 round trip as with EP."""
    import te_ep_torch as te

    moe = make_moe(seed=4, hidden=256, ffn=32, dispatch_dtype="fp8", shared_expert_ffn_hidden=8)
    ref = copy.deepcopy(moe)
    x = torch.randn(10, 256, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    grad = torch.randn(10, 256, generator=torch.Generator().manual_seed(3))
    moe(x).backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    q, scales = te.quantize_fp8(x_ref.detach())
    x_q = x_ref + (te.dequantize_fp8(q, scales) - x_ref).detach()
    y_ref = reference_moe(ref, x_ref, expert_input=x_q)
    y_ref.backward(grad)
    assert_close(moe(x).detach(), y_ref.detach(), "output")
    assert_close(x.grad, x_ref.grad, "input grad")
    for (name, p), (_, p_ref) in zip(moe.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, p_ref.grad, name)
    plain = copy.deepcopy(ref)
    plain.dispatch_dtype = None
    rel = float((moe(x) - plain(x)).norm() / plain(x).norm())
    assert 0 < rel <= FP8_LAYER_REL_ERROR, rel


def test_fp8_dispatch_option_errors():
    with pytest.raises(ValueError, match="dispatch_dtype must be None, 'fp8' or torch.float8_e4m3fn"):
        MoE(256, 32, 8, 2, dispatch_dtype="int8")
    with pytest.raises(ValueError, match="multiple of 128, got hidden=200"):
        MoE(200, 32, 8, 2, dispatch_dtype="fp8")
