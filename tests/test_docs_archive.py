"""The results archive (docs/results/) and the docs that point into it hold together.

docs/results/README.md is the index: at most 100 lines, one line per run file, newest first,
and one "Current figures" table, which README.md quotes. Every relative link of the docs and
README reaches a file. Pure file checks: no torch, no processes.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "README.md"
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-([0-9a-f]{7,40})-[a-z0-9][a-z0-9-]*\.md$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    assert f"## {heading}\n" in text, f"no '## {heading}' section"
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _table(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("|")]


def test_index_is_short():
    lines = INDEX.read_text().splitlines()
    assert len(lines) <= 100, f"docs/results/README.md has {len(lines)} lines (at most 100)"


def test_one_index_line_per_run_file_newest_first():
    runs = sorted(p.name for p in RESULTS.glob("*.md") if p.name != "README.md")
    bad = [name for name in runs if not RUN_NAME.match(name)]
    assert not bad, f"run files not named <YYYY-MM-DD>-<commit>-<slug>.md: {bad}"
    rows = _table(_section(INDEX.read_text(), "Runs, newest first"))[2:]
    linked = [LINK.search(row)[1] for row in rows]
    assert sorted(linked) == runs, "docs/results/README.md must list every run file once, and no other"
    for row, name in zip(rows, linked):
        date, commit = RUN_NAME.match(name).groups()
        assert row.startswith(f"| {date} | {commit}"), f"index line does not give {name}'s date and commit: {row}"
    dates = [RUN_NAME.match(name)[1] for name in linked]
    assert dates == sorted(dates, reverse=True), "docs/results/README.md: runs are not newest first"


def test_readme_quotes_the_current_figures():
    ours = _table(_section(INDEX.read_text(), "Current figures"))
    quoted = _table(_section((REPO / "README.md").read_text(), "Current figures"))
    assert ours, "docs/results/README.md: no 'Current figures' table"
    assert [line.replace("](docs/results/", "](") for line in quoted] == ours, (
        "README's 'Current figures' table differs from docs/results/README.md's (update both)")
    for line in ours[2:]:
        for target in LINK.findall(line):
            assert RUN_NAME.match(target), f"a current figure links {target}, not a run file"


def test_relative_links_resolve():
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for md in files:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_long_docs_stay_under_400_lines():
    for name in ("nccl_ep.md", "benchmarks.md"):
        n = len((REPO / "docs" / name).read_text().splitlines())
        assert n < 400, f"docs/{name} has {n} lines: its run figures belong in docs/results/"
