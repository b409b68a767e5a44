"""capacity_factor: a multiplier of the mean receive load of a rank (docs/ops.md, "Capacity").

The receive rows below are worked out by hand from the definition (factor x top_k x
max_tokens_per_rank, plus num_local_experts x (alignment - 1) zone padding, within
[NCCL EP's floor, the worst case]), not by the formula under test. The multi-rank case
(a fitted handle gives the worst-case handle's results; create_handle and ExpertParallel
take the argument) is ep_cases' ``capacity_factor``, run by tests/test_ep_cases.py.
"""

import math

import pytest
import torch

from te_ep_torch.group import capacity_for_factor, check_capacity_factor
from te_ep_torch.options import EpOptions
from te_ep_torch.parallel import ExpertParallel, parallelize_moe_model


# (W, max_tokens_per_rank, top_k, num_experts, alignment, factor) -> receive rows per rank
BY_HAND = [
    # 16 experts, 100 tokens, top-4, alignment 8, factor 1.25: 500 rows of mean load x 1.25,
    # plus 8 zones x 7 rows at W=2 (worst case 2 x 100 x 4 + 56 = 856) ...
    ((2, 100, 4, 16, 8, 1.25), 556),
    # ... and 4 zones x 7 at W=4 (worst case 4 x 100 x 4 + 28 = 1628): the same mean load.
    ((4, 100, 4, 16, 8, 1.25), 528),
    ((2, 100, 4, 16, 8, 1.0), 456),
    ((4, 100, 4, 16, 8, 2.0), 828),
    # 1.01 x 3 x 7 = 21.21, rounded up; 8 experts, no padding
    ((2, 7, 3, 8, 1, 1.01), 22),
    ((4, 7, 3, 8, 1, 1.01), 22),
    # top-1 of 8 experts at 10 tokens: 10 rows, lifted to NCCL EP's floor (10 rounded up to 4)
    ((2, 10, 1, 8, 1, 1.0), 12),
    ((4, 10, 1, 8, 1, 1.0), 12),
    # clamped to the worst case: 3 x 400 + 56 > 2 x 100 x 4 + 56 = 856 at W=2; at W=4 under
    # its worst case 1628
    ((2, 100, 4, 16, 8, 3.0), 856),
    ((4, 100, 4, 16, 8, 3.0), 1228),
    # top_k above the experts of a rank (8 of 16 at W=4, 4 local): the mean is still 8 x 50
    # rows, the worst case 4 x 50 x 4 = 800
    ((4, 50, 8, 16, 1, 1.5), 600),
    ((4, 50, 8, 16, 1, 2.5), 800),
    # DeepSeek-V3 dims (docs/ops.md's table): 4096 tokens, top-8 of 256, alignment 16
    ((4, 4096, 8, 256, 16, 1.25), 41920),
    ((64, 4096, 8, 256, 16, 1.25), 41020),
]


@pytest.mark.parametrize("sizes,rows", BY_HAND, ids=[f"W{s[0]}-T{s[1]}-K{s[2]}-E{s[3]}-a{s[4]}-f{s[5]}"
                                                     for s, _ in BY_HAND])
def test_rows_of_a_factor(sizes, rows):
    W, T, K, E, a, f = sizes
    assert capacity_for_factor(W, T, K, E // W, a, f) == rows


def test_rows_do_not_grow_with_the_ep_size():
    """The mean load is the same at every EP size; only the zone padding (fewer zones) shrinks."""
    got = [capacity_for_factor(W, 4096, 8, 256 // W, 16, 1.25) for W in (2, 4, 8, 16, 32, 64)]
    assert got == [40960 + (256 // W) * 15 for W in (2, 4, 8, 16, 32, 64)], got


@pytest.mark.parametrize("factor", [1, 1.0, 1.25, 2, 7.5])
def test_accepted_factors(factor):
    check_capacity_factor(factor, "t")
    check_capacity_factor(None, "t")


@pytest.mark.parametrize("factor", [0.5, 0.999, 0.1])
def test_old_fractional_values_say_what_changed(factor):
    # What the old meaning gave at W=2, 100 tokens, top-4 of 16, alignment 8: that fraction
    # of 2 x 100 x 4 token rows plus 56 padding rows (at least NCCL EP's floor of 100).
    old = max(100, math.ceil(factor * 800) + 56)
    with pytest.raises(ValueError) as err:
        capacity_for_factor(2, 100, 4, 8, 8, factor)
    msg = str(err.value)
    for words in ("capacity_factor is now a multiplier of the mean receive load", "Megatron/GShard/TorchTitan",
                  ">= 1.0", f"got {factor}", "removed in te_ep_torch 0.3.0", f"pass capacity={old} instead"):
        assert words in msg, msg
    # Without a group (the integrations' option checks): how to convert, in words.
    with pytest.raises(ValueError, match=r"t: capacity_factor is now a multiplier .*f x EP size x min\(top_k"):
        check_capacity_factor(factor, "t")


FINITE = "or a finite number >= 1.0"


@pytest.mark.parametrize("factor,words", [
    (0, r"or >= 1.0 .*got 0"), (-1.5, r"or >= 1.0 .*got -1.5"), (True, FINITE), ("1.5", FINITE),
    (float("nan"), FINITE), (float("inf"), FINITE), ([1.5], FINITE),
])
def test_bad_factors_name_the_argument(factor, words):
    with pytest.raises(ValueError, match=rf"t: capacity_factor must be None \(the worst case\) {words}"):
        check_capacity_factor(factor, "t")


def test_rule_checks_its_sizes():
    with pytest.raises(ValueError, match="alignment must be a power of two, got 12"):
        capacity_for_factor(2, 100, 4, 8, 12, 1.5)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        capacity_for_factor(2, 100, 0, 8, 1, 1.5)
    with pytest.raises(ValueError, match="factor must be a number >= 1.0, got None"):
        capacity_for_factor(2, 100, 4, 8, 1, None)


def test_expert_parallel_refuses_before_sharding():
    """ExpertParallel (and parallelize_moe_model, which builds one) checks the capacity
    arguments when made, before any weight is sharded (a bad deprecated keyword is refused
    before its FutureWarning)."""
    with pytest.raises(ValueError, match=r"ExpertParallel: pass capacity \(rows\) or capacity_factor .*not both"):
        ExpertParallel(max_tokens_per_rank=8, capacity=64, capacity_factor=1.5)
    with pytest.raises(ValueError, match="parallelize_moe_model: capacity_factor is now a multiplier"):
        parallelize_moe_model(torch.nn.Linear(2, 2), None, max_tokens_per_rank=8, capacity_factor=0.5)
    assert ExpertParallel(max_tokens_per_rank=8, options=EpOptions(capacity_factor=1.25)).capacity_factor == 1.25
    with pytest.raises(ValueError, match=r"parallelize_moe_model: overflow must be one of \('raise', 'drop'\), got 'skip'"):
        parallelize_moe_model(torch.nn.Linear(2, 2), None, max_tokens_per_rank=8, overflow="skip")
    assert ExpertParallel(max_tokens_per_rank=8, options=EpOptions(capacity_factor=1.25, overflow="drop")).overflow \
        == "drop"


def test_memory_table_in_docs_is_the_scripts():
    """docs/ops.md's buffer-memory table is what benchmarks/capacity_memory.py prints."""
    import subprocess
    import sys

    from _dist import REPO, subprocess_env

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "capacity_memory.py")], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("|")]
    assert len(rows) == 8, out  # header, rule, W = 2 ... 64
    docs = (REPO / "docs" / "ops.md").read_text()
    missing = [row for row in rows if row not in docs]
    assert not missing, f"docs/ops.md lacks these rows of benchmarks/capacity_memory.py's table: {missing}"
