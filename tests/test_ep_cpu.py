"""The shared multi-rank cases (ep_cases.CASES) on CPU: gloo process group, te_ep
"reference" backend, W worker processes per world size (see _dist.py)."""

import pytest

import ep_cases
from ep_cases.common import Step
from ep_cases.dense import Layer
from te_ep_torch.group import NCCL_EP_EXPERT_MULTIPLE

PARAMS = [
    pytest.param(case, W, id=f"{case.name}-W{W}")
    for case in ep_cases.CASES
    if not case.only_non_reference
    for W in case.world_sizes
]


@pytest.mark.parametrize("case,world_size", PARAMS)
def test_case(pools, case, world_size):
    pools.run(world_size, case.fn, *case.args, timeout=case.timeout)


def _steps(obj):
    """Every Step in a case's arguments, Layers and nested lists included."""
    if isinstance(obj, Step):
        yield obj
    elif isinstance(obj, Layer):
        yield obj.step
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _steps(item)


def test_shared_steps_fit_nccl_ep():
    """The GPU runner runs every case not marked reference_only on nccl_ep at whatever W it
    is launched with: their steps must keep to nccl_ep's sizes there (docs/ops.md), which
    this machine can check without a GPU."""
    bad = [
        f"{case.name}: {step}"
        for case in ep_cases.CASES
        if not case.reference_only
        for step in _steps(case.args)
        if step.experts_per_rank % NCCL_EP_EXPERT_MULTIPLE or step.hidden * step.torch_dtype().itemsize % 16
    ]
    assert not bad, (f"experts_per_rank must be a multiple of {NCCL_EP_EXPERT_MULTIPLE} and hidden rows a multiple "
                     "of 16 bytes, or the case reference_only:\n" + "\n".join(bad))
