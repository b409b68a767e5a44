"""Finds and loads NVIDIA NCCL EP for the ``nccl_ep`` backend.

NCCL EP is an optional run-time dependency: ``nccl-extensions`` brings
``libnccl_ep.so`` (NCCL EP 0.2.0) and the kernel sources it compiles on first use,
and it needs ``nvidia-nccl-cu13>=2.30.7`` (:func:`install_command` says how for
the torch at hand; README, "Install"). Nothing here imports
those packages (``import nccl.ep`` pulls in cuda-python and more); the
libraries are located on disk and opened by the extension with ``dlopen``.

Environment:
  ``TE_EP_NCCL_EP_LIB``   absolute path of ``libnccl_ep.so`` (default: the one in
                          the installed nccl-extensions, ``nccl/ep/lib/cu13``).
  ``NCCL_EP_JIT_CACHE_DIR`` where NCCL EP caches compiled kernels
                          (its default: ``/tmp/nccl_ep/jit``).
See docs/nccl_ep.md for the rest.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import shutil
import sys
from typing import Optional

import torch

__all__ = [
    "MIN_NCCL_VERSION", "REBUILD", "availability", "expert_multiple", "install_command", "is_available", "load",
    "release_group",
]

#: Oldest NCCL runtime that the libnccl_ep of nccl-extensions 0.1.0 accepts.
MIN_NCCL_VERSION = (2, 30, 7)
_CUDA_MAJOR = 13
#: The first torch release whose NCCL pin (nvidia-nccl-cu13==2.30.7) is the one NCCL EP needs.
FIRST_TORCH_WITH_NCCL_EP_NCCL = (2, 14)
#: Rebuilds te_ep_torch from a checkout against what is installed (te_ep_torch is not on PyPI).
REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall .  (in the te_ep_torch checkout)"
_description: Optional[str] = None


def _find_on_sys_path(relative: str) -> Optional[str]:
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), relative)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def _find_in_distribution(distribution: str, relative: str) -> Optional[str]:
    try:
        path = importlib.metadata.distribution(distribution).locate_file(relative)
    except importlib.metadata.PackageNotFoundError:
        return None
    return os.path.abspath(str(path)) if os.path.isfile(str(path)) else None


def nccl_ep_library() -> Optional[str]:
    """Absolute path of the libnccl_ep.so to load, or None if none is installed."""
    override = os.environ.get("TE_EP_NCCL_EP_LIB")
    if override:
        return os.path.abspath(override) if os.path.isfile(override) else None
    relative = f"nccl/ep/lib/cu{_CUDA_MAJOR}/libnccl_ep.so"
    return _find_in_distribution("nccl-extensions", relative) or _find_on_sys_path(relative)


def nccl_library() -> Optional[str]:
    """The libnccl.so.2 of the installed nvidia-nccl-cu13 wheel, if any.

    torch loads its own libnccl.so.2 at import, and that is the one NCCL EP
    ends up using; this path is only opened when no NCCL is loaded yet, and
    is named in the error when the loaded one is too old.
    """
    relative = "nvidia/nccl/lib/libnccl.so.2"
    return _find_in_distribution(f"nvidia-nccl-cu{_CUDA_MAJOR}", relative) or _find_on_sys_path(relative)


def install_command() -> str:
    """The pip command that installs NCCL EP for the torch of this process.

    torch >= 2.14 pins the NCCL that NCCL EP needs, so the ``cu13`` extra of nccl-extensions
    adds nothing that conflicts. Older torch pins an older NCCL: the newer one must replace it
    (pip then warns about torch's pin; NCCL is backward compatible).
    """
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if release >= FIRST_TORCH_WITH_NCCL_EP_NCCL:
        return "pip install 'nccl-extensions[cu13]'"
    return "pip install nccl-extensions 'nvidia-nccl-cu13==2.30.7'"


def _nvcc_cuda_home() -> Optional[str]:
    for name in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(name)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def _ops():
    from ._loader import load_library

    load_library()
    return torch.ops.te_ep


def expert_multiple() -> int:
    """What ``num_experts`` must be a multiple of on the nccl_ep backend (csrc/comm/backend.h).

    NCCL EP moves per-expert routing weights in 16-byte units. Answered by the op
    library alone, also in builds without NCCL EP.
    """
    return int(_ops()._nccl_ep_expert_multiple())


def availability() -> str:
    """Why the nccl_ep backend can't be used in this process ("" when it can).

    Cheap and side-effect free apart from loading te_ep_torch's own op library:
    it neither opens NCCL EP nor creates a CUDA context beyond torch's.
    """
    if torch.version.cuda is None:
        return "this torch is a CPU-only build"
    cuda_major = int(torch.version.cuda.split(".")[0])
    if cuda_major != _CUDA_MAJOR:
        return (
            f"the nccl_ep backend uses the CUDA {_CUDA_MAJOR} build of libnccl_ep and nvidia-nccl-cu{_CUDA_MAJOR}, "
            f"but this torch is built for CUDA {torch.version.cuda}"
        )
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"NCCL EP needs a Hopper (sm_90) or newer GPU, this one is sm_{major}{minor}"
    if not _ops()._nccl_ep_built():
        return (
            f"te_ep_torch was built without NCCL EP; install it (`{install_command()}`) and rebuild (`{REBUILD}`)"
        )
    if nccl_ep_library() is None:
        where = os.environ.get("TE_EP_NCCL_EP_LIB")
        if where:
            return f"TE_EP_NCCL_EP_LIB={where} does not name a file"
        return f"nccl-extensions (libnccl_ep.so for CUDA {_CUDA_MAJOR}) is not installed; `{install_command()}`"
    if _nvcc_cuda_home() is None and not os.environ.get("NCCL_EP_JIT_NVCC"):
        return (
            "nvcc was not found: NCCL EP compiles its kernels at run time and needs the CUDA toolkit "
            "(put nvcc on PATH or set CUDA_HOME)"
        )
    return ""


def is_available() -> bool:
    return availability() == ""


def _at_exit() -> None:
    # Handles still alive at exit are freed after NCCL and the CUDA driver may
    # be gone; from here on the backend leaks them instead.
    torch.ops.te_ep._nccl_ep_at_exit()


def load() -> str:
    """Opens NCCL EP (once per process) and returns a line describing it.

    Raises RuntimeError naming what to install or set when it can't be used.
    """
    global _description
    if _description is not None:
        return _description
    reason = availability()
    if reason:
        raise RuntimeError(f"te_ep_torch: backend 'nccl_ep' is unavailable: {reason}. Use backend='reference'.")
    cuda_home = _nvcc_cuda_home()
    if cuda_home is not None:
        # libnccl_ep runs nvcc from CUDA_HOME and compiles against its headers.
        os.environ.setdefault("CUDA_HOME", cuda_home)
    _description = _ops()._nccl_ep_load(nccl_ep_library(), nccl_library() or "")
    atexit.register(_at_exit)
    return _description


def release_group(group_name: str) -> None:
    """Collective: drops the NCCL EP groups and communicator of a torch group."""
    if _description is not None:
        torch.ops.te_ep._nccl_ep_release_group(group_name)
