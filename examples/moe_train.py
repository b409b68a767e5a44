"""Train a small MoE transformer with expert parallelism x FSDP2 under torchrun.

    torchrun --nproc-per-node=2 examples/moe_train.py                 # CPU: gloo, reference backend
    torchrun --nproc-per-node=4 examples/moe_train.py --ep 2          # EP 2 x FSDP dp 2
    torchrun --nproc-per-node=2 examples/moe_train.py --ep 1 --load DIR   # resume on another layout
    torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) examples/moe_train.py   # GPUs: NCCL, nccl_ep
    torchrun --nproc-per-node=4 examples/moe_train.py --check         # compare with one process

The model: token + position embeddings, ``--layers`` blocks of causal self-attention
and a te_ep_torch MoE layer (top-k router, SwiGLU experts), an LM head. The data: each
sequence is an arithmetic progression modulo the vocabulary with a random start and
a random stride in [1, 4], so after two tokens the rest is predictable and the loss
falls well below ln(vocab).

Parallelism: a (dp, ep) mesh over all ranks. Each MoE layer keeps num_experts / ep
experts per rank and dispatches tokens over its EP group (te_ep_torch.parallel.
ExpertParallel); FSDP2 shards experts over dp and everything else over all ranks, with
the gradient scaling of te_ep_torch.parallel.apply_fsdp. Every rank reads its own
slice of one global batch. At the end the model and optimizer are saved with
torch.distributed.checkpoint (``--ckpt-dir``, by default a new directory per run) with the
model's arguments next to it (``moe_train_args.json``); ``--load`` resumes from such a
checkpoint, whatever (dp, ep) layout wrote it, with the model arguments it was written
with (a different value given on the command line is an error).

``--check`` first runs one forward/backward of the distributed model and of an
unsharded copy on one process (no parallelism: local permutation, no FSDP) on the same
global batch, and compares the logits, the loss and every gradient. Tolerance: the
largest absolute difference of each tensor, divided by the largest absolute value of
the reference tensor, must be below 1e-4 in float32 and 5e-2 in bfloat16. A mismatch
exits non-zero (on every rank).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import te_ep_torch as te
from te_ep_torch.moe import MoE
from te_ep_torch.parallel import (
    init_moe_mesh,
    load_checkpoint,
    parallelize_moe_model,
    save_checkpoint,
    shutdown_ep_groups,
)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.hidden)
        self.attn = Attention(args.hidden, args.heads)
        self.moe_norm = nn.RMSNorm(args.hidden)
        self.moe = MoE(
            args.hidden,
            args.ffn,
            args.num_experts,
            args.top_k,
            score_func=args.score_func,
            expert_bias=args.expert_bias,
            aux_loss_coef=args.aux_loss_coef,
            shared_expert_ffn_hidden=args.shared_expert_ffn,
            dispatch_dtype="fp8" if args.fp8_dispatch else None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.pos = nn.Parameter(torch.randn(args.seq_len, args.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]].to(self.embed.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        losses = [b.moe.aux_loss for b in self.blocks if b.moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.head.weight.device)


def global_batch(step: int, args: argparse.Namespace, batch: int, device: torch.device):
    """The step's batch of all ranks: ``batch`` progressions of ``seq_len + 1`` tokens."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    start = torch.randint(0, args.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq_len + 1)) % args.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def loss_fn(model: MoETransformer, inputs: torch.Tensor, targets: torch.Tensor):
    logits = model(inputs)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return ce + model.aux_loss(), logits


class Progress:
    """A progress bar on a terminal (tqdm where installed, else a one-line text bar); where
    stdout is not a terminal (a log file, a pipe), only the periodic ``write`` lines. Silent
    off rank 0."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n = total, 0
        self.enabled = enabled
        self.interactive = enabled and sys.stdout.isatty()
        self.bar = None
        if self.interactive:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="train", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, loss: float) -> None:
        self.n += 1
        if not self.interactive:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)
            return
        width = 30
        done = width * self.n // self.total
        end = "\n" if self.n == self.total else ""
        bar = "#" * done + "." * (width - done)
        print(f"\rtrain [{bar}] {self.n}/{self.total} loss {loss:.4f}", end=end, flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            # A text bar in progress ends its line first.
            print(("\n" if self.interactive and 0 < self.n < self.total else "") + line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def check_against_single_process(model, reference, args, rank, world, device, dtype) -> bool:
    """One forward/backward of ``model`` (distributed) and ``reference`` (one process); compare."""
    batch = args.batch_size
    inputs, targets = global_batch(0, args, batch * world, device)
    sl = slice(rank * batch, (rank + 1) * batch)
    loss, logits = loss_fn(model, inputs[sl], targets[sl])
    loss.backward()
    ref_loss, ref_logits = loss_fn(reference, inputs, targets)
    ref_loss.backward()

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    rows = [("logits", relative_error(logits, ref_logits[sl])), ("loss", relative_error(mean_loss, ref_loss))]
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rows.append((f"grad {name}", relative_error(grad, ref_params[name].grad)))
    tol = TOLERANCE[dtype]
    bad = torch.tensor([sum(err > tol for _, err in rows)], device=device)
    dist.all_reduce(bad)
    if rank == 0:
        print(f"--check: {world} ranks vs one process, {dtype}, tolerance {tol:g} (max |diff| / max |ref|)")
        for name, err in rows:
            print(f"  {'FAIL' if err > tol else 'ok  '} {err:.2e}  {name}")
        print(f"--check: {'passed' if bad.item() == 0 else f'FAILED ({bad.item()} mismatches over all ranks)'}")
    model.zero_grad(set_to_none=True)
    return bad.item() == 0


DEFAULT_EXPERTS = 8
# What shapes the model's state: a checkpoint loads only into a model built with the same values.
MODEL_ARGS = ("vocab", "hidden", "ffn", "heads", "layers", "seq_len", "num_experts", "top_k", "score_func",
              "expert_bias", "shared_expert_ffn")
MODEL_ARGS_FILE = "moe_train_args.json"


def resolve_layout(args: argparse.Namespace, world: int) -> None:
    """Fills in ``args.dp`` / ``args.ep`` (dp x ep = world), or exits naming what does not fit."""
    for flag, value in (("--ep", args.ep), ("--dp", args.dp)):
        if value is not None and (value < 1 or world % value):
            raise SystemExit(f"{flag} ({value}) must divide the number of ranks ({world})")
    if args.ep is None:
        args.ep = world // args.dp if args.dp is not None else world
    if args.dp is None:
        args.dp = world // args.ep
    if args.dp * args.ep != world:
        raise SystemExit(f"--dp ({args.dp}) x --ep ({args.ep}) must equal the number of ranks ({world})")


def read_model_args(path: str) -> Optional[dict]:
    """The model arguments saved with the checkpoint at ``path`` (None for one without them)."""
    try:
        with open(os.path.join(path, MODEL_ARGS_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_model_args(path: str, args: argparse.Namespace) -> None:
    with open(os.path.join(path, MODEL_ARGS_FILE), "w") as f:
        json.dump({name: getattr(args, name) for name in MODEL_ARGS}, f, indent=1)


def resolve_model_args(args: argparse.Namespace, saved: Optional[dict]) -> None:
    """The expert count (the checkpoint's, or the default), and a clear exit when the
    command line asks for another model than the checkpoint holds. The default does not
    depend on --ep, so a checkpoint loads into any layout."""
    if args.num_experts is None:
        if saved is not None:
            args.num_experts = saved["num_experts"]
        else:
            multiple = math.lcm(args.ep, te.group.NCCL_EP_EXPERT_MULTIPLE)
            args.num_experts = -(-DEFAULT_EXPERTS // multiple) * multiple
    if saved is not None:
        differ = [f"--{name.replace('_', '-')} {saved[name]} (checkpoint) vs {getattr(args, name)} (this run)"
                  for name in MODEL_ARGS if name in saved and saved[name] != getattr(args, name)]
        if differ:
            raise SystemExit(f"--load {args.load}: the checkpoint holds another model: " + "; ".join(differ))
    if args.num_experts % args.ep:
        raise SystemExit(f"--num-experts ({args.num_experts}) must be divisible by --ep ({args.ep})")


def checkpoint_dir(args: argparse.Namespace, rank: int) -> str:
    """``--ckpt-dir``, or a new directory per run (named by rank 0, so every rank writes to it)."""
    if args.ckpt_dir:
        return args.ckpt_dir
    name = [tempfile.mkdtemp(prefix=f"te_ep_moe_train_{time.strftime('%Y%m%d-%H%M%S')}_") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128, help="inner width of each expert")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=None,
                   help=f"default: {DEFAULT_EXPERTS} (rounded up to a multiple of --ep and of "
                        f"{te.group.NCCL_EP_EXPERT_MULTIPLE}, which nccl_ep needs); with --load, the checkpoint's")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--score-func", default="softmax", choices=("softmax", "sigmoid"))
    p.add_argument("--expert-bias", action="store_true", help="aux-loss-free balancing bias, updated every step")
    p.add_argument("--aux-loss-coef", type=float, default=1e-2)
    p.add_argument("--shared-expert-ffn", type=int, default=0, help="inner width of a shared expert (0: none)")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="dispatch tokens to the experts as block-scaled FP8 (e4m3, a float32 scale per 128 values); "
                        "needs --hidden a multiple of 128 (512 on nccl_ep)")
    p.add_argument("--ep", type=int, default=None, help="EP size (default: all ranks, or ranks / --dp)")
    p.add_argument("--dp", type=int, default=None, help="FSDP size sharding the experts (default: ranks / --ep)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default="auto", choices=te.BACKENDS)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (auto: bfloat16 on GPUs, float32 on CPU); parameters stay float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with a single-process run first (see above)")
    p.add_argument("--ckpt-dir", default=None,
                   help="where to save the final checkpoint (default: a new directory under the temp dir)")
    p.add_argument("--no-save", action="store_true", help="skip the final checkpoint")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from")
    args = p.parse_args()
    if args.fp8_dispatch and args.hidden % 128:
        p.error(f"--fp8-dispatch scales blocks of 128 values: --hidden must be a multiple of 128, got {args.hidden}")
    return args


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
        args.dtype, torch.bfloat16 if use_cuda else torch.float32
    )

    resolve_layout(args, world)
    resolve_model_args(args, read_model_args(args.load) if args.load else None)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = MoETransformer(args).to(device)
    reference = copy.deepcopy(model) if args.check else None

    mesh = init_moe_mesh(device.type, dp=args.dp, ep=args.ep)
    mp_policy = None
    if dtype != torch.float32:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    parallelize_moe_model(
        model,
        mesh,
        max_tokens_per_rank=args.batch_size * args.seq_len,
        options=te.EpOptions(backend=args.backend),
        blocks=model.blocks,
        mp_policy=mp_policy,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ep_group = model.blocks[0].moe.ep_group
    if rank == 0:
        print(
            f"ranks={world} (dp={args.dp} x ep={args.ep}) device={device.type} backend={ep_group.backend} "
            f"dtype={dtype} experts={args.num_experts} ({ep_group.num_local_experts}/rank) top_k={args.top_k} "
            f"tokens/rank/step={args.batch_size * args.seq_len}",
            flush=True,
        )
    if args.load:
        load_checkpoint(args.load, model, opt)
        if rank == 0:
            print(f"loaded checkpoint {args.load}", flush=True)

    ok = True
    if args.check:
        # The single-process copy gets the distributed model's weights (loaded ones included).
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        reference.load_state_dict(full)
        reference.to(dtype)
        ok = check_against_single_process(model, reference, args, rank, world, device, dtype)
        del reference

    losses = []
    progress = Progress(args.steps, enabled=rank == 0)
    start = time.perf_counter()
    sl = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    for step in range(args.steps):
        inputs, targets = global_batch(step + 1, args, args.batch_size * world, device)
        loss, _ = loss_fn(model, inputs[sl], targets[sl])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.expert_bias:
            for block in model.blocks:
                block.moe.update_expert_bias()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
        progress.update(losses[-1])
        if step % max(1, args.steps // 6) == 0 or step == args.steps - 1:
            progress.write(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}")
    progress.close()
    elapsed = time.perf_counter() - start

    if not args.no_save:
        path = checkpoint_dir(args, rank)
        if rank == 0 and os.path.exists(os.path.join(path, ".metadata")):
            print(f"overwriting the checkpoint in {path}", flush=True)
        with warnings.catch_warnings():
            # Said once above, instead of by DCP once per rank.
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            save_checkpoint(path, model, opt)
        if rank == 0:
            write_model_args(path, args)
            print(f"saved checkpoint (torch.distributed.checkpoint) to {path}", flush=True)

    if rank == 0 and losses:
        n = min(5, len(losses))
        head, tail = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(
            f"loss: mean of the first {n} steps {head:.4f} -> mean of the last {n} steps {tail:.4f} "
            f"(ln(vocab) = {math.log(args.vocab):.4f}) in {elapsed:.1f}s, "
            f"{args.steps * args.batch_size * args.seq_len / max(elapsed, 1e-9):.0f} tokens/s/rank",
            flush=True,
        )
    went_down = len(losses) < 10 or sum(losses[-5:]) < sum(losses[:5])

    shutdown_ep_groups()
    # Gloo aborts a rank whose peer tore its connections down first.
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        return 1
    if not went_down:
        print(f"loss did not go down: {losses[:5]} -> {losses[-5:]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is shut down and written by now. Leave without Python's finalization:
    # torch's DTensor keeps the device meshes it has seen (and their process groups, and gloo's
    # worker threads) alive after dist.destroy_process_group(), and a worker still releasing a
    # finished collective's tensors, which needs the GIL, while the interpreter finalizes
    # aborts the process ("terminate called without an active exception", SIGABRT). te_ep's own
    # objects hold no process group; a script without DTensor (README's API example) exits
    # normally. An exception from main() still takes the normal path, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
