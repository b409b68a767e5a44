"""examples/moe_train.py --check on CPU: EP x FSDP2 on 2 and 4 gloo ranks vs one process.

The example compares logits, loss and every gradient of the distributed model with an
unsharded single-process copy (relative tolerance 1e-4 in float32) and exits non-zero
on a mismatch; it then trains a few steps and saves a DCP checkpoint. With
``--fp8-dispatch`` the same check must pass (the single-process copy makes the same FP8
round trip), and FP8 must be in use: the first step's loss differs from a plain run's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "3", "--hidden", "32", "--ffn", "32", "--heads", "2", "--batch-size", "4", "--seq-len", "16"]
# FP8 dispatch scales blocks of 128 values: the smallest hidden it takes (the later --hidden wins).
TINY_FP8 = [*TINY, "--hidden", "128"]


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


def _first_loss(out: str) -> str:
    m = re.search(r"step +0/\d+ +loss (\d+\.\d+)", out)
    assert m, f"no loss line for step 0 in the example's output:\n{out[-4000:]}"
    return m[1]


@pytest.mark.parametrize("nprocs,layout", [(2, []), (4, ["--ep", "2"])], ids=["2ranks-ep2", "4ranks-dp2xep2"])
def test_example_fp8_dispatch_check_matches_single_process(nprocs, layout):
    # The 4-rank layout used to abort a rank at interpreter exit about once in five runs
    # (a gloo worker thread freeing a finished collective's tensors while Python finalized);
    # the example now leaves with os._exit after its own shutdown: 14 runs in a row passed.
    common = ["--check", "--no-save", *TINY_FP8, *layout]
    out = _run_example(nprocs, [*common, "--fp8-dispatch"])
    assert "--check: passed" in out, out[-4000:]
    assert "FAIL" not in out, out[-4000:]
    # Without FP8 dispatch the same seed and data give another loss (e4m3 keeps 4 significant
    # bits; runs are deterministic): the flag reached the MoE layers.
    plain = _run_example(nprocs, common)
    assert "--check: passed" in plain, plain[-4000:]
    assert _first_loss(out) != _first_loss(plain), (
        f"--fp8-dispatch and a plain run gave the same first loss {_first_loss(out)}: FP8 dispatch not in use?")
