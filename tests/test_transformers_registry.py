"""te_ep as transformers' own expert parallelism: ``DistributedConfig(ep_implementation="te_ep")`` (>= 5.23).

transformers 5.23 shards a model itself (``from_pretrained(..., distributed_config=)``: its
EP plan splits the experts ``Shard(0)``, FSDP2 the rest) and runs each experts module's
tokens through the ``EPImplementation`` the config names. The multi-rank tests (bodies in
tests/_transformers_cases.py, ``case_registry_parity``) shard tiny Qwen3-MoE, Mixtral,
gpt-oss and DeepSeek-V3 models (configs written in code, nothing downloaded) that way with
``ep_implementation="te_ep"`` on CPU (gloo, te_ep "reference" backend) at 2 and 4 ranks,
FSDP over all ranks and EP over all of them or half (two copies of each expert, FSDP-sharded
between them), and compare the logits, the loss and every parameter gradient with the
unsharded model on transformers' "eager" experts. Each also checks that every experts module
ran on te_ep: its handle exists, on the reference backend, and was prepared exactly once in
the step (``EpHandle.generation``), so a model whose experts took another path fails.

Tolerances as tests/test_transformers.py (max |diff| / max |ref| per tensor): float32 1e-5,
bfloat16 3e-2.

Skips (with the reason) on transformers without the registry (< 5.23), where
``parallelize_hf_moe`` is the way in (tests/test_transformers.py).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers.integrations.moe", reason="transformers is not installed "
                    "(scripts/dev_setup.sh installs transformers==5.24.0)")
try:
    from transformers.distributed.expert_parallel import EPImplementationInterface
except ImportError:
    pytest.skip("this transformers has no EP implementation registry (DistributedConfig(ep_implementation=) "
                "arrived in 5.23); tests/test_transformers.py covers parallelize_hf_moe", allow_module_level=True)

from test_transformers import _check_diffs  # noqa: E402
from te_ep_torch.options import EpOptions  # noqa: E402

TOKENS = 16  # tests/_transformers_cases.py: BATCH * SEQ tokens per rank

REGISTRY = [
    # Default options (buffers sized from the first batch), EP = FSDP = all ranks.
    pytest.param(2, "qwen3_moe", None, "float32", "random", None, id="qwen3_moe-W2"),
    pytest.param(2, "gpt_oss", None, "float32", "random", None, id="gpt_oss-W2"),
    # EP 2 of FSDP 4: two copies of each expert, FSDP-sharded between them.
    pytest.param(4, "mixtral", 2, "float32", "random", None, id="mixtral-fsdp4xep2-W4"),
    # The last EP rank receives no token at all.
    pytest.param(4, "deepseek_v3", 4, "float32", "uneven", None, id="deepseek_v3-uneven-W4"),
    # bfloat16 parameters and compute.
    pytest.param(2, "mixtral", None, "bfloat16", "random", None, id="mixtral-bf16-W2"),
    # Options through register_te_ep under a name of their own: handles made when the model
    # is sharded, a fitted capacity.
    pytest.param(2, "qwen3_moe", None, "float32", "random",
                 dict(max_tokens_per_rank=TOKENS, dtype=torch.float32, capacity_factor=1.5), id="qwen3_moe-options-W2"),
]


@pytest.mark.parametrize("world_size,family,ep,dtype,scenario,options", REGISTRY)
def test_distributed_config_te_ep_matches_unsharded(pools, world_size, family, ep, dtype, scenario, options):
    from _transformers_cases import case_registry_parity

    impl = "te_ep" if options is None else "te_ep_test_options"
    results = pools.run(world_size, case_registry_parity, family=family, ep=ep, dtype=dtype, scenario=scenario,
                        impl=impl, options=options, timeout=240)
    for rank, res in enumerate(results):
        _check_diffs(res["diffs"], dtype, f"rank {rank}")
        layers, states = res["layers"], res["states"]
        assert layers and sorted(states) == sorted(layers), f"rank {rank}: experts not on te_ep: {layers} vs {states}"
        for name, st in states.items():
            assert len(st["handles"]) == 1 and "mode='reference'" in st["handles"][0], (rank, name, st)
            assert st["generations"] == [1], f"rank {rank} {name}: prepared {st['generations']} times in one step"
            assert st["impls"] == ["loop"], (rank, name, st)
            assert st["max_tokens_per_rank"] == TOKENS, (rank, name, st)
            if options is None:
                assert st["capacity"] == [st["worst_case"]], (rank, name, st)
            else:  # ceil(1.5 * top_k 2 * 16 tokens) rows, the worst case 2 * 16 * 2
                assert st["capacity"] == [48] and st["worst_case"] == 64, (rank, name, st)
        # Without max_tokens_per_rank the state comes with the first forward; with it, with the sharding.
        assert res["made_before_forward"] == ([] if options is None else sorted(layers)), res["made_before_forward"]
    ep_size = results[0]["ep"]
    for layer, c in results[0]["counts"].items():
        local = len(c) // ep_size
        if scenario == "uneven":
            assert sum(c[(ep_size - 1) * local:]) == 0 and sum(c) > 0, (layer, c)
        else:
            assert all(sum(c[r * local:(r + 1) * local]) > 0 for r in range(ep_size)), (layer, c)


def test_refusals_name_what_is_wrong(pools):
    from _transformers_cases import case_registry_refusals

    expected = {
        "tp": r"ValueError: ep_implementation='te_ep': te_ep needs each rank of the EP group to hold a batch of its "
              r"own \(tp_size=1\); here 2 tensor-parallel ranks share one",
        "extra_param": r"ValueError: register_te_ep: experts module 'Qwen3MoeExperts'.* has parameter 'weight_scale'",
    }
    for rank, seen in enumerate(pools.run(2, case_registry_refusals, timeout=120)):
        assert set(seen) == set(expected), sorted(seen)
        for label, pattern in expected.items():
            assert re.search(pattern, seen[label], re.S), f"rank {rank} {label}: {seen[label]}"


def test_import_registers_te_ep():
    from te_ep_torch.integrations.transformers import HAS_EP_REGISTRY, IMPLEMENTATION, TeEpImplementation

    assert HAS_EP_REGISTRY and IMPLEMENTATION == "te_ep"
    assert EPImplementationInterface()["te_ep"] is TeEpImplementation
    assert TeEpImplementation.options["max_tokens_per_rank"] is None
    assert TeEpImplementation.options["capacity_factor"] is None


def test_register_te_ep_options_and_idempotence():
    from te_ep_torch.integrations.transformers import TeEpImplementation, register_te_ep

    record = EpOptions(capacity_factor=1.5, overflow="drop", checks="device")
    cls = register_te_ep("te_ep_test_cf", options=record)
    assert issubclass(cls, TeEpImplementation) and cls is not TeEpImplementation
    assert EPImplementationInterface()["te_ep_test_cf"] is cls
    assert cls.registered_name == "te_ep_test_cf"
    assert (cls.options["capacity_factor"], cls.options["overflow"], cls.options["checks"]) == (1.5, "drop", "device")
    assert register_te_ep("te_ep_test_cf", options=EpOptions(capacity_factor=1.5, overflow="drop", checks="device")) \
        is cls
    # The deprecated keywords give the same registration, with a FutureWarning naming them.
    with pytest.warns(FutureWarning, match=r"register_te_ep\(checks=\.\.\., capacity_factor=\.\.\., overflow=\.\.\.\) "
                                           r"is deprecated and will be removed in 0\.4"):
        assert register_te_ep("te_ep_test_cf", capacity_factor=1.5, overflow="drop", checks="device") is cls
    other = register_te_ep("te_ep_test_cf", options=EpOptions(capacity_factor=1.25))
    assert other is not cls and EPImplementationInterface()["te_ep_test_cf"] is other
    assert EPImplementationInterface()["te_ep"] is TeEpImplementation, "another name replaced the default"


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(capacity_factor=0.5), r"register_te_ep: capacity_factor is now a multiplier"),
    (dict(overflow="skip"), r"register_te_ep: overflow must be one of \('raise', 'drop'\), got 'skip'"),
    (dict(backend="mpi"), r"register_te_ep: backend must be one of .*got 'mpi'"),
    (dict(max_tokens_per_rank=0), r"register_te_ep: max_tokens_per_rank must be a positive int .* or None .*got 0"),
    (dict(expert_impl="fast"), r"register_te_ep: expert_impl must be one of .*got 'fast'"),
    (dict(dtype=torch.int8), r"register_te_ep: dtype must be None, torch.bfloat16, .*got torch.int8"),
    (dict(name="all_to_all"), r"register_te_ep: name 'all_to_all' is taken by 'AllToAllEP'"),
    (dict(name=""), r"register_te_ep: name must be a non-empty str"),
], ids=["capacity_factor", "overflow", "backend", "max_tokens", "expert_impl", "dtype", "name_taken", "name_empty"])
def test_register_te_ep_refuses_bad_options(kwargs, pattern):
    from te_ep_torch.integrations.transformers import register_te_ep

    kwargs = dict(kwargs)
    name = kwargs.pop("name", "te_ep_test_bad")
    with pytest.raises(ValueError, match=pattern):
        register_te_ep(name, **kwargs)
    assert "te_ep_test_bad" not in EPImplementationInterface()


def test_parallelize_hf_moe_points_to_the_registry():
    from te_ep_torch.integrations.transformers import parallelize_hf_moe

    with pytest.warns(DeprecationWarning, match=r"DistributedConfig\(ep_size=\.\.\., ep_implementation='te_ep'\)"):
        # It still runs: the bad mesh argument is refused after the warning, as before.
        with pytest.raises(TypeError, match="mesh_or_group must be a DeviceMesh"):
            parallelize_hf_moe(torch.nn.Linear(2, 2), "ep", max_tokens_per_rank=4)


# ---- benchmarks/bench_transformers.py on CPU -------------------------------------------------


def test_bench_transformers_on_two_cpu_ranks():
    """The GPU benchmark's --device cpu mode (two of its four blocks, tiny): te_ep and all_to_all give the same
    output and input gradient, and the table prints with its ratios."""
    from _dist import REPO, run_torchrun

    out = run_torchrun(REPO / "benchmarks" / "bench_transformers.py", "--device", "cpu", "--models",
                       "qwen3_moe,gpt_oss", "--iters", "2", "--warmup", "1", nprocs=2, timeout=120,
                       CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for family in ("qwen3_moe", "gpt_oss"):
        assert re.search(rf"^{family} \(tiny\): te_ep vs all_to_all .* te_ep \d\.\de-\d\d: ok", out, re.M), out[-4000:]
        row = re.search(rf"^{family} +tiny .*$", out, re.M)
        assert row and "n/a: host sync" in row[0] and "reference/reference/loop" in row[0], out[-4000:]
        assert re.search(r" \d+\.\d\dx ", row[0]) and "yes (" in row[0], row[0]

