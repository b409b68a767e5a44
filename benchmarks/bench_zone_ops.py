"""Benchmark te_ep's zone ops (the work between dispatch and combine) against plain PyTorch
and the GPU's copy bandwidth, at a MoE layer's shapes.

    python benchmarks/bench_zone_ops.py [--csv out.csv] [--rows 65536] [--hidden 4096] [--ffn 1536]

The rows are what one rank's experts receive in bench_moe_layer.py's defaults (8192 tokens
a rank, top-8: 65,536 rows at any EP size), in 32 zones (the rank's experts at EP size 2)
of a buffer with 25% more rows than are in use; bfloat16 (``--dtype``). Each op of
``te_ep_torch.zones`` runs once a layer step:

    glu        forward:  silu(gate) * up                  read 2 R*F, write R*F
    glu_bwd    backward: gate's and up's gradients          read 3 R*F, write 2 R*F
    scale      forward:  rows * routing weight (combine)    read R*H, write R*H
    scale_bwd  backward: grad * weight, row dot products    read 2 R*H, write R*H
    add        backward: the two GEMMs' input gradients     read 2 R*H, write R*H

against the same expression in eager PyTorch on the rows in use (``torch`` column: what the
layer would run without the zone kernels). Bandwidth counts the bytes an op must move and is
compared with a device-to-device copy measured in the same run. Times are medians (as
bench_permute.py takes them). Not a test: it never asserts timings.
"""

from __future__ import annotations

# _common first: it sets the environment NCCL reads when it initialises. Run as a script, this
# folder is on the import path; imported (tests/test_zones.py), the modules beside it are in its
# package.
if __package__:
    from . import _common
    from ._common import Column
    from .bench_permute import bench, copy_bandwidth
else:
    import _common
    from _common import Column
    from bench_permute import bench, copy_bandwidth

import argparse
import sys

import torch
import torch.nn.functional as F

from te_ep_torch import zones  # noqa: F401  (registers the zone ops)

ZONES = 32


def cases(rows: int, hidden: int, ffn: int, dtype: torch.dtype, dev: str = "cuda"):
    """(name, width, bytes, te_ep call, torch call) for each zone op; both calls return what
    they compute on the rows in use (``scale``: the window)."""
    capacity = rows + rows // 4
    counts = torch.full((ZONES,), rows // ZONES, dtype=torch.int32, device=dev)
    counts[: rows % ZONES] += 1
    size = torch.finfo(dtype).bits // 8

    def rand(*shape):
        return torch.randn(*shape, device=dev).to(dtype)

    g, u, d = rand(capacity, ffn), rand(capacity, ffn), rand(capacity, ffn)
    y, grad, other = rand(capacity, hidden), rand(capacity, hidden), rand(capacity, hidden)
    w = torch.rand(capacity, device=dev)
    window = torch.empty_like(y)
    r = slice(0, rows)
    te = torch.ops.te_ep

    def torch_scale():
        window[r] = (y[r].float() * w[r, None]).to(dtype)
        return window

    def te_scale():
        te.zone_scale_into(y, w, counts, window)
        return window

    def torch_scale_bwd():
        gf = grad[r].float()
        return (gf * w[r, None]).to(dtype), (gf * y[r].float()).sum(1)

    return [
        ("glu", ffn, 3 * rows * ffn * size,
         lambda: te.zone_glu(g, counts, "swiglu", False, 1.0, 0.0, u),
         lambda: F.silu(g[r]) * u[r]),
        ("glu_bwd", ffn, 5 * rows * ffn * size,
         lambda: te.zone_glu_bwd(d, g, counts, "swiglu", False, 1.0, 0.0, u),
         lambda: (torch.ops.aten.silu_backward(d[r] * u[r], g[r]), d[r] * F.silu(g[r]))),
        ("scale", hidden, 2 * rows * hidden * size + rows * 4,
         te_scale, torch_scale),
        ("scale_bwd", hidden, 3 * rows * hidden * size + rows * 8,
         lambda: te.zone_scale_bwd(grad, y, w, counts), torch_scale_bwd),
        ("add", hidden, 3 * rows * hidden * size,
         lambda: te.zone_add(grad, other, counts), lambda: grad[r] + other[r]),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536, help="rows in use (one rank's received rows)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=1536, help="each expert's inner width")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--csv", help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_zone_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth(args.rows * args.hidden * 2)
    rows = []
    for name, width, nbytes, te_call, torch_call in cases(args.rows, args.hidden, args.ffn, dtype):
        te_ms, torch_ms = bench(te_call), bench(torch_call)
        rows.append(dict(op=name, rows=args.rows, width=width, te_ep_ms=te_ms, torch_ms=torch_ms,
                         speedup=torch_ms / te_ms, te_ep_gbs=nbytes / (te_ms * 1e-3) / 1e9,
                         copy_fraction=nbytes / (te_ms * 1e-3) / copy))
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, copy bandwidth {copy / 1e9:.0f} GB/s")
    total = dict(op="all", rows=args.rows, width="", te_ep_ms=sum(r["te_ep_ms"] for r in rows),
                 torch_ms=sum(r["torch_ms"] for r in rows))
    total["speedup"] = total["torch_ms"] / total["te_ep_ms"]
    _common.print_table([
        Column("op", "<10", "op"), Column("rows", ">7", "rows"), Column("width", ">6", "width"),
        Column("te_ep ms", ">9", "te_ep_ms", ".3f"), Column("torch ms", ">9", "torch_ms", ".3f"),
        Column("x torch", ">8", "speedup", ".2f"), Column("te_ep GB/s", ">11", lambda r: r.get("te_ep_gbs"), ".0f"),
        Column("of copy", ">8", lambda r: r.get("copy_fraction"), ".0%"),
    ], rows + [total])
    if args.csv:
        _common.write_csv(args.csv, rows + [total])
    return 0


if __name__ == "__main__":
    sys.exit(main())
