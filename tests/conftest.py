"""The suite's options and the per-session worker pools of the multi-process launcher
(tests/_dist.py). The import path (the repository root for an in-place build of te_ep_torch,
and tests/) is pytest's ``pythonpath`` in pyproject.toml; the marks (gpu, nccl_ep, faults,
soak, quick) are registered there too.

A GPU run selects by mark, e.g. ``python3 -m pytest -m "gpu and quick" --world-size 2``
(README, "Tests on GPUs")."""

import os
import shutil

import pytest

from _dist import PoolRegistry
from _launches import DEFAULT_GPU_WORLD_SIZES, save_kernel_cache, unpack_kernel_cache


def pytest_addoption(parser):
    group = parser.getgroup("te_ep", "te_ep's GPU runs")
    group.addoption("--world-size", default=os.environ.get("TE_EP_WORLD_SIZES", DEFAULT_GPU_WORLD_SIZES),
                    metavar="SIZES",
                    help="world sizes of the multi-rank GPU tests, e.g. 2 or 2,4 (1: the cases that hold at one "
                         f"rank; default $TE_EP_WORLD_SIZES or {DEFAULT_GPU_WORLD_SIZES}); one GPU per rank")
    group.addoption("--kernel-cache", default="", metavar="FILE",
                    help="a .tar.gz of NCCL EP's kernel cache: unpacked into NCCL_EP_JIT_CACHE_DIR (a new "
                         "temporary directory where unset) before the tests, rewritten with the whole cache after")
    group.addoption("--faults-pg-timeout", type=float, default=None, metavar="S",
                    help="process-group timeout of the GPU fault cases, seconds (default 20): what a lost-rank "
                         "case waits")
    group.addoption("--faults-summary", default="", metavar="FILE",
                    help="append a line per fault case run: which limit ended each rank, after how long, the "
                         "verdict and the case's own seconds")
    group.addoption("--faults-dump-after", default="", metavar="S[,S...]",
                    help="fault cases, diagnostics: each rank dumps the Python stack and the kernel state of every "
                         "thread to its stderr S seconds after its body starts (see --faults-keep-logs)")
    group.addoption("--faults-keep-logs", default="", metavar="DIR",
                    help="keep each fault case's rank stderr files under DIR/<case>.<variant>.<mode>.w<W>/")


_KERNEL_CACHE = pytest.StashKey[tuple]()  # (the file, NCCL_EP_JIT_CACHE_DIR, whether this run made it)


def pytest_configure(config):
    cache = config.getoption("kernel_cache")
    if cache:
        made = not os.environ.get("NCCL_EP_JIT_CACHE_DIR")
        config.stash[_KERNEL_CACHE] = (cache, unpack_kernel_cache(cache), made)


def pytest_unconfigure(config):
    if _KERNEL_CACHE in config.stash:
        cache, cache_dir, made = config.stash[_KERNEL_CACHE]
        save_kernel_cache(cache, cache_dir)
        if made:
            shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pools():
    """Worker pools by world size and device, spawned on first use, torn down at session end."""
    registry = PoolRegistry()
    yield registry
    registry.close()
