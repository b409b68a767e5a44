"""te_ep_torch.zones and the te_ep.zone_* ops: values and gradients on the rows in use,
rows past the zones never written, fake kernels, compile; CPU here, CUDA where present.

The references are plain PyTorch on the rows in use, in float32; the zone ops compute in
float32 and round once, so float32 results agree to rounding and bfloat16 ones to one
bfloat16 rounding of the result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_ep_torch  # noqa: F401  (loads the library)
from te_ep_torch.zones import (HeldWeightGrads, expert_ffn, grouped_linear, weighted_for_combine, zone_bias, zone_glu,
                               zone_scale)

NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_GPU])]
SENTINEL = 12345.0
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _counts(device, sizes=(3, 0, 5, 2)):
    return torch.tensor(sizes, dtype=torch.int32, device=device)


def _rows(n, cols, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cols, generator=gen).to(dtype=dtype, device=device)


def _clamp(x, limit, lower=False):
    """te_ep's clamp (docs/ops.md, zone_glu): an input equal to a bound is inside and keeps its
    gradient; only one past it gets zero. Written with where, not clamp: torch's clamp changed its
    rule on the bound (2.11 passes the gradient, 2.15 zeroes it), te_ep's kernels keep 2.11's on
    every torch, and bfloat16 activations do land on a bound such as gpt-oss's 7.0."""
    x = torch.where(x > limit, limit, x)
    return torch.where(x < -limit, -limit, x) if lower else x


def _glu_ref(gate_up, gate, interleaved, alpha, limit):
    x = gate_up.float()
    f = x.shape[1] // 2
    g, u = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :f], x[:, f:])
    if gate == "swiglu":
        return F.silu(g) * u
    g = _clamp(g, limit)
    u = _clamp(u, limit, lower=True)
    return (u + 1) * g * torch.sigmoid(g * alpha)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,layout", [("swiglu", "halves"), ("swiglu", "interleaved"), ("swiglu", "split"),
                                         ("clamped_swiglu", "interleaved"), ("clamped_swiglu", "split")])
def test_zone_glu_values_and_gradient(device, dtype, gate, layout):
    counts = _counts(device)
    total = int(counts.sum())
    alpha, limit = 1.702, 1.5  # limit small enough that the clamps bite on randn inputs
    gate_up = (_rows(total + 6, 16, dtype, device) * 2).requires_grad_()
    if layout == "split":
        # gate and up as two tensors (two grouped GEMMs): the halves of the same data.
        g_in, u_in = (t.detach().contiguous().requires_grad_() for t in gate_up.split(8, dim=1))
        h = zone_glu(g_in, counts, gate, False, alpha, limit, up=u_in)
    else:
        h = zone_glu(gate_up, counts, gate, layout == "interleaved", alpha, limit)
    assert h.shape == (total + 6, 8) and h.dtype == dtype
    ref_in = gate_up.detach()[:total].float().requires_grad_()
    ref = _glu_ref(ref_in, gate, layout == "interleaved", alpha, limit)
    torch.testing.assert_close(h[:total].float(), ref, **TOL[dtype])
    grad_h = _rows(total + 6, 8, dtype, device, seed=1)
    if layout == "split":
        grad = torch.cat(torch.autograd.grad(h, (g_in, u_in), grad_h), dim=1)
    else:
        (grad,) = torch.autograd.grad(h, gate_up, grad_h)
    ref.backward(grad_h[:total].float())
    torch.testing.assert_close(grad[:total].float(), ref_in.grad, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_zone_glu_clamp_passes_the_gradient_on_the_bound(device):
    """Inputs on and past the clamps' bounds, where random data lands only by chance: on a bound
    the gradient passes, past it it is zero (_clamp's rule)."""
    limit = 1.5
    g = torch.tensor([1.5, 1.5, 1.5, 2.0, 0.5, 0.5])
    u = torch.tensor([0.5, 1.5, -1.5, 0.5, 2.0, -2.0])
    x = torch.stack([g, u], dim=1).to(device).requires_grad_()
    counts = torch.tensor([2, 4], dtype=torch.int32, device=device)
    h = zone_glu(x, counts, "clamped_swiglu", False, 1.702, limit)
    (grad,) = torch.autograd.grad(h.sum(), x)
    ref_in = x.detach().cpu().requires_grad_()
    _glu_ref(ref_in, "clamped_swiglu", False, 1.702, limit).sum().backward()
    torch.testing.assert_close(grad.cpu(), ref_in.grad, **TOL[torch.float32])
    inside = torch.stack([g <= limit, u.abs() <= limit], dim=1)
    assert torch.equal(grad.cpu() != 0, inside), grad


@pytest.mark.parametrize("device", DEVICES)
def test_zone_glu_bfloat16_rounds_as_the_eager_expression(device):
    """In bfloat16 the gates give what the models' eager expressions give (each step rounded),
    forward and backward: te_ep's experts reproduce the model's own numerics (on a clamp's
    bound, te_ep's rule: _clamp)."""
    # Bit for bit on the CPU (the same ATen expression); on CUDA within one bfloat16 unit
    # (the kernel's sigmoid uses the fast exponential, torch's its own).
    exact = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=2**-7, atol=2**-7)
    counts = _counts(device)
    total = int(counts.sum())
    x = (_rows(total, 16, torch.bfloat16, device) * 3).requires_grad_()
    g, u = x[:, 0::2], x[:, 1::2]
    ref = (_clamp(u, 7.0, lower=True) + 1) * (_clamp(g, 7.0) * torch.sigmoid(_clamp(g, 7.0) * 1.702))
    h = zone_glu(x, counts, "clamped_swiglu", True, 1.702, 7.0)
    torch.testing.assert_close(h, ref, **exact)
    d = _rows(total, 8, torch.bfloat16, device, seed=4)
    torch.testing.assert_close(torch.autograd.grad(h, x, d)[0], torch.autograd.grad(ref, x, d)[0], **exact)
    gs, us = x[:, :8], x[:, 8:]
    ref = torch.nn.functional.silu(gs) * us
    h = zone_glu(x, counts, "swiglu")
    torch.testing.assert_close(h, ref, **exact)
    torch.testing.assert_close(torch.autograd.grad(h, x, d)[0], torch.autograd.grad(ref, x, d)[0], **exact)


@pytest.mark.parametrize("device", DEVICES)
def test_zone_ops_do_not_write_past_the_zones(device):
    """The rows past the zones of an output are not written (their work is not done)."""
    counts = _counts(device)
    total = int(counts.sum())
    y = _rows(total + 4, 8, torch.float32, device)
    w = torch.rand(total + 4, device=device)
    out = torch.full_like(y, SENTINEL)
    torch.ops.te_ep.zone_scale_into(y, w, counts, out)
    torch.testing.assert_close(out[:total], y[:total] * w[:total, None])
    assert (out[total:] == SENTINEL).all()
    grad_y, grad_w = torch.ops.te_ep.zone_scale_bwd(y, y, w, counts)
    assert (grad_w[total:] == 0).all(), "the weights' gradient is zero past the zones"
    torch.testing.assert_close(grad_w[:total], (y[:total] * y[:total]).sum(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zone_bias_and_scale_gradients(device, dtype):
    counts = _counts(device)
    total = int(counts.sum())
    zone = torch.repeat_interleave(torch.arange(4, device=device), counts.long())
    y = _rows(total + 3, 8, dtype, device).requires_grad_()
    bias = _rows(4, 8, dtype, device, seed=2).requires_grad_()
    w = torch.rand(total + 3, device=device, requires_grad=True)
    out = zone_scale(zone_bias(y, bias, counts), w, counts)
    grad_out = _rows(total + 3, 8, dtype, device, seed=3)
    gy, gb, gw = torch.autograd.grad(out, (y, bias, w), grad_out)

    ry, rb, rw = (t.detach().float().requires_grad_() for t in (y[:total], bias, w[:total]))
    ref = (ry + rb[zone]) * rw[:, None]
    torch.testing.assert_close(out[:total].float(), ref, **TOL[dtype])
    ref.backward(grad_out[:total].float())
    torch.testing.assert_close(gy[:total].float(), ry.grad, **TOL[dtype])
    torch.testing.assert_close(gb.float(), rb.grad, **TOL[dtype])
    torch.testing.assert_close(gw[:total], rw.grad, **TOL[dtype])
    assert (gw[total:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_zone_add_and_the_fork_of_a_twice_read_input(device):
    """The gradient of rows two grouped GEMMs read is summed on the zones' rows only, with
    one rounding (autograd's own sum would cover the whole buffer)."""
    counts = _counts(device)
    total = int(counts.sum())
    a, b = _rows(total + 4, 8, torch.bfloat16, device), _rows(total + 4, 8, torch.bfloat16, device, 1)
    out = torch.ops.te_ep.zone_add(a, b, counts)
    torch.testing.assert_close(out[:total], a[:total] + b[:total], rtol=0, atol=0)
    into = torch.full_like(a, SENTINEL)
    torch.ops.te_ep.zone_add_into(a, b, counts, into)
    assert torch.equal(into[:total], out[:total]) and (into[total:] == SENTINEL).all()
    x = _rows(total + 4, 8, torch.float32, device).requires_grad_()
    w1 = _rows(32, 6, torch.float32, device, 1).view(4, 8, 6)
    w2 = _rows(32, 6, torch.float32, device, 2).view(4, 8, 6)
    w3 = _rows(24, 8, torch.float32, device, 3).view(4, 6, 8)
    y = expert_ffn(x, counts, (w1, w2), w3, impl="loop")
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().requires_grad_()
    zone = torch.repeat_interleave(torch.arange(4, device=device), counts.long())
    h = F.silu(torch.einsum("rh,rhf->rf", xr[:total], w1[zone])) * torch.einsum("rh,rhf->rf", xr[:total], w2[zone])
    ref = torch.einsum("rf,rfo->ro", h, w3[zone])
    (gr,) = torch.autograd.grad(ref, xr, g[:total])
    torch.testing.assert_close(gx[:total], gr[:total], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_counts_past_the_buffer_stop_at_its_rows(device):
    counts = torch.tensor([4, 9], dtype=torch.int32, device=device)
    y = _rows(6, 4, torch.float32, device)
    w = torch.ones(6, device=device)
    torch.testing.assert_close(zone_scale(y, w, counts), y)


def _shifted(t):
    """``t``'s values at an address one element past a 16-byte boundary: the CUDA kernels then
    take one element an access instead of 16 bytes."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view_as(t)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


@pytest.mark.gpu
@NO_GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zone_kernels_give_the_same_bits_with_and_without_wide_accesses(dtype):
    """At a layer's widths (a buffer of 37 rows in use of 48, widths 1536 and 4096) every zone
    kernel gives the same bits whether its rows are 16-byte aligned (16 bytes an access) or
    not (one element an access); the weights' gradient, a dot product a row, only sums in
    another order. Both agree with the CPU ops."""
    dev = "cuda"
    counts = torch.tensor([20, 0, 17], dtype=torch.int32, device=dev)
    total = int(counts.sum())
    g, u, d = (_rows(48, 1536, dtype, dev, seed) for seed in (0, 1, 2))
    y, grad, b = (_rows(48, 4096, dtype, dev, seed) for seed in (3, 4, 5))
    bias = _rows(3, 4096, dtype, dev, 6)
    w = torch.rand(48, device=dev)
    te = torch.ops.te_ep

    def run(g, u, d, y, grad, b, bias, w):
        out = torch.full_like(y, SENTINEL)
        te.zone_scale_into(y, w, counts.to(y.device), out)
        c = counts.to(y.device)
        return [te.zone_glu(g, c, "swiglu", False, 1.0, 0.0, u),
                te.zone_glu(g, c, "clamped_swiglu", False, 1.702, 1.5, u),
                *te.zone_glu_bwd(d, g, c, "swiglu", False, 1.0, 0.0, u),
                *te.zone_glu_bwd(d, g, c, "clamped_swiglu", False, 1.702, 1.5, u),
                te.zone_bias(y, bias, c), te.zone_add(grad, b, c), te.zone_scale(y, w, c), out,
                *te.zone_scale_bwd(grad, y, w, c)]

    inputs = (g, u, d, y, grad, b, bias, w)
    wide = run(*inputs)
    narrow = run(*(_shifted(t) for t in inputs[:-1]), w)
    cpu = run(*(t.cpu() for t in inputs))
    assert (wide[9][total:] == SENTINEL).all() and (narrow[9][total:] == SENTINEL).all(), "rows past the zones written"
    dot = dict(rtol=1e-4, atol=1e-3)  # the weights' gradient: 4096-term sums in another order
    for i, (a, c) in enumerate(zip(wide[:-1], narrow[:-1])):
        assert torch.equal(a[:total], c[:total]), f"output {i}: wide and narrow accesses differ"
    torch.testing.assert_close(wide[-1], narrow[-1], **dot)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    for i, (a, c) in enumerate(zip(wide, cpu)):
        torch.testing.assert_close(a[:total].cpu().float(), c[:total].float(), **(dot if i == len(wide) - 1 else tol),
                                   msg=lambda m, i=i: f"output {i} against the CPU op: {m}")


def test_bad_arguments_name_the_argument():
    counts = _counts("cpu")
    y = torch.zeros(10, 8)
    with pytest.raises(RuntimeError, match="counts must be a 1-D torch.int32"):
        zone_scale(y, torch.zeros(10), counts.long())
    with pytest.raises(RuntimeError, match="weights must be a 1-D torch.float32 tensor of 10 rows"):
        zone_scale(y, torch.zeros(9), counts)
    with pytest.raises(RuntimeError, match="gate must be 'swiglu' or 'clamped_swiglu'"):
        zone_glu(y, counts, "gelu")
    with pytest.raises(RuntimeError, match="gate_up must have an even number of columns"):
        zone_glu(torch.zeros(10, 7), counts)
    with pytest.raises(RuntimeError, match=r"bias must have 4 rows"):
        zone_bias(y, torch.zeros(3, 8), counts)
    with pytest.raises(RuntimeError, match="limit must be > 0"):
        zone_glu(y, counts, "clamped_swiglu", True, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="up must have 10 rows"):
        zone_glu(y, counts, up=torch.zeros(9, 8))
    with pytest.raises(RuntimeError, match="interleaved applies to one gate_up tensor"):
        zone_glu(y, counts, interleaved=True, up=y)


def _dense_ffn(x, zone, w1, w2, b1, b2, gate, interleaved, alpha, limit):
    h = torch.einsum("rh,rhf->rf", x.float(), w1.float()[zone])
    if b1 is not None:
        h = h + b1.float()[zone]
    h = _glu_ref(h, gate, interleaved, alpha, limit)
    y = torch.einsum("rf,rfo->ro", h, w2.float()[zone])
    return y if b2 is None else y + b2.float()[zone]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias,gate,interleaved,split", [(False, "swiglu", False, False),
                                                               (False, "swiglu", False, True),
                                                               (True, "clamped_swiglu", True, False)])
def test_expert_ffn_matches_dense_experts(device, with_bias, gate, interleaved, split):
    counts = _counts(device)
    total = int(counts.sum())
    zone = torch.repeat_interleave(torch.arange(4, device=device), counts.long())
    hidden, ffn = 8, 6
    x = _rows(total + 5, hidden, torch.float32, device).requires_grad_()
    w1 = (_rows(4 * hidden, 2 * ffn, torch.float32, device, 1).view(4, hidden, 2 * ffn) / 3).requires_grad_()
    w2 = (_rows(4 * ffn, hidden, torch.float32, device, 2).view(4, ffn, hidden) / 3).requires_grad_()
    b1 = _rows(4, 2 * ffn, torch.float32, device, 3).requires_grad_() if with_bias else None
    b2 = _rows(4, hidden, torch.float32, device, 4).requires_grad_() if with_bias else None
    kw = dict(gate=gate, interleaved=interleaved, alpha=1.702, limit=7.0)
    y = expert_ffn(x, counts, (w1[..., :ffn], w1[..., ffn:]) if split else w1, w2, b1=b1, b2=b2, impl="loop", **kw)
    ref = _dense_ffn(x[:total], zone, w1, w2, b1, b2, **kw)
    torch.testing.assert_close(y[:total], ref, rtol=1e-4, atol=1e-4)
    params = [x, w1, w2] + ([b1, b2] if with_bias else [])
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, params, g)
    ref_grads = torch.autograd.grad(ref, params, g[:total])
    for got, want in zip(grads, ref_grads):
        n = total if got.shape[0] == x.shape[0] else got.shape[0]
        torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)


def test_expert_ffn_model_activation():
    """A model's own activation (no zone kernel for it) runs in place of the gate."""
    counts = _counts("cpu")
    total = int(counts.sum())
    x = _rows(total, 8, torch.float32, "cpu")
    w1 = _rows(32, 6, torch.float32, "cpu", 1).view(4, 8, 6)
    w2 = _rows(24, 8, torch.float32, "cpu", 2).view(4, 6, 8)
    y = expert_ffn(x, counts, w1, w2, activation=F.gelu, impl="loop")
    zone = torch.repeat_interleave(torch.arange(4), counts.long())
    ref = torch.einsum("rf,rfo->ro", F.gelu(torch.einsum("rh,rhf->rf", x, w1[zone])), w2[zone])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gate must be one of"):
        expert_ffn(x, counts, w1, w2, gate="relu")
    with pytest.raises(ValueError, match=r"w1=\(w_gate, w_up\) takes no b1"):
        expert_ffn(x, counts, (w1, w1), w2, b1=torch.zeros(4, 6))
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_linear(x, w1, counts, impl="dense")


@pytest.mark.parametrize("device", DEVICES)
def test_held_weight_grads_come_after_the_dispatch_backward(device):
    """Experts run on HeldWeightGrads' weights give torch._grouped_mm's own outputs and
    gradients, bit for bit; in backward the input gradients come first, then the backward of
    the op that took ``order`` (a dispatch, here a stand-in), then the weight gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = torch.tensor([16, 0, 24, 8], dtype=torch.int32, device=device)
    x0 = _rows(56, 32, torch.bfloat16, device)
    w1 = _rows(4 * 32, 48, torch.bfloat16, device, 1).view(4, 32, 48)
    w2 = _rows(4 * 32, 48, torch.bfloat16, device, 2).view(4, 32, 48)
    w3 = _rows(4 * 48, 32, torch.bfloat16, device, 3).view(4, 48, 32)
    grad_y = _rows(56, 32, torch.bfloat16, device, 4)
    log = []

    window = torch.empty_like(x0)
    window_grads = []

    class Dispatch(torch.autograd.Function):
        """A dispatch's autograd shape: tokens in, rows out, ``order`` taken and given nothing."""

        @staticmethod
        def forward(ctx, tokens, order):
            return tokens.clone()

        @staticmethod
        def backward(ctx, grad):
            log.append("dispatch_bwd")
            window_grads.append(grad.data_ptr() == window.data_ptr())
            return grad.clone(), None

    class GemmLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._grouped_mm:
                log.append("wgrad" if args[1].dim() == 2 else "gemm")
            return func(*args, **(kwargs or {}))

    def step(hold):
        weights = [w.clone().requires_grad_() for w in (w1, w2, w3)]
        tokens = x0.clone().requires_grad_()
        held = HeldWeightGrads(weights) if hold else None
        run = held.weights if hold else weights
        rows = Dispatch.apply(tokens, held.order if hold else None)
        y = expert_ffn(rows, counts, (run[0], run[1]), run[2], impl="grouped_mm", held=held,
                       grad_into=window if hold else None)
        log.clear()
        with GemmLog():
            y.backward(grad_y)
        return [y, tokens.grad] + [w.grad for w in weights], list(log)

    held_results, held_log = step(True)
    plain_results, plain_log = step(False)
    for i, (a, b) in enumerate(zip(held_results, plain_results)):
        assert torch.equal(a[:40], b[:40]) if i < 2 else torch.equal(a, b), f"result {i} differs when held"
    # The rows' gradient reached the dispatch in the window it was written into (held run only).
    assert window_grads == [True, False], window_grads
    # Held: the three GEMMs' input gradients, the dispatch's backward, then the weight gradients.
    assert held_log == ["gemm"] * 3 + ["dispatch_bwd"] + ["wgrad"] * 3, held_log
    assert plain_log.index("dispatch_bwd") == len(plain_log) - 1 and plain_log.count("wgrad") == 3, plain_log
    with pytest.raises(ValueError, match="w must be one of its weights"):
        HeldWeightGrads([w1.clone().requires_grad_()]).linear(x0, w1, counts)
    with pytest.raises(ValueError, match="held weight gradients need impl='grouped_mm'"):
        grouped_linear(x0, w1, counts, impl="loop", held=HeldWeightGrads([w1.clone().requires_grad_()]))


def test_bench_zone_ops_compares_like_with_like():
    """benchmarks/bench_zone_ops.py's PyTorch baseline computes what each te_ep op computes, on
    the rows in use (CPU, small shapes)."""
    from benchmarks import bench_zone_ops

    for name, _, _, te_call, torch_call in bench_zone_ops.cases(96, 64, 32, torch.float32, dev="cpu"):
        got, want = te_call(), torch_call()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            torch.testing.assert_close(a[:96], b[:96], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_weighted_for_combine_without_a_window_is_zone_scale():
    counts = _counts("cpu")
    y = _rows(12, 4, torch.float32, "cpu")
    w = torch.rand(12)
    total = int(counts.sum())
    torch.testing.assert_close(weighted_for_combine(y, w, counts)[:total], zone_scale(y, w, counts)[:total])


def test_one_rule_says_when_rows_go_into_the_combine_window():
    """ops.zones.fits_window is the rule both writers of a zero-copy handle's combine window
    follow (the weighting before combine, and EpStep.run's grad_into for the experts' input
    gradient): zero-copy mode, eager, rows [capacity, hidden] of the handle's dtype; and
    expert_ffn refuses a grad_into it cannot write instead of falling back."""
    from types import SimpleNamespace

    from te_ep_torch.ops.zones import fits_window

    cfg = SimpleNamespace(capacity=12, hidden=4, dtype=torch.float32)
    zero_copy, staged = SimpleNamespace(mode="zero_copy", config=cfg), SimpleNamespace(mode="staged", config=cfg)
    rows = torch.zeros(12, 4)
    assert fits_window(zero_copy, rows)
    assert not fits_window(staged, rows) and not fits_window(None, rows)
    assert not fits_window(zero_copy, torch.zeros(11, 4)) and not fits_window(zero_copy, torch.zeros(12, 8))
    assert not fits_window(zero_copy, rows.bfloat16())
    assert not torch.compile(lambda r: torch.tensor(fits_window(zero_copy, r)), fullgraph=True)(rows)

    counts = _counts("cpu")
    x = _rows(12, 4, torch.float32, "cpu").requires_grad_()
    w_gate, w_up, w_down = (torch.randn(4, 4, 6), torch.randn(4, 4, 6), torch.randn(4, 6, 4))
    with pytest.raises(ValueError, match=r"grad_into must be torch.float32 of shape \(12, 4\)"):
        expert_ffn(x, counts, (w_gate, w_up), w_down, impl="loop", grad_into=torch.zeros(12, 8))
    with pytest.raises(ValueError, match=r"grad_into must be torch.float32 of shape \(12, 4\)"):
        expert_ffn(x, counts, (w_gate, w_up), w_down, impl="loop", grad_into=torch.zeros(12, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"grad_into needs w1=\(w_gate, w_up\)"):
        expert_ffn(x, counts, torch.cat([w_gate, w_up], 2), w_down, impl="loop", grad_into=torch.zeros(12, 4))
    # A grad_into it can write: x's gradient is written there, on the rows in use.
    into = torch.full((12, 4), 7.0)
    total = int(counts.sum())
    expert_ffn(x, counts, (w_gate, w_up), w_down, impl="loop", grad_into=into).sum().backward()
    want = x.grad.clone()
    x.grad = None
    expert_ffn(x, counts, (w_gate, w_up), w_down, impl="loop").sum().backward()
    torch.testing.assert_close(want[:total], x.grad[:total])
    assert torch.equal(into[:total], want[:total])


@pytest.mark.parametrize(
    "op,args",
    [
        ("zone_glu", lambda c: (torch.randn(10, 8, requires_grad=True), c, "swiglu", False, 1.0, 0.0)),
        ("zone_glu", lambda c: (torch.randn(10, 8, requires_grad=True), c, "clamped_swiglu", True, 1.7, 7.0)),
        ("zone_glu", lambda c: (torch.randn(10, 4, requires_grad=True), c, "swiglu", False, 1.0, 0.0,
                                torch.randn(10, 4, requires_grad=True))),
        ("zone_bias", lambda c: (torch.randn(10, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True), c)),
        ("zone_scale", lambda c: (torch.randn(10, 8, requires_grad=True), torch.rand(10, requires_grad=True), c)),
        ("zone_scale_bwd", lambda c: (torch.randn(10, 8), torch.randn(10, 8), torch.rand(10), c)),
        ("zone_add", lambda c: (torch.randn(10, 8), torch.randn(10, 8), c)),
        ("zone_add_into", lambda c: (torch.randn(10, 8), torch.randn(10, 8), c, torch.zeros(10, 8))),
    ],
)
def test_opcheck(op, args):
    # Counts that fill the buffer: every output row is then written, so runs compare equal.
    torch.library.opcheck(getattr(torch.ops.te_ep, op).default, args(_counts("cpu")))


def test_compiled_expert_ffn_fullgraph():
    counts = _counts("cpu")
    x = _rows(10, 8, torch.float32, "cpu")
    w1 = _rows(32, 12, torch.float32, "cpu", 1).view(4, 8, 12)
    w2 = _rows(24, 8, torch.float32, "cpu", 2).view(4, 6, 8)
    w = torch.rand(10)

    def step(x, counts, w1, w2, w):
        return zone_scale(expert_ffn(x, counts, w1, w2, impl="loop"), w, counts)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, counts, w1, w2, w), step(x, counts, w1, w2, w))
