"""The ``te_ep`` ops from Python, one module per op family (as ``csrc/`` is split; docs/ops.md,
"Per-op map"). Each family module holds its ops' typed wrappers, their fake kernels and their
autograd, side by side:

* :mod:`.comm`: the handle and communication ops (wrappers, fakes), and their autograd:
  :func:`ep_prepare`, :func:`ep_dispatch`, :func:`ep_dispatch_fp8`, :func:`ep_combine`;
* :mod:`.fp8`: block-scaled FP8 quantization (wrappers, fakes, :data:`FP8_BLOCK`);
* :mod:`.permute`: the permutation ops' fakes and autograd formulas (the API is
  :mod:`te_ep_torch.permutation`, the DTensor rules ``te_ep_torch/_dtensor_rules.py``);
* :mod:`.zones`: the zone ops' fakes and autograd formulas, and :func:`scale_into_window`
  (the zone API is :mod:`te_ep_torch.zones`);
* :mod:`.watchdog`: :func:`watchdog_state`;
* :mod:`._library`: loads the op library; the argument checks that several families' fakes share.

Importing this package loads the library and registers every fake kernel and autograd formula.
The ops themselves are declared in ``csrc/library.cpp``; their contract is ``docs/ops.md``
(communication, FP8, zones) and ``docs/permutation.md`` (permutation).
"""

from __future__ import annotations

from ._library import load_library  # noqa: F401  (te_ep_torch.ops.load_library, as before the split)
# Every family module, so that importing this package registers every fake kernel and autograd formula.
from . import comm, fp8, permute, watchdog, zones  # noqa: F401
from .comm import (  # noqa: F401  (handle_config_error: public, not in __all__, as before)
    DispatchOutput,
    Fp8DispatchOutput,
    check_handle,
    check_mode,
    combine,
    combine_bwd,
    combine_buffer,
    create_handle,
    destroy_handle,
    dispatch,
    dispatch_bwd,
    dispatch_fp8,
    ep_combine,
    ep_dispatch,
    ep_dispatch_fp8,
    ep_prepare,
    handle_config_error,
    handle_info,
    live_handles,
    prepare,
    prepare_dispatch,
    prepare_dispatch_fp8,
    worst_case_capacity,
)
from .fp8 import FP8_BLOCK, dequantize_fp8, quantize_fp8
from .watchdog import watchdog_state  # noqa: F401  (public, not in __all__, as before)
from .zones import scale_into_window

# The families' public names; handle_config_error stays public but out of __all__, as before.
__all__ = [name for name in comm.__all__ if name != "handle_config_error"] + fp8.__all__ + zones.__all__
