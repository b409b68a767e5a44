"""Helpers shared by the tests, the benchmarks and the tutorial; not part of the layer API.

* :mod:`te_ep_torch.testing.moe_blocks`: one expert-parallel MoE block written twice,
  with ``all_to_all_single`` (:class:`~te_ep_torch.testing.moe_blocks.NativeMoEBlock`)
  and with te_ep_torch (:class:`~te_ep_torch.testing.moe_blocks.TeEpMoEBlock`), same
  parameters and math (docs/tutorial.md, benchmarks/bench_moe_layer.py,
  tests/test_moe_blocks.py).

``import te_ep_torch`` does not import this package.
"""
