"""The chunked EP step (``EpOptions(chunks=N)``): a ``te.MoE`` whose tokens travel in N chunks,
each on handles of its own, gives the unchunked layer's outputs, aux loss and gradients (up to
the summation order of the experts' GEMMs), step after step with batches of every size (a
full batch, batches smaller than N: empty chunks); its ops are issued in the pipelined order
(every dispatch queued, then per chunk join, experts, combine queued); it compiles with
``fullgraph=True`` (tests/test_moe_parallel.py, ``_worker_compile``); bad arguments raise
naming ``chunks``. CPU (gloo, reference backend) at 2
and 4 ranks; the same worker on GPUs in the tests marked ``gpu``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _moe_common import assert_close, make_moe, need_gpus, run_workers

MAX_TOKENS = 40


def _build(ctx, mesh, n: int, dt, comm_sms: int = 0, **kw):
    from torch.distributed.tensor.parallel import parallelize_module

    from te_ep_torch import EpOptions
    from te_ep_torch.parallel import ExpertParallel

    m = make_moe(seed=3, hidden=64, ffn=48, experts=8, top_k=2, shared_expert_ffn_hidden=32, dtype=dt,
                 aux_loss_coef=0.01, **kw).to(ctx.device)
    parallelize_module(m, mesh, ExpertParallel(max_tokens_per_rank=MAX_TOKENS,
                                               options=EpOptions(backend=ctx.backend, chunks=n, comm_sms=comm_sms)))
    return m


def _grads(model):
    from torch.distributed.tensor import DTensor

    return {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters()}


def _worker_chunks(ctx, dtype: str = "float32", chunks=(2, 3), comm_sms: int = 0) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    device, dt = torch.device(ctx.device), getattr(torch, dtype)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    layers = {n: _build(ctx, mesh, n, dt, comm_sms=comm_sms if n > 1 else 0) for n in (1,) + tuple(chunks)}

    # Handles: one per chunk, on a group of ceil(MAX_TOKENS / n) tokens; the receive rows of the
    # chunks together are the unchunked handle's (the worst case scales with the tokens).
    whole = layers[1].ep_step.chunk_handles[dt]
    assert len(whole) == 1 and layers[1].handles[dt] is whole[0]
    for n in chunks:
        step = layers[n].ep_step
        handles = step.chunk_handles[dt]
        assert step.chunks == n and len(handles) == n and len({h.id for h in handles}) == n
        per_chunk = -(-MAX_TOKENS // n)
        assert all(h.group.max_tokens_per_rank == per_chunk for h in handles), [h.group for h in handles]
        assert handles[0].group is step.group.with_max_tokens(per_chunk)  # one sibling group, shared
        assert layers[n].handles[dt] is handles[0]
        # ceil rounds each chunk up by at most one token of W * top_k rows; each zone pads.
        slack = n * (world * 2 + step.group.num_local_experts * (handles[0].config.alignment - 1))
        assert sum(h.config.capacity for h in handles) <= whole[0].config.capacity + slack, (
            [h.config.capacity for h in handles], whole[0].config.capacity)

    def step_of(model, i):
        sizes = (MAX_TOKENS, 1 + rank, 2 if rank == world - 1 else 5, 17 + 3 * rank)
        g = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(sizes[i], 64, generator=g).to(device, dt).requires_grad_(True)
        y, aux = model(x, return_aux_loss=True)
        loss = y.float().square().sum() + y.float().sum() + aux
        loss.backward()
        return y.detach().clone(), aux.detach().clone(), x.grad.clone()

    results = {n: [step_of(m, i) for i in range(4)] for n, m in layers.items()}
    grads = {n: _grads(m) for n, m in layers.items()}
    for n in chunks:
        for i, ((y1, a1, g1), (yn, an, gn)) in enumerate(zip(results[1], results[n])):
            assert yn.shape == y1.shape
            assert_close(yn, y1, f"chunks={n} step {i} output", dt)
            assert_close(an, a1, f"chunks={n} step {i} aux loss", dt)
            assert_close(gn, g1, f"chunks={n} step {i} input grad", dt)
        assert grads[n].keys() == grads[1].keys() and "shared_expert.down.weight" in grads[1]
        for name in grads[1]:
            assert_close(grads[n][name], grads[1][name], f"chunks={n} {name} grad", dt)
        assert torch.equal(layers[n].read_expert_load(), layers[1].read_expert_load())


def _local_of(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _worker_schedule_and_errors(ctx) -> None:
    """The chunked layer's ops in pipelined order (CPU: a stand-in stream that runs the work at
    once and marks launch and join), and its bad arguments."""
    from torch.distributed.device_mesh import init_device_mesh

    import te_ep_torch.moe as moe_module
    from te_ep_torch import EpOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(ctx.device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    n = 3
    model = _build(ctx, mesh, n, torch.float32)
    log, events, joined = [], [], []

    class InlineStream:
        def launch(self, fn, inputs):
            log.append("launch")
            return fn()

        def record(self):
            # The event behind the latest launch, named by its launch's place.
            events.append(len(events))
            return events[-1]

        def join(self, outputs, after=None):
            log.append("join")
            joined.append(after)

    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name.startswith("te_ep.") or name == "aten.mm":
                log.append(name)
            return func(*args, **(kwargs or {}))

    real = moe_module.comm_stream_for
    moe_module.comm_stream_for = lambda dev: InlineStream()
    try:
        x = torch.randn(30, 64, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        with OpLog():
            y = model(x)
        forward = list(log)
        log.clear()
        with OpLog():
            y.square().sum().backward()
        backward = list(log)
    finally:
        moe_module.comm_stream_for = real
    marks = [e for e in forward if e in ("launch", "join")]
    assert marks == ["launch"] * n + ["join", "launch"] * n + ["join"] * n, marks
    # Launches: dispatch 0..n-1, then combine c after chunk c's join. Each join waits for the
    # event of its own launch, not for the stream's tail (chunk c+1's experts must not wait for
    # combine c): dispatch c's event is c, combine c's is n + c.
    assert joined == list(range(2 * n)), joined
    first_join = forward.index("join")
    assert [e for e in forward[:first_join] if e.startswith("te_ep.dispatch")] == ["te_ep.dispatch"] * n, forward
    # Between chunk c's join and its combine's launch: that chunk's experts and weighting, no
    # communication; the launch is that chunk's combine.
    joins = [i for i, e in enumerate(forward) if e == "join"][:n]
    for c, j in enumerate(joins):
        until = forward.index("launch", j)
        between = forward[j + 1:until]
        assert "te_ep.zone_glu" in between and "aten.mm" in between and "te_ep.zone_scale" in between, (c, between)
        assert not any(e.startswith(("te_ep.dispatch", "te_ep.combine", "te_ep.prepare")) for e in between), between
        assert forward[until + 1] == "te_ep.combine", forward[until:until + 2]
    assert forward.count("te_ep.combine") == n
    assert backward.count("te_ep.combine_bwd") == n and backward.count("te_ep.dispatch_bwd") == n, backward

    # Held weight gradients (experts on torch._grouped_mm, here on CPU): in backward each chunk's
    # dispatch_bwd is queued before its experts' weight-gradient GEMMs, which then run under it;
    # outputs and gradients are the unheld layer's, bit for bit.
    from te_ep_torch.moe import GroupedExperts

    def held_run(hold: bool, comm_sms: int = 0):
        m = _build(ctx, mesh, n, torch.float32, comm_sms=comm_sms, expert_impl="grouped_mm")
        order = []

        class GemmLog(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                if name == "te_ep.dispatch_bwd":
                    order.append("dispatch_bwd")
                elif func.overloadpacket is torch.ops.aten._grouped_mm:
                    kind = "wgrad" if args[1].dim() == 2 else "gemm"
                    carveout = torch._C._get_sm_carveout_experimental()
                    order.append(kind if carveout is None else f"{kind}@{carveout}")
                return func(*args, **(kwargs or {}))

        real_hold = GroupedExperts.hold_weight_grads
        if not hold:
            GroupedExperts.hold_weight_grads = lambda self, tokens, comm_sms=0: None
        moe_module.comm_stream_for = lambda dev: InlineStream()
        try:
            x = torch.randn(30, 64, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
            y = m(x)
            with GemmLog():
                y.square().sum().backward()
        finally:
            moe_module.comm_stream_for = real
            GroupedExperts.hold_weight_grads = real_hold
        return [y.detach(), x.grad] + [p.grad for p in m.parameters()], order

    held_results, held_order = held_run(True)
    plain_results, plain_order = held_run(False)
    for i, (a, b) in enumerate(zip(held_results, plain_results)):
        assert torch.equal(_local_of(a), _local_of(b)), f"result {i} differs when the weight gradients are held"
    assert held_order.count("dispatch_bwd") == n and held_order.count("wgrad") == 3 * n, held_order
    # Every chunk's input-gradient GEMMs (autograd takes the experts, made after every
    # dispatch, first), then chunk by chunk its dispatch_bwd and its 3 weight gradients.
    assert held_order == ["gemm"] * 3 * n + (["dispatch_bwd"] + ["wgrad"] * 3) * n, held_order
    assert plain_order.index("dispatch_bwd") > plain_order.index("wgrad"), plain_order
    # comm_sms: the weight gradients leave the SMs too (so do the chunks' own GEMMs), the
    # caller's setting comes back after.
    carved_results, carved_order = held_run(True, comm_sms=8)
    assert carved_order == ["gemm@8"] * 3 * n + (["dispatch_bwd"] + ["wgrad@8"] * 3) * n, carved_order
    assert torch._C._get_sm_carveout_experimental() is None

    # comm_sms: the experts' GEMMs of each chunk run under torch's SM carveout, forward and
    # backward (a probe inside the experts reads it), and the caller's setting comes back after.
    carved = _build(ctx, mesh, n, torch.float32, comm_sms=8)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx_, rows):
            seen.append(("forward", torch._C._get_sm_carveout_experimental()))
            return rows.view_as(rows)

        @staticmethod
        def backward(ctx_, grad):
            seen.append(("backward", torch._C._get_sm_carveout_experimental()))
            return grad

    experts = carved.experts
    experts_forward = experts.forward
    experts.forward = lambda rows, counts: experts_forward(Probe.apply(rows), counts)
    moe_module.comm_stream_for = lambda dev: InlineStream()
    try:
        x = torch.randn(30, 64, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        carved(x).square().sum().backward()
        assert seen == [("forward", 8)] * n + [("backward", 8)] * n, seen
        assert torch._C._get_sm_carveout_experimental() is None
        seen.clear()
        moe_module.comm_stream_for = real  # CPU: no communication stream, nothing overlaps, no carveout
        carved(x).square().sum().backward()
        assert seen == [("forward", None)] * n + [("backward", None)] * n, seen
    finally:
        moe_module.comm_stream_for = real

    # Bad arguments, each naming what is wrong.
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"chunks must be an int >= 1"):
            EpOptions(chunks=bad)
    for bad in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match=r"comm_sms must be an int >= 0"):
            EpOptions(comm_sms=bad)
    with pytest.raises(ValueError, match=r"one chunk count per layer"):
        model.enable_expert_parallel(model.ep_group, dtype=torch.bfloat16, options=EpOptions(chunks=2))
    with pytest.raises(RuntimeError, match=r"chunks=3 runs through EpStep.run"):
        model.ep_step.dispatch(x, torch.zeros(25, 2, dtype=torch.int64), torch.ones(25, 2))
    too_many = make_moe(seed=3, hidden=64, ffn=48, experts=8, top_k=2)
    from torch.distributed.tensor.parallel import parallelize_module
    from te_ep_torch.parallel import ExpertParallel

    with pytest.raises(ValueError, match=rf"chunks={MAX_TOKENS + 1} is more than max_tokens_per_rank={MAX_TOKENS}"):
        parallelize_module(too_many, mesh, ExpertParallel(
            max_tokens_per_rank=MAX_TOKENS, options=EpOptions(backend=ctx.backend, chunks=MAX_TOKENS + 1)))
    # A batch whose chunks do not fit on one rank: every rank raises, that rank with the message.
    big = torch.randn(60 if rank == 0 else 4, 64)
    with pytest.raises((ValueError, RuntimeError)) as info:
        model(big)
    if rank == 0:
        assert f"has 60 tokens, more than max_tokens_per_rank={MAX_TOKENS}" in str(info.value), repr(info.value)

    # The chunk group is the parent's sibling: the same ranks and options, shut down with it.
    group = model.ep_group
    sibling = group.with_max_tokens(-(-MAX_TOKENS // n))
    assert group.with_max_tokens(MAX_TOKENS) is group
    assert (sibling.group_name, sibling.backend, sibling.checks, sibling.nccl_ep_mode) == (
        group.group_name, group.backend, group.checks, group.nccl_ep_mode)
    assert model.ep_step.chunk_handles[torch.float32][0].group is sibling
    group.shutdown()
    assert sibling.closed and all(not h.alive for h in model.ep_step.chunk_handles[torch.float32])


@pytest.mark.parametrize("nprocs", [2, 4])
def test_chunked_layer_matches_unchunked(nprocs):
    run_workers(_worker_chunks, nprocs, timeout=300)


def test_chunked_layer_schedule_and_errors():
    run_workers(_worker_schedule_and_errors, 2, timeout=300)


@pytest.mark.gpu
@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("comm_sms", [0, 16])
def test_chunked_layer_matches_unchunked_gpu(dtype, comm_sms):
    """The chunks' communication on the communication stream, their GEMMs under an SM carveout
    (16) or not."""
    need_gpus(2)
    run_workers(_worker_chunks, 2, timeout=300, device="cuda", dtype=dtype, chunks=(2, 4), comm_sms=comm_sms)
