"""MoE layer (te_ep_torch.moe) and sharding layer (te_ep_torch.parallel) on CPU.

Single-process tests check the router, the expert implementations and the EP-size-1
layer against plain-PyTorch references. Multi-process tests launch their own gloo
workers (reference backend; see ``_launch``) and compare with a single-process dense
reference computed on every rank: forward, every gradient, FSDP2 x EP gradient
scaling, DCP across EP sizes, and torch.compile. The same worker bodies run on GPUs
(NCCL, backend ``auto`` = nccl_ep where usable) in the tests marked ``gpu``, which skip
where fewer GPUs are present.

Tolerances: float32 outputs and gradients ``atol=1e-5, rtol=1e-4`` on CPU and
``atol=1e-4, rtol=1e-3`` on GPUs (only the summation order differs); bfloat16:
``max |diff| <= 3e-2 * max |reference|`` per tensor; bfloat16 grouped GEMM vs float32
loop ``atol=rtol=2e-2``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import te_ep_torch  # noqa: F401  (loads the op library)
from te_ep_torch.moe import GroupedExperts, MoE, TopKRouter

REPO = Path(__file__).resolve().parents[1]
F32 = dict(atol=1e-5, rtol=1e-4)
GPU_F32 = dict(atol=1e-4, rtol=1e-3)
BF16_REL = 3e-2


def _device() -> torch.device:
    """The workers' device: set by ``_launch`` (cuda ranks use the GPU of their rank)."""
    if os.environ.get("TE_EP_TEST_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend() -> str:
    return "reference" if _device().type == "cpu" else "auto"


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


def reference_experts(x, counts, w_gate, w_up, w_down):
    """Each zone through its own expert, zone by zone (host loop over exact slices)."""
    out = torch.zeros(x.shape[0], w_down.shape[2], dtype=x.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        out[start : start + n] = swiglu(x[start : start + n], w_gate[e], w_up[e], w_down[e])
        start += n
    return out


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


# ---- router -----------------------------------------------------------------------------


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
    torch.testing.assert_close(y, ref, **F32)
    assert y[int(counts.sum()) :].abs().max() == 0, "rows after the last zone must be zero"
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, **F32)
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
        gmm(x.bfloat16(), counts).float(), loop(x, counts), atol=2e-2, rtol=2e-2
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

LAYER_CONFIGS = {
    "softmax": dict(),
    "softmax-aligned-shared": dict(alignment=8, shared_expert_ffn_hidden=12),
    "sigmoid-bias-scaled": dict(score_func="sigmoid", expert_bias=True, route_scale=2.5),
}


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


# ---- multi-process harness --------------------------------------------------------------


def _launch(worker: str, nprocs: int, timeout: float = 150.0, device: str = "cpu", **kwargs) -> None:
    """Runs ``worker(**kwargs)`` of this file on ``nprocs`` ranks; fails on any rank's error.

    ``device="cpu"``: gloo ranks; ``"cuda"``: NCCL ranks, one GPU each.

    Each rank is a fresh interpreter (``python tests/test_moe.py <worker>``) in its own
    session; ranks meet through a FileStore in a temporary directory. A rank that
    fails makes the launch kill the others at once, and the launch never waits longer
    than ``timeout``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            OMP_NUM_THREADS="1",
            WORLD_SIZE=str(nprocs),
            TE_EP_TEST_INIT=f"file://{tmp}/store",
            TE_EP_TEST_TMP=tmp,
            TE_EP_TEST_ARGS=json.dumps(kwargs),
            TE_EP_TEST_DEVICE=device,
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1",
        )
        logs, procs = [], []
        for rank in range(nprocs):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), worker],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        failed = timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                failed = True
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        report = []
        for rank, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            report.append(f"--- rank {rank} (exit {p.returncode}) ---\n{log.read()[-4000:]}")
            log.close()
        if timed_out:
            pytest.fail(f"{worker} on {nprocs} ranks timed out after {timeout}s\n" + "\n".join(report))
        if failed or any(p.returncode != 0 for p in procs):
            pytest.fail(f"{worker} on {nprocs} ranks failed\n" + "\n".join(report))


def _worker_main(name: str) -> None:
    torch.set_num_threads(1)
    cuda = os.environ.get("TE_EP_TEST_DEVICE") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=os.environ["TE_EP_TEST_INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    try:
        globals()[name](**json.loads(os.environ["TE_EP_TEST_ARGS"]))
        from te_ep_torch.parallel import shutdown_ep_groups

        shutdown_ep_groups()
        dist.barrier()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}: ok", flush=True)
    os._exit(0)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---- expert parallelism vs dense reference ----------------------------------------------


def _worker_ep_vs_dense(config: str, dtype: str = "float32") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = _device(), getattr(torch, dtype)
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
    parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=max(counts), backend=_backend()))

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
    _launch("_worker_ep_vs_dense", nprocs, config=config)


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, found {torch.cuda.device_count()}")


@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("config,dtype", [("softmax-aligned-shared", "float32"), ("sigmoid-bias-scaled", "bfloat16")])
def test_expert_parallel_matches_dense_gpu(nprocs, config, dtype):
    _need_gpus(nprocs)
    _launch("_worker_ep_vs_dense", nprocs, device="cuda", config=config, dtype=dtype)


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


def _worker_fsdp_grads(dp: int, ep: int) -> None:
    from torch.distributed.tensor import DTensor

    from te_ep_torch.parallel import init_moe_mesh, parallelize_moe_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    moe_kw = dict(aux_loss_coef=0.05, shared_expert_ffn_hidden=8)
    model = TinyModel(3, **moe_kw).to(device)
    ref = copy.deepcopy(model)
    tokens = 10
    g = torch.Generator().manual_seed(11)
    x_all = torch.randn(world * tokens, 16, generator=g).to(device)
    t_all = torch.randn(world * tokens, 4, generator=g).to(device)

    mesh = init_moe_mesh(device.type, dp=dp, ep=ep)
    parallelize_moe_model(model, mesh, max_tokens_per_rank=tokens, backend=_backend(), blocks=[model.moe])
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
    _launch("_worker_fsdp_grads", dp * ep, dp=dp, ep=ep)


@pytest.mark.gpu
@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4), (1, 2)])
def test_fsdp_expert_parallel_gradients_equal_unsharded_gpu(dp, ep):
    _need_gpus(dp * ep)
    _launch("_worker_fsdp_grads", dp * ep, device="cuda", dp=dp, ep=ep)


# ---- distributed checkpoint -------------------------------------------------------------------


def _build_parallel(seed: int, dp: int, ep: int, lr: float = 0.0):
    from te_ep_torch.parallel import init_moe_mesh, parallelize_moe_model

    model = TinyModel(seed, expert_bias=True, score_func="sigmoid")
    mesh = init_moe_mesh("cpu", dp=dp, ep=ep)
    parallelize_moe_model(model, mesh, max_tokens_per_rank=8, backend="reference")
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


def _worker_dcp(layouts) -> None:
    from te_ep_torch.parallel import load_checkpoint, save_checkpoint

    for i, ((dp_a, ep_a), (dp_b, ep_b)) in enumerate(layouts):
        path = os.path.join(os.environ["TE_EP_TEST_TMP"], f"ckpt{i}")
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
    _launch("_worker_dcp", 4, layouts=[[(1, 4), (2, 2)], [(2, 2), (1, 4)]])


def test_dcp_round_trip_ep2_to_ep1():
    # EP=2 -> dp 2 (EP=1: every rank holds all experts).
    _launch("_worker_dcp", 2, layouts=[[(1, 2), (2, 1)]])


# ---- FP8 dispatch -----------------------------------------------------------------------------

# Relative error (Frobenius) of the FP8-dispatch layer's output against the same layer with a
# plain dispatch: e4m3 keeps 3 mantissa bits, a rounding error of at most 2^-4 of each value
# (about 2^-4 / sqrt(3) = 3.6% RMS for uniformly spread mantissas), which the experts' sums
# average down; 0.05 leaves headroom. Measured on CPU: about 0.02.
FP8_LAYER_REL_ERROR = 0.05


def _worker_fp8_dispatch(dtype: str = "float32", compile: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import te_ep_torch as te
    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = _device(), getattr(torch, dtype)
    hidden = 512  # a multiple of 512: what nccl_ep's FP8 dispatch needs
    kw = dict(seed=3, hidden=hidden, ffn=32, experts=8, top_k=2, shared_expert_ffn_hidden=16, dtype=dt)
    counts = [5 + 4 * r for r in range(world)]
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    fp8 = make_moe(dispatch_dtype="fp8", **kw).to(device)
    plain = make_moe(**kw).to(device)
    ref = copy.deepcopy(plain)
    for m in (fp8, plain):
        parallelize_module(m, mesh, ExpertParallel(max_tokens_per_rank=max(counts), backend=_backend()))
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
        parallelize_module(fp8_c, mesh, ExpertParallel(max_tokens_per_rank=max(counts), backend=_backend()))
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
    _launch("_worker_fp8_dispatch", nprocs)


def test_fp8_dispatch_layer_compiles_fullgraph():
    _launch("_worker_fp8_dispatch", 2, timeout=300, compile=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_dispatch_layer_gpu(dtype):
    _need_gpus(2)
    _launch("_worker_fp8_dispatch", 2, timeout=300, device="cuda", dtype=dtype)


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


# ---- overlap: communication on a side stream -----------------------------------------------------


class _OpLog(TorchDispatchMode):
    """Logs ``(op, stream)`` of every ATen and te_ep op (``stream``: the current CUDA stream's
    handle, ``None`` on CPU), next to the ``("launch", None)`` / ``("join", None)`` marks that
    the communication stream (or its CPU stand-in) writes into the same ``log``."""

    def __init__(self, log, device: torch.device):
        super().__init__()
        self.log = log
        self.cuda = device.type == "cuda"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = torch.cuda.current_stream().cuda_stream if self.cuda else None
        self.log.append((str(func.overloadpacket), stream))
        return func(*args, **(kwargs or {}))


def _check_overlap_schedule(forward, backward, comm_stream) -> None:
    """What the overlapped layer issues where, read off the logs of one forward and its backward.

    Forward: launch (dispatch) -> join -> launch (combine) -> join; behind the dispatch (between
    its launch and its join) the router's load count and aux loss and the shared expert's
    gate/up projections, behind the combine the shared expert's down projection. On GPUs
    (``comm_stream`` set) dispatch and combine ran on the communication stream, everything
    else on the current one, and in backward ``combine_bwd`` and ``dispatch_bwd`` ran on the
    communication stream too, with the shared expert's matmuls on the current stream."""
    marks = [(i, name) for i, (name, _) in enumerate(forward) if name in ("launch", "join")]
    assert [name for _, name in marks] == ["launch", "join", "launch", "join"], marks
    (l1, _), (j1, _), (l2, _), (j2, _) = marks
    behind_dispatch = [name for name, _ in forward[l1 + 1 : j1]]
    behind_combine = [name for name, _ in forward[l2 + 1 : j2]]
    for op in ("aten.add_", "aten.mean", "aten.mm", "aten.silu"):  # load count, aux loss, gate/up
        assert op in behind_dispatch, (op, behind_dispatch)
    assert behind_combine.count("aten.mm") == 1 and "aten.silu" not in behind_combine, behind_combine
    comm_ops = [name for name, _ in forward[:l1] if name.startswith("te_ep.dispatch")]
    assert len(comm_ops) == 1, forward[:l1]
    assert [name for name, _ in forward[j1:l2] if name == "te_ep.combine"] == ["te_ep.combine"]
    backward_comm = [name for name, _ in backward if name in ("te_ep.combine_bwd", "te_ep.dispatch_bwd")]
    assert backward_comm == ["te_ep.combine_bwd", "te_ep.dispatch_bwd"], backward_comm
    if comm_stream is None:
        return
    for name, stream in forward:
        if name.startswith("te_ep.dispatch") or name == "te_ep.combine":
            assert stream == comm_stream, (name, "ran on the current stream")
    for name, stream in forward[l1 + 1 : j1] + forward[l2 + 1 : j2]:
        assert stream not in (None, comm_stream), (name, "behind a communication op but not on the current stream")
    for name, stream in backward:
        if name in ("te_ep.combine_bwd", "te_ep.dispatch_bwd"):
            assert stream == comm_stream, (name, "ran on the current stream")
        elif name == "aten.mm":
            assert stream != comm_stream, "a matmul's backward ran on the communication stream"


def _worker_overlap(dtype: str = "float32", fp8: bool = False, stress: bool = False, aux: str = "group") -> None:
    """The overlapped layer (dispatch/combine on the communication stream; the router's
    statistics and aux loss and the shared expert's halves on the current one) gives bitwise the
    sequential layer's output, aux loss, expert load and gradients, step after step with varying
    token counts; then one more step's ops are checked against the schedule
    (:func:`_check_overlap_schedule`). ``aux``: ``"group"`` = softmax router whose aux loss sums
    the choice counts over the world (a collective before the dispatch's launch), ``"local"`` =
    sigmoid router with a selection bias and a local aux loss. ``stress`` (GPU): every launch on
    the communication stream first sleeps there (~1 ms), so reading a dispatch or combine output
    before the join, or a tensor whose memory was handed on early, would change the results."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch import overlap
    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = _device(), getattr(torch, dtype)
    hidden = 512 if fp8 else 64
    router = dict(score_func="softmax") if aux == "group" else dict(score_func="sigmoid", expert_bias=True)
    kw = dict(seed=6, hidden=hidden, ffn=96, experts=8, top_k=2, shared_expert_ffn_hidden=128, dtype=dt,
              dispatch_dtype="fp8" if fp8 else None, aux_loss_coef=0.01, **router)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    layers = []
    for ov in (False, True):
        m = make_moe(overlap=ov, **kw).to(device)
        parallelize_module(m, mesh, ExpertParallel(max_tokens_per_rank=64, backend=_backend()))
        if aux == "group":
            m.router.process_group = dist.group.WORLD
        else:
            m.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
        layers.append(m)
    log = []
    if device.type == "cpu":
        # No streams on CPU: a stand-in that runs the work at once takes the overlapped
        # control flow (the work behind dispatch and combine between launch and join),
        # which must give the sequential layer's results.
        import te_ep_torch.moe as moe_module

        class InlineStream:
            launches = 0

            def launch(self, fn, inputs):
                InlineStream.launches += 1
                assert all(t is None or isinstance(t, torch.Tensor) for t in inputs)
                result = fn()
                log.append(("launch", None))
                return result

            def join(self, outputs):
                assert all(t is None or isinstance(t, torch.Tensor) for t in outputs)
                log.append(("join", None))

        moe_module.comm_stream_for = lambda dev: InlineStream()
    else:
        launch, join = overlap.CommStream.launch, overlap.CommStream.join

        def logged_launch(self, fn, inputs):
            if stress:
                run = fn

                def fn():
                    torch.cuda._sleep(2_000_000)
                    return run()
            result = launch(self, fn, inputs)
            log.append(("launch", None))
            return result

        def logged_join(self, outputs):
            log.append(("join", None))
            join(self, outputs)

        overlap.CommStream.launch, overlap.CommStream.join = logged_launch, logged_join

    def step(model, i):
        g = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(20 + 9 * i + 3 * rank, hidden, generator=g).to(device, dt).requires_grad_(True)
        y, aux_loss = model(x, return_aux_loss=True)
        return x, y, aux_loss, y.float().square().sum() + y.float().sum() + aux_loss

    results = []
    for model in layers:
        outs = []
        for i in range(4):
            x, y, aux_loss, loss = step(model, i)
            loss.backward()
            outs.append((y.detach().clone(), aux_loss.detach().clone(), x.grad.clone()))
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters()}
        results.append((outs, grads, model.read_expert_load()))
    (seq_outs, seq_grads, seq_load), (ov_outs, ov_grads, ov_load) = results
    for i, ((y_s, aux_s, gx_s), (y_o, aux_o, gx_o)) in enumerate(zip(seq_outs, ov_outs)):
        assert torch.equal(y_s, y_o), f"step {i}: output differs with overlap"
        assert torch.equal(aux_s, aux_o), f"step {i}: aux loss differs with overlap"
        assert torch.equal(gx_s, gx_o), f"step {i}: input grad differs with overlap"
    assert seq_grads.keys() == ov_grads.keys() and "router.weight" in seq_grads and "shared_expert.down.weight" in seq_grads
    for name in seq_grads:
        assert torch.equal(seq_grads[name], ov_grads[name]), f"{name}: grad differs with overlap"
    assert torch.equal(seq_load, ov_load) and int(seq_load.sum()) > 0
    if device.type == "cuda":
        assert layers[1].overlap and overlap.comm_stream_for(device) is not None
        comm_stream = overlap.comm_stream_for(device).stream.cuda_stream
    else:
        assert InlineStream.launches == 2 * 4, InlineStream.launches  # dispatch and combine, 4 steps
        assert overlap.comm_stream_for(device) is None
        comm_stream = None
    # One more step of the overlapped layer, its ops logged.
    log.clear()
    with _OpLog(log, device):
        x, y, aux_loss, loss = step(layers[1], 4)
    forward = list(log)
    log.clear()
    with _OpLog(log, device):
        loss.backward()
    _check_overlap_schedule(forward, list(log), comm_stream)


@pytest.mark.parametrize("fp8,aux", [(False, "group"), (False, "local"), (True, "local")])
def test_overlap_layer_matches_sequential(fp8, aux):
    """On CPU: the overlapped control flow with work run at once (see the worker)."""
    _launch("_worker_overlap", 2, fp8=fp8, aux=aux)


@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("dtype,fp8,stress,aux", [("float32", False, True, "group"), ("bfloat16", False, True, "group"),
                                                  ("bfloat16", True, True, "local"), ("bfloat16", False, False, "local")])
def test_overlap_layer_matches_sequential_gpu(nprocs, dtype, fp8, stress, aux):
    _need_gpus(nprocs)
    _launch("_worker_overlap", nprocs, timeout=300, device="cuda", dtype=dtype, fp8=fp8, stress=stress, aux=aux)


def _need_nccl_ep() -> None:
    from te_ep_torch import _nccl_ep

    reason = _nccl_ep.availability()
    if reason:
        pytest.skip(f"needs the nccl_ep backend: {reason}")


def _worker_overlap_graph() -> None:
    """Forwards of overlapped layers captured in a CUDA graph replay bitwise like eager, for the
    captured input and a new one: the benchmarks' TeEpMoEBlock and the MoE layer (router
    statistics and aux loss behind the dispatch, the shared expert split over dispatch and
    combine)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel, ep_group_for
    from te_ep_torch.testing.moe_blocks import MoEConfig, TeEpMoEBlock

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    cfg = MoEConfig(hidden=1024, ffn=512, num_experts=8, top_k=2, dtype=torch.bfloat16, shared_ffn=512)
    block = TeEpMoEBlock(cfg, ep_group_for(mesh, num_experts=8, max_tokens_per_rank=256), alignment=16, overlap=True)
    layer = make_moe(seed=7, hidden=1024, ffn=512, experts=8, top_k=2, shared_expert_ffn_hidden=512,
                     aux_loss_coef=0.01, overlap=True, dtype=torch.bfloat16).to("cuda")
    parallelize_module(layer, mesh, ExpertParallel(max_tokens_per_rank=256))
    for name, module in (("TeEpMoEBlock", block), ("MoE", layer)):
        x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(dist.get_rank())).to("cuda", torch.bfloat16)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
                for _ in range(2):
                    module(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = module(x)
            for step in range(2):
                if step:
                    x.copy_(torch.randn_like(x))
                graph.replay()
                torch.cuda.synchronize()
                eager = module(x)
                assert torch.equal(out, eager), f"{name}: replay {step} differs from eager (world {world})"


@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [1, 2])
def test_overlap_layer_in_a_cuda_graph_gpu(nprocs):
    _need_gpus(nprocs)
    _need_nccl_ep()  # the reference backend reads routing counts on the host: no capture
    _launch("_worker_overlap_graph", nprocs, timeout=300, device="cuda")


# Cycles the communication stream spins before the op of the record_stream test (tens of ms
# on an H100 or H200): far longer than the host needs to drop the input and refill its memory.
_RECORD_STREAM_SPIN = 50_000_000


def _worker_record_stream(op: str, record: bool) -> None:
    """An input of work launched on the communication stream, whose last reference is dropped
    right after the launch, must stay intact until that work has read it.

    The communication stream is held back by a spin, then runs ``op`` on the input: an
    ``ep_dispatch`` (nccl_ep, EP size 1: its kernel reads the tokens on that stream) or
    te_ep's ``quantize_fp8`` kernel (any CUDA build). Meanwhile the current stream allocates and
    fills tensors of the input's size. After the join, the op's result must equal the one
    computed synchronously beforehand, bit for bit.

    ``record=False`` is the negative control: :mod:`te_ep_torch.overlap` with its
    ``record_stream`` calls taken out. The caching allocator then hands the input's block to one
    of the new tensors at once, and the op reads the fill instead of the input. That reuse is
    deterministic here: blocks are pooled per stream, and the test runs on a fresh side stream
    after ``torch.cuda.empty_cache()``, so the input's block is the only free block of its size
    class in that stream's pool when the first fill of the same size is allocated; the worker
    asserts the reuse (same data pointer) before it asserts the corruption.
    """
    import te_ep_torch as te
    from te_ep_torch import overlap

    if not record:
        overlap._record_stream = lambda t, stream: None
    torch.manual_seed(0)
    tokens, hidden = 1024, 4096
    src = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    group = None
    if op == "dispatch":
        group = te.EpGroup(num_experts=8, max_tokens_per_rank=tokens, backend="nccl_ep")
        handle = group.create_handle(top_k=2, hidden=hidden, dtype=torch.bfloat16)
        topk_idx = torch.rand(tokens, 8, device="cuda").topk(2, dim=-1).indices
        topk_weights = torch.rand(tokens, 2, device="cuda")

        def run(x):
            out = te.ep_dispatch(handle, x, topk_idx, topk_weights, prepared=handle.prepare(topk_idx))
            return out.tokens, out.weights
    elif op == "quantize_fp8":
        def run(x):
            return te.quantize_fp8(x)
    else:
        raise ValueError(op)
    with torch.no_grad():
        expected = tuple(t.clone() for t in run(src))
        # Load every kernel of the window below now: CUDA's lazy loading loads a module at its
        # kernel's first launch, and that load waits for the device, spin included, which
        # would order the fill after the op by accident.
        torch.empty_like(src).fill_(3.0)
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        comm = overlap.comm_stream_for(src.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            inputs = [src.clone()]
            freed = inputs[0].data_ptr()

            def spin_then_run():
                torch.cuda._sleep(_RECORD_STREAM_SPIN)
                return run(inputs[0])

            result = comm.launch(spin_then_run, inputs)
            inputs.clear()  # the last reference to the input: its block is freed now
            fills = [torch.empty_like(src).fill_(3.0) for _ in range(2)]
            reused = any(t.data_ptr() == freed for t in fills)
            comm.join(result)
        torch.cuda.synchronize()
    if group is not None:
        group.shutdown()
    exact = all(torch.equal(a, b) for a, b in zip(result, expected))
    print(f"op {op}, record {record}: block reused {reused}, result exact {exact}", flush=True)
    if record:
        assert not reused, "the allocator handed out the input's block while the communication stream still had to read it"
        assert exact, "the launched op's result differs from the synchronous one"
    else:
        assert reused, "negative control: the allocator did not hand the freed block to the next allocation"
        assert not exact, "negative control: the op read refilled memory, yet its result did not change"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["quantize_fp8", "dispatch"])
@pytest.mark.parametrize("record", [True, False], ids=["record_stream", "negative_control"])
def test_overlap_record_stream_gpu(op, record):
    """record_stream keeps a dropped input of launched work alive (``record_stream``); with the
    record taken out the same case reads refilled memory (``negative_control``)."""
    _need_gpus(1)
    if op == "dispatch":
        _need_nccl_ep()
    _launch("_worker_record_stream", 1, timeout=300, device="cuda", op=op, record=record)


# ---- compile with expert parallelism ----------------------------------------------------------


def _worker_compile(dtype: str = "float32") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch.parallel import ExpertParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = _device(), getattr(torch, dtype)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    models = []
    for _ in range(2):
        # alignment None: 16 rows where the experts run torch._grouped_mm (CUDA bf16), else 1.
        moe = make_moe(seed=5, shared_expert_ffn_hidden=8, aux_loss_coef=0.01, dtype=dt).to(device)
        parallelize_module(moe, mesh, ExpertParallel(max_tokens_per_rank=12, backend=_backend()))
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
    _launch("_worker_compile", 2, timeout=240)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_fullgraph_with_expert_parallel_gpu(dtype):
    _need_gpus(2)
    _launch("_worker_compile", 2, timeout=400, device="cuda", dtype=dtype)


if __name__ == "__main__":
    _worker_main(sys.argv[1])


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
