"""examples/moe_train.py --check on CPU: EP x FSDP2 on 2 and 4 gloo ranks vs one process.

The example compares logits, loss and every gradient of the distributed model with an
unsharded single-process copy (relative tolerance 1e-4 in float32) and exits non-zero
on a mismatch; it then trains a few steps and saves a DCP checkpoint. With
``--fp8-dispatch`` the same check must pass (the single-process copy makes the same FP8
round trip), and FP8 must be in use: the first step's loss differs from a plain run's. A
checkpoint written at EP 2 resumes at EP 1. The plain run of each layout is made once and
read by every test that needs it (``plain_run``): a launch costs seconds of imports per rank.
"""

from __future__ import annotations

import os
import re

import pytest

from _dist import REPO, run_torchrun

TINY = ["--steps", "3", "--hidden", "32", "--ffn", "32", "--heads", "2", "--batch-size", "4", "--seq-len", "16"]
# FP8 dispatch scales blocks of 128 values: the smallest hidden it takes (the later --hidden wins).
TINY_FP8 = [*TINY, "--hidden", "128"]
LAYOUTS = {"2ranks-ep2": (2, []), "4ranks-dp2xep2": (4, ["--ep", "2"])}
CKPT_DIR_LAYOUT = "4ranks-dp2xep2"  # its plain run saves to --ckpt-dir; the other's where a run saves by default


def _run_example(nprocs: int, extra, timeout: float = 150.0, expect_ok: bool = True, env_extra=None) -> str:
    # CUDA_VISIBLE_DEVICES="": the CPU path, also on a GPU machine
    return run_torchrun(REPO / "examples" / "moe_train.py", *extra, nprocs=nprocs, timeout=timeout,
                        expect_ok=expect_ok, CUDA_VISIBLE_DEVICES="", **(env_extra or {}))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """``plain_run(layout)``: the output of the example's plain ``--check`` run (float32
    dispatch, the FP8 tests' model) in that layout, and the run's TMPDIR; one run per layout,
    shared by the tests that read it: the check itself, the FP8 test's plain first loss, and
    the checkpoint the 2-rank run saves where a run saves by default (a new directory under
    TMPDIR), which the resume test loads. The 4-rank run saves to ``--ckpt-dir``
    (`CKPT_DIR_LAYOUT`)."""
    runs = {}

    def get(layout: str):
        if layout not in runs:
            nprocs, extra = LAYOUTS[layout]
            tmp = tmp_path_factory.mktemp(f"plain-{layout}")
            save = ["--ckpt-dir", str(tmp / "ckpt")] if layout == CKPT_DIR_LAYOUT else []
            out = _run_example(nprocs, ["--check", *save, *TINY_FP8, *extra], env_extra={"TMPDIR": str(tmp)})
            runs[layout] = (out, str(tmp))
        return runs[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_example_check_matches_single_process(plain_run, layout):
    out, tmp = plain_run(layout)
    assert "--check: passed" in out, out[-4000:]
    assert "FAIL" not in out
    saved = _saved_to(out)
    if layout == CKPT_DIR_LAYOUT:
        assert saved == os.path.join(tmp, "ckpt"), (saved, out[-4000:])
    else:  # the default: a new directory under TMPDIR
        assert saved.startswith(tmp), (saved, out[-4000:])
    assert os.listdir(saved), "no checkpoint written"
    # stdout is a pipe here: plain periodic lines, no progress bar redrawn with "\r".
    assert "\r" not in out and re.search(r"^step +2/3 +loss", out, re.M), out[-4000:]
    assert re.search(r"loss: mean of the first 3 steps \d+\.\d+ -> mean of the last 3 steps", out), out[-4000:]


def _first_loss(out: str) -> str:
    m = re.search(r"step +0/\d+ +loss (\d+\.\d+)", out)
    assert m, f"no loss line for step 0 in the example's output:\n{out[-4000:]}"
    return m[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_example_fp8_dispatch_check_matches_single_process(plain_run, layout):
    # The 4-rank layout used to abort a rank at interpreter exit about once in five runs: a
    # gloo worker thread freeing a finished collective's tensors while Python finalized, its
    # process group kept alive past destroy_process_group() (by te_ep then, which no longer
    # holds one: tests/test_clean_exit.py; by torch's DTensor still, so the example leaves
    # with os._exit after its own shutdown).
    nprocs, extra = LAYOUTS[layout]
    out = _run_example(nprocs, ["--check", "--no-save", *TINY_FP8, *extra, "--fp8-dispatch"])
    assert "--check: passed" in out, out[-4000:]
    assert "FAIL" not in out, out[-4000:]
    # Without FP8 dispatch the same seed and data give another loss (e4m3 keeps 4 significant
    # bits; runs are deterministic, and saving comes after the steps): the flag reached the
    # MoE layers.
    plain, _ = plain_run(layout)
    assert "--check: passed" in plain, plain[-4000:]
    assert _first_loss(out) != _first_loss(plain), (
        f"--fp8-dispatch and a plain run gave the same first loss {_first_loss(out)}: FP8 dispatch not in use?")


def _saved_to(out: str) -> str:
    m = re.search(r"saved checkpoint \(torch.distributed.checkpoint\) to (\S+)", out)
    assert m, f"no checkpoint line in the example's output:\n{out[-4000:]}"
    return m[1]


def test_example_checkpoint_resumes_on_another_ep_size(plain_run):
    # The default expert count does not depend on --ep and the checkpoint carries the model's
    # arguments, so a checkpoint written at EP 2 (the 2-rank plain run's, saved where a run
    # saves by default) loads at EP 1 (dp 2). Each run saves to a new directory by default;
    # asking for another model than the checkpoint holds is a clear error.
    first_out, tmp = plain_run("2ranks-ep2")
    first = _saved_to(first_out)
    env = {"TMPDIR": tmp}
    assert first.startswith(tmp) and os.path.exists(os.path.join(first, "moe_train_args.json"))
    out = _run_example(2, [*TINY_FP8, "--ep", "1", "--load", first], env_extra=env)
    assert "ranks=2 (dp=2 x ep=1)" in out and "experts=8" in out and f"loaded checkpoint {first}" in out, out[-4000:]
    second = _saved_to(out)
    assert second.startswith(tmp) and second != first, "a second run overwrote the first run's checkpoint"
    bad = _run_example(2, [*TINY_FP8, "--load", first, "--hidden", "64"], expect_ok=False, env_extra=env)
    assert "the checkpoint holds another model: --hidden 128 (checkpoint) vs 64 (this run)" in bad, bad[-4000:]


def test_example_ep_that_does_not_divide_the_ranks_says_so():
    out = _run_example(2, [*TINY, "--ep", "3"], expect_ok=False)
    assert "--ep (3) must divide the number of ranks (2)" in out, out[-4000:]
    assert "--dp (0)" not in out
