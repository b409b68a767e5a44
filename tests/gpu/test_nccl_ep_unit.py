"""Tests specific to the nccl_ep backend: discovery, version checks, errors.

The op contract itself (dispatch/combine results, gradients) is tested for both
backends by the shared test bodies (tests/test_ep_cases.py, on GPUs too; its test_raw_ops
drives the ops without EpGroup). Tests here that need a GPU, or NCCL EP, skip with the reason.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch
import torch.distributed as dist

import te_ep_torch  # noqa: F401  (loads the op library)
from te_ep_torch import _nccl_ep

OPS = torch.ops.te_ep
BUILT = bool(OPS._nccl_ep_built())
AVAILABILITY = _nccl_ep.availability()

needs_build = pytest.mark.skipif(not BUILT, reason="te_ep_torch was built without NCCL EP")
needs_nccl_ep = pytest.mark.skipif(bool(AVAILABILITY), reason=f"nccl_ep unavailable: {AVAILABILITY}")


# ---- discovery (no GPU needed) ------------------------------------------------


def _no_distribution(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_availability_is_a_reason_or_empty():
    assert isinstance(AVAILABILITY, str)
    assert _nccl_ep.is_available() == (AVAILABILITY == "")


def test_library_override_by_env(tmp_path, monkeypatch):
    lib = tmp_path / "libnccl_ep.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("TE_EP_NCCL_EP_LIB", str(lib))
    assert _nccl_ep.nccl_ep_library() == str(lib)


def test_library_override_to_missing_file_finds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TE_EP_NCCL_EP_LIB", str(tmp_path / "missing.so"))
    assert _nccl_ep.nccl_ep_library() is None


def test_libraries_found_on_sys_path_without_metadata(tmp_path, monkeypatch):
    ep = tmp_path / "nccl" / "ep" / "lib" / "cu13" / "libnccl_ep.so"
    nccl = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    for path in (ep, nccl):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    monkeypatch.delenv("TE_EP_NCCL_EP_LIB", raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", _no_distribution)
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    assert _nccl_ep.nccl_ep_library() == str(ep)
    assert _nccl_ep.nccl_library() == str(nccl)


def test_nothing_installed_finds_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TE_EP_NCCL_EP_LIB", raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", _no_distribution)
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    assert _nccl_ep.nccl_ep_library() is None
    assert _nccl_ep.nccl_library() is None


@pytest.mark.skipif(_nccl_ep.is_available(), reason="nccl_ep is available here")
def test_load_when_unavailable_names_the_reason():
    with pytest.raises(RuntimeError, match="backend 'nccl_ep' is unavailable") as info:
        _nccl_ep.load()
    assert AVAILABILITY in str(info.value)


@pytest.mark.skipif(BUILT, reason="this build contains the nccl_ep backend")
def test_stub_build_says_how_to_rebuild():
    with pytest.raises(RuntimeError, match=r"python3 -m te_ep_torch prints the command"):
        OPS._nccl_ep_load("/nonexistent/libnccl_ep.so", "")


@needs_build
def test_load_rejects_a_relative_path():
    if _nccl_ep._description is not None:
        pytest.skip("NCCL EP is already loaded in this process; load() ignores later paths")
    with pytest.raises(RuntimeError, match="must be absolute"):
        OPS._nccl_ep_load("libnccl_ep.so", "")


def test_auto_backend_needs_num_experts_a_multiple_of_4(monkeypatch):
    from te_ep_torch import group

    monkeypatch.setattr(_nccl_ep, "availability", lambda: "")
    monkeypatch.setattr(_nccl_ep, "load", lambda: "NCCL EP (stubbed)")
    cuda = torch.device("cuda", 0)
    hosts = ["a", "a"]
    assert group._auto_backend(cuda, 8, hosts) == "nccl_ep"
    with pytest.warns(UserWarning, match="multiple of 4, got 6"):
        assert group._auto_backend(cuda, 6, hosts) == "reference"
    assert group._auto_backend(torch.device("cpu"), 8, hosts) == "reference"
    # ranks NCCL EP can't form teams of (it would assert): reference, saying why
    with pytest.warns(UserWarning, match="same number of ranks on every host"):
        assert group._auto_backend(cuda, 12, ["a", "a", "b"]) == "reference"


def test_release_of_an_unknown_group_is_a_noop():
    OPS._nccl_ep_release_group("no-such-group")


# ---- version checks and errors (GPU) ------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_old_nccl_is_reported_with_the_fix():
    # torch.cuda.nccl.version() is the NCCL torch was built with; the runtime
    # library that nccl_ep loads may be newer (the nccl-ep extra installs one).
    if AVAILABILITY == "":
        pytest.skip("nccl_ep is available: the NCCL runtime is new enough")
    if tuple(torch.cuda.nccl.version()) >= _nccl_ep.MIN_NCCL_VERSION:
        pytest.skip("torch's NCCL is new enough")
    if not BUILT or _nccl_ep.nccl_ep_library() is None:
        pytest.skip("reason would be the missing build or library, not NCCL")
    assert "nvidia-nccl-cu13>=2.30.7" in AVAILABILITY


@pytest.mark.gpu
@needs_build
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_load_of_a_missing_library_fails_clearly(tmp_path):
    if _nccl_ep._description is not None:
        pytest.skip("NCCL EP is already loaded in this process")
    with pytest.raises(RuntimeError, match="could not open"):
        OPS._nccl_ep_load(str(tmp_path / "libnccl_ep.so"), "")


@pytest.mark.gpu
@needs_nccl_ep
def test_load_describes_versions_and_is_idempotent():
    first = _nccl_ep.load()
    assert first.startswith("NCCL EP ") and " on NCCL 2." in first
    assert _nccl_ep.load() == first


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank NCCL process group: enough for create_handle's checks."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    yield dist.group.WORLD.group_name
    if created:
        dist.destroy_process_group()


def _create(group_name, *, hidden=256, dtype=torch.bfloat16, capacity=512, max_tokens=64, num_experts=8):
    return OPS.create_handle(group_name, "nccl_ep", num_experts, max_tokens, 2, hidden, capacity, 1, dtype,
                             torch.device("cuda", 0))


@pytest.mark.gpu
@needs_nccl_ep
def test_row_width_must_be_a_multiple_of_16_bytes(world_of_one):
    _nccl_ep.load()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _create(world_of_one, hidden=100)


@pytest.mark.gpu
@needs_nccl_ep
def test_capacity_below_max_tokens_is_rejected(world_of_one):
    _nccl_ep.load()
    with pytest.raises(RuntimeError, match="capacity >= max_tokens_per_rank"):
        _create(world_of_one, capacity=32, max_tokens=64)
    # NCCL EP's send budget is max_tokens_per_rank rounded up to a multiple of 4.
    with pytest.raises(RuntimeError, match=r"capacity=9 and max_tokens_per_rank=9 \(rounded: 12\)"):
        _create(world_of_one, capacity=9, max_tokens=9)


@pytest.mark.gpu
@needs_nccl_ep
def test_num_experts_must_be_a_multiple_of_4(world_of_one):
    _nccl_ep.load()
    with pytest.raises(RuntimeError, match=r"num_experts to be a multiple of 4.*got num_experts=6"):
        _create(world_of_one, num_experts=6)


_NO_VMM_SCRIPT = """
import torch, torch.distributed as dist, te_ep_torch as te
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
for mode in ("staged", "auto", "zero_copy"):
    g = te.EpGroup(num_experts=8, max_tokens_per_rank=64, backend="nccl_ep", nccl_ep_mode=mode)
    try:
        g.create_handle(top_k=2, hidden=64, dtype=torch.bfloat16)
        print(mode.upper(), "created", flush=True)
    except RuntimeError as e:
        print(mode.upper(), "raised |", str(e).splitlines()[0], flush=True)
    g.shutdown()
dist.destroy_process_group()
"""


@pytest.mark.gpu
@needs_nccl_ep
def test_no_vmm_memory_is_a_clear_error_in_every_mode():
    """With NCCL_CUMEM_ENABLE=0, ncclMemAlloc hands out cudaMalloc memory and NCCL's device API,
    which NCCL EP needs in both modes, is off: NCCL EP's group creation fails with "invalid
    usage" even staged. create_handle raises instead, in every mode, saying why (measured on
    one H200 with NCCL 2.30.7 and NCCL EP 0.2.0). A fresh process: the probe runs once per process."""
    import subprocess
    import sys

    env = dict(os.environ, NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0")
    out = subprocess.run([sys.executable, "-c", _NO_VMM_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()
             if line.startswith(("STAGED", "AUTO", "ZERO_COPY"))}
    for mode in ("STAGED", "AUTO", "ZERO_COPY"):
        line = lines.get(mode, "")
        assert "raised | te_ep.create_handle: backend 'nccl_ep' cannot run on rank 0" in line, out.stdout + out.stderr
        assert "not CUDA VMM" in line and "backend='reference'" in line, line
