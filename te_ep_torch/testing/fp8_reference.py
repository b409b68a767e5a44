"""Block-scaled FP8 (e4m3) quantization in plain PyTorch: the reference semantics.

The layout DeepSeek-V3 trains with and NCCL EP's ``QUANT_FWD`` recipe moves: a token
row ``[H]`` of bfloat16, float16 or float32 becomes ``H`` ``float8_e4m3fn`` values and
``H / 128`` float32 scales, one per block of 128 consecutive elements, with
``x ~= q * scale`` in each block. This module is the oracle that te_ep's FP8 kernels
and FP8 dispatch are to be held to bitwise; it is written for clarity, not speed.

Semantics (per block ``b`` of a row, ``amax = max |x|`` over the block, in float32):

* ``scale = amax / 448`` (448 is e4m3's largest finite value), or with
  ``pow2_scales=True`` the power of two at or above it, ``2 ** ceil(log2(amax / 448))``
  (UE8M0-style scales: an exact exponent, no mantissa);
* ``scale`` is at least ``2 ** -149`` (float32's smallest subnormal), so a block of
  tiny (even subnormal) inputs never divides by zero: its values then stay below 448;
* ``q = float8_e4m3fn(x / scale)``, rounded to nearest even; ``|x / scale| <= 448`` by
  construction, so nothing saturates (the largest element lands on 448 up to rounding);
* an all-zero block has ``scale = 1`` and zero values;
* a block holding an inf or a NaN has ``scale = NaN`` and every value NaN, so it
  dequantizes to NaN throughout: a non-finite input is never turned into finite
  numbers;
* ``H`` must be a multiple of the block size (a ``ValueError`` names ``H``).

``dequantize_reference(q, scales)`` returns ``q * scale`` per block in float32, or in
``dtype`` when given.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["BLOCK", "E4M3_MAX", "quantize_reference", "dequantize_reference"]

BLOCK = 128
E4M3_MAX = 448.0
_MIN_SCALE = 2.0**-149
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_rows(x: Tensor, block: int, name: str) -> Tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, H], got shape {list(x.shape)}")
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    tokens, hidden = x.shape
    if hidden % block:
        raise ValueError(f"H = {hidden} must be a multiple of the block size {block}")
    return tokens, hidden


def _next_power_of_two(v: Tensor) -> Tensor:
    """The least power of two >= each positive float32 of ``v``, exactly.

    ``exp2(ceil(log2(v)))`` is not exact: just above a power of two, float32 ``log2``
    rounds to the integer and the result falls below ``v``. ``frexp`` splits
    ``v = m * 2**e`` with ``m`` in [0.5, 1) exactly; the answer is ``v`` when ``m`` is
    0.5, else ``2**e``, built from its bits (a normal or a subnormal float32).
    """
    mantissa, exponent = torch.frexp(v)
    e = exponent.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    power = torch.where(e >= -126, normal, subnormal).view(torch.float32)
    return torch.where(mantissa == 0.5, v, power)


def quantize_reference(x: Tensor, block: int = BLOCK, pow2_scales: bool = False) -> Tuple[Tensor, Tensor]:
    """``[T, H]`` bf16/fp16/fp32 -> ``(q [T, H] float8_e4m3fn, scales [T, H / block] float32)``."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    tokens, hidden = _check_rows(x, block, "x")
    blocks = x.float().reshape(tokens, hidden // block, block)
    amax = blocks.abs().amax(dim=-1)
    scale = (amax / E4M3_MAX).clamp_min(_MIN_SCALE)
    if pow2_scales:
        scale = _next_power_of_two(scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.reshape(tokens, hidden), scale


def dequantize_reference(q: Tensor, scales: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``q * scale`` per block: ``[T, H]`` float32 (or ``dtype``)."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be torch.float8_e4m3fn, got {q.dtype}")
    if scales.dtype != torch.float32 or scales.dim() != 2 or scales.shape[0] != q.shape[0] or scales.shape[1] == 0:
        raise ValueError(f"scales must be float32 [T, H / block] for q of shape {list(q.shape)}, "
                         f"got {scales.dtype} {list(scales.shape)}")
    tokens, hidden = q.shape
    if hidden % scales.shape[1]:
        raise ValueError(f"H = {hidden} is not a multiple of the {scales.shape[1]} scale blocks")
    block = hidden // scales.shape[1]
    out = q.float().reshape(tokens, -1, block) * scales.unsqueeze(-1)
    out = out.reshape(tokens, hidden)
    return out if dtype is None else out.to(dtype)
