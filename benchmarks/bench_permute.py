"""Benchmark te_ep permute / unpermute against plain PyTorch and the GPU's copy bandwidth.

    python benchmarks/bench_permute.py [--csv out.csv] [--tokens 4096 16384] [--hidden 7168 4096]

For each (T, H): top-8 of 256 experts, bfloat16 tokens, float32 probabilities, routing
uniform at random. Times are medians (triton.testing.do_bench with an L2 flush between
runs when triton is installed, CUDA events otherwise, each call queued behind a GPU
spin). Bandwidth counts the bytes an op must move, the same for both implementations:

    permute    read T*H tokens + T*K ids; write capacity*H rows (+ probs and maps)
    unpermute  read the T*K routed rows, T*K probs and row ids; write T*H

and is compared with a device-to-device copy measured in the same run. The targets at
T=16384, H=7168 are >= 75% of copy bandwidth and >= 3x the plain-PyTorch reference.
Not a test: it never asserts timings.
"""

from __future__ import annotations

# _common first: it sets the environment NCCL reads when it initialises. Run as a script, this
# folder is on the import path; imported (bench_zone_ops.py, tests), _common is in its package.
if __package__:
    from . import _common
    from ._common import Column
else:
    import _common
    from _common import Column

import argparse
import sys

import torch

from te_ep_torch.permutation import permute, unpermute

NUM_EXPERTS, TOP_K = 256, 8
TARGET_TOKENS, TARGET_HIDDEN = 16384, 7168
TARGET_COPY_FRACTION, TARGET_SPEEDUP = 0.75, 3.0


def bench(fn) -> float:
    """Median milliseconds of fn()."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    # Queued behind a spin, as do_bench's back-to-back launches are: the kernels alone are timed.
    return _common.median_ms(fn, flush.device, 5, 50, ranks=False, before=flush.zero_, idle=False,
                             queued=True).queued_ms


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy of num_bytes (read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


def reference_permute(tokens, topk_idx, probs):
    """Plain PyTorch: stable sort of the choices by expert, then index_select."""
    order = torch.argsort(topk_idx.reshape(-1), stable=True)
    return tokens.index_select(0, order // TOP_K), probs.reshape(-1).index_select(0, order), order


def reference_unpermute(expert_out, order, probs):
    """Plain PyTorch: gather each token's K rows, weight in float32, sum, round."""
    rows_of_slot = torch.empty_like(order)
    rows_of_slot[order] = torch.arange(order.numel(), device=order.device)
    gathered = expert_out.index_select(0, rows_of_slot).view(-1, TOP_K, expert_out.shape[1])
    return (gathered.float() * probs.unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)


def run_case(num_tokens: int, hidden: int, copy_bw: float) -> list[dict]:
    dtype = torch.bfloat16
    elem = torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    tokens = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    topk_idx = torch.rand(num_tokens, NUM_EXPERTS, device="cuda").topk(TOP_K, dim=1).indices
    probs = torch.rand(num_tokens, TOP_K, device="cuda")
    capacity = num_tokens * TOP_K
    slots = num_tokens * TOP_K

    out, pp, perm_map = permute(tokens, topk_idx, probs, num_experts=NUM_EXPERTS, capacity=capacity)
    ref_out, ref_pp, order = reference_permute(tokens, topk_idx, probs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(pp, ref_pp, rtol=0, atol=0)
    y = unpermute(out, perm_map, probs)
    torch.testing.assert_close(y, reference_unpermute(ref_out, order, probs), rtol=1.6e-2, atol=1.6e-2)

    permute_bytes = (
        num_tokens * hidden * elem  # tokens
        + slots * topk_idx.element_size()  # ids
        + capacity * hidden * elem  # rows
        + capacity * 4  # permuted probs
        + slots * 4  # probs read
    )
    unpermute_bytes = slots * hidden * elem + num_tokens * hidden * elem + slots * (4 + 4)

    cases = [
        ("permute", permute_bytes,
         lambda: permute(tokens, topk_idx, probs, num_experts=NUM_EXPERTS, capacity=capacity),
         lambda: reference_permute(tokens, topk_idx, probs)),
        ("unpermute", unpermute_bytes,
         lambda: unpermute(out, perm_map, probs),
         lambda: reference_unpermute(ref_out, order, probs)),
    ]
    rows = []
    for op, num_bytes, ours, ref in cases:
        ms, ref_ms = bench(ours), bench(ref)
        for impl, t in (("te_ep", ms), ("torch", ref_ms)):
            bw = num_bytes / (t * 1e-3)
            rows.append(dict(
                op=op, tokens=num_tokens, hidden=hidden, impl=impl, median_ms=t, gbps=bw / 1e9,
                copy_fraction=bw / copy_bw, speedup_vs_torch=ref_ms / t,
            ))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    parser.add_argument("--csv", help="also write the table to this CSV file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_permute.py needs a CUDA GPU")

    largest = max(args.tokens) * TOP_K * max(args.hidden) * 2
    copy_bw = copy_bandwidth(largest)
    print(f"GPU: {torch.cuda.get_device_name()}; device-to-device copy of {largest / 2**30:.2f} GiB: "
          f"{copy_bw / 1e9:.0f} GB/s (read + written)")
    print(f"top-{TOP_K} of {NUM_EXPERTS} experts, bfloat16, capacity = T * {TOP_K}\n")

    rows = []
    for num_tokens in args.tokens:
        for hidden in args.hidden:
            rows += run_case(num_tokens, hidden, copy_bw)
            torch.cuda.empty_cache()

    _common.print_table([
        Column("op", "<10", "op"), Column("T", ">6", "tokens"), Column("H", ">6", "hidden"),
        Column("impl", "<6", "impl"), Column("median ms", ">10", "median_ms", ".3f"), Column("GB/s", ">8", "gbps", ".0f"),
        Column("% copy", ">7", lambda r: f"{100 * r['copy_fraction']:.1f}%"),
        Column("x torch", ">8", "speedup_vs_torch", ".2f"),
    ], rows)

    print()
    for r in rows:
        if r["impl"] == "te_ep" and r["tokens"] == TARGET_TOKENS and r["hidden"] == TARGET_HIDDEN:
            ok = r["copy_fraction"] >= TARGET_COPY_FRACTION and r["speedup_vs_torch"] >= TARGET_SPEEDUP
            print(f"target {r['op']} T={TARGET_TOKENS} H={TARGET_HIDDEN}: {100 * r['copy_fraction']:.1f}% of copy "
                  f"bandwidth (>= {100 * TARGET_COPY_FRACTION:.0f}%), {r['speedup_vs_torch']:.2f}x torch "
                  f"(>= {TARGET_SPEEDUP:.0f}x): {'met' if ok else 'NOT met'}")

    if args.csv:
        _common.write_csv(args.csv, rows)
        print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
