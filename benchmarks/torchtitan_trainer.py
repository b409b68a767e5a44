"""TorchTitan training configs for the trainer benchmark, and a synthetic token source.

A TorchTitan ``config_registry`` (``--module benchmarks.torchtitan_trainer``, with the
repository root on ``PYTHONPATH``) whose functions differ only in the MoE token
dispatcher, so the rows of ``bench_torchtitan_trainer.py`` train the same model on the
same tokens from the same seed:

* ``<dims>_all_to_all``: TorchTitan's ``AllToAllTokenDispatcher`` (``moe_comm_backend``
  "standard"; it syncs with the host, so TorchTitan refuses its CUDA-graph step);
* ``<dims>_minimal_async_ep``: TorchTitan's ``MinimalAsyncEPTokenDispatcher``;
* ``<dims>_te_ep``: the all-to-all config through ``use_te_ep`` (te_ep's dispatcher and
  experts, default arguments), trained by ``TeEpTrainer``.

``<dims>``: ``default`` (dim 2048, expert FFN 1408, 64 experts, top-6, 8192 tokens per rank:
the layer benchmark's defaults) or ``dsv3`` (DeepSeek-V3's dim 7168, expert FFN 2048, top-8,
4096 tokens per rank; 64 experts instead of 256 so that the weights and AdamW state of a
trained model fit two GPUs: each rank still receives ``top_k`` rows per token on average).
Qwen3-MoE blocks (four for ``default``, two for ``dsv3``; every block an MoE block,
causal SDPA, :func:`causal_sdpa`), vocabulary 2048, full
activation checkpointing on every row (MinimalAsyncEP requires it), FSDP and EP over all
ranks, bf16 mixed precision, AdamW, seed 0.

Data: no dataset is reachable on the GPU machines, so every row reads
:class:`SyntheticTokens` (TorchTitan's dataloader interface, selected through its config
system): sequences ``x[t+1] = (x[t] + stride) mod V`` with a random start and stride per
row, drawn from a generator seeded by (seed, DP rank), so the loss falls as the model
learns the rule and every row sees the same batches. The ``synthetic_data`` and
``synthetic_tokenizer`` overrides put it into any TorchTitan config (e.g. TorchTitan's own
``qwen3_moe_debug``, whose ``c4_test`` dataset and tokenizer files are not in its wheel)::

    --override.imports benchmarks.torchtitan_trainer.synthetic_data \\
                       'benchmarks.torchtitan_trainer.synthetic_tokenizer={"vocab_size": 2048}'

On a torch older than TorchTitan 0.3.0 expects (2.12 was what the GPU runs could carry), add
``benchmarks.torchtitan_trainer.causal_sdpa`` (FlexAttention's masks need a newer torch) and
``--parallelism.spmd_backend partial_dtensor`` (its default ``spmd_types`` backend makes FSDP
refuse plain parameters there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Tuple

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torch.nn.attention import SDPBackend
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.config import override

__all__ = ["CausalSDPA", "DIMS", "SyntheticTokenizer", "SyntheticTokens", "causal_sdpa", "synthetic_data",
           "synthetic_tokenizer"]


class SyntheticTokenizer(BaseTokenizer):
    """A tokenizer of ``vocab_size`` ids with no text behind them (ids 0 .. V-1; 0 is EOS)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        if not isinstance(config.vocab_size, int) or config.vocab_size < 2:
            raise ValueError(f"SyntheticTokenizer: vocab_size must be an int >= 2, got {config.vocab_size!r}")
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("SyntheticTokenizer has no text: SyntheticTokens makes the ids directly")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("SyntheticTokenizer has no text: SyntheticTokens makes the ids directly")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticTokens(BaseDataLoader):
    """Endless batches ``({"input": [B, S], "positions": [B, S]}, labels [B, S])`` of learnable id
    sequences (CPU int64 tensors; positions ``0 .. S-1``: each row is one document).

    Row ``b`` of a batch: ``x[t] = 1 + (start_b + t * stride_b) mod (V - 1)`` for ``t`` in
    ``0 .. S`` (EOS never appears, so each row is one document); input ``x[:S]``, labels
    ``x[1:]``. ``start_b`` and ``stride_b`` come from a generator seeded with
    ``seed * 1_000_003 + dp_rank``: the same batches in every run of the same seed and DP size.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "synthetic"
        seed: int = 0
        max_stride: int = 16

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ):
        if not isinstance(config.max_stride, int) or config.max_stride < 1:
            raise ValueError(f"SyntheticTokens: max_stride must be an int >= 1, got {config.max_stride!r}")
        self.vocab_size = tokenizer.get_vocab_size()
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.seed, self.dp_rank, self.max_stride = config.seed, dp_rank, config.max_stride
        self.batches = 0

    def _batch(self, index: int) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.dp_rank) * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size - 1, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, self.max_stride + 1, (self.batch_size, 1), generator=gen)
        t = torch.arange(self.seq_len + 1).unsqueeze(0)
        x = 1 + (start + t * stride) % (self.vocab_size - 1)
        # positions: one document per row (TorchTitan builds its attention masks from them)
        positions = t[:, :-1].expand(self.batch_size, self.seq_len).contiguous()
        return {"input": x[:, :-1].contiguous(), "positions": positions}, x[:, 1:].contiguous()

    def __iter__(self) -> Iterator[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            batch = self._batch(self.batches)
            self.batches += 1
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.batches = int(state_dict["batches"])


@override(target=BaseDataLoader.Config, description="synthetic learnable token sequences (no dataset)")
def synthetic_data(cfg: BaseDataLoader.Config, *, seed: int = 0) -> SyntheticTokens.Config:
    return SyntheticTokens.Config(seed=seed)


@override(target=BaseTokenizer.Config, description="a tokenizer of vocab_size ids without text")
def synthetic_tokenizer(cfg: BaseTokenizer.Config, *, vocab_size: int = 2048) -> SyntheticTokenizer.Config:
    return SyntheticTokenizer.Config(vocab_size=vocab_size)


class CausalSDPA(ScaledDotProductAttention):
    """Causal ``scaled_dot_product_attention`` on the flash kernel (cuDNN's not first: the GPU
    machine's cuDNN is older than the one torch 2.12 was built with)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    sdpa_backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@override(target=FlexAttention.Config, description="causal SDPA in place of FlexAttention")
def causal_sdpa(cfg: FlexAttention.Config) -> CausalSDPA.Config:
    """FlexAttention -> causal SDPA: the same attention where each row is one document (as in
    :class:`SyntheticTokens`). TorchTitan 0.3.0's FlexAttention masks need a newer torch than
    the 2.12 the GPU runs carry (``create_block_mask(separate_full_blocks=...)``), and its
    varlen backend needs FlashAttention 3 (``flash_attn_interface``), which they lack."""
    return CausalSDPA.Config()


# name: (dim, expert FFN, experts, top_k, heads, local batch, seq_len, blocks)
DIMS = {
    "default": (2048, 1408, 64, 6, 16, 2, 4096, 4),
    "dsv3": (7168, 2048, 64, 8, 56, 1, 4096, 2),
}
VOCAB = 2048


def _config(dims: str, comm_backend: str) -> Any:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (  # pinned torchtitan==0.3.0: its Qwen3-MoE block builder
        _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm, model_registry,
    )
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.trainer import Trainer

    dim, ffn, experts, top_k, heads, batch, seq_len, blocks = DIMS[dims]
    head_dim = 128
    spec = model_registry("debugmodel_moe", attn_backend="flex", moe_comm_backend=comm_backend)
    spec.flavor = f"bench_{dims}"
    spec.model = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=blocks, dim=dim, n_heads=heads, n_kv_heads=8, head_dim=head_dim, moe_hidden_dim=ffn,
            num_experts=experts, top_k=top_k, attn_backend="flex", moe_comm_backend=comm_backend,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1000000.0),
        ),
    )
    config = Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        tokenizer=SyntheticTokenizer.Config(vocab_size=VOCAB),
        dataloader=SyntheticTokens.Config(seed=0),
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=100),
        parallelism=ParallelismConfig(),  # EP over every rank: --parallelism.expert_parallel_degree W
        activation_checkpoint=FullAC.Config(),
        debug=DebugConfig(seed=0),
    )
    apply_overrides(OverrideConfig(imports=[f"{__name__}.causal_sdpa"]), config)
    return config


def default_all_to_all() -> Any:
    return _config("default", "standard")


def default_minimal_async_ep() -> Any:
    return _config("default", "minimal_async_ep")


def default_te_ep() -> Any:
    from te_ep_torch.integrations.torchtitan import use_te_ep

    return use_te_ep(_config("default", "standard"))


def dsv3_all_to_all() -> Any:
    return _config("dsv3", "standard")


def dsv3_minimal_async_ep() -> Any:
    return _config("dsv3", "minimal_async_ep")


def dsv3_te_ep() -> Any:
    from te_ep_torch.integrations.torchtitan import use_te_ep

    return use_te_ep(_config("dsv3", "standard"))
