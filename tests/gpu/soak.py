"""Long-run check on GPUs: many training steps, no memory growth, no hang.

    torchrun --nproc-per-node=4 tests/gpu/soak.py --steps 1000 [--backend nccl_ep]

Trains a small MoE layer (router -> ep_dispatch -> per-expert linear ->
ep_combine) for --steps steps with two layers of different top_k / hidden
interleaved, then shuts the group down, re-creates it and runs more steps.
Fails (non-zero exit) if allocated CUDA memory after the warm-up differs from
the end of the run, if any step takes longer than --step-timeout seconds, or
if the loss is not finite. Prints `N passed, M failed` last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

# A script torchrun starts: the repository root (an in-place build) first on the import path,
# as tests/gpu/run_suite.py puts it, so that every part of run_all.sh tests this tree rather
# than whatever te_ep_torch the environment holds.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import te_ep_torch as te  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self, group: te.EpGroup, hidden: int, top_k: int, alignment: int) -> None:
        super().__init__()
        self.group, self.top_k = group, top_k
        self.router = torch.nn.Linear(hidden, group.num_experts, bias=False, device="cuda")
        self.w = torch.nn.Parameter(
            torch.randn(group.num_local_experts, hidden, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        )
        self.handle = group.create_handle(top_k=top_k, hidden=hidden, dtype=torch.bfloat16, alignment=alignment)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.router(x.float()).softmax(-1).topk(self.top_k, dim=-1)
        out = te.ep_dispatch(self.handle, x, idx, weights)
        ends = out.expert_counts.cumsum(0)
        rows = torch.arange(out.tokens.shape[0], device=x.device)
        expert = torch.bucketize(rows, ends, right=True).clamp(max=self.group.num_local_experts - 1)
        y = torch.bmm(out.tokens[:, None, :], self.w[expert]).squeeze(1) * out.weights[:, None].to(x.dtype)
        return te.ep_combine(self.handle, y, x.shape[0])


def run(backend: str, steps: int, tokens: int, step_timeout: float, nccl_ep_mode: str) -> tuple[bool, list[str]]:
    rank = dist.get_rank()
    group = te.EpGroup(num_experts=8 * dist.get_world_size(), max_tokens_per_rank=tokens, backend=backend,
                       nccl_ep_mode=nccl_ep_mode)
    a = Layer(group, hidden=256, top_k=4, alignment=16)
    b = Layer(group, hidden=512, top_k=2, alignment=8)
    proj_in = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    params = list(a.parameters()) + list(b.parameters()) + list(proj_in.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    failures = []
    mem_after_warmup = None
    worst = 0.0

    def train_step(step: int) -> float:
        # Token count varies per step and rank, as with real batches.
        x = torch.randn(tokens - (step % 7) * (rank + 1), 256, device="cuda", dtype=torch.bfloat16)
        loss = b(proj_in(a(x))).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for step in range(steps):
        t0 = time.perf_counter()
        loss = train_step(step)
        if not torch.isfinite(torch.tensor(loss)):
            failures.append(f"step {step}: loss is {loss}")
            break
        worst = max(worst, time.perf_counter() - t0)
        if worst > step_timeout:
            failures.append(f"step {step} took {worst:.1f}s (> {step_timeout}s)")
            break
        if step == 20:
            torch.cuda.synchronize()
            mem_after_warmup = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    mem_end = torch.cuda.memory_allocated()
    if mem_after_warmup is not None and mem_end != mem_after_warmup:
        failures.append(f"allocated memory grew: {mem_after_warmup} B after warm-up, {mem_end} B at the end")
    group.shutdown()
    if rank == 0:
        print(f"{backend}: {steps} steps, slowest step {worst * 1e3:.1f} ms, memory {mem_after_warmup} -> {mem_end} B")
    return len(failures) == 0, failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--backend", default="nccl_ep", choices=te.BACKENDS)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--nccl-ep-mode", default=te.DEFAULT_NCCL_EP_MODE, choices=te.group.NCCL_EP_MODES)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    torch.manual_seed(dist.get_rank())

    results = []
    ok, failures = run(args.backend, args.steps, args.tokens, args.step_timeout, args.nccl_ep_mode)
    results.append(("soak", ok, failures))
    # Shutdown and re-initialisation in one process, then a shorter run.
    ok, failures = run(args.backend, max(50, args.steps // 10), args.tokens, args.step_timeout, args.nccl_ep_mode)
    results.append(("re-init", ok, failures))

    flags = torch.tensor([int(ok) for _, ok, _ in results], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    passed = int(flags.sum())
    if dist.get_rank() == 0:
        for (name, _, failures), flag in zip(results, flags.tolist()):
            print(f"{'PASS' if flag else 'FAIL'} {name}" + "".join(f"\n  {f}" for f in failures))
        print(f"{passed} passed, {len(results) - passed} failed")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
