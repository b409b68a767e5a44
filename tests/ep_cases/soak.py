"""A long run: many training steps, no memory growth, no hang.

`case_soak` trains a small MoE layer (router -> ep_dispatch -> per-expert linear ->
ep_combine) for ``steps`` steps with two layers of different top_k / hidden interleaved and
token counts that vary per step and rank, then shuts the group down, creates it again and
runs a tenth as many steps (at least 50). Fails if a loss is not finite, if a step takes
longer than ``step_timeout`` seconds, or, on CUDA, if the allocated memory after the warm-up
(step 20) differs from the end of the run.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import te_ep_torch as te

WARMUP_STEPS = 20


class _Layer(torch.nn.Module):
    def __init__(self, group: te.EpGroup, hidden: int, top_k: int, alignment: int, device, dtype) -> None:
        super().__init__()
        self.group, self.top_k = group, top_k
        self.router = torch.nn.Linear(hidden, group.num_experts, bias=False, device=device)
        self.w = torch.nn.Parameter(
            torch.randn(group.num_local_experts, hidden, hidden, device=device, dtype=dtype) * hidden**-0.5)
        self.handle = group.create_handle(top_k=top_k, hidden=hidden, dtype=dtype, alignment=alignment)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.router(x.float()).softmax(-1).topk(self.top_k, dim=-1)
        out = te.ep_dispatch(self.handle, x, idx, weights)
        ends = out.expert_counts.cumsum(0)
        rows = torch.arange(out.tokens.shape[0], device=x.device)
        expert = torch.bucketize(rows, ends, right=True).clamp(max=self.group.num_local_experts - 1)
        y = torch.bmm(out.tokens[:, None, :], self.w[expert]).squeeze(1) * out.weights[:, None].to(x.dtype)
        return te.ep_combine(self.handle, y, x.shape[0])


def _run(ctx, steps: int, tokens: int, step_timeout: float) -> list:
    """The run's failures (empty: it passed)."""
    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    # bf16 on GPUs, as in training; float32 on CPU, where bf16 matmuls are slow
    dtype = torch.bfloat16 if cuda else torch.float32
    rank = ctx.rank
    group = te.EpGroup(num_experts=8 * ctx.world_size, max_tokens_per_rank=tokens, backend=ctx.backend,
                       device=device, **ctx.group_options())
    a = _Layer(group, 256, 4, 16, device, dtype)
    b = _Layer(group, 512, 2, 8, device, dtype)
    proj_in = torch.nn.Linear(256, 512, device=device, dtype=dtype)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()) + list(proj_in.parameters()), lr=1e-3)
    failures = []
    mem_after_warmup = None
    worst = 0.0
    def train_step(step: int) -> float:
        # Token count varies per step and rank, as with real batches. The step's tensors die
        # with this frame: the memory reads below see only what outlives a step (parameters,
        # gradients, handles), whatever the last batch's size.
        x = torch.randn(tokens - (step % 7) * (rank + 1), 256, device=device, dtype=dtype)
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
        if step == WARMUP_STEPS and cuda:
            torch.cuda.synchronize()
            mem_after_warmup = torch.cuda.memory_allocated()
    if cuda:
        torch.cuda.synchronize()
        mem_end = torch.cuda.memory_allocated()
        if mem_after_warmup is not None and mem_end != mem_after_warmup:
            failures.append(f"allocated memory grew: {mem_after_warmup} B after warm-up, {mem_end} B at the end")
    group.shutdown()
    return failures


def case_soak(ctx, steps: int, tokens: int = 512, step_timeout: float = 60.0) -> None:
    torch.manual_seed(ctx.rank)
    failures = {"soak": _run(ctx, steps, tokens, step_timeout)}
    # Shutdown and re-initialisation in one process, then a shorter run.
    failures["re-init"] = _run(ctx, max(50, steps // 10), tokens, step_timeout)
    # Every rank learns whether any failed, so they all fail the same run together.
    flags = torch.tensor([int(not f) for f in failures.values()], device=ctx.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    bad = [name for name, flag in zip(failures, flags.tolist()) if not flag]
    assert not bad, f"{bad} failed on some rank; here: {failures}"
