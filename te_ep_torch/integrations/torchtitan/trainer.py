"""TorchTitan's Trainer with te_ep's token dispatcher admitted to its CUDA-graph step.

TorchTitan 0.3.0's ``Trainer`` captures forward + backward in a CUDA graph unless
``--training.disable_cuda_graphs`` is given, and with expert parallelism it admits only the
dispatchers it knows to run without a host sync (MinimalAsyncEP, HybridEP with a
non-blocking capacity factor): ``Trainer.Config._validate_cuda_graphs``. te_ep's ops need
no host sync on the ``nccl_ep`` backend, so :class:`TeEpTrainer` judges its own dispatchers
by te_ep's rule (:func:`capture_blockers`) and hands every other dispatcher of the model to
TorchTitan's check unchanged: a dispatcher that syncs is refused exactly as before.

Beyond the check, a captured step needs three things TorchTitan's Trainer does not do for
te_ep, and :class:`TeEpTrainer` does them:

* the sizes of each te_ep handle known before the first step (the handles are created
  collectively when the EP mesh is wired, never inside a capture): ``hidden_dim``,
  ``num_max_tokens_per_rank`` and ``dtype`` come from the final trainer config (CLI
  included), as TorchTitan derives them for its own static dispatchers, unless given;
* errors recorded on the device during a replay (a bad expert id, a capacity overflow under
  ``overflow="raise"``) raised on the host: no op runs on the host during a replay, so
  every handle is checked after each step that TorchTitan logs (where it reads the loss
  and synchronizes anyway) and when training ends;
* te_ep's groups shut down in ``close()``, after the graphs are torn down and before the
  process group is destroyed.

Users reach it through ``--module te_ep_torch.integrations.torchtitan`` (its
``config_registry``) or :func:`te_ep_torch.integrations.torchtitan.use_te_ep` in a config
function of their own (docs/torchtitan.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List

from torchtitan.trainer import Trainer

from ... import shutdown_ep_groups
from . import TeEpTokenDispatcher

__all__ = ["TeEpTrainer", "capture_blockers", "fill_sizes"]


def capture_blockers(cfg: TeEpTokenDispatcher.Config) -> List[str]:
    """Why a te_ep dispatcher config cannot run inside a captured step ([] when it can).

    The ``reference`` backend plans the routing on the host (a device sync per op) and the
    ``"synchronous"`` check mode waits for every op on the host; ``"auto"`` is admitted
    here and judged again once resolved (:meth:`TeEpTrainer._check_resolved_backends`)."""
    blockers = []
    if cfg.backend == "reference":
        blockers.append('backend="reference" plans the routing on the host (a device sync per op)')
    if cfg.checks == "synchronous":
        blockers.append('checks="synchronous" waits for every op on the host')
    return blockers


def fill_sizes(config: Any) -> None:
    """Fills each te_ep dispatcher's unset sizes from the trainer config (in place).

    ``hidden_dim`` = the model's ``dim``; ``num_max_tokens_per_rank`` =
    ``local_batch_size * seq_len / (cp * tp)`` (CP and TP shard the token axis before the
    MoE layer), the rule TorchTitan applies to its own static dispatchers; ``dtype`` =
    ``training.mixed_precision_param`` (what FSDP hands the layer). Values already set
    (override kwargs) are kept."""
    training, parallelism = config.training, config.parallelism
    shards = parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
    for cfg in _te_ep_dispatchers(config):
        if cfg.hidden_dim is None:
            cfg.hidden_dim = config.model_spec.model.dim
        if cfg.num_max_tokens_per_rank is None:
            cfg.num_max_tokens_per_rank = -(-training.local_batch_size * training.seq_len // shards)
        if cfg.dtype is None:
            cfg.dtype = training.mixed_precision_param


def _te_ep_dispatchers(config: Any) -> Iterator[TeEpTokenDispatcher.Config]:
    if config.model_spec is None:
        return
    for _, cfg, _, _ in config.model_spec.model.traverse(TeEpTokenDispatcher.Config):
        yield cfg


class _ModelWithout:
    """A model config whose ``traverse`` skips te_ep's dispatchers (what TorchTitan's check sees)."""

    def __init__(self, model: Any):
        self._model = model

    def traverse(self, config_cls: type, **kwargs: Any):
        for item in self._model.traverse(config_cls, **kwargs):
            if not isinstance(item[1], TeEpTokenDispatcher.Config):
                yield item


class _View:
    """``obj`` with some attributes replaced; every other one read from ``obj``."""

    def __init__(self, obj: Any, **replaced: Any):
        self._obj = obj
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)


class TeEpTrainer(Trainer):
    """TorchTitan's ``Trainer`` that captures te_ep's dispatch and combine in its CUDA-graph step.

    Everything else is TorchTitan's: the same config fields, CLI, checkpoints, logging.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        def _validate_cuda_graphs(self) -> None:
            if not self.training.disable_cuda_graphs and self.model_spec is not None:
                for cfg in _te_ep_dispatchers(self):
                    blockers = capture_blockers(cfg)
                    if blockers:
                        raise ValueError(
                            "CUDA graphs: te_ep's TeEpTokenDispatcher cannot be captured with "
                            + " and ".join(blockers)
                            + "; use backend='nccl_ep' or 'auto' and checks='local' or 'device', or set "
                            "--training.disable_cuda_graphs"
                        )
                # Every other dispatcher is judged by TorchTitan's own rule, unchanged.
                spec = self.model_spec
                without_te_ep = _View(self, model_spec=_View(spec, model=_ModelWithout(spec.model)))
                Trainer.Config._validate_cuda_graphs(without_te_ep)
                return
            Trainer.Config._validate_cuda_graphs(self)

    def __init__(self, config: "TeEpTrainer.Config"):
        fill_sizes(config)
        super().__init__(config)
        self.te_ep_dispatchers = [
            module for part in self.model_parts for module in part.modules() if isinstance(module, TeEpTokenDispatcher)
        ]
        if not config.training.disable_cuda_graphs:
            self._check_resolved_backends()

    def _check_resolved_backends(self) -> None:
        for dispatcher in self.te_ep_dispatchers:
            for handle in dispatcher.handles():
                if handle.group.backend != "nccl_ep":
                    raise ValueError(
                        f"CUDA graphs: te_ep's backend={dispatcher.options.backend!r} resolved to "
                        f"{handle.group.backend!r} on this machine (te_ep's warning above says why), which "
                        "syncs with the host in every op; install NCCL EP (python -m te_ep_torch says what "
                        "is missing) or set --training.disable_cuda_graphs"
                    )

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        # A replay runs no op on the host: what the ops recorded on the device is raised here,
        # at the steps TorchTitan logs (it reads the loss then, so the GPU is waited for anyway)
        # and at the last step.
        if not self.config.training.disable_cuda_graphs and (
            self.metrics_processor.should_log(self.step) or self.step >= self.config.training.steps
        ):
            for dispatcher in self.te_ep_dispatchers:
                for handle in dispatcher.handles():
                    handle.check()

    def close(self) -> None:
        try:
            super().close()
        finally:
            # After the graphs are torn down (they hold the handles' windows), before the
            # process group goes.
            shutdown_ep_groups()
