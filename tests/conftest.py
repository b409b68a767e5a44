"""Owns the per-session worker pools of the multi-process launcher (tests/_dist.py). The import
path (the repository root for an in-place build of te_ep_torch, and tests/) is pytest's
``pythonpath`` in pyproject.toml."""

import pytest

from _dist import PoolRegistry


@pytest.fixture(scope="session")
def pools():
    """Worker pools by world size, spawned on first use, torn down at session end."""
    registry = PoolRegistry(backend="reference")
    yield registry
    registry.close()
