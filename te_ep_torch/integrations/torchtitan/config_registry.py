"""TorchTitan's training configs with te_ep switched on: ``--module te_ep_torch.integrations.torchtitan``.

TorchTitan's ``ConfigManager`` loads ``<module>.config_registry`` and calls the function
named by ``--config``. Here every name resolves to the TorchTitan config function of that
name (``torchtitan.models.<model>.config_registry``), passed through
:func:`~te_ep_torch.integrations.torchtitan.use_te_ep`::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module te_ep_torch.integrations.torchtitan --config qwen3_moe_debug \\
        --parallelism.expert_parallel_degree 8

is TorchTitan's ``qwen3_moe_debug`` (``--module qwen3``) trained with te_ep's dispatcher and
experts by :class:`~te_ep_torch.integrations.torchtitan.trainer.TeEpTrainer`, CUDA-graph step
included. te_ep's options go through TorchTitan's override kwargs, e.g.
``--override.imports 'te_ep_torch.integrations.torchtitan.te_ep_dispatcher={"capacity_factor": 1.25}'``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Dict, List, Tuple

from . import use_te_ep


def _torchtitan_registries() -> Tuple[List[Any], List[str]]:
    """TorchTitan's model config registries that import here, and why the others do not."""
    import torchtitan.models

    registries, failures = [], []
    for info in sorted(pkgutil.iter_modules(torchtitan.models.__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        name = f"torchtitan.models.{info.name}.config_registry"
        try:
            registries.append(importlib.import_module(name))
        except Exception as exc:  # a model whose own dependencies are missing or broken offers no configs
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return registries, failures


_RESOLVED: Dict[str, Callable[[], Any]] = {}


def __getattr__(name: str) -> Callable[[], Any]:
    if name.startswith("_"):
        raise AttributeError(name)
    if name not in _RESOLVED:
        registries, failures = _torchtitan_registries()
        found = [reg for reg in registries if callable(getattr(reg, name, None))]
        if not found:
            raise AttributeError(
                f"te_ep_torch.integrations.torchtitan: no TorchTitan config function named {name!r} in "
                "torchtitan.models.*.config_registry (--config takes the name TorchTitan's own --module uses)"
                + ("; these registries did not import: " + "; ".join(failures) if failures else "")
            )
        if len(found) > 1:
            raise AttributeError(
                f"te_ep_torch.integrations.torchtitan: {name!r} names configs in several models "
                f"({', '.join(reg.__name__ for reg in found)}); write a config function of your own that "
                "returns use_te_ep(config)"
            )
        base = getattr(found[0], name)

        def config_fn() -> Any:
            return use_te_ep(base())

        config_fn.__name__ = config_fn.__qualname__ = name
        config_fn.__doc__ = f"{found[0].__name__}.{name} with te_ep's dispatcher and experts (use_te_ep)."
        _RESOLVED[name] = config_fn
    return _RESOLVED[name]
