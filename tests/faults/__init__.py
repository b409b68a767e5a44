"""Fault injection for the te_ep "fail loudly, on every rank, never hang" contract.

Each fault case (`cases.CASES`) runs in W fresh processes of its own (never the shared
worker pools of tests/_dist.py): a new process group with a short explicit timeout, a new
te_ep handle registry, a hard wall-clock limit after which every process of the case is
killed and the case is reported as a hang. The fault (a bad argument, a rank that exits or
sleeps in the middle of a step, ...) is injected on one rank; the runner records, per rank,
whether it raised, the exception type and message, the seconds from the fault to the failure
(or completion), the exit code, and, where a rank completes the faulted step, whether its
outputs are exact (the fingerprint checks of tests/ep_cases), so a silently wrong result is
seen. Every case declares what the contract asks of it and what the code does today where
that falls short (`cases.Expect`); tests/test_faults.py asserts both on CPU/gloo. A hang or a wrong
output that a case does not declare fails it in every variant.

    python3 -m tests.faults --backend reference --world-size 2
    python3 -m tests.faults --backend nccl_ep --device cuda --world-size 2 [--check-routing | --device-checks]

Modules: `runner` (processes, records, the table), `cases` (the faults and their
expectations), `__main__` (the command line).
"""

from __future__ import annotations

import os
import sys

# The cases reuse tests/ep_cases (imported as a top-level package, as the rest of the
# suite does) and the in-place build of te_ep_torch at the repository root.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.dirname(_TESTS), _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
