"""What the MoE layer tests (tests/test_moe_*.py) share: plain-PyTorch references, the
layer configurations, tolerances and the launch of multi-process workers.

Multi-process tests run their workers in fresh processes (tests/_dist.py, ``run_fresh``):
gloo ranks and the reference backend on CPU; the same worker bodies run on GPUs (NCCL,
backend ``auto`` = nccl_ep where usable) in the tests marked ``gpu``, which skip where fewer
GPUs are present. They compare with a single-process dense reference computed on every rank.

Tolerances: float32 outputs and gradients ``atol=1e-5, rtol=1e-4`` on CPU and
``atol=1e-4, rtol=1e-3`` on GPUs (only the summation order differs); bfloat16:
``max |diff| <= 3e-2 * max |reference|`` per tensor; bfloat16 grouped GEMM vs float32
loop ``atol=rtol=2e-2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import _dist
import te_ep_torch  # noqa: F401  (loads the op library)
from te_ep_torch.moe import MoE, TopKRouter

F32 = dict(atol=1e-5, rtol=1e-4)
GPU_F32 = dict(atol=1e-4, rtol=1e-3)
BF16_REL = 3e-2


def assert_close(got, ref, name="", dtype=torch.float32):
    """float32: ``assert_close`` with the device's tolerance; bfloat16: relative to the max."""
    if dtype == torch.bfloat16:
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
        assert err <= BF16_REL, f"{name}: max |diff| / max |ref| = {err:.3e} > {BF16_REL}"
        return
    tol = F32 if got.device.type == "cpu" else GPU_F32
    torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{name}: {m}")


# ---- plain-PyTorch references ----------------------------------------------------------


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def reference_router(router: TopKRouter, x):
    logits = x.float() @ router.weight.float().t()
    scores = logits.softmax(-1) if router.score_func == "softmax" else logits.sigmoid()
    biased = scores if router.expert_bias is None else scores + router.expert_bias
    idx = biased.topk(router.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if router.normalize_weights:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * router.route_scale, scores


def reference_moe(moe: MoE, x, expert_input=None):
    """Every expert on every token, masked by the routing: no permutation, no communication.

    ``expert_input`` (default ``x``) is what the experts see, e.g. the FP8 round trip of
    ``x``; the router and the shared expert always see ``x``.
    """
    tokens = x.reshape(-1, moe.hidden)
    inp = tokens if expert_input is None else expert_input.reshape(-1, moe.hidden)
    idx, w, _ = reference_router(moe.router, tokens)
    ex = moe.experts
    out = torch.zeros_like(tokens, dtype=torch.float32)
    for e in range(moe.num_experts):
        gate = (w * (idx == e)).sum(-1, keepdim=True)
        out = out + gate * swiglu(inp, ex.w_gate[e], ex.w_up[e], ex.w_down[e]).float()
    out = out.to(x.dtype)
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(tokens)
    return out.reshape(x.shape)


def fresh_compile(module):
    """``torch.compile(fullgraph=True)`` without on-disk caches.

    The caches key on the traced graph, not on the te_ep op library: a cached backward
    could call an op with the argument order of an older build.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    return torch.compile(module, fullgraph=True)


def make_moe(seed=0, hidden=16, ffn=24, experts=8, top_k=2, **kw):
    torch.manual_seed(seed)
    return MoE(hidden, ffn, experts, top_k, **kw)


LAYER_CONFIGS = {
    "softmax": dict(),
    "softmax-aligned-shared": dict(alignment=8, shared_expert_ffn_hidden=12),
    "sigmoid-bias-scaled": dict(score_func="sigmoid", expert_bias=True, route_scale=2.5),
}


def need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, found {torch.cuda.device_count()}")


def need_nccl_ep() -> None:
    from te_ep_torch import _nccl_ep

    reason = _nccl_ep.availability()
    if reason:
        pytest.skip(f"needs the nccl_ep backend: {reason}")


def run_workers(worker, nprocs: int, timeout: float = 150.0, device: str = "cpu", **kwargs) -> None:
    """Runs ``worker(ctx, **kwargs)`` on ``nprocs`` fresh ranks; fails on any rank's error.

    ``device="cpu"``: gloo ranks, reference backend; ``"cuda"``: NCCL ranks, one GPU each,
    backend ``auto``. After the worker, every rank shuts its te_ep groups down and meets the
    others in a barrier.
    """
    _dist.run_fresh(nprocs, _worker_then_shutdown, worker, kwargs, timeout=timeout, device=device)


def _worker_then_shutdown(ctx, worker, kwargs: dict) -> None:
    from te_ep_torch.parallel import shutdown_ep_groups

    worker(ctx, **kwargs)
    shutdown_ep_groups()
    dist.barrier()
