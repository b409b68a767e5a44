"""Expert-parallel MoE forward + backward under torchrun.

    torchrun --nproc-per-node=2 examples/moe_train.py            # CPU, gloo, reference backend
    torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) examples/moe_train.py   # GPUs, NCCL

Each rank owns num_experts / world_size experts. A step routes every rank's
tokens with a learned top-k router, dispatches them to the experts' ranks,
runs the local experts, combines the weighted outputs back and regresses
them onto a fixed random teacher MoE; the loss goes down.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_ep_torch as te


class ExpertParallelMoE(torch.nn.Module):
    """Router -> ep_dispatch -> local SwiGLU experts -> ep_combine."""

    def __init__(self, group: te.EpGroup, hidden: int, ffn: int, top_k: int, dtype: torch.dtype, alignment: int):
        super().__init__()
        self.group = group
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, group.num_experts, bias=False, dtype=torch.float32)
        e_local = group.num_local_experts
        scale = hidden**-0.5
        self.w_gate = torch.nn.Parameter(torch.randn(e_local, hidden, ffn, dtype=dtype) * scale)
        self.w_up = torch.nn.Parameter(torch.randn(e_local, hidden, ffn, dtype=dtype) * scale)
        self.w_down = torch.nn.Parameter(torch.randn(e_local, ffn, hidden, dtype=dtype) * ffn**-0.5)
        self.handle = group.create_handle(top_k=top_k, hidden=hidden, dtype=dtype, alignment=alignment)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x.float()).softmax(dim=-1)
        topk_weights, topk_idx = scores.topk(self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = te.ep_dispatch(self.handle, x, topk_idx, topk_weights)
        # Row r of the receive buffer belongs to the zone whose end offset is the
        # first one above r; rows past the last zone are padding and stay zero.
        ends = out.expert_counts.cumsum(0)
        rows = torch.arange(out.tokens.shape[0], device=x.device)
        expert = torch.bucketize(rows, ends, right=True).clamp(max=self.group.num_local_experts - 1)
        h = out.tokens[:, None, :]
        act = F.silu(torch.bmm(h, self.w_gate[expert])) * torch.bmm(h, self.w_up[expert])
        y = torch.bmm(act, self.w_down[expert]).squeeze(1)
        y = y * out.weights[:, None].to(y.dtype)
        return te.ep_combine(self.handle, y, x.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--alignment", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="auto", choices=te.BACKENDS)
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    torch.manual_seed(1234 + rank)

    group = te.EpGroup(
        num_experts=args.experts_per_rank * world, max_tokens_per_rank=args.tokens, backend=args.backend
    )
    model = ExpertParallelMoE(group, args.hidden, args.ffn, args.top_k, dtype, args.alignment).to(device)
    teacher = torch.randn(args.hidden, args.hidden, device=device) * args.hidden**-0.5
    # The router is replicated: average its gradient so all ranks stay in sync.
    for p in model.router.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"world={world} device={device} backend={group.backend} dtype={dtype} experts={group.num_experts}")

    first = last = None
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, device=device)
        target = torch.tanh(x @ teacher)
        y = model(x.to(dtype))
        loss = F.mse_loss(y.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.router.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg = avg.item() / world
        first = avg if first is None else first
        last = avg
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}/{args.steps}  loss {avg:.5f}")
    elapsed = time.perf_counter() - start
    if rank == 0:
        tok_s = args.steps * args.tokens / elapsed
        print(f"loss {first:.5f} -> {last:.5f} in {elapsed:.1f}s ({tok_s:.0f} tokens/s per rank)")
    group.shutdown()
    # Gloo aborts a rank whose peer tore its connections down first.
    dist.barrier()
    dist.destroy_process_group()
    if last >= first:
        raise SystemExit(f"loss did not go down: {first} -> {last}")


if __name__ == "__main__":
    main()
