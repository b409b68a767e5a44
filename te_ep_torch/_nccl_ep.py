"""NCCL EP runtime discovery (the backend itself is not in this build yet)."""

from __future__ import annotations


def availability() -> str:
    """Why the nccl_ep backend can't be used here ("" when it can)."""
    return "the nccl_ep backend is not part of this build"


def is_available() -> bool:
    return availability() == ""


def load() -> None:
    reason = availability()
    if reason:
        raise RuntimeError(f"te_ep_torch: backend 'nccl_ep' is unavailable: {reason}; use backend='reference'")


def release_group(group_name: str) -> None:
    """Nothing to release while the backend is not built."""
