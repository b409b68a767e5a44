"""Integrations of te_ep_torch with training frameworks (optional).

Each submodule imports its framework; this package imports none of them, so
``import te_ep_torch`` never needs a framework installed.

* :mod:`te_ep_torch.integrations.torchtitan`: a TorchTitan MoE token dispatcher on the
  ``te_ep`` ops (docs/torchtitan.md). Needs ``torchtitan`` 0.3.0 (docs/torchtitan.md says
  how to install it without another torch).
* :mod:`te_ep_torch.integrations.transformers`: a Hugging Face transformers experts
  implementation on the ``te_ep`` ops and ``parallelize_hf_moe`` (docs/transformers.md).
  Needs ``transformers`` 5.17 to 5.24 (docs/transformers.md says how to install it).
"""

__all__: list = []
