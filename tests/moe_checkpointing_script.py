"""Run by tests/test_moe_checkpointing.py at 2 ranks: the MoE layer under activation
checkpointing against the plain layer, two training steps each, over gloo."""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import te_ep_torch as te
from te_ep_torch.moe import MoE

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layer = MoE(32, 64, 8, 2, aux_loss_coef=0.01)
group = te.EpGroup(num_experts=8, max_tokens_per_rank=24)
# This rank's experts as plain tensors (no DTensor: torch's DTensor keeps process groups alive
# past destroy_process_group, and this script exits through the interpreter's finalization).
lo, hi = rank * group.num_local_experts, (rank + 1) * group.num_local_experts
for name in ("w_gate", "w_up", "w_down"):
    setattr(layer.experts, name, nn.Parameter(getattr(layer.experts, name)[lo:hi].detach().clone()))
layer.enable_expert_parallel(group)
layer.router.process_group = dist.group.WORLD
torch.manual_seed(1 + rank)
x0 = torch.randn(24, 32)


results, loads = {}, {}
for checkpointed in (False, True):
    layer.zero_grad(set_to_none=True)
    layer.reset_expert_load()
    got = []
    for step in range(2):
        x = (x0 + step).requires_grad_()
        y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        (y.square().mean() + layer.aux_loss).backward()
        got += [y.detach(), x.grad]
    results[checkpointed] = got + [p.grad.clone() for p in layer.parameters()]
    loads[checkpointed] = layer.read_expert_load()

for i, (plain, ckpt) in enumerate(zip(results[False], results[True])):
    assert torch.equal(plain, ckpt), f"rank {rank}: tensor {i} differs under activation checkpointing"
assert torch.equal(loads[True], 2 * loads[False]), (loads[False], loads[True])  # recomputation counts again
print(f"rank {rank}: checkpointed == plain", flush=True)
group.shutdown()
dist.destroy_process_group()
