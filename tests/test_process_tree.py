"""tests/gpu/process_tree.sh: a GPU-suite part stopped by a time limit leaves no process behind.

torchrun starts its workers in sessions of their own (start_new_session), so when the caller's
`timeout` ends the suite script, the workers outlive it and keep the GPUs (seen on 4 x H200,
2026-11-26: three leftover workers slowed the next lease call's benchmarks). Here a part is a
Python process with a child in a new session, as torchrun and a worker are.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from _dist import REPO

# The part: a "launcher" that starts a "worker" in a new session and waits; both write their pids.
PART = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{worker.pid}\\n")
    time.sleep(120)
""")


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it holds nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def _start(tmp_path, body: str):
    pids = tmp_path / "pids"
    script = tmp_path / "suite.sh"
    script.write_text(body.format(tree=REPO / "tests" / "gpu" / "process_tree.sh", python=sys.executable,
                                  part=tmp_path / "part.py", pids=pids))
    (tmp_path / "part.py").write_text(PART)
    suite = subprocess.Popen(["bash", str(script)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().endswith("\n")):
        assert time.monotonic() < deadline and suite.poll() is None, "the part did not start"
        time.sleep(0.05)
    launcher = int(subprocess.run(["pgrep", "-f", str(tmp_path / "part.py")], capture_output=True,
                                  text=True).stdout.split()[0])
    return suite, launcher, int(pids.read_text())


def test_a_stopped_suite_ends_the_parts_whole_tree(tmp_path):
    suite, launcher, worker = _start(tmp_path, 'source {tree}\nrun_in_tree {python} {part} {pids}\necho "not reached"\n')
    suite.send_signal(signal.SIGTERM)
    _, err = suite.communicate(timeout=20)
    assert suite.returncode == 143, (suite.returncode, err)
    assert "stopped: ending every process of the running part" in err, err
    deadline = time.monotonic() + 10
    while not (_gone(launcher) and _gone(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(launcher) and _gone(worker), (launcher, worker)


def test_without_it_the_worker_outlives_the_suite(tmp_path):
    """The control: a plain foreground part. TERM to the shell and the launcher (what `timeout`'s
    signal to its process group reaches) leaves the worker running."""
    suite, launcher, worker = _start(tmp_path, "{python} {part} {pids}\n")
    try:
        for pid in (suite.pid, launcher):
            os.kill(pid, signal.SIGTERM)
        suite.wait(timeout=20)
        time.sleep(0.5)
        assert _gone(launcher) and not _gone(worker), "the worker ended with its launcher: the control shows nothing"
    finally:
        for pid in (launcher, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
