"""The scripts under tests/gpu that torchrun starts as files load this tree's te_ep_torch.

run_all.sh's suite parts import the tree (pytest's rootdir, run_suite.py's own path); a
script started as a file sees only its own folder and PYTHONPATH, so without putting the
tree first it would test whatever te_ep_torch the environment holds, or none (a lease on the
GPU machine once failed its smoke test so). Each script runs ``--help`` with a decoy
te_ep_torch first on PYTHONPATH, which fails on import.
"""

import os
import subprocess
import sys

import pytest

from _dist import REPO

SCRIPTS = ["run_suite.py", "smoke_nccl_ep.py", "soak.py", "transformers_gpu.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_started_as_a_file_loads_this_tree(tmp_path, script):
    decoy = tmp_path / "decoy" / "te_ep_torch"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text('raise ImportError("the decoy te_ep_torch, not this tree\'s")\n')
    env = dict(os.environ, PYTHONPATH=str(decoy.parent))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
