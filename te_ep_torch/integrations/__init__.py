"""Integrations of te_ep_torch with training frameworks (optional).

Each submodule imports its framework; this package imports none of them, so
``import te_ep_torch`` never needs a framework installed.

* :mod:`te_ep_torch.integrations.torchtitan`: a TorchTitan MoE token dispatcher and experts
  on the ``te_ep`` ops, ``TeEpTrainer`` (its ``trainer`` module: TorchTitan's Trainer with te_ep
  admitted to the CUDA-graph step) and the config registry behind ``--module
  te_ep_torch.integrations.torchtitan`` (docs/torchtitan.md). Needs ``torchtitan`` 0.3.0 (docs/torchtitan.md
  says how to install it without another torch); its Trainer needs torch >= 2.12.
* :mod:`te_ep_torch.integrations.transformers`: te_ep as a transformers expert-parallel
  implementation (``DistributedConfig(ep_implementation="te_ep")``, transformers >= 5.23), a
  transformers experts implementation on the ``te_ep`` ops and ``parallelize_hf_moe`` (5.17 to
  5.22; docs/transformers.md). Needs ``transformers`` 5.17 to 5.24 (docs/transformers.md says how
  to install it).
"""

__all__: list = []
