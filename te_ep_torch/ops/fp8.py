"""The FP8 family: block-scaled e4m3 quantization (``te_ep::quantize_fp8``,
``te_ep::dequantize_fp8``; C++ in ``csrc/fp8/``): typed wrappers and fake kernels.

Neither op has an autograd formula: :func:`~te_ep_torch.ep_dispatch_fp8` and the MoE layer
pass gradients straight through (docs/ops.md, "FP8").
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ._library import _ROW_DTYPES, _check

__all__ = ["FP8_BLOCK", "quantize_fp8", "dequantize_fp8"]

# FP8 dispatch and the quantize ops scale blocks of this many values of a row.
FP8_BLOCK = 128


# ---- typed wrappers ------------------------------------------------------------------


def quantize_fp8(x: Tensor, pow2_scales: bool = False) -> Tuple[Tensor, Tensor]:
    """Block-scaled e4m3: ``x [T, H]`` -> ``(values [T, H] float8_e4m3fn, scales [T, H / 128] float32)``.

    ``x ~= values * scale`` per block of 128 values of a row; ``pow2_scales`` makes every
    scale a power of two. The exact rules (zero and non-finite blocks, rounding) are in
    docs/ops.md, "FP8", and :mod:`te_ep_torch.testing.fp8_reference`.
    """
    return torch.ops.te_ep.quantize_fp8(x, pow2_scales)


def dequantize_fp8(values: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values * scale`` per block of 128, computed in float32 and returned in ``dtype``."""
    return torch.ops.te_ep.dequantize_fp8(values, scales, dtype)


# ---- fake kernels --------------------------------------------------------------------


def _check_fp8_rows(op: str, name: str, t: Tensor) -> None:
    _check(t.dim() == 2, f"{op}: {name} must be 2-D [T, H], got shape {tuple(t.shape)}")
    _check(t.shape[1] % FP8_BLOCK == 0,
           f"{op}: {name}.size(1) (H) must be a multiple of the block size {FP8_BLOCK}, got H = {t.shape[1]}")


@torch.library.register_fake("te_ep::quantize_fp8")
def _quantize_fp8_fake(x, pow2_scales=False):
    op = "te_ep.quantize_fp8"
    _check(x.dtype in _ROW_DTYPES, f"{op}: x must be torch.bfloat16, torch.float16 or torch.float32, got {x.dtype}")
    _check_fp8_rows(op, "x", x)
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], x.shape[1] // FP8_BLOCK), dtype=torch.float32))


@torch.library.register_fake("te_ep::dequantize_fp8")
def _dequantize_fp8_fake(values, scales, dtype):
    op = "te_ep.dequantize_fp8"
    _check(values.dtype == torch.float8_e4m3fn, f"{op}: values must be torch.float8_e4m3fn, got {values.dtype}")
    _check_fp8_rows(op, "values", values)
    _check(scales.dtype == torch.float32, f"{op}: scales must be torch.float32, got {scales.dtype}")
    _check(scales.dim() == 2 and scales.shape[0] == values.shape[0] and scales.shape[1] == values.shape[1] // FP8_BLOCK,
           f"{op}: scales must have shape [{values.shape[0]}, {values.shape[1] // FP8_BLOCK}], got {tuple(scales.shape)}")
    _check(dtype in _ROW_DTYPES, f"{op}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    return values.new_empty(values.shape, dtype=dtype)
