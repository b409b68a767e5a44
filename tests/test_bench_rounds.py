"""benchmarks/bench_dispatch_combine.py --rounds: how the rounds' rows become one table
(and --nvtx: which name each timed call's NVTX range gets).

A ratio to hold against a bar (te_ep / NCCL EP alone >= 0.97, issue 36) must not move with the
machine's drift between the variants' turns: each round's ratio pairs two variants timed in that
round, and the table gives the median of those ratios, not the ratio of the medians.
"""

import math

from benchmarks import bench_dispatch_combine as bench
from benchmarks._common import Timing

SHAPE = bench.SHAPES["small"]
TE_EP = bench.VariantSpec("nccl_ep", "zero_copy")
ALONE = bench.VariantSpec("nccl_ep_alone", "zero_copy")


def _dispatch_result(spec, timing, check=1e-3):
    """A variant's Result with a dispatch time only (its kind from the spec's backend)."""
    kind = "te_ep" if spec.backend == "nccl_ep" else "nccl.ep"
    return bench.Result(spec.row_label(), kind, "zero_copy", spec, 100, {"dispatch": timing}, check)


def _round(te_ep_ms, alone_ms, check=1e-3, queued=None):
    """One round's table rows: te_ep and (unless alone_ms is None) NCCL EP alone, dispatch only.
    ``queued``: (te_ep, alone) queued times, else half of each ms."""
    te_q, alone_q = queued if queued else (te_ep_ms / 2, None if alone_ms is None else alone_ms / 2)
    results = [_dispatch_result(TE_EP, Timing(te_ep_ms, te_ep_ms / 2, te_q), check)]
    if alone_ms is not None:
        results.append(_dispatch_result(ALONE, Timing(alone_ms, alone_ms / 2, alone_q)))
    return bench.table_rows(SHAPE, results, logical_bytes=1e9, remote_bytes=5e8, copy_gbps=None)


def test_ratios_pair_the_variants_of_one_round():
    # Each round's own ratio: 0.9, 1.0 and 0.2 (the machine slowed down during the second round's
    # te_ep turn and sped up during the third round's NCCL EP turn). The table gives their median,
    # 0.9; the ratio of the two medians (0.9 / 2.0 = 0.45) would mix turns of different rounds.
    rounds = [_round(1.0, 0.9), _round(2.0, 2.0), _round(3.0, 0.6)]
    rows = {row["variant"]: row for row in bench.merge_rounds(rounds)}
    te_ep = rows[TE_EP.row_label()]
    assert te_ep["rounds"] == 3
    assert math.isclose(te_ep["ms"], 2.0) and math.isclose(te_ep["host_ms"], 1.0)
    assert math.isclose(rows[ALONE.row_label()]["ms"], 0.9)
    assert math.isclose(te_ep["x_alone"], 0.9)
    assert math.isclose(te_ep["x_alone_min"], 0.2) and math.isclose(te_ep["x_alone_max"], 1.0)


def test_queued_ratio_pairs_the_queued_times_of_one_round():
    # The host path shows in ms, not in queued: te_ep 0.9x alone by ms, 1.1x by queued times,
    # each the median of the rounds' own ratios (queued: 1.1, 1.0 and 1.2).
    rows = {row["variant"]: row for row in bench.merge_rounds([
        _round(1.0, 0.9, queued=(0.5, 0.55)), _round(2.0, 1.8, queued=(1.0, 1.0)), _round(1.0, 0.9, queued=(0.5, 0.6))])}
    te_ep = rows[TE_EP.row_label()]
    assert math.isclose(te_ep["x_alone"], 0.9)
    assert math.isclose(te_ep["x_alone_queued"], 1.1)
    assert math.isclose(te_ep["x_alone_queued_min"], 1.0) and math.isclose(te_ep["x_alone_queued_max"], 1.2)
    assert math.isnan(rows[ALONE.row_label()]["x_alone_queued"])


def test_range_and_worst_check_over_rounds():
    rows = {row["variant"]: row for row in bench.merge_rounds(
        [_round(1.0, 0.8), _round(1.0, 1.0, check=5e-3), _round(1.0, 0.95)])}
    te_ep = rows[TE_EP.row_label()]
    assert math.isclose(te_ep["x_alone"], 0.95)
    assert (te_ep["x_alone_min"], te_ep["x_alone_max"]) == (0.8, 1.0)
    assert te_ep["check_rel_err"] == 5e-3  # a round trip's error is the worst of any round
    assert math.isnan(rows[ALONE.row_label()]["x_alone"])  # NCCL EP's own rows have no ratio to themselves


def test_one_round_is_the_table_as_it_was():
    rows = bench.merge_rounds([_round(1.0, 0.9)])
    assert [row["rounds"] for row in rows] == [1, 1]
    assert math.isclose(rows[0]["x_alone"], 0.9)


def test_a_variant_missing_from_a_round_counts_its_own_rounds():
    rows = {row["variant"]: row for row in bench.merge_rounds([_round(1.0, 0.9), _round(4.0, None)])}
    assert rows[TE_EP.row_label()]["rounds"] == 2 and rows[ALONE.row_label()]["rounds"] == 1
    assert math.isclose(rows[TE_EP.row_label()]["ms"], 2.5)
    assert math.isclose(rows[TE_EP.row_label()]["x_alone"], 0.9)  # the round without NCCL EP has no ratio


class _FakeVariant(bench.Variant):
    """Ops that record their calls, in ``log``."""

    def __init__(self, label, names, log):
        super().__init__(label)
        self.names, self.log = names, log

    def ops(self):
        return {name: bench.Op(lambda name=name: self.log.append((self.label, name))) for name in self.names}


def test_nvtx_names_each_timed_call_only_when_asked(monkeypatch):
    # With --nvtx, nsys attributes the host calls inside a range to '<variant> <op>'.
    seen = []

    def fake(calls, *a, **kw):
        seen.extend(call.nvtx for call in calls)
        return [Timing(1, 1, 1)] * len(calls)

    monkeypatch.setattr(bench._common, "interleaved_median_ms", fake)
    variant = _FakeVariant("te_ep/zero_copy", ["dispatch"], [])
    for nvtx in (True, False):
        args = bench.argparse.Namespace(warmup=0, iters=1, nvtx=nvtx)
        bench.time_variants([variant], args, bench.torch.device("cpu"))
    assert seen == ["te_ep/zero_copy dispatch", None]


def test_the_variants_take_turns_op_by_op(tmp_path):
    # Op by op in OPS order; within an op, the variants that have it take turns call by call,
    # in the reverse order every other iteration (so a drift weighs on each alike).
    log = []
    a = _FakeVariant("a", ["combine", "prepare", "dispatch"], log)
    b = _FakeVariant("b", ["dispatch", "combine"], log)
    args = bench.argparse.Namespace(warmup=1, iters=3, nvtx=False)
    dist = bench.dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        timings = bench.time_variants([a, b], args, bench.torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert [sorted(t) for t in timings] == [["combine", "dispatch", "prepare"], ["combine", "dispatch"]]
    per_op = [("a", "prepare")] * 4
    for op in ("dispatch", "combine"):
        per_op += [("a", op), ("b", op)]  # the warm-up calls, each variant's in turn
        per_op += [("a", op), ("b", op), ("b", op), ("a", op), ("a", op), ("b", op)]
    assert log == per_op


FLOOR = bench.VariantSpec("nccl_ep_floor", "zero_copy")


def test_the_floor_row_is_held_against_nccl_ep_alone():
    # nccl.ep+floor (NCCL EP alone plus te_ep's own CUDA calls) gets an x alone of its own, so a
    # te_ep row's x alone can be read against it: 0.8 / 1.0 and 0.8 / 0.9 here.
    results = [
        _dispatch_result(TE_EP, Timing(1.0, 0.3, 0.9)),
        _dispatch_result(FLOOR, Timing(0.9, 0.2, 0.8)),
        _dispatch_result(ALONE, Timing(0.8, 0.1, 0.8)),
    ]
    rows = {row["variant"]: row for row in bench.table_rows(SHAPE, results, 1e9, 5e8, None)}
    assert FLOOR.row_label() == "nccl.ep+floor/zero_copy"
    assert math.isclose(rows[TE_EP.row_label()]["x_alone"], 0.8)
    assert math.isclose(rows[FLOOR.row_label()]["x_alone"], 0.8 / 0.9)
    assert math.isclose(rows[FLOOR.row_label()]["x_alone_queued"], 1.0)
    assert math.isnan(rows[ALONE.row_label()]["x_alone"])


def test_the_floor_follows_the_zero_copy_structure_only():
    args = bench.argparse.Namespace(backends=["nccl_ep", "nccl_ep_alone", "nccl_ep_floor"],
                                    modes=["staged", "zero_copy"], nccl_ep_env=None, fp8=False, checks=["local"])
    labels = [spec.row_label() for spec in bench.variant_specs(args)]
    assert labels == ["te_ep/staged", "te_ep/zero_copy", "nccl.ep/staged", "nccl.ep/zero_copy",
                      "nccl.ep+floor/zero_copy"]


DROP = bench.VariantSpec("nccl_ep_drop", "zero_copy")


def test_the_drop_row_is_held_against_nccl_ep_alone():
    # nccl.ep-drop (NCCL EP alone under te_ep's overflow policy) gets an x alone of its own: what
    # DROP costs NCCL EP itself, against which a te_ep row's x alone is read.
    results = [
        _dispatch_result(DROP, Timing(1.0, 0.2, 0.9)),
        _dispatch_result(ALONE, Timing(0.8, 0.1, 0.6)),
    ]
    rows = {row["variant"]: row for row in bench.table_rows(SHAPE, results, 1e9, 5e8, None)}
    assert DROP.row_label() == "nccl.ep-drop/zero_copy"
    assert math.isclose(rows[DROP.row_label()]["x_alone"], 0.8)
    assert math.isclose(rows[DROP.row_label()]["x_alone_queued"], 0.6 / 0.9)


def test_the_drop_row_asks_for_drop_below_the_worst_case_capacity_only(monkeypatch):
    # te_ep's rule: DROP where a routing could overflow the capacity, TRAP where none can.
    made = []

    class FakeAlone:
        def __init__(self, **kw):
            made.append(kw)

    monkeypatch.setattr(bench._nccl_ep_alone, "unavailable", lambda: "")
    monkeypatch.setattr(bench._nccl_ep_alone, "NcclEpAlone", FakeAlone)
    monkeypatch.setattr(bench.torch.cuda, "Event", lambda *a, **kw: None)
    on_gpu = type("Tokens", (), {"device": bench.torch.device("cuda")})()  # no GPU needed: NcclEpAlone is a fake
    routing = bench.argparse.Namespace(tokens=on_gpu, topk_idx=None, topk_weights=None)
    world, alignment = 4, 1
    worst = bench.worst_case_capacity(SHAPE, world, alignment)
    assert worst == world * SHAPE.tokens * min(SHAPE.top_k, SHAPE.experts // world)
    for spec, capacity in ((DROP, worst - 1), (DROP, worst), (ALONE, worst - 1)):
        bench.NcclEpAloneVariant(spec, SHAPE, routing, capacity, alignment, world)
    assert [kw["overflow_drop"] for kw in made] == [True, False, False]
