"""examples/moe_train.py --check on CPU: EP x FSDP2 on 2 and 4 gloo ranks vs one process.

The example compares logits, loss and every gradient of the distributed model with an
unsharded single-process copy (relative tolerance 1e-4 in float32) and exits non-zero
on a mismatch; it then trains a few steps and saves a DCP checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "3", "--hidden", "32", "--ffn", "32", "--heads", "2", "--batch-size", "4", "--seq-len", "16"]


def _run_example(nprocs: int, extra, timeout: float = 150.0) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        str(REPO / "examples" / "moe_train.py"),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"example timed out after {timeout}s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"example exited with {proc.returncode}:\n{out[-6000:]}")
    return out


@pytest.mark.parametrize(
    "nprocs,layout",
    [(2, []), (4, ["--ep", "2"])],
    ids=["2ranks-ep2", "4ranks-dp2xep2"],
)
def test_example_check_matches_single_process(nprocs, layout):
    with tempfile.TemporaryDirectory() as ckpt:
        out = _run_example(nprocs, ["--check", "--ckpt-dir", ckpt, *TINY, *layout])
        assert "--check: passed" in out, out[-4000:]
        assert "FAIL" not in out
        assert "saved checkpoint" in out and os.listdir(ckpt), "no checkpoint written"
