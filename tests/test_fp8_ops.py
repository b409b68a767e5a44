"""te_ep.quantize_fp8 / te_ep.dequantize_fp8: bit for bit the semantics of
te_ep_torch.testing.fp8_reference, on CPU and (where present) CUDA.

Compared bitwise: values (as bytes) and scales (as float32 bits) of every finite block,
dequantized rows; a block holding inf or NaN must have a NaN scale and only NaN values
(the reference's NaN bytes may carry another sign, so NaN blocks compare by isnan).
"""

import pytest
import torch
from torch.library import opcheck

import te_ep_torch as te
from te_ep_torch.testing.fp8_reference import BLOCK, dequantize_reference, quantize_reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The CUDA kernels are in the quick GPU selection (pytest -m "gpu and quick").
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.quick, NO_GPU])]


def _rows(dtype, tokens=24, hidden=4 * BLOCK, seed=0, device="cpu"):
    """Rows over many binades, with a zero block, an inf block, a NaN block and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    span = 12 if dtype == torch.float16 else 60
    x = torch.randn(tokens, hidden, generator=g) * torch.exp2(
        torch.randint(-span, span, (tokens, hidden // BLOCK, 1), generator=g).float()
    ).expand(-1, -1, BLOCK).reshape(tokens, hidden)
    x[1, :BLOCK] = 0
    x[2, BLOCK + 3] = float("inf")
    x[3, 2 * BLOCK + 7] = float("nan")
    x[4, 3 * BLOCK :] = 1e-6 * torch.randn(BLOCK, generator=g)
    return x.to(dtype).to(device)


def _assert_matches_reference(x, pow2):
    q, s = te.quantize_fp8(x, pow2)
    rq, rs = quantize_reference(x.cpu(), pow2_scales=pow2)
    q, s = q.cpu(), s.cpu()
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (x.shape[0], x.shape[1] // BLOCK)
    finite = torch.isfinite(rs)
    assert torch.equal(torch.isfinite(s), finite)
    assert torch.equal(s[finite].view(torch.int32), rs[finite].view(torch.int32)), "scales differ"
    cols = finite.repeat_interleave(BLOCK, dim=1)
    assert torch.equal(q.view(torch.uint8)[cols], rq.view(torch.uint8)[cols]), "values differ"
    assert torch.isnan(q[~cols].float()).all() and torch.isnan(s[~finite]).all()
    return q, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference_bitwise(device, dtype, pow2):
    x = _rows(dtype, device=device)
    q, s = _assert_matches_reference(x, pow2)
    for out_dtype in DTYPES:
        got = te.dequantize_fp8(q.to(device), s.to(device), out_dtype).cpu()
        ref = dequantize_reference(q, s, out_dtype)
        assert got.dtype == out_dtype
        same = torch.isnan(got) & torch.isnan(ref) | (got.view(torch.uint8) == ref.view(torch.uint8)).view(
            got.shape[0], got.shape[1], -1).all(-1)
        assert same.all(), f"dequantize to {out_dtype} differs at {(~same).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
def test_values_round_like_torch_when_the_scale_is_one(device):
    """A block whose amax is 448 has scale 1, so its values are torch's own e4m3 rounding of x:
    every code, every midpoint between neighbours (ties to even), subnormals and signs."""
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (codes[:-1] + codes[1:]) / 2
    near = torch.cat([codes, mid, mid * (1 + 2**-12), mid * (1 - 2**-12), -codes, -mid])
    n = -(-near.numel() // (BLOCK - 1)) * (BLOCK - 1)
    rows = torch.cat([near, torch.zeros(n - near.numel())]).reshape(-1, BLOCK - 1)
    x = torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1).to(device)
    q, s = te.quantize_fp8(x)
    assert torch.equal(s.cpu(), torch.ones(x.shape[0], 1))
    assert torch.equal(q.cpu().view(torch.uint8), x.cpu().to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_pow2_scale_just_above_a_power_of_two(device):
    """amax / 448 one ulp above 2^-10: the scale must be 2^-9 (log2 in float32 would say 2^-10)."""
    s = torch.nextafter(torch.tensor(2.0**-10), torch.tensor(1.0))
    x = torch.zeros(1, BLOCK)
    x[0, 0] = s * 448
    q, scales = te.quantize_fp8(x.to(device), pow2_scales=True)
    assert scales.item() == 2.0**-9
    assert abs(q.float()[0, 0].item()) <= 448
    _assert_matches_reference(x.to(device), True)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_and_empty_inputs(device):
    x = _rows(torch.bfloat16, device=device)
    # a non-contiguous view and a view at an odd offset give the same as a dense copy
    wide = torch.zeros(x.shape[0], x.shape[1] + 3, dtype=x.dtype, device=device)
    wide[:, 3:] = x
    base_q, base_s = te.quantize_fp8(x)
    for view in (wide[:, 3:], x.t().contiguous().t()):
        q, s = te.quantize_fp8(view)
        assert torch.equal(q.view(torch.uint8), base_q.view(torch.uint8))
        assert torch.equal(s.nan_to_num(-1), base_s.nan_to_num(-1))
    q, s = te.quantize_fp8(torch.zeros(0, 2 * BLOCK, device=device))
    assert q.shape == (0, 2 * BLOCK) and s.shape == (0, 2)
    assert te.dequantize_fp8(q, s, torch.bfloat16).shape == (0, 2 * BLOCK)


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(RuntimeError, match=r"x.size\(1\) \(H\) must be a multiple of the block size 128, got H = 100"):
        te.quantize_fp8(torch.zeros(2, 100))
    with pytest.raises(RuntimeError, match="x must be torch.bfloat16, torch.float16 or torch.float32"):
        te.quantize_fp8(torch.zeros(2, BLOCK, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"x must be 2-D \[T, H\]"):
        te.quantize_fp8(torch.zeros(BLOCK))
    q, s = te.quantize_fp8(torch.ones(2, 2 * BLOCK))
    with pytest.raises(RuntimeError, match="values must be torch.float8_e4m3fn"):
        te.dequantize_fp8(q.float(), s)
    with pytest.raises(RuntimeError, match=r"scales must have shape \[2, 2\]"):
        te.dequantize_fp8(q, s[:, :1])
    with pytest.raises(RuntimeError, match="scales must be torch.float32"):
        te.dequantize_fp8(q, s.double())
    with pytest.raises(RuntimeError, match="dtype must be torch.bfloat16, torch.float16 or torch.float32"):
        te.dequantize_fp8(q, s, torch.int32)


# opcheck's test_schema compares float8 tensors (outputs and inputs) with arithmetic torch 2.11 lacks on CPU
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn); the other utils run.
_OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = _rows(torch.bfloat16, tokens=6, device=device)
    x = torch.nan_to_num(x, nan=1.0, posinf=2.0)  # opcheck compares outputs with allclose
    opcheck(torch.ops.te_ep.quantize_fp8, (x,), test_utils=_OPCHECK_UTILS)
    opcheck(torch.ops.te_ep.quantize_fp8, (x, True), test_utils=_OPCHECK_UTILS)
    q, s = te.quantize_fp8(x)
    opcheck(torch.ops.te_ep.dequantize_fp8, (q, s, torch.bfloat16), test_utils=_OPCHECK_UTILS)


def test_compiles_fullgraph():
    x = _rows(torch.float32, tokens=5)
    x = torch.nan_to_num(x, nan=1.0, posinf=2.0)

    def roundtrip(t):
        q, s = te.quantize_fp8(t, True)
        return te.dequantize_fp8(q, s, torch.bfloat16)

    torch._dynamo.reset()
    got = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, roundtrip(x))


@pytest.mark.parametrize("device", DEVICES)
def test_midpoints_under_a_scale_without_exact_reciprocal(device):
    """Scale 3 (amax 1344): x / 3 lands exactly on e4m3 midpoints, where x * (1/3) may not; the
    values must be the round-to-nearest-even of the exact quotient, as in the reference."""
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (codes[:-1] + codes[1:]) / 2  # at most 5 significant bits: times 3 is exact
    vals = torch.cat([mid, -mid, codes]) * 3
    n = -(-vals.numel() // (BLOCK - 1)) * (BLOCK - 1)
    rows = torch.cat([vals, torch.zeros(n - vals.numel())]).reshape(-1, BLOCK - 1)
    x = torch.cat([torch.full((rows.shape[0], 1), 1344.0), rows], dim=1)
    q, s = te.quantize_fp8(x.to(device))
    assert torch.equal(s.cpu(), torch.full((x.shape[0], 1), 3.0))
    assert torch.equal(q.cpu().view(torch.uint8), (x / 3).to(torch.float8_e4m3fn).view(torch.uint8))
    _assert_matches_reference(x.to(device), False)


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_scales(device):
    """Blocks whose scale has no finite float32 reciprocal (below 2^-128) or is subnormal."""
    x = torch.zeros(3, BLOCK)
    x[0, :5] = torch.tensor([1e-44, -3e-43, 1e-42, 0.0, 7e-45])
    x[1, :3] = torch.tensor([2e-39, -1e-38, 5e-39])
    x[2, :] = torch.linspace(-1e-40, 1e-40, BLOCK)
    for pow2 in (False, True):
        _assert_matches_reference(x.to(device), pow2)
