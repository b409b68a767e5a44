"""transformers integration (te_ep_torch.integrations.transformers) against the unsharded model.

The multi-rank tests (bodies in tests/_transformers_cases.py) build tiny transformers MoE
models from configs written in code (Qwen3-MoE, Mixtral, gpt-oss with expert biases and its
interleaved clamped gate, DeepSeek-V3 with its sigmoid group-limited router, score bias and
shared expert; OLMoE, Qwen2-MoE and Nemotron-H, whose experts have no gate, as other models
of the decorated kind), make them expert-parallel with ``parallelize_hf_moe`` on CPU (gloo,
te_ep "reference" backend) and compare the logits, the loss and every parameter gradient of
the whole model with the unsharded model running transformers' own "eager" experts, at 2
and 4 ranks: EP over the default process group, over a 1-D mesh, and EP x FSDP2 on a
(dp, ep) mesh (float32 and bfloat16 compute), also with transformers' activation
checkpointing. Plus ``torch.compile(fullgraph=True)`` of an MoE block (``aot_eager``), a
DCP save at dp 2 x ep 2 loaded at EP 2, on a (1, 2) mesh and into the unsharded model, a
batch too long on one rank, and what ``parallelize_hf_moe`` refuses. The way in of transformers
>= 5.23, ``DistributedConfig(ep_implementation="te_ep")``, is tested in
tests/test_transformers_registry.py; the example and the GPU script, run here, take both.

Tolerances (max |diff| / max |reference| per tensor): float32 ``1e-5`` (the experts see the
same rows; only the order of the GEMMs' and the combine's sums differs from transformers'
per-expert loop; observed at most 1e-6); bfloat16 ``3e-2`` (observed at most 1.4e-2, an
expert weight gradient of gpt-oss).

All tests skip (with the reason) when transformers is not installed; scripts/dev_setup.sh
installs it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from _dist import REPO, run_torchrun

pytest.importorskip("transformers.integrations.moe", reason="transformers is not installed "
                    "(scripts/dev_setup.sh installs transformers==5.24.0)")

TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def _check_diffs(diffs: dict, dtype: str, where: str) -> None:
    bad = []
    for name, d in diffs.items():
        if d["max_abs"] > TOL[dtype] * max(d["ref_max"], 1e-6):
            bad.append(f"{where} {name}: max |diff| {d['max_abs']:.3e}, max |ref| {d['ref_max']:.3e}")
        if name.endswith(".grad") and d["ref_max"] == 0.0:
            bad.append(f"{where} {name}: the reference gradient is all zero (nothing was compared)")
    assert not bad, "te_ep differs from the unsharded model:\n" + "\n".join(bad)


PARITY = [
    # EP over the default process group, 2 ranks: the four models of the issue.
    pytest.param(2, "qwen3_moe", "group", None, "float32", "random", False, id="qwen3_moe-group-W2"),
    pytest.param(2, "mixtral", "group", None, "float32", "random", False, id="mixtral-group-W2"),
    pytest.param(2, "gpt_oss", "group", None, "float32", "random", False, id="gpt_oss-group-W2"),
    pytest.param(2, "deepseek_v3", "group", None, "float32", "uneven", False, id="deepseek_v3-uneven-group-W2"),
    # Other models with transformers' decorated experts.
    pytest.param(2, "olmoe", "group", None, "float32", "random", False, id="olmoe-group-W2"),
    pytest.param(2, "qwen2_moe", "group", None, "float32", "random", False, id="qwen2_moe-group-W2"),
    pytest.param(2, "nemotron_h", "group", None, "float32", "random", False, id="nemotron_h-group-W2"),
    # A 1-D EP mesh over 4 ranks.
    pytest.param(4, "qwen3_moe", "mesh1d", None, "float32", "random", False, id="qwen3_moe-mesh1d-W4"),
    pytest.param(4, "deepseek_v3", "mesh1d", None, "float32", "uneven", False, id="deepseek_v3-uneven-mesh1d-W4"),
    # EP x FSDP2 on a dp 2 x ep 2 mesh.
    pytest.param(4, "qwen3_moe", "fsdp", 2, "float32", "random", False, id="qwen3_moe-fsdp-dp2xep2"),
    pytest.param(4, "mixtral", "fsdp", 2, "float32", "random", False, id="mixtral-fsdp-dp2xep2"),
    pytest.param(4, "gpt_oss", "fsdp", 2, "float32", "random", False, id="gpt_oss-fsdp-dp2xep2"),
    pytest.param(4, "deepseek_v3", "fsdp", 2, "float32", "uneven", False, id="deepseek_v3-uneven-fsdp-dp2xep2"),
    # bfloat16 compute (FSDP2 mixed precision, float32 reduction).
    pytest.param(2, "mixtral", "fsdp", 2, "bfloat16", "random", False, id="mixtral-fsdp-dp1xep2-bf16"),
    pytest.param(4, "gpt_oss", "fsdp", 2, "bfloat16", "random", False, id="gpt_oss-fsdp-dp2xep2-bf16"),
    # transformers' activation checkpointing (each layer's forward again inside the backward).
    pytest.param(4, "qwen3_moe", "fsdp", 2, "float32", "random", True, id="qwen3_moe-fsdp-dp2xep2-checkpointing"),
]


@pytest.mark.parametrize("world_size,family,layout,ep,dtype,scenario,checkpointing", PARITY)
def test_whole_model_matches_unsharded(pools, world_size, family, layout, ep, dtype, scenario, checkpointing):
    from _transformers_cases import case_parity

    results = pools.run(world_size, case_parity, family=family, layout=layout, ep=ep, dtype=dtype,
                        scenario=scenario, checkpointing=checkpointing, timeout=180)
    for rank, res in enumerate(results):
        _check_diffs(res["diffs"], dtype, f"rank {rank}")
        assert res["handles"] and all("mode='reference'" in h for h in res["handles"]), res["handles"]
        assert set(res["impls"]) == {"loop"}, res["impls"]
        # Every expert weight is Shard(0) over the EP dim (after FSDP2: Shard(1) over dp too).
        expected = ["S(0)"] if layout != "fsdp" else ["S(1)", "S(0)"]
        assert res["placements"] and all(p == expected for p in res["placements"].values()), res["placements"]
    counts = results[0]["counts"]
    assert counts, "no MoE layer ran"
    ep = results[0]["ep"]
    for layer, c in counts.items():
        local = len(c) // ep
        if scenario == "uneven":  # the last EP rank received no token at all
            assert sum(c[(ep - 1) * local:]) == 0 and sum(c) > 0, (layer, c)
        else:  # every EP rank received tokens
            assert all(sum(c[r * local:(r + 1) * local]) > 0 for r in range(ep)), (layer, c)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiled_moe_block_fullgraph(pools, family):
    """torch.compile(fullgraph=True, aot_eager) of an MoE block on te_ep: two steps on other
    inputs, one graph, output and every gradient equal to the eager unsharded block."""
    from _transformers_cases import case_compiled_block

    results = pools.run(2, case_compiled_block, family=family, timeout=240)
    for rank, res in enumerate(results):
        for step, s in enumerate(res["steps"]):
            _check_diffs(s["diffs"], "float32", f"rank {rank} step {step}")
            if step == 0:
                assert s["new_graphs"] >= 1, f"rank {rank}: nothing was compiled"
            else:
                assert s["new_graphs"] == 0, f"rank {rank}: step {step} recompiled ({s['new_graphs']} graphs)"


def test_checkpoint_round_trip_across_ep_sizes(pools, tmp_path):
    """DCP save on a dp 2 x ep 2 mesh (4 ranks), load at EP 2 (2 ranks), on a (1, 2) mesh and
    into the unsharded model: the same global weights and logits."""
    from _transformers_cases import case_load, case_save

    path = str(tmp_path / "ckpt")
    saved = pools.run(4, case_save, family="qwen3_moe", path=path, ep=2, timeout=180)[0]
    for layout in ("ep", "fsdp", "unsharded"):
        for rank, res in enumerate(pools.run(2, case_load, family="qwen3_moe", path=path, layout=layout, timeout=180)):
            assert sorted(res["state"]) == sorted(saved["state"]), (layout, sorted(res["state"]))
            for name, t in saved["state"].items():
                torch.testing.assert_close(res["state"][name], t, atol=0, rtol=0, msg=f"{layout} rank {rank} {name}")
            torch.testing.assert_close(res["logits"], saved["logits"], atol=1e-5, rtol=1e-4,
                                       msg=f"{layout} rank {rank} logits")


def test_a_batch_too_long_on_one_rank_raises_on_every_rank(pools):
    from _transformers_cases import case_bad_batch_one_rank

    results = pools.run(2, case_bad_batch_one_rank, timeout=120)
    faulty, other = results[1], results[0]
    assert faulty["type"] == "ValueError", faulty
    assert "hidden_states has 22 tokens, more than max_tokens_per_rank=16" in faulty["message"], faulty
    assert other["type"] == "RuntimeError" and "te_ep.prepare" in other["message"], other
    assert "rank 1" in other["message"], other


def test_refusals_name_what_is_wrong(pools):
    from _transformers_cases import case_refusals

    results = pools.run(2, case_refusals, timeout=120)
    expected = {
        "indivisible": r"ValueError: .*'model.layers.0.mlp.experts'.*num_experts \(5\) must be divisible by the EP "
                       r"size \(2\)",
        "no_experts": r"ValueError: .*LlamaForCausalLM has no experts module of transformers' "
                      r"@use_experts_implementation kind",
        "extra_param": r"ValueError: .*'model.layers.0.mlp.experts'.*parameter 'weight_scale'",
        "interleaved": r"ValueError: .*interleaved \(is_concatenated=False\) without its own _apply_gate",
        "module_list": r"ValueError: .*'model.layers.1.mlp.experts' \(ModuleList\) holds experts that are not",
        "max_tokens": r"ValueError: .*max_tokens_per_rank must be a positive int .*got 0",
        "backend": r"ValueError: .*backend must be one of .*got 'mpi'",
        "alignment": r"ValueError: .*alignment must be None or a power of two, got 3",
        "capacity_factor": r"ValueError: parallelize_hf_moe: capacity_factor is now a multiplier of the mean receive "
                           r"load.*got 0.5.*removed in te_ep_torch 0.3.0",
        "overflow": r"ValueError: parallelize_hf_moe: overflow must be one of \('raise', 'drop'\), got 'skip'",
        "expert_impl": r"ValueError: .*expert_impl must be one of .*got 'fast'",
        "nccl_ep_mode": r"ValueError: .*nccl_ep_mode must be one of .*got 'fast'",
        "checks": r"ValueError: .*checks must be one of .*got 'strict'",
        "dtype": r"ValueError: .*dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got torch.int8",
        "fsdp_options_without_mesh": r"ValueError: .*mp_policy and blocks are FSDP2 options; they need a 2-D",
        "mesh_dims": r"ValueError: .*2-D mesh with dims \('dp', 'ep'\)",
        "mesh_type": r"TypeError: .*mesh_or_group must be a DeviceMesh, a ProcessGroup or None .*got str",
        "twice": r"RuntimeError: .*gate_up_proj is already a DTensor; parallelize_hf_moe applies once",
        "not_parallelized": r"RuntimeError: Qwen3MoeExperts: config._experts_implementation is 'te_ep' but this "
                            r"experts module was not made expert-parallel",
    }
    for rank, res in enumerate(results):
        assert res["untouched"], f"rank {rank}: a refused model was changed"
        assert set(res["seen"]) == set(expected), sorted(res["seen"])
        for label, pattern in expected.items():
            assert re.search(pattern, res["seen"][label], re.S), f"rank {rank} {label}: {res['seen'][label]}"


def test_registered_in_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from te_ep_torch.integrations.transformers import IMPLEMENTATION, te_ep_experts_forward

    assert ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] is te_ep_experts_forward


# ---- example and GPU script on CPU -----------------------------------------------------------


def _torchrun(nprocs: int, script: Path, args, timeout: float) -> str:
    # CUDA_VISIBLE_DEVICES="": the CPU path, also on a GPU machine.
    return run_torchrun(script, *args, nprocs=nprocs, timeout=timeout, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


def test_finetune_example_on_two_cpu_ranks(tmp_path):
    """examples/hf_moe_finetune.py --impl all: EP 2 x FSDP2 on 2 gloo ranks, every way in this transformers has
    (te_ep and all_to_all through DistributedConfig on >= 5.23, parallelize_hf_moe); for each the loss falls,
    a checkpoint is written and tokens/s are printed."""
    from te_ep_torch.integrations.transformers import HAS_EP_REGISTRY

    ckpt = tmp_path / "ckpt"
    out = _torchrun(2, REPO / "examples" / "hf_moe_finetune.py", ["--impl", "all", "--steps", "20", "--ckpt-dir",
                                                                   str(ckpt)], 240)
    impls = ["te_ep", "all_to_all", "parallelize_hf_moe"] if HAS_EP_REGISTRY else ["parallelize_hf_moe"]
    assert sorted(os.listdir(ckpt)) == sorted(impls), (os.listdir(ckpt), out[-4000:])
    for impl in impls:
        assert re.search(rf"\[{impl}\] loss .* tokens/s; loss went down", out), (impl, out[-4000:])
        assert f"[{impl}] saved checkpoint" in out, (impl, out[-4000:])
        assert re.search(rf"^{impl} +[\d,]+ +\d+\.\d+$", out, re.M), (impl, out[-4000:])
    if HAS_EP_REGISTRY:  # the experts of the te_ep run went through te_ep's group
        assert re.search(r"\[te_ep\] .* te_ep backend=reference experts=8 \(4/rank\) in 2 MoE layers", out), out[-4000:]


def test_gpu_script_logic_on_cpu():
    """tests/gpu/transformers_gpu.py --device cpu (two of its models, to keep it short): the equality
    checks (parallelize_hf_moe, and on transformers >= 5.23 DistributedConfig(ep_implementation="te_ep"))
    pass and the timing table prints."""
    out = _torchrun(2, REPO / "tests" / "gpu" / "transformers_gpu.py",
                    ["--device", "cpu", "--tiny", "--models", "gpt_oss,deepseek_v3", "--iters", "2", "--warmup", "1",
                     "--repeats", "1"], 240)
    assert "equality: passed" in out, out[-4000:]
    assert "te_ep / grouped_mm" in out, out[-4000:]
    from te_ep_torch.integrations.transformers import HAS_EP_REGISTRY

    if HAS_EP_REGISTRY:  # also sharded by transformers with ep_implementation="te_ep"
        for family in ("gpt_oss", "deepseek_v3"):
            assert re.search(rf"^ok +{family} float32 registry W=2", out, re.M), out[-4000:]
