"""TorchTitan's own training loop, one row per MoE token dispatcher, CUDA-graph step on and off.

    python benchmarks/bench_torchtitan_trainer.py --nproc 2 --dims default dsv3 --steps 120
    python benchmarks/bench_torchtitan_trainer.py --parse-only LOGDIR      # the table from earlier logs

Each row is one ``torchrun -m torchtitan.train`` job (TorchTitan's entry point, its Trainer,
FSDP + EP over all ranks) of a config of ``benchmarks/torchtitan_trainer.py``: the same model,
synthetic tokens and seed, only the dispatcher differs:

* ``te_ep graphs``, ``te_ep eager``: te_ep's dispatcher and experts (``use_te_ep``, default
  arguments), trained by ``TeEpTrainer``, with TorchTitan's CUDA-graph step and without;
* ``all_to_all eager``: TorchTitan's all-to-all dispatcher (TorchTitan refuses it a graph);
* ``MinimalAsyncEP graphs``, ``MinimalAsyncEP eager``: TorchTitan's own static dispatcher.

The numbers are TorchTitan's own logging (one line per step): tokens per second per GPU
(``tps``), MFU and the peak reserved memory. A row reports the median over the steps after
``--skip`` (warm-up, capture, NCCL EP's first-use kernel builds). The loss of every step of
every row is compared with ``all_to_all eager``'s: the table gives the largest difference and
its step, and the run fails where it exceeds ``--loss-tol`` (relative to all_to_all's loss).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# row name: (config suffix in torchtitan_trainer.py, CUDA-graph step on)
ROWS: Dict[str, Tuple[str, bool]] = {
    "te_ep graphs": ("te_ep", True),
    "te_ep eager": ("te_ep", False),
    "all_to_all eager": ("all_to_all", False),
    "MinimalAsyncEP graphs": ("minimal_async_ep", True),
    "MinimalAsyncEP eager": ("minimal_async_ep", False),
}
REFERENCE_ROW = "all_to_all eager"
BASELINE_ROW = "MinimalAsyncEP graphs"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+).*?memory:\s*(?P<mem>[0-9.]+)GiB.*?"
    r"tps:\s*(?P<tps>[0-9,]+).*?mfu:\s*(?P<mfu>[0-9.]+%|N/A)"
)


@dataclass
class Run:
    """One row's per-step log: step -> (loss, peak reserved GiB, tokens/s per GPU, MFU % or None)."""

    steps: Dict[int, Tuple[float, float, float, Optional[float]]] = field(default_factory=dict)

    def medians(self, skip: int) -> Tuple[float, Optional[float], float]:
        """Median tokens/s and MFU over the steps after ``skip``, and the largest peak memory."""
        kept = [v for s, v in sorted(self.steps.items()) if s > skip]
        if not kept:
            raise ValueError(f"no logged step after the first {skip} (logged: {sorted(self.steps)})")
        mfus = [v[3] for v in kept if v[3] is not None]
        return (statistics.median(v[2] for v in kept), statistics.median(mfus) if mfus else None,
                max(v[1] for v in self.steps.values()))


def parse_log(text: str) -> Run:
    """TorchTitan's per-step metric lines of one job (any rank's; they log the same global loss)."""
    run = Run()
    for line in text.splitlines():
        m = _STEP.search(_ANSI.sub("", line))
        if m is None or "validate" in line:
            continue
        mfu = None if m["mfu"] == "N/A" else float(m["mfu"].rstrip("%"))
        run.steps.setdefault(int(m["step"]), (float(m["loss"]), float(m["mem"]),
                                              float(m["tps"].replace(",", "")), mfu))
    return run


def loss_gap(run: Run, ref: Run) -> Tuple[float, int]:
    """Largest ``|loss - ref loss| / |ref loss|`` over the steps both logged, and its step."""
    common = sorted(set(run.steps) & set(ref.steps))
    if not common:
        raise ValueError("the two runs logged no common step")
    gaps = [(abs(run.steps[s][0] - ref.steps[s][0]) / max(abs(ref.steps[s][0]), 1e-12), s) for s in common]
    return max(gaps)


def table(runs: Dict[str, Run], skip: int, loss_tol: float, title: str) -> Tuple[str, List[str]]:
    """The markdown table of one config's rows and the rows whose loss left the tolerance."""
    lines = [f"### {title}", "",
             "| row | tokens/s/GPU | MFU % | peak reserved GiB | vs MinimalAsyncEP graphs | vs all_to_all "
             "| worst loss gap vs all_to_all (step) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    stats = {name: run.medians(skip) for name, run in runs.items()}
    failed = []
    for name, run in runs.items():
        tps, mfu, mem = stats[name]
        vs = [f"{tps / stats[b][0]:.2f}x" if b in stats else "-" for b in (BASELINE_ROW, REFERENCE_ROW)]
        if REFERENCE_ROW in runs and name != REFERENCE_ROW:
            gap, step = loss_gap(run, runs[REFERENCE_ROW])
            gap_text = f"{gap:.2e} ({step})"
            if gap > loss_tol:
                failed.append(name)
                gap_text += " FAIL"
        else:
            gap_text = "-"
        lines.append(f"| {name} | {tps:,.0f} | {'N/A' if mfu is None else f'{mfu:.2f}'} | {mem:.2f} | {vs[0]} "
                     f"| {vs[1]} | {gap_text} |")
    return "\n".join(lines), failed


def command(nproc: int, config: str, graphs: bool, steps: int, extra: Sequence[str]) -> List[str]:
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "torchtitan.train",
           "--module", "benchmarks.torchtitan_trainer", "--config", config,
           "--parallelism.expert_parallel_degree", str(nproc), "--training.steps", str(steps),
           "--metrics.log_freq", "1"]
    if not graphs:
        cmd.append("--training.disable_cuda_graphs")
    return cmd + list(extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="GPUs (EP size = FSDP size = nproc)")
    p.add_argument("--dims", nargs="+", default=["default", "dsv3"], choices=("default", "dsv3"))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the medians")
    p.add_argument("--loss-tol", type=float, default=2e-2,
                   help="largest relative loss difference to all_to_all accepted at any step")
    p.add_argument("--logs", default="torchtitan_trainer_logs", help="folder of the jobs' logs")
    p.add_argument("--timeout", type=float, default=900, help="seconds one job may take")
    p.add_argument("--parse-only", action="store_true", help="make the tables from the logs in --logs")
    p.add_argument("extra", nargs="*", help="arguments appended to every job (after --)")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be >= 2: with one rank TorchTitan builds no EP mesh")
    if args.skip >= args.steps:
        p.error(f"--skip ({args.skip}) must be below --steps ({args.steps})")
    os.makedirs(args.logs, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    failed_all: List[str] = []
    for dims in args.dims:
        runs: Dict[str, Run] = {}
        for row in args.rows:
            suffix, graphs = ROWS[row]
            log_path = os.path.join(args.logs, f"w{args.nproc}_{dims}_{suffix}_{'graphs' if graphs else 'eager'}.log")
            if not args.parse_only:
                cmd = command(args.nproc, f"{dims}_{suffix}", graphs, args.steps, args.extra)
                print("+", " ".join(cmd), flush=True)
                with open(log_path, "w") as log:
                    try:
                        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            timeout=args.timeout).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                if rc != 0:
                    print(f"{row}: job failed ({rc}); log {log_path}:", flush=True)
                    with open(log_path) as log:
                        print("".join(log.readlines()[-25:]), flush=True)
                    failed_all.append(f"{dims}/{row}")
                    continue
            if not os.path.exists(log_path):
                continue
            with open(log_path) as log:
                run = parse_log(log.read())
            if run.steps:
                runs[row] = run
        if runs:
            text, failed = table(runs, args.skip, args.loss_tol,
                                 f"{dims} dims, {args.nproc} GPUs, {args.steps} steps (medians after step {args.skip})")
            print(text, flush=True)
            failed_all += [f"{dims}/{row} (loss)" for row in failed]
    if failed_all:
        print("FAILED:", ", ".join(failed_all))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
