"""EpOptions (te_ep_torch/options.py): the EP options in one record, validated once, and the
capacity file's drop rule (te_ep_torch/capacity.py) on one rank."""

import datetime
import types

import pytest
import torch

import te_ep_torch as te
from te_ep_torch.capacity import drop_past_share, expert_share
from te_ep_torch.options import EpOptions
from te_ep_torch.parallel import ExpertParallel


def test_defaults_are_what_a_user_gets_without_asking():
    o = EpOptions()
    assert (o.backend, o.nccl_ep_mode, o.timeout, o.checks) == ("auto", te.DEFAULT_NCCL_EP_MODE, None, "local")
    assert (o.capacity, o.capacity_factor, o.overflow) == (None, None, "raise")
    assert o.group_kwargs() == {"backend": "auto", "nccl_ep_mode": te.DEFAULT_NCCL_EP_MODE, "timeout": None,
                                "checks": "local"}
    assert o.handle_kwargs() == {"capacity": None, "capacity_factor": None, "overflow": "raise"}


@pytest.mark.parametrize("fields,message", [
    (dict(backend="mpi"), r"EpOptions: backend must be one of \('auto', 'reference', 'nccl_ep'\), got 'mpi'"),
    (dict(nccl_ep_mode="fast"), r"EpOptions: nccl_ep_mode must be one of .*got 'fast'"),
    (dict(checks="all"), r"EpOptions: checks must be one of \('local', 'device', 'synchronous'\), got 'all'"),
    (dict(overflow="skip"), r"EpOptions: overflow must be one of \('raise', 'drop'\), got 'skip'"),
    (dict(timeout=0), r"EpOptions: timeout must be None or a positive number of seconds, got 0"),
    (dict(timeout=True), r"EpOptions: timeout must be None or a positive number of seconds, got True"),
    (dict(capacity=0), r"EpOptions: capacity must be None \(the worst case\) or a positive int, got 0"),
    (dict(capacity=64, capacity_factor=1.5), r"EpOptions: pass capacity \(rows\) or capacity_factor .*not both"),
    (dict(capacity_factor=0.5), r"EpOptions: capacity_factor is now a multiplier"),
    (dict(capacity_factor=float("nan")), r"EpOptions: capacity_factor must be None"),
])
def test_each_bad_field_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        EpOptions(**fields)
    with pytest.raises(ValueError, match=message.replace("EpOptions:", "my_entry:")):
        EpOptions.build("my_entry", **fields)


def test_valid_values_pass():
    EpOptions(timeout=datetime.timedelta(seconds=5), capacity=128, overflow="drop", checks="device")
    EpOptions(timeout=2.5, capacity_factor=1.25, backend="reference", nccl_ep_mode="staged")
    with pytest.raises(TypeError, match="my_entry: unknown EP option 'capacity_rows'"):
        EpOptions.build("my_entry", capacity_rows=3)


def test_an_entry_point_takes_options_or_keywords_not_both():
    record = EpOptions(capacity_factor=1.25, overflow="drop", checks="device")
    style = ExpertParallel(max_tokens_per_rank=8, options=record)
    assert style.options is record
    assert (style.capacity_factor, style.overflow, style.checks, style.backend) == (1.25, "drop", "device", "auto")
    assert ExpertParallel(max_tokens_per_rank=8, capacity_factor=1.25, overflow="drop", checks="device").options == \
        record
    with pytest.raises(ValueError, match="ExpertParallel: pass options=EpOptions.* or the keywords, not both; got "
                                         "options and capacity_factor"):
        ExpertParallel(max_tokens_per_rank=8, capacity_factor=1.5, options=record)
    with pytest.raises(TypeError, match="ExpertParallel: options must be a te_ep_torch.EpOptions, got dict"):
        ExpertParallel(max_tokens_per_rank=8, options={"capacity_factor": 1.5})
    with pytest.raises(AttributeError, match="no attribute 'capacity_rows'"):
        ExpertParallel(max_tokens_per_rank=8).capacity_rows


def test_expert_share_is_an_equal_aligned_share_below_the_worst_case():
    assert expert_share(100, 400, 4, 8, "drop") == 24  # 100 // 4 = 25, rounded down to 8
    assert expert_share(100, 400, 4, 8, "raise") is None
    assert expert_share(400, 400, 4, 8, "drop") is None  # the worst case: nothing can overflow


def test_drop_past_share_keeps_the_first_choices_of_each_expert_on_one_rank():
    group = types.SimpleNamespace(num_experts=3, ep_size=1, rank=0, group_name="unused")
    topk_idx = torch.tensor([[0, 1], [0, 1], [1, 0], [2, -1]])
    dropped = torch.zeros(3, dtype=torch.int64)
    out = drop_past_share(group, topk_idx, 1, dropped)
    # Order: token, then choice. Expert 0 keeps (0, 0); expert 1 keeps (0, 1); expert 2 keeps (3, 0).
    assert out.tolist() == [[0, 1], [-1, -1], [-1, -1], [2, -1]]
    assert dropped.tolist() == [2, 2, 0]
    # Ids outside [0, E) stay for the ops' checks, and are not counted.
    out = drop_past_share(group, torch.tensor([[5, 0]]), 1, dropped)
    assert out.tolist() == [[5, 0]] and dropped.tolist() == [2, 2, 0]
