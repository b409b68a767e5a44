"""What the build recorded, and `python -m te_ep_torch`, the report a user reads when the fast
path is slow or missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import te_ep_torch  # noqa: F401  (loads the op library)

REPO = Path(__file__).resolve().parents[1]


def _build_info():
    try:
        from te_ep_torch._build_info import BUILD_INFO
    except ImportError:
        pytest.skip("no te_ep_torch/_build_info.py: the library was not built by setup.py's build_ext here")
    return BUILD_INFO


def test_build_record_matches_the_library():
    info = _build_info()
    assert bool(info["nccl_ep"]) == bool(torch.ops.te_ep._nccl_ep_built()), info
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0], (
        f"built against torch {info['torch']}, running {torch.__version__}")


def test_fast_path_compiled_where_ci_asks_for_it():
    # .ci/run sets TE_EP_NCCL_EP_HEADERS=1: where the CUDA sources are compiled, NCCL EP's
    # headers are installed and setup.py must compile the nccl_ep backend (it fails the build
    # otherwise); this catches a library built some other way, e.g. copied from a stub build.
    if os.environ.get("TE_EP_NCCL_EP_HEADERS") != "1":
        pytest.skip("TE_EP_NCCL_EP_HEADERS is not 1 (set by .ci/run)")
    if not _build_info()["cuda_archs"]:
        pytest.skip("a CPU-only build")
    assert torch.ops.te_ep._nccl_ep_built(), "the nccl_ep backend was not compiled"


def test_default_build_covers_hopper_and_blackwell_with_ptx(monkeypatch):
    spec = importlib.util.spec_from_file_location("te_ep_setup", REPO / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # not as __main__: defines the helpers, builds nothing
    monkeypatch.delenv("TE_EP_CUDA_ARCH", raising=False)
    assert setup._gencode(setup._cuda_archs()) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_100,code=[sm_100,compute_100]",
    ]
    monkeypatch.setenv("TE_EP_CUDA_ARCH", "90")
    assert setup._gencode(setup._cuda_archs()) == ["-gencode=arch=compute_90,code=[sm_90,compute_90]"]


def test_python_m_te_ep_torch_reports_versions_build_and_fast_path():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "te_ep_torch"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"te_ep_torch {te_ep_torch.__version__}" in out, out
    assert f"torch {torch.__version__}" in out, out
    assert "nccl_ep backend: " in out and "backend='auto' on a CUDA group: " in out, out
    if torch.version.cuda is not None:
        assert "NCCL: torch built with " in out and "loaded " in out, out
    if "backend='auto' on a CUDA group: reference" in out:
        # Off: the report says why, and where the reason is fixable here, with a command.
        assert "nccl_ep: " in out or "to get the nccl_ep backend" in out, out
    if not torch.ops.te_ep._nccl_ep_built():
        assert "nccl-extensions" in out and "pip install" in out, out
