"""The FP8 quantizer ops (te_ep.quantize_fp8 / dequantize_fp8) against a copy of the same bytes.

    python benchmarks/bench_quantize.py [--csv out.csv]                       # 1 GPU, bf16, the main shapes
    python benchmarks/bench_quantize.py --dtype fp32 --shapes 16384x4096
    python benchmarks/bench_quantize.py --device cpu --shapes 64x256 --iters 3  # tests the script

For each shape T x H (tokens x hidden; H a multiple of the 128-value block, the one
condition the ops set) and input dtype (--dtype, default bf16), one table:

* ``copy``            ``dst.copy_(x)``: the input read and written once, 2 * T*H*elem bytes;
* ``copy same bytes`` ``dst.copy_(src)`` of a uint8 buffer of half the quantizer's
  bytes: the bytes ``quantize`` reads + writes, moved by a copy;
* ``quantize``        ``te_ep_torch.ops.quantize_fp8(x)``: reads T*H*elem, writes T*H
  e4m3 values and T*H/128 float32 scales;
* ``quantize pow2``   the same with ``pow2_scales=True`` (every scale a power of two);
* ``dequantize->D``   ``dequantize_fp8(values, scales, D)``: reads the values and
  scales, writes T*H values of D (--dequantize-dtype; default the input dtype, the
  way docs/benchmarks.md's quantizer table was measured).

Columns: ``bytes`` read + written by the row (HBM traffic; the L2 cache is not
accounted for), ``ms`` the median time of one call, ``GB/s`` = bytes / ms,
``x copy`` = GB/s over the ``copy`` row's, ``x same`` = GB/s over the ``copy same
bytes`` row's. Every row is measured in the same run.

Timing. CUDA: --warmup untimed calls, then --iters calls, each timed with a pair of
CUDA events; each call is queued behind a GPU spin (``torch.cuda._sleep``) so that
its host path (argument checks, allocation of the outputs) is hidden and the
events time the kernels alone; ``--flush-l2`` also overwrites 256 MiB before each
call (by default a shape that fits in L2 may be served from it). CPU (``--device cpu``): wall time of each call
(``time.perf_counter``); it tests the script, the numbers mean little.

Before timing, each shape is checked: on CUDA, the first rows' values and scales
equal the CPU kernels' bit for bit (pow2 and not) and dequantizing them equals the
CPU's; everywhere, dequantize(quantize(x)) is within e4m3's rounding of x (at most
2^-4 of a block's largest magnitude per value). A failed check exits non-zero.
Not a test of speed: it never asserts timings.
"""

from __future__ import annotations

import _common  # first: it sets the environment NCCL reads when it initialises

import argparse
import sys
from typing import Callable, Dict, List, Tuple

import torch

import te_ep_torch as te
from _common import Column
from te_ep_torch import ops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# tokens x hidden: the main dispatch shape, a TorchTitan-like 4096 hidden, the large
# shape, and a hidden that is a multiple of 128 but not of 512.
DEFAULT_SHAPES = ["4096x7168", "8192x4096", "16384x7168", "4096x2176"]
CHECKED_ROWS = 256  # rows compared with the CPU kernels on CUDA
FLUSH_BYTES = 256 * 1024 * 1024


def parse_shape(text: str) -> Tuple[int, int]:
    """``TxH`` -> (T, H); argparse turns a ValueError into a usage error naming the argument."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is TOKENSxHIDDEN, e.g. 4096x7168, got {text!r}")
    tokens, hidden = int(parts[0]), int(parts[1])
    if tokens < 1 or hidden < 1:
        raise argparse.ArgumentTypeError(f"tokens and hidden must be >= 1, got {text!r}")
    if hidden % ops.FP8_BLOCK:
        raise argparse.ArgumentTypeError(
            f"hidden must be a multiple of the FP8 block, {ops.FP8_BLOCK} (quantize_fp8 scales blocks of "
            f"{ops.FP8_BLOCK} values of a row), got hidden={hidden} in {text!r}"
        )
    return tokens, hidden


class Timer:
    """Median milliseconds of one call of fn, queued behind a GPU spin so that its kernels alone are
    timed (on the CPU: its wall time), the L2 cache flushed before it where asked."""

    def __init__(self, device: torch.device, warmup: int, iters: int, flush_l2: bool) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush = (torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
                      if flush_l2 and device.type == "cuda" else None)

    def __call__(self, fn: Callable[[], object]) -> float:
        flush = self.flush.zero_ if self.flush is not None else None
        return _common.median_ms(fn, self.device, self.warmup, self.iters, ranks=False, before=flush, idle=False,
                                 queued=True).queued_ms


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_shape(x: torch.Tensor, dequantize_dtype: torch.dtype) -> List[str]:
    """Problems found (empty: all good); see the module docstring, "Before timing"."""
    problems = []
    for pow2 in (False, True):
        values, scales = ops.quantize_fp8(x, pow2)
        if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
            problems.append(f"quantize_fp8(pow2_scales={pow2}) returned {values.dtype} / {scales.dtype}, expected "
                            "torch.float8_e4m3fn / torch.float32")
            continue
        if x.is_cuda:
            head = x[:CHECKED_ROWS].cpu()
            want_v, want_s = ops.quantize_fp8(head, pow2)
            if not torch.equal(values[:CHECKED_ROWS].cpu().view(torch.uint8), want_v.view(torch.uint8)):
                problems.append(f"quantize_fp8(pow2_scales={pow2}): CUDA values differ from the CPU kernel's")
            if not torch.equal(scales[:CHECKED_ROWS].cpu().view(torch.int32), want_s.view(torch.int32)):
                problems.append(f"quantize_fp8(pow2_scales={pow2}): CUDA scales differ from the CPU kernel's")
            got = ops.dequantize_fp8(values[:CHECKED_ROWS], scales[:CHECKED_ROWS], dequantize_dtype).cpu()
            want = ops.dequantize_fp8(want_v, want_s, dequantize_dtype)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"dequantize_fp8 to {dequantize_dtype}: CUDA output differs from the CPU kernel's")
        # Round trip, in float32: per value at most 2^-4 of its block's largest magnitude.
        back = ops.dequantize_fp8(values, scales, torch.float32)
        blocks = x.float().view(x.shape[0], -1, ops.FP8_BLOCK)
        err = (back.view_as(blocks) - blocks).abs().amax(dim=2)
        bound = blocks.abs().amax(dim=2) * 2**-4
        if bool((err > bound).any()):
            worst = float((err - bound).max())
            problems.append(f"dequantize(quantize(x), pow2_scales={pow2}) exceeds e4m3's rounding bound by {worst:.3e}")
    return problems


def run_shape(tokens: int, hidden: int, dtype: torch.dtype, dequantize_dtype: torch.dtype, timer: Timer,
              device: torch.device) -> List[Dict]:
    gen = torch.Generator(device=device).manual_seed(tokens * 131 + hidden)
    # Magnitudes of about 1 and some blocks far larger or smaller, as activations have.
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32)
    x *= torch.exp2(torch.randint(-8, 9, (tokens, hidden // ops.FP8_BLOCK, 1), generator=gen, device=device)
                    .float()).expand(-1, -1, ops.FP8_BLOCK).reshape(tokens, hidden)
    x = x.to(dtype)
    problems = check_shape(x, dequantize_dtype)
    if problems:
        raise SystemExit(f"T={tokens} H={hidden} {dtype}: check FAILED:\n  " + "\n  ".join(problems))

    elem = x.element_size()
    values, scales = ops.quantize_fp8(x)
    fp8_bytes = values.numel() * values.element_size() + scales.numel() * scales.element_size()
    quantize_bytes = x.numel() * elem + fp8_bytes
    dequantize_bytes = fp8_bytes + x.numel() * dequantize_dtype.itemsize

    copy_dst = torch.empty_like(x)
    same_src = torch.empty(quantize_bytes // 2, dtype=torch.uint8, device=device).random_(0, 255, generator=gen)
    same_dst = torch.empty_like(same_src)
    # (op, what it writes, bytes read + written, the call)
    cases = [
        ("copy", dtype, 2 * x.numel() * elem, lambda: copy_dst.copy_(x)),
        ("copy same bytes", torch.uint8, 2 * same_src.numel(), lambda: same_dst.copy_(same_src)),
        ("quantize", torch.float8_e4m3fn, quantize_bytes, lambda: ops.quantize_fp8(x, False)),
        ("quantize pow2", torch.float8_e4m3fn, quantize_bytes, lambda: ops.quantize_fp8(x, True)),
        ("dequantize", dequantize_dtype, dequantize_bytes,
         lambda: ops.dequantize_fp8(values, scales, dequantize_dtype)),
    ]
    rows = []
    for name, out_dtype, num_bytes, fn in cases:
        ms = timer(fn)
        rows.append(dict(tokens=tokens, hidden=hidden, dtype=dtype_name(dtype), op=name,
                         out_dtype=dtype_name(out_dtype), bytes=num_bytes, median_ms=ms,
                         gbps=num_bytes / (ms * 1e-3) / 1e9))
    copy_gbps, same_gbps = rows[0]["gbps"], rows[1]["gbps"]
    for r in rows:
        r["x_copy"] = r["gbps"] / copy_gbps
        r["x_same_bytes"] = r["gbps"] / same_gbps
    return rows


COLUMNS = [
    Column("op", "<20", lambda r: f"dequantize->{r['out_dtype']}" if r["op"] == "dequantize" else r["op"]),
    Column("bytes", ">13", "bytes"), Column("ms", ">9", "median_ms", ".4f"), Column("GB/s", ">9", "gbps", ".1f"),
    Column("x copy", ">7", "x_copy", ".2f"), Column("x same", ">7", "x_same_bytes", ".2f"),
]


def print_table(rows: List[Dict]) -> None:
    first = rows[0]
    print(f"\nT={first['tokens']} H={first['hidden']} {first['dtype']}")
    _common.print_table(COLUMNS, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in DEFAULT_SHAPES],
                        metavar="TxH", help=f"tokens x hidden (default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="input dtype of quantize")
    parser.add_argument("--dequantize-dtype", choices=["input", *DTYPES], default="input",
                        help="output dtype of dequantize (default: the input dtype)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the current GPU; cpu: the CPU kernels, tests the script")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per row")
    parser.add_argument("--iters", type=int, default=100, help="timed calls per row (the median is reported)")
    parser.add_argument("--flush-l2", action="store_true", help="CUDA: overwrite 256 MiB before each timed call")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1, got --warmup {args.warmup} --iters {args.iters}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_quantize.py --device cuda: no CUDA device here (use --device cpu to test the script)")

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    dequantize_dtype = dtype if args.dequantize_dtype == "input" else DTYPES[args.dequantize_dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    timing = ("CUDA events, each call queued behind a GPU spin" + (", L2 flushed before each" if args.flush_l2 else "")
              if device.type == "cuda" else "time.perf_counter")
    print(f"device: {where}; torch {torch.__version__}; te_ep_torch {te.__version__}")
    print(f"{args.dtype} in, e4m3 + float32 scales per {ops.FP8_BLOCK} values out; median of {args.iters} calls "
          f"after {args.warmup} warm-up ({timing}); GB/s = bytes read + written / time", flush=True)

    all_rows = []
    timer = Timer(device, args.warmup, args.iters, args.flush_l2)
    for tokens, hidden in args.shapes:
        rows = run_shape(tokens, hidden, dtype, dequantize_dtype, timer, device)
        print_table(rows)
        sys.stdout.flush()
        all_rows += rows
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.csv:
        _common.write_csv(args.csv, all_rows)
        print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
