"""te_ep's watchdog on the host, without a GPU (csrc/watchdog/core/watchdog.h, docs/nccl_ep.md "Timeouts").

A rank whose peer exited waits inside an op forever: in a collective, in NCCL EP's host calls,
or in a CUDA call behind GPU work that waits for the peer. The watchdog's limit counts from the
op's entry on the host, and the thread that decides makes no CUDA call, so it fires whatever
the op's thread is blocked in. A private op (``te_ep._watchdog_test_hold``) holds the host
inside a watched op of a real handle for a given time: a stalled op as the watchdog sees it.
The handle is a reference-backend handle on a one-rank gloo group whose timeout is the limit,
so the test also covers how the limit gets there (the process group's timeout, through
EpGroup) and how the op is named. Each case runs in a fresh interpreter (the action is read
once per process); the three run side by side. So do the interpreters that check how
``TE_EP_WATCHDOG`` picks the action, and that any other value is an error naming it.
"""

from __future__ import annotations

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


def _start(action: str, *holds: float) -> subprocess.Popen:
    env = subprocess_env(TE_EP_WATCHDOG=action)
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, holds)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen):
    out, err = proc.communicate(timeout=120)
    said = [line for line in err.splitlines() if line.startswith("te_ep watchdog: ")]
    handle = next(line.split()[1:] for line in out.splitlines() if line.startswith("HANDLE"))
    return proc.returncode, out, err, said, handle


def test_watchdog_ends_a_stalled_op_and_spares_a_short_one():
    # Started together: each child pays the imports once, and they overlap.
    stalled = _start("exit", 0.2, 60.0)  # a short hold, then one far past the limit
    warned = _start("warn", LIMIT_S + 1.0)
    off = _start("off", LIMIT_S + 0.5)

    code, out, err, said, (handle_id, group_name, timeout_ms) = _finish(stalled)
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

    code, out, err, said, _ = _finish(warned)
    assert code == 0, (code, out, err[-3000:])
    assert len(said) == 1 and "TE_EP_WATCHDOG=warn: the process goes on" in said[0], err[-3000:]
    assert "RETURNED" in out and out.split("RETURNED", 1)[1].strip().splitlines()[0].endswith("('warn', 0, 1)"), out

    code, out, err, said, _ = _finish(off)
    assert code == 0 and not said and "te_ep watchdog" not in err, (code, out, err[-3000:])
    assert "('off', 0, 0)" in out, out


def test_watchdog_state_op_reports_the_action():
    from te_ep_torch import ops

    action, pending, fired = ops.watchdog_state()
    assert action in ("exit", "warn", "off")
    assert pending >= 0 and fired >= 0


def test_action_follows_the_env_and_a_bad_value_is_named():
    # TE_EP_WATCHDOG is read once per process: one fresh interpreter per value, side by side.
    code = "from te_ep_torch import ops; print(ops.watchdog_state())"
    expected = {"": "exit", "exit": "exit", "warn": "warn", "off": "off", "0": "off", "sometimes": None}
    procs = {value: subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(TE_EP_WATCHDOG=value),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for value in expected}
    for value, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if expected[value] is None:
            assert proc.returncode != 0, out
            assert f"TE_EP_WATCHDOG must be 'exit' (the default), 'warn' or 'off', got '{value}'" in err, err[-3000:]
        else:
            assert proc.returncode == 0, (value, err[-3000:])
            assert out.strip() == f"('{expected[value]}', 0, 0)", (value, out)
