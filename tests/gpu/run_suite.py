#!/usr/bin/env python3
"""Runs the shared multi-rank cases (tests/ep_cases/) on CUDA with an NCCL process group.

    torchrun --standalone --nproc-per-node=N tests/gpu/run_suite.py --backend nccl_ep|reference [-k SUBSTR ...]

Prints one ``PASS <case>`` / ``FAIL <case>: ...`` line per case (rank 0), the
failing ranks' tracebacks, and a final line ``N passed, M failed``; exits non-zero
on any failure. With a backend other than ``reference``, the suite also runs
``backend_agreement``, which compares that backend with the reference backend
on the same inputs in the same process.

A case that does not finish within its deadline on some rank is a failure: that
rank prints ``FAIL <case> (hang ...)`` and the final line, and exits (torchrun
then stops the others). A hang never stalls the caller.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import threading
import traceback

# NVLink multicast (NVLS) stays off: shared machines require it, and it isn't
# what these tests are about.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

# A script torchrun starts, outside pytest's pythonpath: tests/ and the repository root (an
# in-place build) on the import path, as pytest puts them.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ep_cases  # noqa: E402
from _dist import Ctx  # noqa: E402

# The CPU deadlines, stretched for first-call CUDA/NCCL set-up and NCCL EP's
# kernel compilation; TE_EP_SUITE_TIMEOUT_FACTOR overrides.
GPU_TIMEOUT_FACTOR = float(os.environ.get("TE_EP_SUITE_TIMEOUT_FACTOR", "2.0"))


# The cases whose checks hold at one rank, where the faulty rank is the only rank (one GPU):
# they prove that rank's side, not agreement across ranks. The others need a second rank by
# construction (a value that differs on the last rank, 8 experts for a top-8 step, a tight
# capacity below NCCL EP's floor, ...).
ONE_RANK_CASES = {
    "alignment_exact", "two_layers_raw_ops", "no_grad_path", "opcheck", "opcheck_empty_rank", "cuda_graph",
    "fp8_dispatch_exact", "fp8_dispatch_grads", "lifetime_microbatches", "lifetime_checkpoint",
    "handle_mode_and_memory", "compile_aot_eager", "compile_many_layers", "device_checks",
    "device_checks_arguments", "device_checks_op_arguments", "routing_guard", "check_modes",
}


def _select(backend: str, checks: str, world_size: int, patterns: list | None, agreement: str, skipped: list):
    out = []
    for case in ep_cases.CASES:
        if patterns and not any(p in case.name for p in patterns):
            continue
        if world_size == 1:
            if case.name not in ONE_RANK_CASES:
                continue
        elif world_size < case.min_world:
            continue
        if case.only_non_reference and backend == "reference":
            continue
        if case.reference_only and backend != "reference":
            skipped.append((case.name, case.reference_only))
            continue
        if case.name == "cuda_graph" and checks == "synchronous":
            skipped.append((case.name, "checks='synchronous' waits for the GPU in every op: nothing to capture"))
            continue
        agreeing = backend == "reference" or checks == "synchronous"
        if agreement == "only" and not case.needs_agreement:
            continue
        if case.needs_agreement and not agreeing:
            skipped.append((case.name, f"{backend} raises in the op on every rank only with --checks synchronous"))
            continue
        # The CPU suite restricts some cases to certain sizes only to save CPU time;
        # on GPUs every case runs at the launched size, except the 8-rank smoke cases,
        # which only make sense at 8 or more ranks.
        if case.name.startswith("smoke_8") and world_size < 8:
            continue
        out.append(case)
    return out


class _Watchdog:
    def __init__(self, rank: int):
        self.rank = rank
        self._timer: threading.Timer | None = None
        # this rank's error, if it failed and now waits for the others (which may be
        # stuck in a collective it left): printed on expiry, else it would be lost
        self.pending_error: str | None = None

    def arm(self, name: str, seconds: float, counts: list) -> None:
        self.pending_error = None

        def fire():
            passed, failed = counts
            if self.pending_error is not None:
                print(f"FAIL {name}: rank {self.rank} raised, and the others did not finish "
                      f"within {seconds:.0f} s:\n{self.pending_error}", flush=True)
            else:
                print(f"FAIL {name} (hang: not finished on rank {self.rank} after {seconds:.0f} s); stacks:",
                      flush=True)
                faulthandler.dump_traceback(all_threads=True)
            print(f"{passed} passed, {failed + 1} failed", flush=True)
            os._exit(1)

        self._timer = threading.Timer(seconds, fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True, choices=("nccl_ep", "reference"))
    ap.add_argument("-k", dest="patterns", nargs="+", default=None, metavar="SUBSTR",
                    help="run only cases whose name contains one of these")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead (to check this runner without GPUs)")
    ap.add_argument("--agreement", choices=("include", "only"), default="include",
                    help="'only': run just the cases that need every rank to raise on one rank's bad input")
    ap.add_argument("--checks", default="local", choices=("local", "device", "synchronous"),
                    help="EpGroup(checks=...) of the cases' groups")
    ap.add_argument("--nccl-ep-mode", default=None, choices=("staged", "zero_copy", "auto"),
                    help="EpGroup(nccl_ep_mode=...) of the cases' groups (default: EpGroup's)")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=900)
    if args.cpu:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Status exchange on a gloo group: it must work even if NCCL is out of step after a failure.
    status_group = dist.new_group(backend="gloo")
    ctx = Ctx(rank=rank, world_size=world_size, device=str(dev), backend=args.backend,
              nccl_ep_mode=args.nccl_ep_mode, checks=args.checks)

    skipped: list = []
    cases = _select(args.backend, args.checks, world_size, args.patterns, args.agreement, skipped)
    if rank == 0:
        for name, why in skipped:
            print(f"SKIP {name}: {why}", flush=True)
        if not cases:
            print(f"no case selected at world size {world_size} (patterns {args.patterns}); the cases need at "
                  f"least {min(c.min_world for c in ep_cases.CASES)} ranks, so a run without cases fails", flush=True)
    counts = [0, 0]
    watchdog = _Watchdog(rank)
    for case in cases:
        watchdog.arm(case.name, case.timeout * GPU_TIMEOUT_FACTOR, counts)
        try:
            case.fn(ctx, *case.args)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            err = None
        except BaseException:
            err = traceback.format_exc()
            watchdog.pending_error = err
        statuses = [None] * world_size
        dist.all_gather_object(statuses, err, group=status_group)
        watchdog.disarm()
        bad = {r: e for r, e in enumerate(statuses) if e is not None}
        if bad:
            counts[1] += 1
            if rank == 0:
                first = next(iter(bad.values())).strip().splitlines()[-1]
                print(f"FAIL {case.name}: ranks {sorted(bad)}: {first}", flush=True)
                for r, e in bad.items():
                    print(f"---- {case.name} rank {r} ----\n{e}", flush=True)
        else:
            counts[0] += 1
            if rank == 0:
                print(f"PASS {case.name}", flush=True)
    if rank == 0:
        print(f"{counts[0]} passed, {counts[1]} failed, {len(skipped)} skipped", flush=True)
    ok = counts[1] == 0 and counts[0] > 0
    dist.barrier(group=status_group)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
