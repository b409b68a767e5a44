"""Launches tests/gpu/run_suite.py with torchrun on W GPUs (W = 2, 4). Skips, with the
reason, where fewer than W GPUs or no usable NCCL EP exist."""

import os
import re
import subprocess
import sys

import pytest
import torch

RUN_SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_suite.py")
SUITE_TIMEOUT_S = 1800


def _nccl_ep_usable() -> tuple:
    try:
        from te_ep_torch import _nccl_ep

        return _nccl_ep.is_available(), "te_ep_torch._nccl_ep.is_available() is False"
    except Exception as e:  # a CPU-only build has no NCCL EP at all
        return False, f"NCCL EP not loadable: {e}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl_ep", "reference"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_suite(world_size, backend):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs, found {n}")
    if backend == "nccl_ep":
        ok, why = _nccl_ep_usable()
        if not ok:
            pytest.skip(why)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           RUN_SUITE, "--backend", backend]
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hang: the GPU suite did not finish within {SUITE_TIMEOUT_S} s\n{e.stdout or ''}")
    out = proc.stdout + proc.stderr
    summary = re.findall(r"^(\d+) passed, (\d+) failed(?:, \d+ skipped)?$", proc.stdout, re.M)
    assert proc.returncode == 0 and summary and summary[-1][1] == "0" and int(summary[-1][0]) > 0, (
        f"run_suite exit code {proc.returncode}, summary {summary}\n{out[-20000:]}"
    )
