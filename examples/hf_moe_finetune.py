"""Fine-tune a Hugging Face transformers MoE model with expert parallelism x FSDP2 on te_ep.

    torchrun --nproc-per-node=2 examples/hf_moe_finetune.py                   # CPU: gloo, reference backend
    torchrun --nproc-per-node=4 examples/hf_moe_finetune.py --ep 2            # EP 2 x FSDP dp 2
    torchrun --nproc-per-node=8 examples/hf_moe_finetune.py --model mixtral   # GPUs: NCCL, nccl_ep
    torchrun --nproc-per-node=8 examples/hf_moe_finetune.py --pretrained Qwen/Qwen3-30B-A3B ...

The model: by default a tiny model of a transformers MoE family (``--model``: qwen3_moe,
mixtral, gpt_oss, deepseek_v3) built from a config written below, with random weights
(the same on every rank); ``--pretrained NAME_OR_PATH`` loads a real checkpoint with
``from_pretrained`` instead. The data: each sequence is an arithmetic progression modulo
the vocabulary with a random start and stride, so after two tokens the rest is
predictable and the loss falls well below ln(vocab) within a few dozen steps.

Parallelism: one call, ``parallelize_hf_moe(model, mesh, ...)`` on a ``(dp, ep)`` mesh:
each MoE layer keeps ``num_experts / ep`` experts per rank and sends its tokens to them
with te_ep's dispatch and combine (the model's own router decides), FSDP2 shards the
experts over ``dp`` and everything else over all ranks. Every rank trains on its own
slice of one global batch with the model's own loss (``labels=``). At the end the
model and optimizer are saved with torch.distributed.checkpoint (``--ckpt-dir``), which
any ``(dp, ep)`` layout or the unsharded model loads back (docs/transformers.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import te_ep_torch as te
from te_ep_torch.integrations.transformers import expert_parallel_modules, parallelize_hf_moe
from te_ep_torch.parallel import init_moe_mesh, load_checkpoint, save_checkpoint, shutdown_ep_groups


def tiny_config(family: str, args: argparse.Namespace):
    """A small config of a transformers MoE family (two layers, ``--num-experts`` experts, top-2)."""
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=args.top_k,
                  max_position_embeddings=max(64, args.seq_len))
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=args.num_experts, moe_intermediate_size=args.ffn,
                                           intermediate_size=2 * args.ffn, norm_topk_prob=True, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=args.num_experts, intermediate_size=args.ffn, **common)
    if family == "gpt_oss":
        # Its YaRN rope checks max_position_embeddings against its original 4096 positions.
        return transformers.GptOssConfig(num_local_experts=args.num_experts, intermediate_size=args.ffn,
                                         **dict(common, max_position_embeddings=131072))
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            n_routed_experts=args.num_experts, n_group=1, topk_group=1, n_shared_experts=1,
            moe_intermediate_size=args.ffn, intermediate_size=2 * args.ffn, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            **dict(common, num_key_value_heads=4))
    raise ValueError(f"unknown --model {family!r}")


def global_batch(step: int, args: argparse.Namespace, batch: int, device: torch.device) -> torch.Tensor:
    """The step's batch of all ranks: ``batch`` progressions of ``seq_len`` tokens."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    start = torch.randint(0, args.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    return ((start + stride * torch.arange(args.seq_len)) % args.vocab).to(device)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"))
    p.add_argument("--pretrained", default=None,
                   help="from_pretrained name or path of a transformers MoE checkpoint (instead of --model)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=64, help="inner width of each expert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=None, help="default: 4 per EP rank")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", type=int, default=None, help="EP size (default: all ranks)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default="auto", choices=te.BACKENDS)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (auto: bfloat16 on GPUs, float32 on CPU); parameters stay float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="where to save the final checkpoint (default: a temp dir)")
    p.add_argument("--no-save", action="store_true", help="skip the final checkpoint")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from (any (dp, ep) layout)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if use_cuda else torch.float32)
    args.ep = args.ep or world
    if world % args.ep:
        raise SystemExit(f"--ep ({args.ep}) must divide the number of ranks ({world})")
    args.num_experts = args.num_experts or 4 * args.ep

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)  # same initial weights on every rank
    if args.pretrained:
        # Every rank reads the checkpoint; parallelize_hf_moe keeps each rank's own slice of
        # the experts (src_data_rank=None below), so nothing is scattered.
        model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
        args.vocab = model.config.vocab_size
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.model, args))
    model.to(device).train()

    mesh = init_moe_mesh(device.type, dp=world // args.ep, ep=args.ep)
    mp_policy = None
    if dtype != torch.float32:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    parallelize_hf_moe(model, mesh, max_tokens_per_rank=args.batch_size * args.seq_len, backend=args.backend,
                       mp_policy=mp_policy, src_data_rank=None if args.pretrained else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    experts = expert_parallel_modules(model)
    group = experts[0][1].te_ep.group
    if rank == 0:
        print(f"{type(model).__name__}: ranks={world} (dp={world // args.ep} x ep={args.ep}) device={device.type} "
              f"backend={group.backend} dtype={dtype} MoE layers={len(experts)} experts={group.num_experts} "
              f"({group.num_local_experts}/rank) tokens/rank/step={args.batch_size * args.seq_len}", flush=True)
    if args.load:
        load_checkpoint(args.load, model, opt)
        if rank == 0:
            print(f"loaded checkpoint {args.load}", flush=True)

    losses = []
    start = time.perf_counter()
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    for step in range(args.steps):
        tokens = global_batch(step, args, args.batch_size * world, device)[rows]
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
        if rank == 0 and (step % max(1, args.steps // 8) == 0 or step == args.steps - 1):
            print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    if not args.no_save:
        path = args.ckpt_dir or os.path.join(tempfile.gettempdir(), "te_ep_hf_moe_finetune_ckpt")
        save_checkpoint(path, model, opt)
        if rank == 0:
            print(f"saved checkpoint (torch.distributed.checkpoint) to {path}", flush=True)
    head, tail = losses[:min(5, len(losses))], losses[-min(5, len(losses)):]
    went_down = len(losses) >= 10 and sum(tail) < 0.8 * sum(head)
    if rank == 0 and losses:
        print(f"loss {sum(head) / len(head):.4f} -> {sum(tail) / len(tail):.4f} (ln(vocab) = "
              f"{math.log(args.vocab):.4f}) in {elapsed:.1f}s; "
              f"{'loss went down' if went_down else 'loss did not go down'}", flush=True)
    shutdown_ep_groups()
    # Gloo aborts a rank whose peer tore its connections down first.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if went_down or len(losses) < 10 else 2


if __name__ == "__main__":
    code = main()
    # Everything is shut down and written by now; leave without Python's finalization, where
    # a gloo worker thread still releasing a finished collective can abort the process
    # (examples/moe_train.py has the details).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
