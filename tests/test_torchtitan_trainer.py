"""te_ep in TorchTitan's own training entry point: ``TeEpTrainer`` and its CUDA-graph check,
``use_te_ep``, ``--module te_ep_torch.integrations.torchtitan``, and the trainer benchmark's
synthetic token source and log parsing (benchmarks/torchtitan_trainer.py,
benchmarks/bench_torchtitan_trainer.py).

Single-process and CPU only: TorchTitan's Trainer itself needs CUDA devices; its GPU runs are
``benchmarks/bench_torchtitan_trainer.py`` (docs/torchtitan.md). Tests that load TorchTitan's
own model configs need what those import (torch >= 2.12 for its FSDP, the ``datasets``
package) and skip with the reason where it is missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import statistics

import pytest
import torch

pytest.importorskip("torchtitan.models.common.token_dispatcher",
                    reason="TorchTitan is not installed (scripts/dev_setup.sh installs torchtitan==0.3.0)")
try:
    import torchtitan.trainer  # noqa: F401  (its training stack: torchdata, tensorboard, ...)
except ImportError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"TorchTitan's Trainer cannot be imported here: {exc}", allow_module_level=True)

from torchtitan.config import Configurable, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    MinimalAsyncEPTokenDispatcher,
)
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from _torchtitan_cases import DIM, NUM_EXPERTS, TOP_K, _moe_config  # noqa: E402

from te_ep_torch.integrations.torchtitan import (  # noqa: E402
    EXPERTS_OVERRIDE_TARGET,
    OVERRIDE_TARGET,
    ROUTED_EXPERTS_OVERRIDE_TARGET,
    TeEpGroupedExperts,
    TeEpRoutedExperts,
    TeEpTokenDispatcher,
    te_ep_dispatcher,
    use_te_ep,
)
from te_ep_torch.integrations.torchtitan.trainer import TeEpTrainer, fill_sizes  # noqa: E402



def _moe(dispatcher_cfg):
    return _moe_config(dispatcher_cfg, te_experts=False)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Layers(Configurable.Config):
    """A model config of MoE layers (what the CUDA-graph check and the size rule read)."""

    layers: list = dataclasses.field(default_factory=list)
    dim: int = DIM


def _a2a():
    return AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K)


def _trainer_config(*dispatchers, cls=Trainer.Config, ep=1, graphs=True, pp=1, **training):
    model = _Layers(layers=[_moe(d) for d in dispatchers])
    spec = ModelSpec(name="toy", flavor="moe", model=model, parallelize_fn=lambda m, **_: m, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    return cls(
        model_spec=spec,
        training=TrainingConfig(disable_cuda_graphs=not graphs, **training),
        parallelism=ParallelismConfig(expert_parallel_degree=ep, pipeline_parallel_degree=pp),
    )


def _with(config, **changes):
    """The config rebuilt with ``changes`` (as tyro rebuilds it from the CLI: __post_init__ runs)."""
    return dataclasses.replace(config, **changes)


def _dispatchers(config):
    return [layer.routed_experts.token_dispatcher for layer in config.model_spec.model.layers]


# ---- the CUDA-graph check --------------------------------------------------------------------


def test_torchtitan_refuses_te_ep_graphs_and_te_ep_trainer_admits_them():
    """TorchTitan's own Trainer refuses te_ep's dispatcher in its graph step; TeEpTrainer admits it."""
    plain = _trainer_config(_a2a(), _a2a())
    with pytest.raises(ValueError, match="Unsupported token dispatcher: AllToAllTokenDispatcher.Config"):
        _with(plain, parallelism=ParallelismConfig(expert_parallel_degree=2))
    config = use_te_ep(plain)
    assert type(config) is TeEpTrainer.Config and config._owner is TeEpTrainer
    assert all(isinstance(d, TeEpTokenDispatcher.Config) for d in _dispatchers(config))
    captured = _with(config, parallelism=ParallelismConfig(expert_parallel_degree=2))
    captured._validate_cuda_graphs()  # what the Trainer calls again after its overrides
    assert not captured.training.disable_cuda_graphs
    with pytest.raises(ValueError, match="Unsupported token dispatcher: TeEpTokenDispatcher.Config"):
        _trainer_config(te_ep_dispatcher(_a2a()), ep=2)  # te_ep in TorchTitan's own Trainer


def test_other_dispatchers_keep_torchtitans_rule():
    """Next to te_ep's, a dispatcher that syncs is refused with TorchTitan's own message, one that
    TorchTitan admits is admitted, and pipeline parallelism is refused as before."""
    te = te_ep_dispatcher(_a2a())
    with pytest.raises(ValueError, match="CUDA graphs support only .*Unsupported token dispatcher: "
                                         "AllToAllTokenDispatcher.Config"):
        _trainer_config(te, _a2a(), cls=TeEpTrainer.Config, ep=2)
    maep = MinimalAsyncEPTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K)
    _trainer_config(te, maep, cls=TeEpTrainer.Config, ep=2)
    with pytest.raises(ValueError, match="CUDA graphs do not support pipeline parallelism"):
        _trainer_config(te, cls=TeEpTrainer.Config, ep=2, pp=2)
    # Graphs off: TorchTitan checks nothing, neither do we.
    _trainer_config(te, _a2a(), cls=TeEpTrainer.Config, ep=2, graphs=False)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(backend="reference"), r'backend="reference" plans the routing on the host'),
        (dict(checks="synchronous"), r'checks="synchronous" waits for every op on the host'),
    ],
)
def test_te_ep_options_that_sync_are_refused_a_graph(options, message):
    te = te_ep_dispatcher(_a2a(), **options)
    with pytest.raises(ValueError, match=message + ".*--training.disable_cuda_graphs"):
        _trainer_config(te, cls=TeEpTrainer.Config, ep=2)
    _trainer_config(te, cls=TeEpTrainer.Config, ep=2, graphs=False)
    for ok in (dict(backend="auto"), dict(backend="nccl_ep", checks="device"), dict(checks="local")):
        _trainer_config(te_ep_dispatcher(_a2a(), **ok), cls=TeEpTrainer.Config, ep=2)


# ---- use_te_ep and the sizes ------------------------------------------------------------------


def test_use_te_ep_switches_the_tree_in_place_and_forwards_options():
    plain = _trainer_config(_a2a(), _a2a())
    config = use_te_ep(plain, capacity_factor=1.25, overflow="drop")
    for cfg in (plain, config):  # the tree is shared: changed in place
        for layer in cfg.model_spec.model.layers:
            d = layer.routed_experts.token_dispatcher
            assert isinstance(d, TeEpTokenDispatcher.Config)
            assert (d.num_experts, d.top_k, d.capacity_factor, d.overflow) == (NUM_EXPERTS, TOP_K, 1.25, "drop")
            assert (d.hidden_dim, d.num_max_tokens_per_rank, d.dtype) == (None, None, None)  # filled at build
            assert type(layer.routed_experts.inner_experts) is TeEpGroupedExperts.Config
            assert type(layer.routed_experts) is TeEpRoutedExperts.Config
    assert config.override.imports == []  # applied now, not deferred to the Trainer
    with pytest.raises(ValueError, match="capacity_factor"):
        use_te_ep(_trainer_config(_a2a()), capacity_factor=0.5)
    for target in (EXPERTS_OVERRIDE_TARGET, ROUTED_EXPERTS_OVERRIDE_TARGET):
        listed = _trainer_config(_a2a())
        listed.override.imports.append(target)
        with pytest.raises(ValueError, match="already in override.imports; pass its options to use_te_ep"):
            use_te_ep(listed)
    no_moe = _trainer_config()
    with pytest.raises(ValueError, match="has no MoE token dispatcher"):
        use_te_ep(no_moe)


def test_override_kwargs_still_reach_a_switched_config():
    """--override.imports te_ep_dispatcher={...} on a TeEpTrainer config changes te_ep's options."""
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    config = use_te_ep(_trainer_config(_a2a()))
    apply_overrides(OverrideConfig(imports=parse_cli_imports([OVERRIDE_TARGET + '={"capacity_factor": 2.0}'])),
                    config)
    assert _dispatchers(config)[0].capacity_factor == 2.0
    config._validate_cuda_graphs()


def test_fill_sizes_takes_the_final_trainer_config():
    config = use_te_ep(_trainer_config(_a2a(), _a2a(), local_batch_size=4, seq_len=1024))
    # The CLI changes the shape after the config function ran: the sizes follow it.
    config = _with(config, training=TrainingConfig(local_batch_size=2, seq_len=512, mixed_precision_param="float32"),
                   parallelism=ParallelismConfig(tensor_parallel_degree=2, expert_parallel_degree=2))
    _dispatchers(config)[1].num_max_tokens_per_rank = 4096  # given explicitly: kept
    fill_sizes(config)
    first, second = _dispatchers(config)
    assert (first.hidden_dim, first.num_max_tokens_per_rank, first.dtype) == (DIM, 512, "float32")
    assert (second.hidden_dim, second.num_max_tokens_per_rank) == (DIM, 4096)


# ---- --module te_ep_torch.integrations.torchtitan ------------------------------------------------


def test_config_registry_names_an_unknown_config():
    registry = importlib.import_module("te_ep_torch.integrations.torchtitan.config_registry")
    with pytest.raises(AttributeError, match="no TorchTitan config function named 'no_such_config'"):
        registry.no_such_config
    assert getattr(registry, "no_such_config", None) is None  # what TorchTitan's ConfigManager does


def _torchtitan_models_importable() -> str:
    try:
        importlib.import_module("torchtitan.models.qwen3.config_registry")
    except ImportError as exc:
        return str(exc)
    return ""


@pytest.mark.skipif(bool(_torchtitan_models_importable()),
                    reason=f"TorchTitan's model configs cannot be imported here: {_torchtitan_models_importable()}")
def test_one_entry_switch_loads_torchtitans_config_with_te_ep(capsys):
    """`--module te_ep_torch.integrations.torchtitan --config qwen3_moe_debug` with EP 2 and the
    CUDA-graph step on: TorchTitan's own config, te_ep's dispatchers, TeEpTrainer; the same
    arguments with --module qwen3 are refused by TorchTitan."""
    from torchtitan.config import ConfigManager

    args = ["--config", "qwen3_moe_debug", "--parallelism.expert_parallel_degree", "2", "--training.seq_len", "512"]
    config = ConfigManager().parse_args(["--module", "te_ep_torch.integrations.torchtitan", *args])
    assert type(config) is TeEpTrainer.Config and not config.training.disable_cuda_graphs
    found = [cfg for _, cfg, _, _ in config.model_spec.model.traverse(TeEpTokenDispatcher.Config)]
    assert found and all(cfg.top_k == 8 and cfg.num_experts == 64 for cfg in found)
    fill_sizes(config)
    assert {(c.hidden_dim, c.num_max_tokens_per_rank) for c in found} == {(256, 4 * 512)}
    with pytest.raises(SystemExit):  # tyro reports the config's ValueError and exits
        ConfigManager().parse_args(["--module", "qwen3", *args])
    err = " ".join(re.sub(r"[│┃|]", " ", capsys.readouterr().err).split())  # tyro boxes and wraps it
    assert "Unsupported token dispatcher: AllToAllTokenDispatcher.Config" in err, err


# ---- the benchmark's synthetic tokens and its log parsing ---------------------------------------


def _synthetic(seed=0, dp_rank=0, batch=3, seq=16, vocab=50):
    from benchmarks.torchtitan_trainer import SyntheticTokenizer, SyntheticTokens

    tok = SyntheticTokenizer.Config(vocab_size=vocab).build(tokenizer_path="unused")
    return SyntheticTokens.Config(seed=seed).build(dp_world_size=2, dp_rank=dp_rank, tokenizer=tok, seq_len=seq,
                                                   local_batch_size=batch)


def test_synthetic_tokens_are_learnable_reproducible_and_resumable():
    loader = _synthetic()
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    for inputs, labels in batches:
        x = inputs["input"]
        assert x.shape == labels.shape == (3, 16) and x.dtype == torch.int64
        assert int(x.min()) >= 1 and int(x.max()) < 50  # EOS (0) never appears
        assert torch.equal(x[:, 1:], labels[:, :-1])
        step = (labels - x) % 49  # x[t+1] = 1 + (x[t] - 1 + stride) mod (V - 1)
        assert torch.equal(step, step[:, :1].expand_as(step))
    assert not torch.equal(batches[0][0]["input"], batches[1][0]["input"])
    again = iter(_synthetic())
    assert torch.equal(next(again)[0]["input"], batches[0][0]["input"])
    assert not torch.equal(next(iter(_synthetic(dp_rank=1)))[0]["input"], batches[0][0]["input"])
    resumed = _synthetic()
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))[0]["input"], next(it)[0]["input"])
    with pytest.raises(ValueError, match="vocab_size must be an int >= 2, got 1"):
        _synthetic(vocab=1)


def test_synthetic_overrides_replace_dataset_and_tokenizer():
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    from benchmarks.torchtitan_trainer import SyntheticTokenizer, SyntheticTokens

    config = _trainer_config(_a2a())
    imports = parse_cli_imports(["benchmarks.torchtitan_trainer.synthetic_data",
                                 'benchmarks.torchtitan_trainer.synthetic_tokenizer={"vocab_size": 4096}'])
    apply_overrides(OverrideConfig(imports=imports), config)
    assert type(config.dataloader) is SyntheticTokens.Config
    assert type(config.tokenizer) is SyntheticTokenizer.Config and config.tokenizer.vocab_size == 4096


def _log(steps, loss_shift=0.0, tps=1000):
    esc = "\x1b[31m"
    return "\n".join(
        f"[rank0]:[titan] INFO - {esc}step: {s:2}  {esc}loss: {7.0 - 0.01 * s + loss_shift:8.5f}  grad_norm: 1.0  "
        f"{esc}memory: {10 + s / 100:5.2f}GiB(12.00%)  {esc}tps: {tps + s:,}  {esc}tflops: 100.00  {esc}mfu: 10.00%"
        for s in steps
    )


def test_trainer_benchmark_parses_torchtitans_log_and_checks_the_loss():
    from benchmarks.bench_torchtitan_trainer import parse_log, table

    ref = parse_log(_log(range(1, 31)) + "\nvalidate step: 5 loss: 1.0 memory: 1.00GiB tps: 5")
    assert sorted(ref.steps) == list(range(1, 31))
    assert ref.steps[3] == (pytest.approx(6.97), 10.03, 1003.0, 10.0)
    tps, mfu, mem = ref.medians(skip=10)
    assert (tps, mfu, mem) == (statistics.median(range(1011, 1031)), 10.0, 10.30)
    runs = {"all_to_all eager": ref, "MinimalAsyncEP graphs": parse_log(_log(range(1, 31), tps=500)),
            "te_ep graphs": parse_log(_log(range(1, 31), loss_shift=0.5, tps=2000))}
    text, failed = table(runs, skip=10, loss_tol=0.02, title="t")
    assert failed == ["te_ep graphs"]
    row = next(line for line in text.splitlines() if line.startswith("| te_ep graphs"))
    assert "FAIL" in row and "x |" in row
    gap = 0.5 / (7.0 - 0.01 * 30)
    assert f"{gap:.2e} (30)" in row
    with pytest.raises(ValueError, match="no logged step after the first 40"):
        ref.medians(skip=40)


def test_trainer_benchmark_refuses_bad_arguments(capsys):
    from benchmarks.bench_torchtitan_trainer import main

    with pytest.raises(SystemExit):
        main(["--nproc", "1"])
    assert "--nproc must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--steps", "10", "--skip", "10"])
    assert "--skip (10) must be below --steps (10)" in capsys.readouterr().err
