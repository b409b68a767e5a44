"""benchmarks/_common.py: a checkout built in place is measured before an installed
te_ep_torch, but a build that PYTHONPATH names comes first (comparing two builds)."""

import os
import subprocess
import sys

from _dist import REPO

PROBE = ("import sys; sys.path.insert(0, {bench!r}); import _common; "
         "print(sys.path.index({named!r}) if {named!r} in sys.path else -1, sys.path.index({repo!r}))")


def _order(tmp_path, named):
    env = dict(os.environ, PYTHONPATH=named)
    code = PROBE.format(bench=str(REPO / "benchmarks"), named=named, repo=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [int(v) for v in out.stdout.split()]


def test_pythonpath_comes_before_the_checkout(tmp_path):
    if not (REPO / "te_ep_torch" / "_C.so").exists():
        import pytest

        pytest.skip("the checkout is not built in place: _common.py adds nothing to sys.path")
    other = str(tmp_path / "other_build")
    named, repo = _order(tmp_path, other)
    assert 0 <= named < repo, (named, repo)
