"""tests/gpu/run_all.sh's scheduler, on a fake machine: every step runs once, on GPUs of its own.

The script's `python3` is a fake (PYTHON=...): it reports the machine's GPU count, and every other
call records its CUDA_VISIBLE_DEVICES, its arguments and its start and end time, sleeps, and prints
a pytest-like result line. What a real run adds (the steps' own work) is in docs/results/.
"""

import os
import signal
import subprocess
import tarfile
import time
from collections import Counter

import pytest

from _dist import REPO

FAKE = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "$FAKE_NGPU"; exit 0; fi
echo "start $(date +%s.%N) ${CUDA_VISIBLE_DEVICES:-} $*" >> "$FAKE_RECORD"
if [ -n "${NCCL_EP_JIT_CACHE_DIR:-}" ]; then  # a step that finds the kernel cache adds a kernel to it
  echo "$NCCL_EP_JIT_CACHE_DIR $(ls "$NCCL_EP_JIT_CACHE_DIR" | tr '\n' ' ')" >> "$FAKE_RECORD.cache"
  touch "$NCCL_EP_JIT_CACHE_DIR/kernel.$$"
fi
if [[ " $* " == *"$FAKE_FAIL"* ]]; then echo "0 passed, 1 failed"; exit 1; fi
sleep "$FAKE_SLEEP"
echo "end $(date +%s.%N) ${CUDA_VISIBLE_DEVICES:-} $*" >> "$FAKE_RECORD"
echo "1 passed"
"""


def _run_all(tmp_path, ngpu, env_extra, sleep="0.05", fail="no such step", start=False):
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    record = tmp_path / "record"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TE_EP_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHON=str(fake), FAKE_NGPU=str(ngpu), FAKE_RECORD=str(record), FAKE_SLEEP=sleep,
               FAKE_FAIL=fail, TE_EP_LOG_DIR=str(tmp_path / "logs"), **env_extra)
    cmd = ["bash", str(REPO / "tests" / "gpu" / "run_all.sh")]
    if start:
        # SIGINT as a terminal leaves it: a runner that started this test in the background has it
        # ignored, and a shell cannot trap a signal ignored when it starts.
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)), record
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc, record


def _calls(record):
    """[(start, end or None, gpus, args)] per recorded call."""
    starts, ends = {}, {}
    for line in record.read_text().splitlines():
        kind, t, gpus, args = line.split(" ", 3)
        key = (gpus, args)
        (starts if kind == "start" else ends).setdefault(key, []).append(float(t))
    calls = []
    for key, ts in starts.items():
        es = ends.get(key, [])
        for i, t in enumerate(ts):
            calls.append((t, es[i] if i < len(es) else None, key[0].split(","), key[1]))
    return sorted(calls)


def _ranks(args):
    """The GPUs a step asks for: its ranks (torchrun, the fault harness) or the pytest part's."""
    for word in args.split():
        if word.startswith("--nproc-per-node="):
            return int(word.split("=")[1])
    words = args.split()
    if "--world-size" in words:
        return int(words[words.index("--world-size") + 1])
    return 2 if "test_moe_overlap" in args or "test_moe_fp8" in args else 1


def test_every_step_once_on_gpus_of_its_own_most_gpus_first(tmp_path):
    proc, record = _run_all(tmp_path, 4, {"TE_EP_WORLD_SIZES": "2 4", "TE_EP_FAULT_PG_TIMEOUT": "10"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _calls(record)
    kinds = Counter()
    for _, end, gpus, args in calls:
        assert end is not None, args
        assert len(gpus) == len(set(gpus)) == _ranks(args), (gpus, args)
        kind = ("reference" if "--backend reference" in args else "suite" if "run_suite.py" in args else
                "smoke" if "smoke" in args else "soak" if "soak.py" in args else
                "faults" if "tests.faults" in args else "pytest")
        kinds[kind, _ranks(args)] += 1
        if kind == "soak":
            assert "--steps 1000" in args
        if kind == "faults":
            assert "--pg-timeout 10" in args
    # W=2 and W=4 each: the reference suite, 2 modes x 3 check modes, 2 smokes, 2 soaks, 2 x 3 fault
    # steps; the permutation, watchdog (1 GPU), FP8 and overlap (2) tests.
    assert kinds == {("reference", 2): 1, ("reference", 4): 1, ("suite", 2): 6, ("suite", 4): 6,
                     ("smoke", 2): 2, ("smoke", 4): 2, ("soak", 2): 2, ("soak", 4): 2, ("faults", 2): 6,
                     ("faults", 4): 6,
                     ("pytest", 1): 2, ("pytest", 2): 2}, kinds
    # Steps that overlap in time hold disjoint GPUs, and some did overlap.
    overlapped = 0
    for i, (s1, e1, g1, a1) in enumerate(calls):
        for s2, e2, g2, a2 in calls[i + 1:]:
            if s2 < e1:
                overlapped += 1
                assert not set(g1) & set(g2), (a1, g1, a2, g2)
    assert overlapped > 0
    # Parts that need all 4 GPUs run first.
    first_small = min(s for s, _, g, _ in calls if len(g) < 4)
    assert all(e <= first_small for _, e, g, _ in calls if len(g) == 4)
    # A fault part's check modes in order, its warm-up once (before the first).
    for w in (2, 4):
        for mode in ("staged", "zero_copy"):
            steps = [a for _, _, _, a in calls
                     if "tests.faults" in a and f"--world-size {w} " in a and f"--nccl-ep-mode {mode} " in a]
            assert [a.split("--checks ")[1].split()[0] for a in steps] == ["local", "device", "synchronous"]
            assert ["--no-warmup" in a for a in steps] == [False, True, True]
    # The summary: one line per step, every one rc=0, and the total.
    summary = proc.stdout.split("\n\n")[-1].strip().splitlines()
    assert len(summary) == len(calls) + 1 and summary[-1].startswith("total "), proc.stdout
    assert all("rc=0" in line and "1 passed" in line for line in summary[:-1]), summary
    assert not list((tmp_path / "logs").glob(".summary.*")), "the summary directory was left behind"


def test_a_failed_step_fails_the_run_and_the_rest_still_runs(tmp_path):
    proc, record = _run_all(tmp_path, 2, {"TE_EP_WORLD_SIZES": "2", "TE_EP_PARTS": "smoke perm fp8 watchdog"},
                            fail="test_fp8_ops.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = proc.stdout.split("\n\n")[-1]
    assert "FP8 CUDA tests" in summary and "rc=1" in summary and "1 failed" in summary, summary
    assert summary.count("rc=0") == 4, summary  # 2 smokes, permutation, watchdog
    assert len(_calls(record)) == 5


def test_one_gpu_runs_the_parts_one_at_a_time_and_the_faults_at_w1(tmp_path):
    proc, record = _run_all(tmp_path, 1, {"TE_EP_PARTS": "faults overlap fp8", "TE_EP_NCCL_EP_MODES": "zero_copy"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _calls(record)
    assert [g for _, _, g, _ in calls] == [["0"]] * 5, calls  # 3 fault steps, overlap, FP8
    assert all("--world-size 1 " in a for _, _, _, a in calls if "tests.faults" in a)
    for (_, e1, _, _), (s2, _, _, _) in zip(calls, calls[1:]):
        assert e1 <= s2


def test_it_uses_the_gpus_it_was_given(tmp_path):
    proc, record = _run_all(tmp_path, 2, {"TE_EP_PARTS": "perm watchdog", "CUDA_VISIBLE_DEVICES": "5,7"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(g[0] for _, _, g, _ in _calls(record)) == ["5", "7"]


def _cache_names(path):
    with tarfile.open(path) as tar:
        return sorted(os.path.basename(m.name) for m in tar.getmembers() if m.isfile())


def test_the_kernel_cache_is_unpacked_before_the_parts_and_saved_after(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "old.bin").write_text("a kernel")
    cache = tmp_path / "cache.tgz"
    subprocess.run(["tar", "czf", str(cache), "-C", str(old), "."], check=True)
    proc, record = _run_all(tmp_path, 1, {"TE_EP_PARTS": "perm watchdog", "TE_EP_KERNEL_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = (tmp_path / "record.cache").read_text().splitlines()
    assert len(seen) == 2, seen
    # Where NCCL_EP_JIT_CACHE_DIR is unset, the cache lives under the log directory; every
    # step found the unpacked kernel there.
    assert all(line.split()[0] == str(tmp_path / "logs" / "nccl_ep_jit") and "old.bin" in line.split()[1:]
               for line in seen), seen
    names = _cache_names(cache)
    assert names[-1] == "old.bin" and len(names) == 3 and all(n.startswith("kernel.") for n in names[:2]), names
    assert f"kernel cache saved to {cache}" in proc.stdout, proc.stdout
    # A file that is not there yet is made; one that is no cache fails the run before any part.
    fresh = tmp_path / "fresh.tgz"
    proc, _ = _run_all(tmp_path, 1, {"TE_EP_PARTS": "perm", "TE_EP_KERNEL_CACHE": str(fresh),
                                     "NCCL_EP_JIT_CACHE_DIR": str(tmp_path / "jit")})
    assert proc.returncode == 0 and len(_cache_names(fresh)) == 1, proc.stdout + proc.stderr
    bad = tmp_path / "bad.tgz"
    bad.write_text("not a tarball")
    (tmp_path / "record").unlink()
    proc, record = _run_all(tmp_path, 1, {"TE_EP_PARTS": "perm", "TE_EP_KERNEL_CACHE": str(bad)})
    assert proc.returncode == 1 and "TE_EP_KERNEL_CACHE must name a .tar.gz" in proc.stdout, proc.stdout
    assert not record.exists(), "a part ran with a broken kernel cache"


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopped_it_ends_every_part_and_prints_what_ended(tmp_path, sig, status):
    # 3 GPUs: the FP8 part (2) and the permutation part (1) run, the watchdog part waits.
    cache = tmp_path / "cache.tgz"
    proc, record = _run_all(tmp_path, 3, {"TE_EP_PARTS": "perm fp8 watchdog", "TE_EP_KERNEL_CACHE": str(cache)},
                            sleep="60", start=True)
    deadline = time.monotonic() + 30
    while not (record.exists() and record.read_text().count("start") == 2):
        assert time.monotonic() < deadline and proc.poll() is None, "the parts did not start"
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == status, (proc.returncode, out, err)
    assert out.count("not run to its end") == 3, out
    for label in ("FP8 CUDA tests", "permutation CUDA tests", "watchdog GPU tests"):
        assert f"{label}".ljust(50) + " not run to its end" in out, out
    assert not list((tmp_path / "logs").glob(".summary.*")), "the summary directory was left behind"
    assert len(_cache_names(cache)) == 2, "a stopped run did not save the kernels its parts compiled"
    left = subprocess.run(["pgrep", "-f", f"sleep 60"], capture_output=True, text=True).stdout.split()
    mine = [p for p in left if str(tmp_path) in open(f"/proc/{p}/environ", "rb").read().decode(errors="replace")]
    assert not mine, "a step outlived the stopped run"
