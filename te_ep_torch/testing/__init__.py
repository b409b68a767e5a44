"""Helpers shared by the tests, the benchmarks and the tutorial; not part of the layer API.

* :mod:`te_ep_torch.testing.moe_blocks`: one expert-parallel MoE block written twice,
  with ``all_to_all_single`` (:class:`~te_ep_torch.testing.moe_blocks.NativeMoEBlock`)
  and with te_ep_torch (:class:`~te_ep_torch.testing.moe_blocks.TeEpMoEBlock`), same
  parameters and math (docs/tutorial.md, benchmarks/bench_moe_layer.py,
  tests/test_moe_blocks.py), and its compute-only stand-in
  (:class:`~te_ep_torch.testing.moe_blocks.ComputeOnlyMoEBlock`).
* :mod:`te_ep_torch.testing.fp8_reference`: block-scaled e4m3 quantization in plain
  PyTorch, the semantics te_ep's FP8 kernels and FP8 dispatch are to match bitwise
  (tests/test_fp8_reference.py checks it against an independent round-to-nearest-even
  table).

``import te_ep_torch`` does not import this package.
"""
