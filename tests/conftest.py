"""Puts the repo root (for an in-place build of te_ep_torch) and tests/ on sys.path, and
owns the per-session worker pools of the multi-process harness."""

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.dirname(_TESTS), _TESTS):
    if p not in sys.path:
        sys.path.insert(0, p)

from _dist import PoolRegistry  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """Worker pools by world size, spawned on first use, torn down at session end."""
    registry = PoolRegistry(backend="reference")
    yield registry
    registry.close()
