"""The nccl_ep transport a user gets without asking: one owner, te_ep_torch.DEFAULT_NCCL_EP_MODE.

Every Python entry point defaults to it (docs/nccl_ep.md, "Modes"); the create_handle op keeps
its 0.2.0 schema default, which EpGroup never relies on (docs/ops.md, "create_handle").
"""

import inspect

import pytest
import torch

import te_ep_torch as te
from _dist import run_fresh
from te_ep_torch.options import UNSET
from te_ep_torch.parallel import ep_group_for


def _default(fn, name="nccl_ep_mode"):
    return inspect.signature(fn).parameters[name].default


def test_the_default_is_zero_copy_and_a_mode():
    assert te.DEFAULT_NCCL_EP_MODE == "zero_copy"
    assert te.DEFAULT_NCCL_EP_MODE in te.NCCL_EP_MODES


@pytest.mark.parametrize("entry", [te.EpGroup, ep_group_for, te.EpOptions], ids=lambda f: f.__name__)
def test_entry_points_take_the_one_default(entry):
    assert _default(entry) == te.DEFAULT_NCCL_EP_MODE


def test_layer_entry_points_run_with_the_records_default():
    # Their nccl_ep_mode keyword is deprecated (UNSET: not passed); what they run with is EpOptions()'s.
    assert _default(te.ExpertParallel) is UNSET and _default(te.parallelize_moe_model) is UNSET
    assert te.ExpertParallel(max_tokens_per_rank=8).options.nccl_ep_mode == te.DEFAULT_NCCL_EP_MODE


def test_transformers_takes_the_one_default():
    pytest.importorskip("transformers")
    from te_ep_torch.integrations.transformers import parallelize_hf_moe

    assert _default(parallelize_hf_moe) is UNSET  # deprecated keyword: options=EpOptions() carries the default


def _torchtitan_config_mode(ctx):
    from te_ep_torch.integrations.torchtitan import TeEpTokenDispatcher as D

    return D.Config(num_experts=8, top_k=2, hidden_dim=8, num_max_tokens_per_rank=4).nccl_ep_mode


def test_torchtitan_config_takes_the_one_default():
    # TorchTitan is imported in a process of its own (a fresh one of the suite's launcher, which
    # forks it from a process that imported torch and te_ep_torch once), never in pytest's, as
    # tests/test_torchtitan.py does (its worker pools)
    assert run_fresh(1, _torchtitan_config_mode, timeout=120) == [te.DEFAULT_NCCL_EP_MODE]


def test_the_op_schema_keeps_its_020_default():
    (arg,) = [a for a in torch.ops.te_ep.create_handle.default._schema.arguments if a.name == "nccl_ep_mode"]
    assert arg.default_value == "staged"
