"""te_ep's watchdog on the host, without a GPU (csrc/watchdog/core/watchdog.h, docs/nccl_ep.md "Timeouts").

A rank whose peer exited waits inside an op forever: in a collective, in NCCL EP's host calls,
or in a CUDA call behind GPU work that waits for the peer. The watchdog's limit counts from the
op's entry on the host, and the thread that decides makes no CUDA call, so it fires whatever
the op's thread is blocked in. A private op (``te_ep._watchdog_test_hold``) holds the host
inside a watched op of a real handle for a given time: a stalled op as the watchdog sees it.
The handle is a reference-backend handle on a one-rank gloo group whose timeout is the limit,
so the test also covers how the limit gets there (the process group's timeout, through
EpGroup) and how the op is named. Each case runs in a process of its own (the action is read
once per process); the three run side by side. So do the processes that check how
``TE_EP_WATCHDOG`` picks the action, and that any other value is an error naming it.

The processes are forks of one interpreter that imported torch (not te_ep_torch) once: each
sets its ``TE_EP_WATCHDOG``, then imports te_ep_torch and runs its code as ``python -c`` would,
leaving through the interpreter's normal exit (``_forked``). Importing torch costs seconds of
a core per interpreter; te_ep_torch, which reads the variable, is new in every child.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from _dist import subprocess_env

EXIT_CODE = 70
LIMIT_S = 1.5

CHILD = textwrap.dedent(
    """
    import atexit, datetime, sys, tempfile, time
    import torch, torch.distributed as dist
    import te_ep_torch as te
    from te_ep_torch import ops

    holds = [float(s) for s in sys.argv[1:]]
    atexit.register(lambda: print("ATEXIT", flush=True))
    store = dist.FileStore(tempfile.mktemp(prefix="te_ep_watchdog_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=%(limit)r))
    group = te.EpGroup(num_experts=4, max_tokens_per_rank=8, backend="reference", device="cpu")
    handle = group.create_handle(top_k=2, hidden=16, dtype=torch.float32)
    print("HANDLE", handle.id, group.group_name, group.timeout_ms, flush=True)
    for hold in holds:
        start = time.monotonic()
        torch.ops.te_ep._watchdog_test_hold(handle.id, "dispatch", hold)
        print("RETURNED", hold, round(time.monotonic() - start, 2), ops.watchdog_state(), flush=True)
    group.shutdown()
    dist.destroy_process_group()
    """
) % {"limit": LIMIT_S}


# Runs each (TE_EP_WATCHDOG value, code, argv) in a fork of this interpreter, all side by side;
# prints the exit codes (negative: the signal) as JSON. A child's stdout and stderr go to files.
FORKER = textwrap.dedent(
    """
    import json, os, sys
    # Once, for every child: torch and the parts of it te_ep_torch imports; te_ep_torch itself
    # (and with it the variable's reading) is each child's own.
    import torch, torch._dynamo, torch.distributed, torch.distributed.tensor

    specs = json.loads(sys.argv[1])  # [[TE_EP_WATCHDOG, code, argv, stdout file, stderr file], ...]
    sys.stdout.flush()
    pids = []
    for action, code, argv, out, err in specs:
        pid = os.fork()
        if pid == 0:
            os.environ["TE_EP_WATCHDOG"] = action
            for fd, path in ((1, out), (2, err)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.argv = ["-c", *argv]
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit:
                raise
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.exit(1)
            sys.exit(0)  # the interpreter's normal exit, as at the end of python -c
        pids.append(pid)
    print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]))
    """
)


def _forked(tmp_path, specs):
    """Runs each ``(TE_EP_WATCHDOG value, code, argv)`` in a process of its own, side by side;
    returns ``[(exit code, stdout, stderr), ...]``."""
    files = [(str(tmp_path / f"child{i}.out"), str(tmp_path / f"child{i}.err")) for i in range(len(specs))]
    arg = json.dumps([[action, code, [str(a) for a in argv], *paths]
                      for (action, code, argv), paths in zip(specs, files)])
    env = subprocess_env()
    env.pop("TE_EP_WATCHDOG", None)
    proc = subprocess.run([sys.executable, "-c", FORKER, arg], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    results = []
    for code, (out, err) in zip(codes, files):
        with open(out) as f_out, open(err) as f_err:
            results.append((code, f_out.read(), f_err.read()))
    return results


def _case(result):
    code, out, err = result
    said = [line for line in err.splitlines() if line.startswith("te_ep watchdog: ")]
    handle = next(line.split()[1:] for line in out.splitlines() if line.startswith("HANDLE"))
    return code, out, err, said, handle


def test_watchdog_ends_a_stalled_op_and_spares_a_short_one(tmp_path):
    # Started together, so they overlap.
    stalled, warned, off = _forked(tmp_path, [
        ("exit", CHILD, (0.2, 60.0)),  # a short hold, then one far past the limit
        ("warn", CHILD, (LIMIT_S + 1.0,)),
        ("off", CHILD, (LIMIT_S + 0.5,)),
    ])

    code, out, err, said, (handle_id, group_name, timeout_ms) = _case(stalled)
    assert timeout_ms == str(int(LIMIT_S * 1000)), out  # the process group's timeout reached the handle
    returned = [line for line in out.splitlines() if line.startswith("RETURNED")]
    # the short hold returned, untouched; the long one never did
    assert len(returned) == 1 and returned[0].startswith("RETURNED 0.2 "), out + err
    assert returned[0].endswith("('exit', 0, 0)"), returned[0]  # nothing pending or fired once it returned
    assert code == EXIT_CODE, (code, out, err[-3000:])
    assert "ATEXIT" not in out, "the watchdog must end the process with _exit: exit handlers may wait for the GPU"
    assert len(said) == 1, err[-3000:]
    message = said[0]
    for part in (f"te_ep watchdog: te_ep.dispatch on handle {handle_id} of group '{group_name}' (rank 0 of 1) "
                 "has not returned on the host ", f"limit {LIMIT_S:.1f} s", "Linux thread id ",
                 f"exit code {EXIT_CODE}", "TE_EP_WATCHDOG=off"):
        assert part in message, (part, message)
    waited = float(message.split(" s after it was entered")[0].rsplit(" ", 1)[1])
    assert LIMIT_S <= waited < LIMIT_S + 2.0, message

    code, out, err, said, _ = _case(warned)
    assert code == 0, (code, out, err[-3000:])
    assert len(said) == 1 and "TE_EP_WATCHDOG=warn: the process goes on" in said[0], err[-3000:]
    assert "RETURNED" in out and out.split("RETURNED", 1)[1].strip().splitlines()[0].endswith("('warn', 0, 1)"), out

    code, out, err, said, _ = _case(off)
    assert code == 0 and not said and "te_ep watchdog" not in err, (code, out, err[-3000:])
    assert "('off', 0, 0)" in out, out


def test_watchdog_state_op_reports_the_action():
    from te_ep_torch import ops

    action, pending, fired = ops.watchdog_state()
    assert action in ("exit", "warn", "off")
    assert pending >= 0 and fired >= 0


def test_action_follows_the_env_and_a_bad_value_is_named(tmp_path):
    # TE_EP_WATCHDOG is read once per process: one process per value, side by side.
    code = "from te_ep_torch import ops; print(ops.watchdog_state())"
    expected = {"": "exit", "exit": "exit", "warn": "warn", "off": "off", "0": "off", "sometimes": None}
    results = _forked(tmp_path, [(value, code, ()) for value in expected])
    for (value, want), (returncode, out, err) in zip(expected.items(), results):
        if want is None:
            assert returncode != 0, out
            assert f"TE_EP_WATCHDOG must be 'exit' (the default), 'warn' or 'off', got '{value}'" in err, err[-3000:]
        else:
            assert returncode == 0, (value, err[-3000:])
            assert out.strip() == f"('{want}', 0, 0)", (value, out)
