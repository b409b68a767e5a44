"""One process, one GPU, EP size 1: drives the nccl_ep watchdog (csrc/watchdog/core/watchdog.h).

    python3 tests/gpu/_watchdog_case.py stall|steps [--timeout S] [--stall S]

``stall``: a few good steps, then a GPU kernel that spins for ``--stall`` seconds
(``torch.cuda._sleep``) queued ahead of a ``prepare`` and a ``dispatch`` on the same stream:
to the watchdog this looks exactly like a peer that never arrives (their markers stay
pending). With TE_EP_WATCHDOG unset the process must end with exit code 70 about
``--timeout`` seconds after the prepare was launched, long before the spin ends; with
``warn`` it prints the message once and runs to the end; with ``off`` it stays silent.

``steps``: good steps only, the limit short; nothing may fire, and every marker must be
retired once the GPU is idle.

``capture``: while markers are pending (a spinning kernel ahead of a ``prepare``), the main
thread captures a CUDA graph in torch's default (global) capture mode for longer than a few
polls: the watchdog thread's event queries must not invalidate that capture.

Prints ``STATE <json>`` lines (watchdog state, timestamps) and ``DONE`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import te_ep_torch as te  # noqa: E402

T, H, E, K = 256, 1024, 8, 2


def state(tag: str, **extra) -> None:
    action, pending, fired = te.ops.watchdog_state()
    print("STATE " + json.dumps({"tag": tag, "action": action, "pending": pending, "fired": fired,
                                 "t": time.monotonic(), **extra}), flush=True)


def cycles_per_second() -> float:
    """GPU clock cycles per second as torch.cuda._sleep counts them (measured)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 200_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=("stall", "steps", "capture"))
    p.add_argument("--timeout", type=float, default=1.0, help="EpGroup(timeout=...), seconds")
    p.add_argument("--stall", type=float, default=8.0, help="seconds the GPU spins ahead of the watched ops")
    args = p.parse_args()

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    group = te.EpGroup(num_experts=E, max_tokens_per_rank=T, backend="nccl_ep", timeout=args.timeout)
    handle = group.create_handle(top_k=K, hidden=H, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
    idx = torch.stack([torch.randperm(E, device=device, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=device, generator=gen)

    def step():
        out = te.ep_dispatch(handle, x, idx, w)
        return te.ep_combine(handle, out.tokens * out.weights[:, None].to(out.tokens.dtype), T)

    for _ in range(3):
        y = step()
    torch.cuda.synchronize()
    expected = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(y, expected, atol=0.05, rtol=0.02)
    time.sleep(0.5)  # two polls: every marker of the good steps retired
    state("after_good_steps", mode=handle.mode)

    if args.case == "stall":
        rate = cycles_per_second()
        torch.cuda._sleep(int(args.stall * rate))
        state("stall_queued", stall_s=args.stall)
        handle.prepare(idx)  # queued behind the spin: its marker stays pending
        state("watched_op_launched")
        torch.cuda.synchronize()  # here the host waits, as it would on a lost peer
        state("gpu_idle")
        time.sleep(0.5)
        y = step()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, expected, atol=0.05, rtol=0.02)
        time.sleep(0.5)  # two polls: the markers of that step retired
    elif args.case == "capture":
        rate = cycles_per_second()
        torch.cuda._sleep(int(args.stall * rate))
        handle.prepare(idx)  # its marker stays pending while the graph is captured
        state("watched_op_launched")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        a = torch.ones(1024, device=device)
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):  # capture_error_mode "global", torch's default
                b = a
                for _ in range(5):
                    b = b * 2
                    time.sleep(0.1)  # about five polls of the watchdog during the capture
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(b, torch.full_like(a, 32.0)), b[:4]
        state("captured", pending_during=True)
        time.sleep(0.5)
    else:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        time.sleep(0.5)
    state("end")
    group.shutdown()
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
