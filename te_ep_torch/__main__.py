"""``python -m te_ep_torch``: what this installation runs on, and why the fast path is off.

Prints the versions that matter (te_ep_torch, torch, CUDA, NCCL as torch was built with it
and as loaded in this process, NCCL EP), what the extension was built with (GPU
architectures, the nccl_ep backend), and whether ``backend="auto"`` gets ``nccl_ep`` here;
when it does not, the reason and the command that fixes it. It opens no NCCL EP library
and creates no communicator: safe on any machine.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from typing import List, Optional, Tuple

import torch

import te_ep_torch
from te_ep_torch import _nccl_ep


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _build_info() -> Optional[dict]:
    try:
        from te_ep_torch._build_info import BUILD_INFO
    except ImportError:
        return None
    return BUILD_INFO


def _nccl_code_to_tuple(code: int) -> Tuple[int, int, int]:
    # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9.
    return code // 10000, code % 10000 // 100, code % 100


def _loaded_nccl() -> Tuple[Optional[Tuple[int, int, int]], Optional[str]]:
    """The NCCL runtime of this process (the libnccl.so.2 torch loaded, which NCCL EP binds to)."""
    path = next((line.split()[-1] for line in _maps() if line.rstrip().endswith("libnccl.so.2")), None)
    try:
        lib = ctypes.CDLL(path or "libnccl.so.2")
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None, path
    except (OSError, AttributeError):
        return None, path
    return _nccl_code_to_tuple(code.value), path


def _maps() -> List[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.readlines()
    except OSError:
        return []


def _fmt(version) -> str:
    return ".".join(str(v) for v in version) if version else "unknown"


def _covers(archs: List[str], capability: Tuple[int, int]) -> bool:
    """Whether kernels built for ``archs`` (SASS for each, PTX of the last) run on ``capability``."""
    cc = capability[0] * 10 + capability[1]
    numbers = [int("".join(c for c in a if c.isdigit())) for a in archs]
    return cc in numbers or (bool(numbers) and cc >= numbers[-1])


def report() -> Tuple[List[str], List[str]]:
    """``(lines, problems)``: the report, and what keeps the nccl_ep backend from running, each
    with the command that fixes it."""
    lines, problems = [], []
    info = _build_info()
    built_nccl_ep = bool(torch.ops.te_ep._nccl_ep_built())

    lines.append(f"te_ep_torch {te_ep_torch.__version__} ({os.path.dirname(os.path.abspath(te_ep_torch.__file__))})")
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU-only build)'}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    capability = None
    if gpus:
        capability = torch.cuda.get_device_capability()
        lines.append(f"GPUs: {gpus} x {torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})")
    else:
        lines.append("GPUs: none visible")

    if torch.version.cuda is not None:
        try:
            compiled = _fmt(torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            compiled = "unknown"
        loaded, path = _loaded_nccl()
        wheel = _dist_version(f"nvidia-nccl-cu{_nccl_ep._CUDA_MAJOR}")
        lines.append(
            f"NCCL: torch built with {compiled}; loaded {_fmt(loaded)}"
            + (f" ({path})" if path else "")
            + (f"; nvidia-nccl-cu{_nccl_ep._CUDA_MAJOR} wheel {wheel}" if wheel else "")
            + " (NCCL EP runs on the loaded one)"
        )
        if loaded and loaded < _nccl_ep.MIN_NCCL_VERSION:
            problems.append(
                f"NCCL EP needs NCCL >= {_fmt(_nccl_ep.MIN_NCCL_VERSION)}, this process loads {_fmt(loaded)}: "
                f"`{_nccl_ep.install_command()}`"
            )

    extensions = _dist_version("nccl-extensions")
    library = _nccl_ep.nccl_ep_library()
    if extensions or library:
        lines.append(f"NCCL EP: nccl-extensions {extensions or '(not a pip install)'}, library {library or 'not found'}")
    else:
        lines.append("NCCL EP: not installed (pip package nccl-extensions)")
    if library is None:
        rebuild = "" if built_nccl_ep else f", then rebuild: `{_nccl_ep.REBUILD}`"
        problems.append(f"NCCL EP is not installed: `{_nccl_ep.install_command()}`{rebuild}")

    if info is None:
        lines.append("build: no record (te_ep_torch/_build_info.py is written by setup.py's build_ext)")
    else:
        archs = info.get("cuda_archs") or []
        cuda = (f"CUDA kernels for {', '.join('sm_' + a for a in archs)} (+ PTX of compute_{archs[-1]})"
                if archs else "no CUDA kernels (CPU-only build)")
        lines.append(f"build: against torch {info.get('torch')}; {cuda}")
        if _public(info.get("torch")) != _public(torch.__version__):
            problems.append(f"te_ep_torch was built against torch {info.get('torch')}, this is torch "
                            f"{torch.__version__}: rebuild: `{_nccl_ep.REBUILD}`")
        if capability and archs and not _covers(archs, capability):
            problems.append(f"no kernels for this GPU (sm_{capability[0]}{capability[1]}); rebuild with "
                            f"TE_EP_CUDA_ARCH=\"{capability[0]}{capability[1]}\": `{_nccl_ep.REBUILD}`")
        if bool(info.get("nccl_ep")) != built_nccl_ep:
            problems.append("te_ep_torch/_C.so does not match te_ep_torch/_build_info.py (copied from another "
                            f"build?): rebuild: `{_nccl_ep.REBUILD}`")
    if built_nccl_ep:
        headers = f" (NCCL EP {info.get('nccl_ep_header_version')} headers)" if info else ""
        lines.append(f"nccl_ep backend: built{headers}")
    else:
        lines.append("nccl_ep backend: not built (nccl_ep.h was not found at build time)")
        if library is not None:
            problems.append(f"te_ep_torch was built before NCCL EP was installed: rebuild: `{_nccl_ep.REBUILD}`")

    reason = _nccl_ep.availability()
    if reason:
        lines.append(f"backend='auto' on a CUDA group: reference (nccl_ep: {reason})")
    elif problems:
        lines.append("backend='auto' on a CUDA group: reference (see below)")
    else:
        lines.append("backend='auto' on a CUDA group: nccl_ep")
    return lines, problems


def _public(version: Optional[str]) -> Optional[str]:
    return version.split("+", 1)[0] if version else version


def main() -> int:
    lines, problems = report()
    print("\n".join(lines))
    if problems:
        print("to get the nccl_ep backend (the fast path):")
        for problem in dict.fromkeys(problems):
            print(f"  - {problem}")
        if "nvidia-nccl-cu13==" in _nccl_ep.install_command():
            print(f"  (torch {torch.__version__.split('+')[0]} pins an older NCCL: that command replaces it, and pip "
                  "warns about torch's pin; torch >= 2.14 pins NCCL 2.30.7 and needs no override)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
