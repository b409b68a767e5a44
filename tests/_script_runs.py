"""Runs a torchrun-style script many times at W ranks and reports how every rank ended.

    python3 tests/_script_runs.py SCRIPT --runs 30 --world 2 [--parallel 2] [--switch-interval S]
        [-- SCRIPT ARGS]

Prints one JSON object: ``{"runs", "world", "failed": [{"run", "rank", "status", "log"}],
"seconds"}``, where ``status`` is the exit code, or ``-N`` for a rank killed by signal N.

Why it forks instead of launching torchrun per run: importing torch costs 5-10 s on a small
CI machine, so 30 runs at 2 ranks would take many minutes. This process imports torch and
te_ep_torch once; every rank of every run is a fork of it that sets torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), runs the script in ``__main__``
(its objects live in module globals, as in a script run by ``python``) and then leaves
through the interpreter's normal finalization: what a clean exit is about. Nothing in this
process starts a thread or touches a process group before it forks.

``--switch-interval`` sets ``sys.setswitchinterval`` in the ranks: a long one keeps the main
thread on the GIL from a collective's end to the interpreter's finalization, which widens
the window in which a torch.distributed worker thread that still needs the GIL would abort
the process (the failure tests/test_clean_exit.py guards against).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import types


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(script: str, argv, rank: int, world: int, port: int, log: str, switch_interval) -> None:
    """In a forked child: becomes rank ``rank`` of a run and executes ``script`` as ``__main__``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    # A fresh __main__ in sys.modules: the script's globals live until the interpreter
    # finalizes, as they do when python runs the script.
    module = types.ModuleType("__main__")
    module.__file__ = script
    sys.modules["__main__"] = module
    sys.argv = [script, *argv]
    exec(code, module.__dict__)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("script")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--parallel", type=int, default=1, help="runs at once")
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--logs", default=None, help="directory for the ranks' output (default: a temp dir)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, script_args = p.parse_args(argv[:cut]), argv[cut + 1:]
    logs = args.logs or __import__("tempfile").mkdtemp(prefix="te_ep_script_runs_")
    os.makedirs(logs, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch  # noqa: F401  (imported once here, inherited by every fork)
    import torch.distributed  # noqa: F401
    import te_ep_torch  # noqa: F401

    running, status = {}, {}
    next_run, start = 0, time.time()
    while next_run < args.runs or running:
        while next_run < args.runs and len(running) < args.parallel * args.world:
            port = _free_port()
            for rank in range(args.world):
                log = os.path.join(logs, f"run{next_run}_rank{rank}.log")
                pid = os.fork()
                if pid == 0:
                    try:
                        _run_rank(args.script, script_args, rank, args.world, port, log, args.switch_interval)
                    except SystemExit:
                        raise
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        sys.exit(1)
                    # Falls off the end of this module: the normal interpreter exit.
                    sys.exit(0)
                running[pid] = (next_run, rank, log)
            next_run += 1
        pid, wait_status = os.wait()
        run, rank, log = running.pop(pid)
        status[(run, rank)] = (os.waitstatus_to_exitcode(wait_status), log)

    failed = []
    for (run, rank), (code, log) in sorted(status.items()):
        if code != 0:
            with open(log, errors="replace") as f:
                failed.append({"run": run, "rank": rank, "status": code, "log": f.read()[-3000:]})
    print(json.dumps({"runs": args.runs, "world": args.world, "failed": failed, "logs": logs,
                      "seconds": round(time.time() - start, 1)}))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
