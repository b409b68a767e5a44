"""The watchdog of the nccl_ep ops (csrc/watchdog/core/watchdog.h, docs/nccl_ep.md "Timeouts").

NCCL EP's high-throughput kernels wait for the other ranks with no time limit, so a lost
rank would leave the others spinning forever. te_ep registers every nccl_ep op with a
watchdog that ends the process (exit code 70) when the op has not returned on the host, or
its GPU work has not finished, within the group's timeout of the op's entry (the host side
alone is tested on CPU too: tests/test_watchdog_host.py). The GPU cases run one process on one GPU: a spinning kernel queued
ahead of the watched op stands in for the peer that never arrives (the 2-GPU fault cases
in tests/faults have a real one).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import te_ep_torch  # noqa: F401  (loads the op library)
from _dist import subprocess_env
from te_ep_torch import _nccl_ep

pytestmark = pytest.mark.quick  # the watchdog's GPU side is in the quick GPU selection

CASE = Path(__file__).with_name("_watchdog_case.py")
EXIT_CODE = 70

needs_gpu_and_nccl_ep = pytest.mark.skipif(
    not torch.cuda.is_available() or not _nccl_ep.is_available(),
    reason=("no CUDA GPU" if not torch.cuda.is_available() else f"nccl_ep unavailable: {_nccl_ep.availability()}"),
)


def _env(**extra) -> dict:
    env = subprocess_env()
    env.pop("TE_EP_WATCHDOG", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module", autouse=True)
def _warm_kernel_cache():
    """NCCL EP compiles its kernels on their first use, inside the op, and that time counts
    against the op's limit (docs/nccl_ep.md, "Timeouts"): the cases' 1 s limits assume a warm
    kernel cache, which one run of the good steps with a long limit fills."""
    if torch.cuda.is_available() and _nccl_ep.is_available():
        subprocess.run([sys.executable, str(CASE), "steps", "--timeout", "600", "--stall", "0"], env=_env(),
                       capture_output=True, text=True, timeout=600)


def _run_case(case: str, env: dict, timeout_s: float, stall_s: float) -> tuple:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(CASE), case, "--timeout", str(timeout_s), "--stall", str(stall_s)],
                          env=env, capture_output=True, text=True, timeout=300)
    states = {}
    for line in proc.stdout.splitlines():
        if line.startswith("STATE "):
            record = json.loads(line[len("STATE "):])
            states[record["tag"]] = record
    return proc, states, time.monotonic() - start


@pytest.mark.gpu
@needs_gpu_and_nccl_ep
def test_a_stalled_op_ends_the_process_with_a_message():
    proc, states, _ = _run_case("stall", _env(), timeout_s=1.0, stall_s=20.0)
    assert proc.returncode == EXIT_CODE, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert states["after_good_steps"]["pending"] == 0 and states["after_good_steps"]["fired"] == 0, states
    assert "gpu_idle" not in states, "the process outlived the stall"
    message = [line for line in proc.stderr.splitlines() if line.startswith("te_ep watchdog: ")]
    assert len(message) == 1, proc.stderr[-3000:]
    for part in ("te_ep.prepare on handle ", "of group '", "(rank 0 of 1)", "limit 1.0 s",
                 f"exit code {EXIT_CODE}", "TE_EP_WATCHDOG=off"):
        assert part in message[0], (part, message[0])
    # It fired about one limit after the prepare was entered, long before the spin ended.
    waited = float(message[0].split(" s after it was entered")[0].rsplit(" ", 1)[1])
    assert 1.0 <= waited < 3.0, message[0]


@pytest.mark.gpu
@needs_gpu_and_nccl_ep
def test_warn_prints_once_and_goes_on():
    proc, states, _ = _run_case("stall", _env(TE_EP_WATCHDOG="warn"), timeout_s=1.0, stall_s=4.0)
    assert proc.returncode == 0 and "DONE" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    message = [line for line in proc.stderr.splitlines() if line.startswith("te_ep watchdog: ")]
    assert len(message) == 1 and "TE_EP_WATCHDOG=warn: the process goes on" in message[0], proc.stderr[-3000:]
    assert states["end"]["fired"] == 1 and states["end"]["pending"] == 0, states


@pytest.mark.gpu
@needs_gpu_and_nccl_ep
def test_off_watches_nothing():
    proc, states, _ = _run_case("stall", _env(TE_EP_WATCHDOG="off"), timeout_s=1.0, stall_s=3.0)
    assert proc.returncode == 0 and "DONE" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "te_ep watchdog" not in proc.stderr
    assert states["watched_op_launched"]["pending"] == 0 and states["end"]["fired"] == 0, states


@pytest.mark.gpu
@needs_gpu_and_nccl_ep
def test_good_steps_never_fire_and_markers_retire():
    proc, states, _ = _run_case("steps", _env(), timeout_s=1.0, stall_s=0.0)
    assert proc.returncode == 0 and "DONE" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "te_ep watchdog" not in proc.stderr
    assert states["end"]["fired"] == 0 and states["end"]["pending"] == 0, states
    assert states["after_good_steps"]["action"] == "exit"


@pytest.mark.gpu
@needs_gpu_and_nccl_ep
def test_polling_does_not_break_a_graph_capture():
    """The watchdog thread queries events while the main thread captures a CUDA graph in
    global mode (torch's default): the capture must succeed (the thread runs in relaxed
    capture mode) and nothing fires."""
    proc, states, _ = _run_case("capture", _env(), timeout_s=30.0, stall_s=2.0)
    assert proc.returncode == 0 and "DONE" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert states["watched_op_launched"]["pending"] >= 1, states
    assert "captured" in states and states["end"]["fired"] == 0 and states["end"]["pending"] == 0, states
