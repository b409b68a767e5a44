"""What every op family module of :mod:`te_ep_torch.ops` starts from: the op library, loaded
once (importing this module loads it), and the argument checks of the fake kernels that more
than one family shares."""

from __future__ import annotations

import torch
from torch import Tensor

from .._loader import load_library

load_library()

__all__ = ["load_library"]

# The row dtypes of the local ops (permutation, zone, FP8 quantization).
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond, message: str) -> None:
    torch._check(cond, lambda: message)


def _check_rows(op: str, name: str, t: Tensor) -> None:
    _check(t.dim() == 2, f"{op}: {name} must be 2-D, got {t.dim()}-D (shape {tuple(t.shape)})")
    _check(t.dtype in _ROW_DTYPES, f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_probs(op: str, name: str, p: Tensor, shape) -> None:
    _check(p.dtype == torch.float32, f"{op}: {name} must be float32, got {p.dtype}")
    _check(p.dim() == len(shape), f"{op}: {name} must have shape {tuple(shape)}, got {tuple(p.shape)}")
    for have, want in zip(p.shape, shape):
        _check(have == want, f"{op}: {name} must have shape {tuple(shape)}, got {tuple(p.shape)}")
