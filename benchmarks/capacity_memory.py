"""Receive and combine buffer bytes per rank of one te_ep MoE layer, worst case vs a capacity factor.

    python3 benchmarks/capacity_memory.py                      # DeepSeek-V3 dims, the table in docs/ops.md
    python3 benchmarks/capacity_memory.py --factor 1.5 --ep 8 16

Prints a markdown table. The capacities come from te_ep_torch itself
(``te_ep_torch.ops.worst_case_capacity`` and ``te_ep_torch.group.capacity_for_factor``, the
rule of ``EpGroup.capacity_for_factor``); the bytes from what the nccl_ep backend allocates
(csrc/nccl_ep/nccl_ep_backend.cpp) for ``C`` capacity rows, ``T`` tokens per rank and rows of
``H`` values of the token dtype:

* staged: ``dispatch`` returns the receive tensor ``[C, H]`` and its weights ``[C]`` float32
  (caching allocator, per call); ``combine`` allocates its output ``[T, H]``, and its
  backward (``combine_bwd``) the gradient rows ``[C, H]``;
* zero_copy: the handle's two symmetric windows, receive and combine, ``2 * C * H`` values
  for its whole life (before NCCL's allocation granularity); per call the weights ``[C]`` and
  combine's output ``[T, H]``, as staged.

NCCL EP's own group buffers (its staging, weights and scales regions) come on top and are not
counted: NCCL EP does not report them.
"""

from __future__ import annotations

import _common  # noqa: F401  (first: a checkout built in place is used before an installed te_ep_torch)

import argparse

import te_ep_torch as te
from te_ep_torch.group import capacity_for_factor


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--alignment", type=int, default=16)
    p.add_argument("--element-bytes", type=int, default=2, help="bytes of a token value (2: bfloat16)")
    p.add_argument("--factor", type=float, default=1.25)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    args = p.parse_args(argv)
    H, K, T, a, b = args.hidden, args.top_k, args.tokens_per_rank, args.alignment, args.element_bytes
    row = H * b

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"

    f = f"{args.factor:g}"
    print(f"hidden {H}, top-{K} of {args.experts} experts, {T} tokens/rank, alignment {a}, {b}-byte values; "
          f"GiB per rank, worst case / capacity_factor={f}")
    print()
    print(f"| W | experts/rank | rows: worst | rows: {f} | staged receive (dispatch) | staged combine (fwd out + "
          f"bwd rows) | zero_copy windows |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for W in args.ep:
        El = args.experts // W
        rows = (te.ops.worst_case_capacity(W, T, K, El, a), capacity_for_factor(W, T, K, El, a, args.factor))
        recv = [C * (row + 4) for C in rows]
        combine = [T * row + C * row for C in rows]
        windows = [2 * C * row for C in rows]
        print(f"| {W} | {El} | {rows[0]:,} | {rows[1]:,} | " + " | ".join(
            f"{gib(x[0])} / {gib(x[1])}" for x in (recv, combine, windows)) + " |")


if __name__ == "__main__":
    main()
