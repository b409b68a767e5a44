"""Fine-tune a Hugging Face transformers MoE model with expert parallelism x FSDP2 on te_ep.

    torchrun --nproc-per-node=2 examples/hf_moe_finetune.py                   # CPU: gloo, reference backend
    torchrun --nproc-per-node=4 examples/hf_moe_finetune.py --ep 2            # EP 2 x FSDP 4
    torchrun --nproc-per-node=2 examples/hf_moe_finetune.py --impl all        # every way in, tokens/s of each
    torchrun --nproc-per-node=8 examples/hf_moe_finetune.py --model mixtral   # GPUs: NCCL, nccl_ep
    torchrun --nproc-per-node=8 examples/hf_moe_finetune.py --pretrained Qwen/Qwen3-30B-A3B ...

The model: by default a tiny model of a transformers MoE family (``--model``: qwen3_moe,
mixtral, gpt_oss, deepseek_v3) built from a config written below, with random weights
(the same on every rank); ``--pretrained NAME_OR_PATH`` loads a real checkpoint with
``from_pretrained`` instead. The data: each sequence is an arithmetic progression modulo
the vocabulary with a random start and stride, so after two tokens the rest is
predictable and the loss falls well below ln(vocab) within a few dozen steps.

Parallelism (``--impl``, comma-separated; each trains the same model from the same weights
on the same batches, and prints its tokens/s):

* ``te_ep`` (transformers >= 5.23, the default there): transformers shards the model
  itself, ``DistributedConfig(fsdp_size=W, ep_size=--ep, ep_implementation="te_ep")``: its
  EP plan splits the experts over the EP ranks, FSDP2 shards the rest, and te_ep's dispatch
  and combine (registered by importing te_ep_torch.integrations.transformers, options
  through ``register_te_ep``) bring each MoE layer's tokens to its experts;
* ``all_to_all`` (>= 5.23): the same with transformers' own ``ep_implementation="all_to_all"``
  (two all-to-alls per layer, the split sizes read back to the host);
* ``parallelize_hf_moe`` (any transformers from 5.17, the default before 5.23):
  ``parallelize_hf_moe(model, mesh, ...)`` on a ``(dp, ep)`` mesh, te_ep's own sharding.

Either way the model's own router decides, and every rank trains on its own slice of one
global batch with the model's own loss (``labels=``). At the end each run saves the model
and optimizer with torch.distributed.checkpoint under ``--ckpt-dir``/<impl>, which any
layout or the unsharded model loads back (docs/transformers.md).
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
from te_ep_torch.integrations.transformers import (HAS_EP_REGISTRY, expert_parallel_modules, parallelize_hf_moe,
                                                   register_te_ep)
from te_ep_torch.parallel import init_moe_mesh, load_checkpoint, save_checkpoint, shutdown_ep_groups

# The ways in (--impl): transformers' DistributedConfig with te_ep or its own all_to_all
# (>= 5.23), and te_ep's parallelize_hf_moe (any version).
REGISTRY_IMPLS = ("te_ep", "all_to_all")
IMPLS = REGISTRY_IMPLS + ("parallelize_hf_moe",)


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
    p.add_argument("--impl", default=None,
                   help=f"comma-separated, of {list(IMPLS)}, or 'all' (those this transformers has); default te_ep "
                        "on transformers >= 5.23, else parallelize_hf_moe")
    p.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"))
    p.add_argument("--pretrained", default=None,
                   help="from_pretrained name or path of a transformers MoE checkpoint (instead of --model); the "
                        "te_ep and all_to_all ways in load it with distributed_config=, which needs accelerate")
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
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="te_ep's capacity_factor (default: the worst case, which no routing overflows)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (auto: bfloat16 on GPUs, float32 on CPU); parameters stay float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None,
                   help="where to save the final checkpoints, one folder per --impl (default: a temp dir)")
    p.add_argument("--no-save", action="store_true", help="skip the final checkpoint")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from (any layout)")
    args = p.parse_args()
    available = IMPLS if HAS_EP_REGISTRY else ("parallelize_hf_moe",)
    if args.impl is None:
        args.impls = ["te_ep" if HAS_EP_REGISTRY else "parallelize_hf_moe"]
    elif args.impl == "all":
        args.impls = list(available)
    else:
        args.impls = [i for i in args.impl.split(",") if i]
        unknown = [i for i in args.impls if i not in IMPLS]
        if unknown or not args.impls:
            p.error(f"--impl: unknown {unknown or args.impl!r}; choose from {list(IMPLS)} or 'all'")
        missing = [i for i in args.impls if i not in available]
        if missing:
            p.error(f"--impl {','.join(missing)}: needs transformers >= 5.23 (DistributedConfig(ep_implementation=)); "
                    "use --impl parallelize_hf_moe")
    return args


def build_model(impl: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The model of ``--model`` / ``--pretrained``, sharded the ``impl`` way (same initial weights every time)."""
    from transformers import AutoModelForCausalLM

    world = dist.get_world_size()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if impl in REGISTRY_IMPLS:
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=world, ep_size=args.ep, ep_implementation=impl,
                                   fsdp_mixed_precision=dtype != torch.float32)
        if args.pretrained:
            return AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32,
                                                        distributed_config=config).train()
        # from_config takes no distributed_config: the two steps from_pretrained takes around
        # its init (meshes, then the EP plan and FSDP2) on the model built here.
        model = AutoModelForCausalLM.from_config(tiny_config(args.model, args)).to(device).train()
        cls = type(model)
        config, _, meshes = cls.prepare_distribute_model(config)
        return cls.maybe_distribute_model(model, config, meshes)
    if args.pretrained:
        # Every rank reads the checkpoint; parallelize_hf_moe keeps each rank's own slice of
        # the experts (src_data_rank=None below), so nothing is scattered.
        model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.model, args))
    model.to(device).train()
    mp_policy = None
    if dtype != torch.float32:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    mesh = init_moe_mesh(device.type, dp=world // args.ep, ep=args.ep)
    return parallelize_hf_moe(model, mesh, max_tokens_per_rank=args.batch_size * args.seq_len,
                              options=te.EpOptions(backend=args.backend, capacity_factor=args.capacity_factor),
                              mp_policy=mp_policy,
                              src_data_rank=None if args.pretrained else 0)


def train(impl: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """``--steps`` steps of ``impl``: its losses and its tokens/s (all ranks, after the first step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(impl, args, device, dtype)
    if args.pretrained:  # the data are progressions modulo the checkpoint's vocabulary
        args.vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if args.load:
        load_checkpoint(args.load, model, opt)
        if rank == 0:
            print(f"[{impl}] loaded checkpoint {args.load}", flush=True)
    losses = []
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == 1:
            # The first step makes te_ep's handles (collective setup): not timed.
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        tokens = global_batch(step, args, args.batch_size * world, device)[rows]
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
        if step == 0 and rank == 0:
            experts = expert_parallel_modules(model)
            where = "transformers' all_to_all (no te_ep group)"
            if experts:
                group = experts[0][1].te_ep.group
                where = (f"te_ep backend={group.backend} experts={group.num_experts} ({group.num_local_experts}/rank)"
                         f" in {len(experts)} MoE layers")
            print(f"[{impl}] {type(model).__name__}: ranks={world} (ep={args.ep}) device={device.type} dtype={dtype} "
                  f"{where}; tokens/rank/step={args.batch_size * args.seq_len}", flush=True)
        if rank == 0 and (step % max(1, args.steps // 8) == 0 or step == args.steps - 1):
            print(f"[{impl}] step {step:4d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    timed_steps = max(args.steps - 1, 1)
    if not args.no_save:
        path = os.path.join(args.ckpt_dir or os.path.join(tempfile.gettempdir(), "te_ep_hf_moe_finetune_ckpt"), impl)
        save_checkpoint(path, model, opt)
        if rank == 0:
            print(f"[{impl}] saved checkpoint (torch.distributed.checkpoint) to {path}", flush=True)
    head, tail = losses[:min(5, len(losses))], losses[-min(5, len(losses)):]
    went_down = len(losses) >= 10 and sum(tail) < 0.8 * sum(head)
    tokens_per_s = timed_steps * args.batch_size * args.seq_len * world / elapsed
    if rank == 0 and losses:
        print(f"[{impl}] loss {sum(head) / len(head):.4f} -> {sum(tail) / len(tail):.4f} (ln(vocab) = "
              f"{math.log(args.vocab):.4f}) in {elapsed:.1f}s; {tokens_per_s:,.0f} tokens/s; "
              f"{'loss went down' if went_down else 'loss did not go down'}", flush=True)
    shutdown_ep_groups()
    return {"ok": went_down or len(losses) < 10, "tokens_per_s": tokens_per_s,
            "loss": sum(tail) / len(tail) if tail else math.nan}


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
    if "te_ep" in args.impls:
        # DistributedConfig carries no te_ep options: they are registered with the name.
        register_te_ep(max_tokens_per_rank=args.batch_size * args.seq_len,
                       options=te.EpOptions(backend=args.backend, capacity_factor=args.capacity_factor))
    results = {impl: train(impl, args, device, dtype) for impl in args.impls}
    if rank == 0:
        print(f"\n{'impl':<20}{'tokens/s':>14}{'final loss':>12}  ({world} ranks, {device.type}, "
              f"{args.batch_size * args.seq_len} tokens/rank/step, steps 1 to {args.steps - 1} timed)")
        for impl, r in results.items():
            print(f"{impl:<20}{r['tokens_per_s']:>14,.0f}{r['loss']:>12.4f}", flush=True)
    # Gloo aborts a rank whose peer tore its connections down first.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results.values()) else 2


if __name__ == "__main__":
    code = main()
    # Everything is shut down and written by now; leave without Python's finalization, where
    # a gloo worker thread still releasing a finished collective can abort the process
    # (examples/moe_train.py has the details).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
