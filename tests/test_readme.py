"""README's API example runs as written: extracted from README.md, at 2 ranks on gloo."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from test_clean_exit import REPO, _report, run_script


def api_example() -> str:
    """The first ```python block of README's "API in short" section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## API in short"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block in 'API in short'"
    return match[1]


def test_readme_api_example_runs_at_2_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "readme_api_example.py"
        script.write_text(api_example())
        summary = run_script(script, runs=1, args=[], logs=tmp)
        assert not summary["failed"], _report(summary)
        for rank in range(2):
            out = (Path(tmp) / f"run0_rank{rank}.log").read_text()
            m = re.search(rf"rank {rank}: y \(256, 256\), \|grad x\| (\d+\.\d+)", out)
            assert m and float(m[1]) > 0, out[-3000:]
