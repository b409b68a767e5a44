"""EpOptions (te_ep_torch/options.py): the EP options in one record, validated once, the
deprecation of the entry points' per-option keywords (FutureWarning), and the capacity file's
drop rule (te_ep_torch/capacity.py) on one rank."""

import datetime
import types
import warnings

import pytest
import torch

import te_ep_torch as te
from te_ep_torch.capacity import drop_past_share, expert_share
from _moe_common import make_moe
from te_ep_torch.options import UNSET, EpOptions
from te_ep_torch.parallel import ExpertParallel, parallelize_moe_model


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
    with pytest.warns(FutureWarning, match=r"ExpertParallel\(checks=\.\.\., capacity_factor=\.\.\., overflow=\.\.\.\)"):
        assert ExpertParallel(max_tokens_per_rank=8, capacity_factor=1.25, overflow="drop", checks="device").options \
            == record
    with pytest.raises(ValueError, match="ExpertParallel: pass options=EpOptions.* or the keywords, not both; got "
                                         "options and capacity_factor"):
        ExpertParallel(max_tokens_per_rank=8, capacity_factor=1.5, options=record)
    with pytest.raises(TypeError, match="ExpertParallel: options must be a te_ep_torch.EpOptions, got dict"):
        ExpertParallel(max_tokens_per_rank=8, options={"capacity_factor": 1.5})
    with pytest.raises(AttributeError, match="no attribute 'capacity_rows'"):
        ExpertParallel(max_tokens_per_rank=8).capacity_rows


# ---- the per-option keywords of the entry points: deprecated (FutureWarning), removed in 0.4 ----------


class _FakeStep:
    """Stands in for EpStep in MoE.enable_expert_parallel (no process group here)."""

    def __init__(self, group, **kwargs):
        self.group, self.options = group, kwargs["options"]
        self.added = []

    def add_handle(self, dtype, options, checks=None):
        self.added.append((dtype, options, checks))


class _FakeGroup:
    num_experts, num_local_experts = 8, 8


def _enable(monkeypatch):
    """``MoE.enable_expert_parallel`` on a fresh layer and a fake group: returns the options its
    handle got."""
    monkeypatch.setattr("te_ep_torch.moe.EpStep", _FakeStep)

    def call(**kwargs):
        moe = make_moe()
        moe.enable_expert_parallel(_FakeGroup(), **kwargs)
        (added,) = moe._step.added
        return added[1]

    return call


def _refused_after_options(exc_type, message, fn, *args, **kwargs):
    """Runs ``fn``, which gets past its options and is then refused with ``exc_type`` and
    ``message`` (any other error, e.g. the options' own, propagates)."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        if message not in str(exc):
            raise
    else:
        raise AssertionError(f"{fn.__name__} was not refused with {message!r}")


def _entry_points(monkeypatch):
    """``{name: call(**kwargs) -> EpOptions or None}`` for every entry point that takes both
    ``options`` and the deprecated keywords, run as far as a CPU test without a process group
    can (past the options)."""

    def parallelize(**kwargs):
        # The options are resolved first; a model without MoE layers is refused after them.
        _refused_after_options(ValueError, "parallelize_moe_model: the model has no te_ep_torch.moe.MoE layer",
                               parallelize_moe_model, torch.nn.Linear(2, 2), None, max_tokens_per_rank=8, **kwargs)

    calls = {
        "MoE.enable_expert_parallel": _enable(monkeypatch),
        "ExpertParallel": lambda **kwargs: ExpertParallel(max_tokens_per_rank=8, **kwargs).options,
        "parallelize_moe_model": parallelize,
    }
    try:
        from te_ep_torch.integrations import transformers as hf
    except ImportError:
        return calls

    def parallelize_hf(**kwargs):
        # Past the options, a mesh_or_group of the wrong type is refused.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # >= 5.23: use DistributedConfig
            _refused_after_options(TypeError, "mesh_or_group must be a DeviceMesh", hf.parallelize_hf_moe,
                                   torch.nn.Linear(2, 2), "ep", max_tokens_per_rank=4, **kwargs)

    calls["parallelize_hf_moe"] = parallelize_hf
    if hf.HAS_EP_REGISTRY:
        calls["register_te_ep"] = lambda **kwargs: {
            k: v for k, v in hf.register_te_ep("te_ep_test_deprecated", **kwargs).options.items()
            if k in EpOptions.__dataclass_fields__}
    return calls


# The deprecated keywords of each entry point (MoE.enable_expert_parallel: the handle's;
# its ``checks`` is the handle's check mode, None = the group's, and stays).
KEYWORDS = {
    "MoE.enable_expert_parallel": dict(capacity=64, capacity_factor=1.5, overflow="drop"),
    "ExpertParallel": dict(backend="reference", nccl_ep_mode="staged", timeout=5.0, checks="device", capacity=64,
                           capacity_factor=1.5, overflow="drop"),
    "parallelize_moe_model": dict(backend="reference", nccl_ep_mode="staged", timeout=5.0, checks="device",
                                  capacity=64, capacity_factor=1.5, overflow="drop"),
    "parallelize_hf_moe": dict(backend="reference", nccl_ep_mode="staged", timeout=5.0, checks="device",
                               capacity_factor=1.5, overflow="drop"),
    "register_te_ep": dict(backend="reference", nccl_ep_mode="staged", timeout=5.0, checks="device",
                           capacity_factor=1.5, overflow="drop"),
}


def test_every_entry_point_has_its_keywords_listed(monkeypatch):
    import inspect

    from te_ep_torch.moe import MoE

    entries = {"MoE.enable_expert_parallel": MoE.enable_expert_parallel, "ExpertParallel": ExpertParallel,
               "parallelize_moe_model": parallelize_moe_model}
    try:
        from te_ep_torch.integrations import transformers as hf
        entries.update(parallelize_hf_moe=hf.parallelize_hf_moe, register_te_ep=hf.register_te_ep)
    except ImportError:
        pass
    for name, fn in entries.items():
        deprecated = {p for p, param in inspect.signature(fn).parameters.items() if param.default is UNSET}
        assert deprecated == set(KEYWORDS[name]), (name, deprecated)
        assert "options" in inspect.signature(fn).parameters, name


def _combined(entry):
    """All of ``entry``'s keywords at once (capacity_factor, not capacity: not both)."""
    given = dict(KEYWORDS[entry])
    given.pop("capacity", None)
    return given


def _one_future_warning(call, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(**kwargs)
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 1, [str(w.message) for w in caught]
    return result, future[0]


@pytest.mark.parametrize("entry", sorted(KEYWORDS))
def test_each_keyword_warns_once_naming_the_entry_point_and_the_replacement(monkeypatch, entry):
    calls = _entry_points(monkeypatch)
    if entry not in calls:
        pytest.skip(f"{entry} needs transformers{' >= 5.23' if entry == 'register_te_ep' else ''}")
    for name, value in KEYWORDS[entry].items():
        _, w = _one_future_warning(calls[entry], **{name: value})
        assert str(w.message) == (f"{entry}({name}=...) is deprecated and will be removed in 0.4: pass "
                                  f"options=te.EpOptions({name}=...)")
        assert w.filename == __file__, (w.filename, "the warning points at the caller of the entry point")
    # Several keywords: one warning naming them all, in EpOptions' field order; same record as options=.
    given = _combined(entry)
    result, w = _one_future_warning(calls[entry], **given)
    names = [f for f in EpOptions.__dataclass_fields__ if f in given]
    args = ", ".join(f"{n}=..." for n in names)
    assert str(w.message) == (f"{entry}({args}) is deprecated and will be removed in 0.4: pass "
                              f"options=te.EpOptions({args})")
    if result is not None:
        expected = EpOptions(**given)
        got = result if isinstance(result, EpOptions) else EpOptions(**result)
        assert got == expected, (got, expected)


@pytest.mark.parametrize("entry", sorted(KEYWORDS))
def test_defaults_and_options_warn_nothing(monkeypatch, entry):
    calls = _entry_points(monkeypatch)
    if entry not in calls:
        pytest.skip(f"{entry} needs transformers{' >= 5.23' if entry == 'register_te_ep' else ''}")
    given = _combined(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)  # parallelize_hf_moe's on transformers >= 5.23
        default = calls[entry]()
        record = calls[entry](options=EpOptions(**given))
    if default is not None:
        got = default if isinstance(default, EpOptions) else EpOptions(**default)
        assert got == EpOptions()
        got = record if isinstance(record, EpOptions) else EpOptions(**record)
        assert got == EpOptions(**given)


@pytest.mark.parametrize("entry", sorted(KEYWORDS))
def test_keywords_and_options_are_still_refused_together(monkeypatch, entry):
    calls = _entry_points(monkeypatch)
    if entry not in calls:
        pytest.skip(f"{entry} needs transformers{' >= 5.23' if entry == 'register_te_ep' else ''}")
    name, value = next(iter(KEYWORDS[entry].items()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # refused before any warning
        with pytest.raises(ValueError, match=rf"{entry}: pass options=EpOptions\(\.\.\.\) or the keywords, not "
                                             rf"both; got options and {name}"):
            calls[entry](options=EpOptions(), **{name: value})


def test_resolve_is_the_one_rule():
    with pytest.warns(FutureWarning, match=r"^my_entry\(overflow=\.\.\.\) is deprecated"):
        assert EpOptions.resolve("my_entry", None, overflow="drop", capacity=UNSET) == EpOptions(overflow="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert EpOptions.resolve("my_entry", None, overflow=UNSET) == EpOptions()
        with pytest.raises(ValueError, match="my_entry: overflow must be one of"):  # refused, not warned
            EpOptions.resolve("my_entry", None, overflow="skip")
    # A keyword at its default beside options: warned (deprecated), not refused (it always worked).
    record = EpOptions(capacity_factor=1.5)
    with pytest.warns(FutureWarning, match=r"my_entry\(overflow=\.\.\.\)"):
        assert EpOptions.resolve("my_entry", record, overflow="raise") is record
    assert repr(UNSET) == "UNSET"
    import copy
    import pickle
    assert copy.deepcopy(UNSET) is UNSET and pickle.loads(pickle.dumps(UNSET)) is UNSET


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
