"""The watchdog family: ``te_ep::_watchdog_state`` (C++ in ``csrc/watchdog/``), the state of
the nccl_ep watchdog. Host side and eager only, so no fake kernel and no autograd."""

from __future__ import annotations

from typing import Tuple

import torch

from . import _library  # noqa: F401  (loads the op library)

__all__ = ["watchdog_state"]


def watchdog_state() -> Tuple[str, int, int]:
    """The nccl_ep watchdog (docs/nccl_ep.md, "Timeouts"): ``(action, ops and markers
    pending, times fired)``; action is ``$TE_EP_WATCHDOG`` (``"exit"``, ``"warn"``,
    ``"off"``). Raises ``RuntimeError`` naming the variable for any other value of it."""
    action, pending, fired = torch.ops.te_ep._watchdog_state()
    return str(action), int(pending), int(fired)
