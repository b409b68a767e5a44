"""The MoE layer under activation checkpointing gives the plain layer's outputs and gradients
bit for bit (2 ranks, gloo, reference backend, aux loss on; docs/moe.md, "Limits")."""

from __future__ import annotations

from test_clean_exit import REPO, _report, run_script


def test_moe_layer_under_activation_checkpointing_matches_plain():
    summary = run_script(REPO / "tests" / "moe_checkpointing_script.py", runs=1)
    assert not summary["failed"], _report(summary)
