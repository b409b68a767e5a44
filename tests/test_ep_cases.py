"""The shared multi-rank cases (ep_cases.CASES), and the raw-ops and soak bodies, through the
suite's launcher (tests/_dist.py, worker pools; tests/_launches.py for the parameters):

* on CPU: gloo, the reference backend, each case at its `Case.world_sizes`;
* on GPUs (marked ``gpu``, at each size of ``--world-size``): NCCL with one GPU per rank, the
  reference backend, and nccl_ep in each mode and check mode.

Which cases run on GPUs: every case at every size from its ``min_world`` up (at one rank, the
cases marked ``one_rank``); on nccl_ep, none marked ``reference_only``, and per check mode:
``local`` and ``device`` run every case but those that need every rank to raise in the op when
one rank's input is bad (``needs_agreement``), which only ``synchronous`` does, and
``synchronous`` runs just those (at one rank: the one-rank cases but ``cuda_graph``, as a sync
per op leaves nothing to capture). The reference backend on GPUs runs at two ranks or more.
"""

import pytest

import ep_cases
from _dist import Launch
from _launches import gpu_launches, param
from ep_cases.common import Step
from ep_cases.dense import Layer
from ep_cases.raw_ops import case_raw_ops
from ep_cases.soak import case_soak
from te_ep_torch.group import NCCL_EP_EXPERT_MULTIPLE

SOAK_STEPS = 1000


def _runs_on(case: ep_cases.Case, launch: Launch) -> bool:
    """Whether `case` runs on the GPU launch `launch` (the module docstring)."""
    W = launch.world_size
    if W == 1 and not (case.one_rank and launch.backend == "nccl_ep"):
        return False
    if W > 1 and W < case.min_world:
        return False
    if launch.backend == "reference":
        return not case.only_non_reference
    if case.reference_only:
        return False
    if launch.checks == "synchronous":
        return case.name != "cuda_graph" if W == 1 else case.needs_agreement
    return not case.needs_agreement


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if metafunc.function is test_case:
        params = [param(Launch(W), case, name=case.name)
                  for case in ep_cases.CASES if not case.only_non_reference for W in case.world_sizes]
        params += [param(launch, case, name=case.name, quick=case.quick and launch.backend == "nccl_ep")
                   for launch in gpu_launches(config) for case in ep_cases.CASES if _runs_on(case, launch)]
        metafunc.parametrize("case,launch", params)
    elif metafunc.function is test_raw_ops:
        params = [param(Launch(2))]
        params += [param(launch, quick=True) for launch in gpu_launches(config, ["nccl_ep"], ["local"])]
        metafunc.parametrize("launch", params)
    elif metafunc.function is test_soak:
        metafunc.parametrize("launch", [param(launch, marks=[pytest.mark.soak])
                                        for launch in gpu_launches(config, ["nccl_ep"], ["local"])])


def test_case(pools, case, launch):
    pools.run(launch, case.fn, *case.args, timeout=launch.timeout(case.timeout))


def test_raw_ops(pools, launch):
    """The ops without EpGroup against a torch reference (ep_cases/raw_ops.py); on GPUs in each
    nccl_ep mode (the body sets its own check modes)."""
    pools.run(launch, case_raw_ops, timeout=launch.timeout(300))


def test_soak(pools, launch):
    """1000 training steps and a re-initialisation, in each nccl_ep mode (ep_cases/soak.py)."""
    pools.run(launch, case_soak, SOAK_STEPS, timeout=launch.timeout(450))


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
    """The GPU parameters run every case not marked reference_only on nccl_ep at every
    --world-size: their steps must keep to nccl_ep's sizes there (docs/ops.md), which this
    machine can check without a GPU."""
    bad = [
        f"{case.name}: {step}"
        for case in ep_cases.CASES
        if not case.reference_only
        for step in _steps(case.args)
        if step.experts_per_rank % NCCL_EP_EXPERT_MULTIPLE or step.hidden * step.torch_dtype().itemsize % 16
    ]
    assert not bad, (f"experts_per_rank must be a multiple of {NCCL_EP_EXPERT_MULTIPLE} and hidden rows a multiple "
                     "of 16 bytes, or the case reference_only:\n" + "\n".join(bad))
