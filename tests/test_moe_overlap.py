"""The overlapped MoE layer (``overlap=True``: dispatch and combine on a communication
stream): bitwise the sequential layer, step after step, with the schedule of its ops checked;
on CPU through a stand-in stream, on GPUs (tests marked ``gpu``) with a delayed stream, in a
CUDA graph, and with ``record_stream`` keeping a dropped input alive (tests/_moe_common.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from _moe_common import make_moe, need_gpus, need_nccl_ep, run_workers
from te_ep_torch.options import EpOptions


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


def _worker_overlap(ctx, dtype: str = "float32", fp8: bool = False, stress: bool = False, aux: str = "group") -> None:
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
    device, dt = torch.device(ctx.device), getattr(torch, dtype)
    hidden = 512 if fp8 else 64
    router = dict(score_func="softmax") if aux == "group" else dict(score_func="sigmoid", expert_bias=True)
    kw = dict(seed=6, hidden=hidden, ffn=96, experts=8, top_k=2, shared_expert_ffn_hidden=128, dtype=dt,
              dispatch_dtype="fp8" if fp8 else None, aux_loss_coef=0.01, **router)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    layers = []
    for ov in (False, True):
        m = make_moe(overlap=ov, **kw).to(device)
        parallelize_module(m, mesh, ExpertParallel(max_tokens_per_rank=64, options=EpOptions(backend=ctx.backend)))
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

            def record(self):
                return "event"

            def join(self, outputs, after=None):
                assert all(t is None or isinstance(t, torch.Tensor) for t in outputs)
                assert after == "event", after
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

        def logged_join(self, outputs, after=None):
            log.append(("join", None))
            join(self, outputs, after)

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
    run_workers(_worker_overlap, 2, fp8=fp8, aux=aux)


@pytest.mark.gpu
@pytest.mark.quick
@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("dtype,fp8,stress,aux", [("float32", False, True, "group"), ("bfloat16", False, True, "group"),
                                                  ("bfloat16", True, True, "local"), ("bfloat16", False, False, "local")])
def test_overlap_layer_matches_sequential_gpu(nprocs, dtype, fp8, stress, aux):
    need_gpus(nprocs)
    run_workers(_worker_overlap, nprocs, timeout=300, device="cuda", dtype=dtype, fp8=fp8, stress=stress, aux=aux)


def _worker_overlap_graph(ctx) -> None:
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
@pytest.mark.quick
@pytest.mark.parametrize("nprocs", [1, 2])
def test_overlap_layer_in_a_cuda_graph_gpu(nprocs):
    need_gpus(nprocs)
    need_nccl_ep()  # the reference backend reads routing counts on the host: no capture
    run_workers(_worker_overlap_graph, nprocs, timeout=300, device="cuda")


# Cycles the communication stream spins before the op of the record_stream test (tens of ms
# on an H100 or H200): far longer than the host needs to drop the input and refill its memory.
_RECORD_STREAM_SPIN = 50_000_000


def _worker_record_stream(ctx, op: str, record: bool) -> None:
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
    need_gpus(1)
    if op == "dispatch":
        need_nccl_ep()
    run_workers(_worker_record_stream, 1, timeout=300, device="cuda", op=op, record=record)


def test_overlap_module_functions_are_deprecated():
    """``overlap.launch`` / ``join`` / ``overlapped`` still work (0.3) and say what replaces them:
    the EP step owns when a layer's ops fork and join (te_ep_torch.step)."""
    from te_ep_torch import overlap

    t = torch.ones(3)
    with pytest.warns(FutureWarning, match=r"overlap\.launch is deprecated and will be removed in 0\.4: call "
                                           r"CommStream\.launch"):
        out = overlap.launch(None, lambda: t * 2, (t,))
    with pytest.warns(FutureWarning, match=r"overlap\.join is deprecated"):
        assert overlap.join(None, out) is out
    with pytest.warns(FutureWarning, match=r"overlap\.overlapped is deprecated .*EpStep\.run"):
        result, side = overlap.overlapped(None, lambda: t + 1, (t,), meanwhile=lambda: "side")
    assert torch.equal(out, t * 2) and torch.equal(result, t + 1) and side == "side"
