"""tests/gpu/transformers_gpu.py, a script torchrun starts as a file, loads this tree's te_ep_torch.

A script started as a file sees only its own folder and PYTHONPATH, so without putting the
tree first it would test whatever te_ep_torch the environment holds, or none (a lease on the
GPU machine once failed a smoke test so). The script runs ``--help`` with a decoy te_ep_torch
first on PYTHONPATH, which fails on import.
"""

import os
import subprocess
import sys

from _dist import REPO


def test_a_script_started_as_a_file_loads_this_tree(tmp_path):
    decoy = tmp_path / "decoy" / "te_ep_torch"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text('raise ImportError("the decoy te_ep_torch, not this tree\'s")\n')
    env = dict(os.environ, PYTHONPATH=str(decoy.parent))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "transformers_gpu.py"), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
