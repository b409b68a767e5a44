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

tests/test_faults.py runs every case as a test of its own: on CPU (gloo, the reference
backend), and on GPUs (marked gpu, faults and nccl_ep) with the nccl_ep backend in each mode
and check mode at each ``--world-size`` (1: only the cases marked ``one_rank``, the faulty
rank's side). For example, every fault case at two and four GPUs, with a 10 s process-group
timeout, and a line per case saying which limit ended each rank:

    python3 -m pytest -m "gpu and faults" --world-size 2,4 --faults-pg-timeout 10 --faults-summary faults.txt

Modules: `runner` (records; the processes are tests/_dist.py's fresh-processes mode), `cases`
(the faults and their expectations), `expect` (the judge). They import tests/ as the rest of
the suite does (``_dist``, ``ep_cases``): pytest's ``pythonpath`` puts it on the import path.
"""
