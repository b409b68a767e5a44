"""Compatibility module: the autograd of the ``te_ep`` ops moved to its op families.

* :class:`DispatchOutput`, :class:`Fp8DispatchOutput`, :func:`ep_dispatch`,
  :func:`ep_dispatch_fp8`, :func:`ep_combine` (and the new :func:`~te_ep_torch.ops.ep_prepare`):
  :mod:`te_ep_torch.ops.comm`, re-exported by :mod:`te_ep_torch.ops` and :mod:`te_ep_torch`;
* the permutation ops' registered formulas: :mod:`te_ep_torch.ops.permute`;
* the zone ops' registered formulas: :mod:`te_ep_torch.ops.zones`.

The public names keep working from here; import them from ``te_ep_torch`` or
``te_ep_torch.ops`` instead. The private names this module had raise an ``AttributeError``
that names their new module.
"""

from __future__ import annotations

from .ops.comm import DispatchOutput, Fp8DispatchOutput, ep_combine, ep_dispatch, ep_dispatch_fp8

__all__ = ["DispatchOutput", "Fp8DispatchOutput", "ep_dispatch", "ep_dispatch_fp8", "ep_combine"]

# Where this module's private names went.
_MOVED = {
    **dict.fromkeys(("_needs_graph", "_check_generation", "_save_handle", "_saved_handle", "_dispatch_backward",
                     "_dispatch_op", "_combine_op", "_Dispatch", "_Combine", "_dispatch_fp8_op", "_DispatchFp8",
                     "_DequantizeRows"), "te_ep_torch.ops.comm"),
    **dict.fromkeys(("_permute_setup", "_permute_backward", "_unpermute_setup", "_unpermute_backward",
                     "_sort_chunks_grads", "_sort_chunks_by_index_setup", "_sort_chunks_by_index_backward",
                     "_sort_chunks_by_map_setup", "_sort_chunks_by_map_backward"), "te_ep_torch.ops.permute"),
    **dict.fromkeys(("_zone_glu_setup", "_zone_glu_backward", "_zone_bias_setup", "_zone_bias_backward",
                     "_zone_scale_setup", "_zone_scale_backward"), "te_ep_torch.ops.zones"),
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"te_ep_torch.autograd.{name} moved to {_MOVED[name]}.{name} (te_ep_torch.autograd "
                             "only re-exports the public names)")
    raise AttributeError(f"module 'te_ep_torch.autograd' has no attribute {name!r}")
