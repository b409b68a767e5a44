"""Dispatch / combine latency and bandwidth: nccl_ep vs reference vs all_to_all.

    torchrun --nproc-per-node=4 benchmarks/bench_dispatch_combine.py [--csv out.csv]

For each shape (tokens per rank, hidden, top_k, experts; bf16) the same routing
runs through

* ``nccl_ep``   te_ep_torch's NCCL EP backend (``EpGroup(backend="nccl_ep")``),
* ``reference`` te_ep_torch's torch.distributed backend on the same NCCL group,
* ``all_to_all`` the baseline a user would write (TorchTitan style): permute
  (token, expert) pairs by expert, exchange per-expert counts with
  ``all_to_all_single``, ``.tolist()`` the splits, ``all_to_all_single`` the
  rows, regroup expert-major; combine is the reverse plus a scatter-add.

Dispatch time includes the routing exchange (``prepare`` for te_ep, the count
exchange for the baseline). For the te_ep backends two more rows split it:
``prepare`` (the routing exchange alone) and ``dispatch_op`` (the dispatch op on
already-prepared routing: the token transport, whose NVLink figure is the one
to hold against the copy bandwidth). Each iteration starts after a barrier and a device
synchronisation and is timed with CUDA events; a row reports the median over
iterations of the slowest rank.

Bandwidth follows DeepEP's convention: a token sent to a rank counts once per
destination rank, however many of that rank's experts it goes to.
``logical GB/s`` = all bytes a rank receives (its own tokens included) / time;
``NVLink GB/s`` = bytes received from other ranks / time, averaged over ranks.
``% copy`` relates the NVLink figure to a plain GPU-to-GPU copy measured in the
same run (one peer copy, cuda:0 -> cuda:1, one direction); all-to-all receives
from several peers at once, so it can exceed 100%.

``--nccl-ep-env SPEC ...`` times nccl_ep once per environment setting in the
same run (e.g. ``default TE_EP_NCCL_EP_SMS=32 NCCL_EP_HT_EM_LOCAL_DUP=1``): each
variable is set while that variant's group is created, when te_ep and NCCL EP
read it. Each new NCCL EP configuration compiles its kernels on first use.

NVLink multicast is never used: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are the defaults.
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    top_k: int
    experts: int

    def label(self) -> str:
        return f"T={self.tokens} H={self.hidden} K={self.top_k} E={self.experts}"


SHAPES = {
    "main": Shape(4096, 7168, 8, 256),
    "small": Shape(1024, 7168, 8, 256),
    "large": Shape(16384, 7168, 8, 256),
    "top2": Shape(4096, 4096, 2, 256),
}


@dataclass
class Routing:
    topk_idx: torch.Tensor  # [T, K] int64, on the device
    topk_weights: torch.Tensor  # [T, K] float32
    tokens: torch.Tensor  # [T, H] bf16
    recv_rows: int  # (token, local expert) pairs this rank receives
    recv_bytes: int  # DeepEP convention: (token, destination rank) pairs * row bytes
    recv_bytes_remote: int  # the same, from other ranks only


def make_routing(shape: Shape, rank: int, world: int, device: torch.device) -> Routing:
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    scores = torch.rand(shape.tokens, shape.experts, generator=gen)
    topk_idx = scores.topk(shape.top_k, dim=1).indices
    topk_weights = torch.rand(shape.tokens, shape.top_k, generator=gen) + 0.5
    tokens = torch.randn(shape.tokens, shape.hidden, generator=gen).to(DTYPE)

    local = shape.experts // world
    dest_rank = topk_idx // local
    # Per destination: (token, expert) pairs, and tokens counted once per rank.
    pairs = torch.bincount(dest_rank.flatten(), minlength=world)
    unique_tokens = torch.zeros(world, dtype=torch.int64)
    for r in range(world):
        unique_tokens[r] = (dest_rank == r).any(dim=1).sum()
    stats = torch.stack([pairs, unique_tokens]).to(device)
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    row_bytes = shape.hidden * DTYPE.itemsize
    recv_rows = sum(int(g[0, rank]) for g in gathered)
    recv_tokens = [int(g[1, rank]) for g in gathered]
    return Routing(
        topk_idx=topk_idx.to(device),
        topk_weights=topk_weights.to(device),
        tokens=tokens.to(device),
        recv_rows=recv_rows,
        recv_bytes=sum(recv_tokens) * row_bytes,
        recv_bytes_remote=(sum(recv_tokens) - recv_tokens[rank]) * row_bytes,
    )


def median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median of barrier-aligned iterations; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    result = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result.item())


def peer_copy_gbps(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> Optional[float]:
    """One-direction cuda:i -> cuda:i+1 copy bandwidth, measured by rank 0 alone."""
    value = torch.zeros(1, device=device)
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=peer)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        torch.cuda.synchronize(peer)
        value[0] = nbytes * iters / (start.elapsed_time(end) * 1e-3) / 1e9
        del src, dst
        torch.cuda.empty_cache()
    dist.broadcast(value, src=0)
    return float(value.item()) or None


# ---- backends -----------------------------------------------------------------


class TeEpBackend:
    """te_ep_torch through its public API (EpGroup / ep_dispatch / ep_combine)."""

    def __init__(self, name: str, shape: Shape, routing: Routing, capacity: int, alignment: int) -> None:
        import te_ep_torch as te

        self.te = te
        self.group = te.EpGroup(num_experts=shape.experts, max_tokens_per_rank=shape.tokens, backend=name)
        self.handle = self.group.create_handle(
            top_k=shape.top_k, hidden=shape.hidden, dtype=DTYPE, alignment=alignment, capacity=capacity
        )
        self.routing = routing
        self.expert_out = None

    def dispatch(self):
        r = self.routing
        out = self.te.ep_dispatch(self.handle, r.tokens, r.topk_idx, r.topk_weights)
        self.expert_out = out.tokens
        return out

    def combine(self):
        return self.te.ep_combine(self.handle, self.expert_out, self.routing.tokens.shape[0])

    def prepare_only(self):
        return self.handle.prepare(self.routing.topk_idx)

    def dispatch_only(self):
        """The dispatch op alone on the prepared routing: the transport itself."""
        r, h = self.routing, self.handle
        return self.te.ops.dispatch(
            r.tokens, r.topk_weights, h.handle_mem, self.group.group_name, h.id, h.config.capacity
        )

    def close(self) -> None:
        self.expert_out = None
        self.group.shutdown()


class AllToAllBaseline:
    """Dispatch/combine written with all_to_all_single, as in TorchTitan."""

    def __init__(self, shape: Shape, routing: Routing, world: int) -> None:
        self.shape, self.routing, self.world = shape, routing, world
        self.local = shape.experts // world
        self.state = None

    def dispatch(self):
        r, shape, world, local = self.routing, self.shape, self.world, self.local
        flat = r.topk_idx.flatten()
        order = torch.argsort(flat, stable=True)
        send = r.tokens.index_select(0, order // shape.top_k)
        counts = torch.bincount(flat, minlength=shape.experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        send_splits = counts.view(world, local).sum(1).tolist()
        recv_splits = recv_counts.view(world, local).sum(1).tolist()
        recv = send.new_empty(sum(recv_splits), shape.hidden)
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        # Rows arrive grouped by (source rank, local expert); regroup by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=recv.device).repeat(world), recv_counts.view(-1), output_size=recv.shape[0]
        )
        regroup = torch.argsort(expert_of_row, stable=True)
        expert_major = recv.index_select(0, regroup)
        self.state = (order, send_splits, recv_splits, regroup, expert_major)
        return expert_major

    def combine(self):
        order, send_splits, recv_splits, regroup, expert_out = self.state
        shape = self.shape
        back = torch.empty_like(expert_out)
        back.index_copy_(0, regroup, expert_out)
        returned = expert_out.new_empty(sum(send_splits), shape.hidden)
        dist.all_to_all_single(returned, back, send_splits, recv_splits)
        out = torch.zeros(shape.tokens, shape.hidden, dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, order // shape.top_k, returned.float())
        return out.to(DTYPE)

    def close(self) -> None:
        self.state = None


# ---- driver -------------------------------------------------------------------


def fit_capacity(routing: Routing, shape: Shape, world: int, alignment: int, worst_case: bool) -> int:
    local = shape.experts // world
    if worst_case:
        return world * shape.tokens * min(shape.top_k, local) + local * (alignment - 1)
    need = torch.tensor([routing.recv_rows], device="cuda")
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    # 10% headroom, as a capacity factor would give; padding on top.
    return max(shape.tokens, math.ceil(int(need.item()) * 1.1) + local * (alignment - 1))


def backend_variants(args) -> List[tuple]:
    """(row label, backend, environment of the variant) for each timed variant."""
    out = []
    for name in args.backends:
        if name == "nccl_ep" and args.nccl_ep_env:
            out += [(f"nccl_ep[{spec}]" if spec != "default" else "nccl_ep", name, parse_env(spec))
                    for spec in args.nccl_ep_env]
        else:
            out.append((name, name, {}))
    return out


def parse_env(spec: str) -> Dict[str, str]:
    """'default' or 'NAME=VALUE[,NAME=VALUE...]' -> {NAME: VALUE}."""
    if spec == "default":
        return {}
    env = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--nccl-ep-env: expected NAME=VALUE[,NAME=VALUE...] or 'default', got {spec!r}")
        env[name] = value
    return env


@contextlib.contextmanager
def env_setting(env: Dict[str, str]):
    """Set env while the variant's EpGroup is created (NCCL EP and te_ep read it then)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_shape(shape: Shape, args, world: int, rank: int, device: torch.device, copy_gbps) -> List[Dict]:
    routing = make_routing(shape, rank, world, device)
    capacity = fit_capacity(routing, shape, world, args.alignment, args.worst_case_capacity)
    rows = []
    times = {}
    parts = {}
    for name, backend_name, env in backend_variants(args):
        if backend_name == "all_to_all":
            backend = AllToAllBaseline(shape, routing, world)
        else:
            with env_setting(env):
                backend = TeEpBackend(backend_name, shape, routing, capacity, args.alignment)
        with torch.no_grad():
            t_dispatch = median_ms(backend.dispatch, args.warmup, args.iters)
            backend.dispatch()
            t_combine = median_ms(backend.combine, args.warmup, args.iters)
            if backend_name != "all_to_all":
                # Split dispatch into its routing exchange and the token transport.
                parts[name] = (
                    median_ms(backend.prepare_only, args.warmup, args.iters),
                    median_ms(backend.dispatch_only, args.warmup, args.iters),
                )
        backend.close()
        del backend
        torch.cuda.empty_cache()
        times[name] = (t_dispatch, t_combine)

    volumes = torch.tensor([routing.recv_bytes, routing.recv_bytes_remote], dtype=torch.float64, device=device)
    dist.all_reduce(volumes)
    logical_bytes, remote_bytes = (float(v) / world for v in volumes.tolist())
    baseline = times.get("all_to_all")
    for name, (t_d, t_c) in times.items():
        row = {"shape": shape.label(), "backend": name, "capacity": capacity if name != "all_to_all" else ""}
        ops = [("dispatch", t_d, baseline and baseline[0]), ("combine", t_c, baseline and baseline[1])]
        if name in parts:
            ops += [("prepare", parts[name][0], None), ("dispatch_op", parts[name][1], None)]
        for op, t, base in ops:
            nvlink = remote_bytes / (t * 1e-3) / 1e9
            row[f"{op}_ms"] = t
            row[f"{op}_logical_GBps"] = logical_bytes / (t * 1e-3) / 1e9
            row[f"{op}_nvlink_GBps"] = nvlink
            row[f"{op}_pct_copy"] = 100.0 * nvlink / copy_gbps if copy_gbps else float("nan")
            row[f"{op}_speedup_vs_a2a"] = base / t if base else float("nan")
        rows.append(row)
    return rows


def print_table(rows: List[Dict], copy_gbps) -> None:
    print(f"\nGPU-to-GPU copy (cuda:0 -> cuda:1, one direction): {copy_gbps or float('nan'):.1f} GB/s")
    width = max([len("backend")] + [len(row["backend"]) for row in rows])
    header = (
        f"{'shape':<30} {'backend':<{width}} {'op':<11} {'ms':>8} {'logical GB/s':>13} {'NVLink GB/s':>12} "
        f"{'% copy':>7} {'x a2a':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        for op in ("dispatch", "combine", "prepare", "dispatch_op"):
            if op + "_ms" not in row:
                continue
            print(
                f"{row['shape']:<30} {row['backend']:<{width}} {op:<11} {row[op + '_ms']:>8.3f} "
                f"{row[op + '_logical_GBps']:>13.1f} {row[op + '_nvlink_GBps']:>12.1f} "
                f"{row[op + '_pct_copy']:>7.1f} {row[op + '_speedup_vs_a2a']:>6.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["nccl_ep", "reference", "all_to_all"],
                        choices=["nccl_ep", "reference", "all_to_all"])
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (the first compiles NCCL EP kernels)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--alignment", type=int, default=1, help="per-expert zone alignment of te_ep handles")
    parser.add_argument("--worst-case-capacity", action="store_true",
                        help="size te_ep receive buffers for the worst case instead of this routing + 10%%")
    parser.add_argument("--nccl-ep-env", nargs="+", default=None, metavar="SPEC",
                        help="time nccl_ep once per SPEC: 'default', or NAME=VALUE[,NAME=VALUE...] set while its "
                             "group is created (e.g. TE_EP_NCCL_EP_SMS=32 or NCCL_EP_HT_EM_LOCAL_DUP=1); "
                             "rows are labelled nccl_ep[SPEC]")
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()

    copy_gbps = peer_copy_gbps(device)
    rows = []
    for key in args.shapes:
        shape = SHAPES[key]
        if rank == 0:
            print(f"running {shape.label()} ...", flush=True)
        rows += run_shape(shape, args, world, rank, device, copy_gbps)

    if rank == 0:
        print_table(rows, copy_gbps)
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                fields = list(dict.fromkeys(k for row in rows for k in row))
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
