"""The launches a multi-rank test runs on, as pytest parameters, and the GPU run's kernel cache.

A multi-rank body runs on CPU (gloo, the reference backend) at the world sizes the test names,
and on GPUs at each world size of ``--world-size`` (conftest.py): with the reference backend
on NCCL, and with nccl_ep in each mode (`NCCL_EP_MODES`) and check mode (`CHECK_MODES`). A GPU
parameter carries the mark ``gpu`` (and ``nccl_ep``; ``quick`` where the test asks) and skips,
with the reason, where this machine cannot run it (fewer GPUs than ranks, no usable NCCL EP):
a skipped GPU test never counts as passed.
"""

from __future__ import annotations

import functools
import os
import shutil
import tarfile
import tempfile
from typing import Iterable, List, Sequence

import pytest

from _dist import Launch

NCCL_EP_MODES = ("staged", "zero_copy")
CHECK_MODES = ("local", "device", "synchronous")
DEFAULT_GPU_WORLD_SIZES = "2,4"


def gpu_world_sizes(config) -> List[int]:
    """The world sizes of the GPU parameters: ``--world-size`` ("2", "2,4", "1 2 4")."""
    text = config.getoption("world_size")
    try:
        sizes = [int(word) for word in text.replace(",", " ").split()]
    except ValueError:
        raise pytest.UsageError(f"--world-size takes world sizes such as 2 or 2,4, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-size takes world sizes of at least 1, got {text!r}")
    return sorted(set(sizes))


def gpu_launches(config, backends: Sequence[str] = ("reference", "nccl_ep"),
                 checks: Sequence[str] = CHECK_MODES) -> List[Launch]:
    """Every GPU launch, the world size outermost (so a run keeps one pool per size)."""
    out = []
    for w in gpu_world_sizes(config):
        for backend in backends:
            if backend == "reference":
                out.append(Launch(w, "cuda", "reference"))
            else:
                out += [Launch(w, "cuda", backend, mode, c) for mode in NCCL_EP_MODES for c in checks]
    return out


@functools.lru_cache(maxsize=None)
def _unavailable(launch: Launch) -> str:
    return launch.unavailable()


def param(launch: Launch, *values, name: str = "", quick: bool = False, marks: Iterable = ()):
    """The pytest parameter ``(*values, launch)`` with id ``<launch id>-<name>``, the launch's
    marks and, where this machine cannot run it, a skip with the reason."""
    marks = list(marks)
    if launch.device == "cuda":
        marks.append(pytest.mark.gpu)
    if launch.backend == "nccl_ep":
        marks.append(pytest.mark.nccl_ep)
    if quick:
        marks.append(pytest.mark.quick)
    why = _unavailable(launch)
    if why:
        marks.append(pytest.mark.skip(reason=why))
    return pytest.param(*values, launch, id="-".join(filter(None, [launch.id, name])), marks=marks)


# ---------------------------------------------------------------------------
# NCCL EP's kernel cache across machines (--kernel-cache FILE)
# ---------------------------------------------------------------------------
# NCCL EP compiles its kernels per shape and world size on first use, into
# NCCL_EP_JIT_CACHE_DIR, tens of seconds each: a GPU run on a fresh machine unpacks the cache an
# earlier run left, and leaves the cache it ends with.
_UNPACKING = ".te_ep_unpacking."


def unpack_kernel_cache(path: str) -> str:
    """Unpacks the .tar.gz ``path`` (where it exists) into NCCL_EP_JIT_CACHE_DIR, set to a new
    temporary directory where unset; returns that directory. Each file lands whole (unpacked
    beside it, then renamed), so runs side by side may share the directory, as NCCL EP allows."""
    cache_dir = os.environ.get("NCCL_EP_JIT_CACHE_DIR") or tempfile.mkdtemp(prefix="te_ep_nccl_ep_jit_")
    os.environ["NCCL_EP_JIT_CACHE_DIR"] = cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    if not os.path.exists(path):
        return cache_dir
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=_UNPACKING) as tmp:
        try:
            with tarfile.open(path, "r:gz") as tar:
                # "data": nothing outside tmp (Pythons without tarfile's filters unpack as is)
                tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        except (tarfile.TarError, OSError) as e:
            raise pytest.UsageError(f"--kernel-cache must name a .tar.gz of a kernel cache (or a file not there "
                                    f"yet), got {path!r}: {e}") from None
        for root, _, files in os.walk(tmp):
            into = os.path.join(cache_dir, os.path.relpath(root, tmp))
            os.makedirs(into, exist_ok=True)
            for name in files:
                os.replace(os.path.join(root, name), os.path.join(into, name))
    return cache_dir


def save_kernel_cache(path: str, cache_dir: str) -> None:
    """Writes the whole of ``cache_dir`` to the .tar.gz ``path``, through a file of this
    process's own: a run cut short, or one beside it writing the same file, leaves a whole one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(cache_dir)):
            if not name.startswith(_UNPACKING):
                tar.add(os.path.join(cache_dir, name), arcname=name)
    shutil.move(tmp, path)
