"""Integrations of te_ep_torch with training frameworks (optional).

Each submodule imports its framework; this package imports none of them, so
``import te_ep_torch`` never needs a framework installed.

* :mod:`te_ep_torch.integrations.torchtitan`: a TorchTitan MoE token dispatcher on the
  ``te_ep`` ops (docs/torchtitan.md). Needs ``torchtitan`` (``pip install
  'te_ep_torch[torchtitan]'``).
* :mod:`te_ep_torch.integrations.transformers`: a Hugging Face transformers experts
  implementation on the ``te_ep`` ops and ``parallelize_hf_moe`` (docs/transformers.md).
  Needs ``transformers`` (``pip install 'te_ep_torch[transformers]'``).
"""

__all__: list = []
