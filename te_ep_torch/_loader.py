"""Loads the compiled op library once per process."""

from __future__ import annotations

import os

import torch

_LIB_NAME = "_C.so"


def load_library() -> None:
    """Loads ``te_ep_torch/_C.so`` into ``torch.ops`` (idempotent)."""
    if hasattr(torch.ops, "te_ep") and torch.ops.te_ep.__dict__.get("_te_ep_loaded"):
        return
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)
    if not os.path.exists(path):
        raise ImportError(
            f"te_ep_torch: the compiled library {path} is missing. Build it with "
            "`pip install --no-build-isolation .` (or `python setup.py build_ext --inplace` in a checkout)."
        )
    torch.ops.load_library(path)
    torch.ops.te_ep.__dict__["_te_ep_loaded"] = True
