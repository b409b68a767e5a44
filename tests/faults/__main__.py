"""Runs the fault cases and prints one table row per case.

    python3 -m tests.faults --backend reference --world-size 2
    python3 -m tests.faults --backend nccl_ep --device cuda --world-size 2 [--check-routing | --device-checks]

`--world-size 1` (one GPU) runs only the cases marked `one_rank`: the fault is then on the
only rank, so it measures the faulty rank's side and nothing about the others.

The runner launches the W processes of each case itself (no torchrun): on CUDA, rank r
uses GPU r % device_count and an NCCL process group. Verdicts: ``contract`` (meets it),
``shortfall`` (as declared in tests/faults/cases.py, short of the contract), ``UNEXPECTED``
(differs from the declaration; or, where nothing is declared, a rank hung or returned a
wrong output), ``STALE`` (declared short of the contract, now meets it), ``measured``
(nothing declared for this backend variant, e.g. the reference backend on CUDA; no hang, no
wrong output). Variants: ``reference``, ``nccl_ep`` (check mode local), ``nccl_ep+check``
(--checks synchronous), ``nccl_ep+device`` (--checks device). Exits 1 on any UNEXPECTED or STALE verdict, or a failed control.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

# Run from the repository root (``python3 -m tests.faults``), outside pytest, whose
# ``pythonpath`` gives the suite tests/ (for _dist and ep_cases, imported as top-level modules).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from . import cases as fault_cases  # noqa: E402
from .expect import judge  # noqa: E402
from .runner import (  # noqa: E402
    DEFAULT_PG_TIMEOUT_CUDA_S,
    DEFAULT_PG_TIMEOUT_S,
    RunConfig,
    describe,
    run_case,
    summary_line,
    table_header,
    table_row,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.faults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="reference", choices=("reference", "nccl_ep"))
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"),
                    help="default: cuda for nccl_ep, cpu for reference")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--pg-timeout", type=float, default=None,
                    help=f"timeout of each case's process group, seconds (default {DEFAULT_PG_TIMEOUT_S:g} on cpu, "
                         f"{DEFAULT_PG_TIMEOUT_CUDA_S:g} on cuda)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="nccl_ep: skip the fault-free warm-up case that fills NCCL EP's kernel cache first (the "
                         "first use of a shape compiles for tens of seconds, which would count as a hang)")
    ap.add_argument("--checks", default="local", choices=("local", "device", "synchronous"),
                    help="EpGroup(checks=...) in the ranks (nccl_ep; variants nccl_ep, nccl_ep+device, nccl_ep+check)")
    ap.add_argument("--nccl-ep-mode", default=None, choices=("staged", "zero_copy", "auto"),
                    help="EpGroup(nccl_ep_mode=...) in the ranks (default: EpGroup's)")
    ap.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    ap.add_argument("-k", dest="patterns", nargs="+", default=None, metavar="SUBSTR",
                    help="only cases whose name contains one of these")
    ap.add_argument("--controls", action="store_true", help="also run the harness's control cases")
    ap.add_argument("-v", "--verbose", action="store_true", help="every rank's record after each row")
    ap.add_argument("--dump-after", type=float, nargs="+", default=(), metavar="S",
                    help="diagnostics: each rank dumps the Python stack and the kernel state of every thread to its "
                         "stderr S seconds after its body starts (see --keep-logs)")
    ap.add_argument("--keep-logs", default="", metavar="DIR",
                    help="keep each case's rank stderr files under DIR/<case>.<variant>.<mode>.w<W>/")
    ap.add_argument("--summary", default="", metavar="FILE",
                    help="append one line per case to FILE: which limit ended each rank, after how long, the "
                         "verdict and the case's own seconds (start of its processes to their end)")
    args = ap.parse_args(argv)

    if args.world_size < 1:
        ap.error(f"--world-size must be at least 1, got {args.world_size}")
    device = args.device or ("cuda" if args.backend == "nccl_ep" else "cpu")
    if args.backend == "nccl_ep" and device != "cuda":
        ap.error("--backend nccl_ep needs --device cuda")
    if args.checks != "local" and args.backend != "nccl_ep":
        ap.error("--checks chooses between behaviours of --backend nccl_ep (the reference backend always raises in "
                 "the op)")
    if device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < args.world_size:
            ap.error(f"--device cuda --world-size {args.world_size}: needs one GPU per rank, found {n}")
    pg_timeout = args.pg_timeout or (DEFAULT_PG_TIMEOUT_CUDA_S if device == "cuda" else DEFAULT_PG_TIMEOUT_S)
    config = RunConfig(backend=args.backend, device=device, world_size=args.world_size,
                       pg_timeout_s=pg_timeout, checks=args.checks,
                       nccl_ep_mode=args.nccl_ep_mode,
                       start_method=args.start_method,
                       dump_after_s=tuple(args.dump_after), keep_logs=args.keep_logs)
    selected = [c for c in fault_cases.CASES + (fault_cases.CONTROLS if args.controls else [])
                if not args.patterns or any(p in c.name for p in args.patterns)]
    print(f"te_ep fault cases: backend {config.variant}, W={config.world_size}, device {device}, "
          f"PG timeout {config.pg_timeout_s:g} s", flush=True)
    if config.world_size == 1:
        skipped = [c.name for c in selected if not c.one_rank]
        selected = [c for c in selected if c.one_rank]
        print("W=1: the fault is on the only rank, so only the faulty rank's side is measured (where it raises, its "
              "message, its outputs, recovery); what the other ranks do needs W >= 2. Skipped, meaningless at W=1: "
              + (", ".join(skipped) or "none"), flush=True)
    if args.backend == "nccl_ep" and not args.no_warmup:
        for name in ("control_no_fault", "control_overflow_shape"):
            warm = run_case(fault_cases.CASES_BY_NAME[name],
                            dataclasses.replace(config, pg_timeout_s=300.0, dump_after_s=(), keep_logs=""))
            print(f"warm-up {name}: {', '.join(rec.outcome() for rec in warm.ranks)} in {warm.wall_s:.0f} s"
                  f"{' (HANG)' if warm.hang else ''}", flush=True)
    print(table_header(), flush=True)
    counts: dict = {}
    failures = []
    t_start = time.monotonic()
    for case in selected:
        t_case = time.monotonic()
        result = run_case(case, config)
        case_s = time.monotonic() - t_case  # processes started to processes gone: what selecting the case costs
        verdict, problems = judge(case, result)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(table_row(result, verdict), flush=True)
        if args.summary:
            with open(args.summary, "a") as f:
                f.write(f"{summary_line(result)} | verdict {verdict} | case {case_s:.1f} s\n")
        if args.verbose:
            print(describe(result), flush=True)
        if verdict in ("UNEXPECTED", "STALE"):
            failures.append((case, result, problems))
        elif verdict == "measured":
            for p in problems[:3]:
                print(f"    vs the contract: {p.splitlines()[0][:200]}", flush=True)
    print(f"\n{len(selected)} cases in {time.monotonic() - t_start:.0f} s: "
          + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + f"; {len(failures)} failed", flush=True)
    shortfalls = [c for c in selected if not c.control and (c.expected(config.variant) or c.contract).shortfall]
    if shortfalls:
        print("\ndeclared shortfalls of the contract on this backend:")
        for c in shortfalls:
            print(f"  {c.name}: {c.expected(config.variant).shortfall}")
    for case, result, problems in failures:
        print(f"\n{case.name}: " + "\n  ".join(problems) + "\n" + describe(result), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
