"""te_ep_torch.testing.fp8_reference: the block-scaled e4m3 semantics te_ep's FP8 kernels are to match."""

import math

import pytest
import torch

from te_ep_torch.testing.fp8_reference import BLOCK, E4M3_MAX, dequantize_reference, quantize_reference


def _e4m3_codes_rne(v: torch.Tensor) -> torch.Tensor:
    """Independent oracle: the e4m3fn code (0..126, no sign) nearest to each |v| <= 448, ties to the
    even code (= even mantissa), from a table of every finite e4m3 value."""
    codes = torch.arange(127, dtype=torch.uint8)
    table = codes.view(torch.float8_e4m3fn).double()  # 0, subnormals, normals up to 448, increasing
    dist = (v.double().abs().reshape(-1, 1) - table.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # among tied codes, the even one (two neighbours tie at most)
    even = tied & (codes.reshape(1, -1) % 2 == 0)
    pick = torch.where(even.any(dim=1), even.float().argmax(dim=1), tied.float().argmax(dim=1))
    return codes[pick].reshape(v.shape)


def _rows(dtype, tokens=6, hidden=3 * BLOCK, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, tokens).reshape(-1, 1)
    return x.to(dtype)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_values_are_round_to_nearest_even_of_x_over_scale(dtype, pow2):
    x = _rows(dtype)
    q, scales = quantize_reference(x, pow2_scales=pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], x.shape[1] // BLOCK)
    v = x.float().reshape(x.shape[0], -1, BLOCK) / scales.unsqueeze(-1)
    assert v.abs().max() <= E4M3_MAX * (1 + 2**-20)
    bits = q.view(torch.uint8).reshape(v.shape)
    assert torch.equal(bits & 0x7F, _e4m3_codes_rne(v)), "values differ from round-to-nearest-even"
    nonzero = bits & 0x7F != 0
    assert torch.equal((bits >> 7)[nonzero], (v < 0).to(torch.uint8)[nonzero]), "signs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_and_round_trip(dtype):
    x = _rows(dtype, seed=1)
    q, scales = quantize_reference(x)
    amax = x.float().reshape(x.shape[0], -1, BLOCK).abs().amax(-1)
    torch.testing.assert_close(scales, amax / E4M3_MAX, rtol=0, atol=0)
    # the largest element of every block lands on +-448
    top = (x.float().reshape(x.shape[0], -1, BLOCK).abs().argmax(-1, keepdim=True))
    assert torch.equal(q.float().reshape(x.shape[0], -1, BLOCK).gather(-1, top).abs(),
                       torch.full_like(top, E4M3_MAX, dtype=torch.float32))
    back = dequantize_reference(q, scales)
    err = (back - x.float()).abs().reshape(x.shape[0], -1, BLOCK)
    bound = x.float().abs().reshape(err.shape) * 2**-4 + scales.unsqueeze(-1) * 2**-10
    assert (err <= bound).all()
    assert dequantize_reference(q, scales, dtype).dtype == dtype


def test_pow2_scales_are_exact_powers_of_two():
    x = _rows(torch.float32, seed=2)
    _, scales = quantize_reference(x, pow2_scales=True)
    exponent = torch.log2(scales)
    assert torch.equal(exponent, exponent.round())
    ratio = x.reshape(x.shape[0], -1, BLOCK).abs().amax(-1) / scales
    assert (ratio <= E4M3_MAX).all() and (ratio > E4M3_MAX / 2).all()


def test_zero_block_has_scale_one_and_zero_values():
    x = _rows(torch.bfloat16)
    x[2, BLOCK : 2 * BLOCK] = 0
    q, scales = quantize_reference(x)
    assert scales[2, 1] == 1.0
    assert torch.equal(q[2, BLOCK : 2 * BLOCK].float(), torch.zeros(BLOCK))
    assert torch.equal(dequantize_reference(q, scales)[2, BLOCK : 2 * BLOCK], torch.zeros(BLOCK))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_non_finite_input_poisons_its_block_only(bad):
    x = _rows(torch.float32, seed=3)
    clean_q, clean_s = quantize_reference(x)
    x[1, 5] = bad
    q, scales = quantize_reference(x)
    assert math.isnan(scales[1, 0])
    assert torch.isnan(q[1, :BLOCK].float()).all()
    assert torch.isnan(dequantize_reference(q, scales)[1, :BLOCK]).all()
    keep = torch.ones_like(scales, dtype=torch.bool)
    keep[1, 0] = False
    assert torch.equal(scales[keep], clean_s[keep])
    same = torch.ones_like(x, dtype=torch.bool)
    same[1, :BLOCK] = False
    assert torch.equal(q.view(torch.uint8)[same], clean_q.view(torch.uint8)[same])


def test_subnormal_inputs_stay_finite_and_accurate():
    tiny = torch.tensor([1e-44, -3e-42, 1e-40, 2e-39], dtype=torch.float32)
    x = torch.zeros(2, BLOCK)
    x[0, :4] = tiny
    x[1, :] = 1e-41
    q, scales = quantize_reference(x)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    back = dequantize_reference(q, scales)
    assert torch.isfinite(back).all()
    assert (back[0, :4] != 0).all(), "subnormal inputs must not flush to zero"
    assert ((back - x).abs() <= x.abs() * 2**-4 + scales.repeat_interleave(BLOCK, dim=1) * 2**-10).all()


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"H = 100 must be a multiple of the block size 128"):
        quantize_reference(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="x must be one of"):
        quantize_reference(torch.zeros(2, BLOCK, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"2-D \[T, H\]"):
        quantize_reference(torch.zeros(BLOCK))
    q, s = quantize_reference(torch.ones(2, BLOCK))
    with pytest.raises(ValueError, match="q must be torch.float8_e4m3fn"):
        dequantize_reference(q.float(), s)
    with pytest.raises(ValueError, match="scales must be float32"):
        dequantize_reference(q, s.double())
