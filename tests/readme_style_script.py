"""A script shaped like README's example, run by tests/test_clean_exit.py under torchrun's
environment: dispatch, experts, combine and backward on gloo, a result checked across the
ranks with a collective of the user's own, then shut down and leave as README ends.

``--keep-alive``: skip ``group.shutdown()`` and keep the group, the handle and their outputs
referenced until exit, as a script that forgets to shut down does, and the benchmarks'
yardsticks (te_ep_torch.testing's blocks, native and te_ep) with them; then check that
``dist.destroy_process_group()`` still destroyed the process group (nothing of te_ep keeps it,
or gloo's worker threads, alive into the interpreter's finalization).
"""

import sys
import weakref

import torch
import torch.distributed as dist

import te_ep_torch as te

keep_alive = "--keep-alive" in sys.argv[1:]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
E, H, K, T = 8, 32, 2, 16
group = te.EpGroup(num_experts=E, max_tokens_per_rank=T)
handle = group.create_handle(top_k=K, hidden=H, dtype=torch.float32, alignment=4)
router = te.TopKRouter(H, E, K, aux_loss_coef=0.01)
router.process_group = dist.group.WORLD
w = (torch.randn(group.num_local_experts, H, H) * H**-0.5).requires_grad_()

x = torch.randn(T, H, requires_grad=True)
routing = router(x)
out = te.ep_dispatch(handle, x, routing.topk_idx, routing.topk_weights)
y = torch._grouped_mm(out.tokens, w, offs=out.expert_counts.cumsum(0, dtype=torch.int32))
y = te.ep_combine(handle, y * out.weights[:, None], T)
(y.square().mean() + routing.aux_loss).backward()

check = torch.stack([y.detach().abs().sum(), x.grad.abs().sum(), w.grad.abs().sum()])
print(f"rank {rank}: {check.tolist()}", flush=True)
# The last collective is one of the script's own, on tensors it made (a Python tensor
# finished by a gloo worker thread), with nothing after it that waits: the case that aborted.
dist.all_reduce(check)
assert bool(torch.isfinite(check).all()) and bool((check > 0).all()), check

if keep_alive:
    from te_ep_torch.testing.moe_blocks import MoEConfig, NativeMoEBlock, TeEpMoEBlock

    config = MoEConfig(hidden=H, ffn=H, num_experts=E, top_k=K, dtype=torch.float32)
    blocks = [NativeMoEBlock(config, device="cpu"), TeEpMoEBlock(config, group, alignment=4)]
    block_outputs = [block(x.detach()) for block in blocks]
    torch.stack([o.sum() for o in block_outputs]).sum().backward()

pg = weakref.ref(dist.group.WORLD)
if not keep_alive:
    group.shutdown()
dist.destroy_process_group()
if keep_alive:
    assert pg() is None, "dist.destroy_process_group() left the process group alive: something still holds it"
