"""The shared multi-rank cases (ep_cases.CASES) on CPU: gloo process group, te_ep
"reference" backend, W worker processes per world size (see _dist.py)."""

import pytest

import ep_cases

PARAMS = [
    pytest.param(case, W, id=f"{case.name}-W{W}")
    for case in ep_cases.CASES
    if not case.only_non_reference
    for W in case.world_sizes
]


@pytest.mark.parametrize("case,world_size", PARAMS)
def test_case(pools, case, world_size):
    pools.run(world_size, case.fn, *case.args, timeout=case.timeout)
