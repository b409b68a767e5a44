"""Worker bodies of tests/test_transformers.py: transformers MoE models on te_ep vs the unsharded model.

Every case builds a tiny transformers model from a config written here (nothing is
downloaded) twice with the same weights: the reference runs transformers' own ``"eager"``
experts (its per-expert loop: the ground truth of the model's maths) in one process on
every rank's batch; the other is made expert-parallel by
``te_ep_torch.integrations.transformers.parallelize_hf_moe`` and runs this rank's batch.
The bodies take a ``Ctx`` (tests/_dist.py) and run on CPU/gloo in the worker pools;
tests/gpu/transformers_gpu.py runs ``case_parity`` on CUDA with ``nccl_ep``.
``case_registry_parity`` takes transformers' own way in instead (>= 5.23): its sharding
(``DistributedConfig(fsdp_size=W, ep_size=ep, ep_implementation="te_ep")``, EP plan and
FSDP2), with the experts run by the ``EPImplementation`` te_ep registers.

Gradients: rank ``r`` computes ``L_r``, the model's own loss (mean cross-entropy) on
its batch; the reference is ``L = (1/W) sum_r L_r`` on the unsharded model (every rank
has the same token count, so that is the loss of the concatenated batch). With FSDP2 on a
``(dp, ep)`` mesh every gradient is ``dL/dp`` already; with expert parallelism alone
(a process group or a 1-D mesh), a dense gradient is ``dL_r/dp`` (summed over the ranks
here, as data parallelism would) and an expert's is ``sum_r dL_r/dw`` (the combine's
backward brings every rank's loss gradient back); both are divided by ``W``. transformers'
sharding averages over the FSDP ranks itself, so there every gradient is ``dL/dp`` too.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import transformers
from transformers import AutoModelForCausalLM

from te_ep_torch.integrations.transformers import expert_parallel_modules, parallelize_hf_moe, register_te_ep
from te_ep_torch.options import EpOptions
from te_ep_torch.parallel import init_moe_mesh, load_checkpoint, save_checkpoint

VOCAB, HIDDEN, BATCH, SEQ = 64, 32, 2, 8
TOKENS = BATCH * SEQ
REFERENCE = EpOptions(backend="reference")
EP_FIELDS = {f.name for f in dataclasses.fields(EpOptions)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, max_position_embeddings=64, initializer_range=0.2, num_experts_per_tok=2)


def make_config(family: str):
    """A tiny config of ``family`` (8 experts, top-2, two layers, hidden 32)."""
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=16, intermediate_size=48,
                                           norm_topk_prob=True, **_COMMON)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=8, intermediate_size=16, **_COMMON)
    if family == "gpt_oss":
        # Its YaRN rope checks max_position_embeddings against its original 4096 positions.
        return transformers.GptOssConfig(num_local_experts=8, intermediate_size=16,
                                         **dict(_COMMON, max_position_embeddings=131072))
    if family == "deepseek_v3":
        # Layer 0 dense, layer 1 MoE: sigmoid router with a score-correction bias, 2 groups
        # of 4 experts of which each token picks 1 (so at EP 2 a token's two experts are on
        # one rank), normalised and scaled weights, one shared expert.
        common = dict({k: v for k, v in _COMMON.items() if k != "head_dim"}, num_key_value_heads=4)
        return transformers.DeepseekV3Config(
            n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=16,
            intermediate_size=48, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common)
    if family == "olmoe":
        return transformers.OlmoeConfig(num_experts=8, intermediate_size=16, **_COMMON)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(num_experts=8, moe_intermediate_size=16, intermediate_size=48,
                                           shared_expert_intermediate_size=24, **_COMMON)
    if family == "nemotron_h":
        # Experts without a gate (up_proj, relu2, down_proj), an attention and an MoE layer.
        return transformers.NemotronHConfig(
            layers_block_type=["attention", "moe"], n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1,
            **{k: v for k, v in _COMMON.items() if k != "num_hidden_layers"})
    raise ValueError(f"unknown family {family!r}")


def _steer(model, scenario: str, ep: int) -> None:
    """Routing of a scenario through the model's own score bias (DeepSeek-V3's
    ``e_score_correction_bias``): "uneven" keeps every choice off the last EP rank's experts,
    so that rank receives no token at all."""
    if scenario == "random":
        return
    if scenario != "uneven":
        raise ValueError(f"unknown scenario {scenario!r}")
    biases = [m for name, m in model.named_buffers() if name.endswith("e_score_correction_bias")]
    if not biases:
        raise ValueError("scenario 'uneven' needs a router score bias (deepseek_v3)")
    for bias in biases:
        local = bias.shape[0] // ep
        bias.zero_()
        bias[(ep - 1) * local:] = -10.0


def build(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, scenario: str = "random", ep: int = 1):
    """``(reference, model)``: the same weights, each with its own config; the reference on ``"eager"`` experts."""
    config = make_config(family)
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="eager")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in ref.named_parameters():
            if name.endswith("bias"):  # transformers initialises biases to zero: make them count
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        _steer(ref, scenario, ep)
    ref.to(dtype)
    for name, b in ref.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="eager")
    model.to(dtype)
    model.load_state_dict(ref.state_dict())
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    return ref, model


def batch(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _against_reference(ctx, model, ref, ids, out, names):
    """The unsharded reference's step on every rank's batch (its loss the mean over ranks, as the
    sharded step's gradients are), and the logits and loss differences of ``out`` from it."""
    ref_losses, ref_logits = [], None
    for r, x in enumerate(ids):
        o = ref(x, labels=x)
        ref_losses.append(o.loss)
        if r == ctx.rank:
            ref_logits = o.logits.detach().float()
    (torch.stack(ref_losses).sum() / len(ids)).backward()

    diffs = {"logits": _diff(out.logits.detach().float(), ref_logits),
             "loss": _diff(out.loss.detach().float().reshape(1), ref_losses[ctx.rank].detach().float().reshape(1))}
    params = dict(model.named_parameters())
    if sorted(params) != sorted(names):
        raise AssertionError(f"parameter names changed: {sorted(set(params) ^ set(names))}")
    return diffs, params


def _diff(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    return {"max_abs": (a - b).abs().max().item() if a.numel() else 0.0,
            "ref_max": b.abs().max().item() if b.numel() else 0.0}


def _expert_counts(ref, ids: List[torch.Tensor]) -> Dict[str, List[int]]:
    """Choices per expert of every MoE layer of the reference on the batches ``ids`` (the scenario's routing)."""
    counts: Dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, output):
            top_k_index = args[1]
            c = torch.bincount(top_k_index.reshape(-1), minlength=module.num_experts)
            counts[name] = counts.get(name, 0) + c
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in ref.named_modules()
               if type(m).__name__.endswith("Experts")]
    with torch.no_grad():
        for x in ids:
            ref(x)
    for h in handles:
        h.remove()
    return {name: c.tolist() for name, c in counts.items()}


def case_parity(ctx, *, family: str, layout: str, ep: Optional[int] = None, dtype: str = "float32",
                scenario: str = "random", checkpointing: bool = False):
    """Logits, loss and every gradient of the expert-parallel model vs the unsharded one.

    ``layout``: ``"group"`` (the default process group), ``"mesh1d"`` (a 1-D EP mesh) or
    ``"fsdp"`` (a ``(W / ep, ep)`` mesh: EP x FSDP2, bfloat16 parameters under
    ``dtype="bfloat16"``, float32 reduction); ``checkpointing``: transformers' activation
    checkpointing on. Returns ``{"diffs": {tensor: {max_abs,
    ref_max}}, "counts": {layer: [E]}, "handles": [repr], "impls": [str], "ep": ep}``.
    """
    W = ctx.world_size
    ep = ep or W
    torch_dtype = _DTYPES[dtype]
    fsdp = layout == "fsdp"
    device = torch.device(ctx.device)
    # Under FSDP2 the parameters are kept in float32 and computed in bfloat16 (mp_policy).
    ref, model = build(family, dtype=torch_dtype, scenario=scenario, ep=ep)
    ref.to(device)
    model.to(device)
    if fsdp and torch_dtype != torch.float32:
        model.to(torch.float32)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.data = b.data.float()
    names = [n for n, _ in ref.named_parameters()]

    kwargs = dict(max_tokens_per_rank=TOKENS, options=EpOptions(backend=ctx.backend))
    if layout == "group":
        parallelize_hf_moe(model, None, **kwargs)
    elif layout == "mesh1d":
        from torch.distributed.device_mesh import init_device_mesh

        parallelize_hf_moe(model, init_device_mesh(device.type, (W,), mesh_dim_names=("ep",)), **kwargs)
    elif layout == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch_dtype, reduce_dtype=torch.float32)
        parallelize_hf_moe(model, init_moe_mesh(device.type, dp=W // ep, ep=ep), mp_policy=mp, **kwargs)
    else:
        raise ValueError(f"unknown layout {layout!r}")

    if checkpointing:
        # transformers' activation checkpointing: each decoder layer (its MoE block included)
        # runs its forward again inside the backward, with the same routing.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = [batch(r).to(device) for r in range(W)]
    out = model(ids[ctx.rank], labels=ids[ctx.rank])
    out.loss.backward()

    diffs, params = _against_reference(ctx, model, ref, ids, out, names)
    for name, p_ref in ref.named_parameters():
        p = params[name]
        if p.grad is None or p_ref.grad is None:
            raise AssertionError(f"{name}: no gradient (ours {p.grad is None}, reference {p_ref.grad is None})")
        g = _full(p.grad)
        if not fsdp:
            if isinstance(p, DTensor):
                g = g / W
            else:
                dist.all_reduce(g)
                g = g / W
        diffs[name + ".grad"] = _diff(g, p_ref.grad.float())
        # The global weights the sharded model computes with are the reference's.
        diffs[name] = _diff(_full(p.data), p_ref.detach().float())
    experts = expert_parallel_modules(model)
    return {
        "diffs": diffs,
        "counts": _expert_counts(ref, ids),
        "handles": [repr(next(iter(m.te_ep.handles.values()))) for _, m in experts],
        "impls": [next(iter(m.te_ep.impls.values())) for _, m in experts],
        "placements": {name: [str(pl) for pl in p.placements] for name, p in model.named_parameters()
                       if isinstance(p, DTensor) and ".experts." in name},
        "ep": ep,
    }


# ---- torch.compile of one MoE block ------------------------------------------------------


def _moe_block(model, family: str):
    layer = model.model.layers[1]
    return layer.mlp


def case_compiled_block(ctx, *, family: str, compile_backend: str = "aot_eager", steps: int = 2):
    """``torch.compile(block, fullgraph=True)`` of layer 1's MoE block on te_ep vs the eager
    reference block; ``steps`` forward + backward on other inputs, one graph.

    Returns per step the diffs of the output, the input gradient and every parameter
    gradient of the block, and the graphs dynamo compiled in that step.
    """
    from torch._dynamo.utils import counters

    W = ctx.world_size
    ref, model = build(family)
    parallelize_hf_moe(model, None, max_tokens_per_rank=TOKENS, options=REFERENCE)
    ref_block, block = _moe_block(ref, family), _moe_block(model, family)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=compile_backend, fullgraph=True)
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step)
        xs = [torch.randn(BATCH, SEQ, HIDDEN, generator=gen) for _ in range(W)]
        w = torch.linspace(-1.0, 1.0, TOKENS * HIDDEN).view(BATCH, SEQ, HIDDEN)
        for p in list(block.parameters()) + list(ref_block.parameters()):
            p.grad = None
        graphs = counters["stats"]["unique_graphs"]
        x = xs[ctx.rank].clone().requires_grad_(True)
        y = compiled(x)
        y = y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores
        (y * w).sum().backward()
        new_graphs = counters["stats"]["unique_graphs"] - graphs
        ref_xs = [t.clone().requires_grad_(True) for t in xs]
        ref_ys = [ref_block(t) for t in ref_xs]
        ref_ys = [t[0] if isinstance(t, tuple) else t for t in ref_ys]
        sum((t * w).sum() for t in ref_ys).backward()
        diffs = {"output": _diff(y.detach(), ref_ys[ctx.rank].detach()),
                 "input_grad": _diff(x.grad, ref_xs[ctx.rank].grad)}
        ref_params = dict(ref_block.named_parameters())
        for name, p in block.named_parameters():
            g = _full(p.grad)
            if not isinstance(p, DTensor):
                dist.all_reduce(g)
            diffs[name + ".grad"] = _diff(g, ref_params[name].grad)
        out.append({"diffs": diffs, "new_graphs": new_graphs})
    torch._dynamo.reset()
    return {"steps": out}


# ---- checkpoints ---------------------------------------------------------------------------


def _global_state(model) -> Dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in model.state_dict().items()}


def case_save(ctx, *, family: str, path: str, ep: int):
    """EP x FSDP2 on a ``(W / ep, ep)`` mesh, one SGD step (weights no longer the initial ones), DCP save.

    Returns the global state dict written and the logits of a fixed batch after the step."""
    _, model = build(family, seed=1)
    parallelize_hf_moe(model, init_moe_mesh("cpu", dp=ctx.world_size // ep, ep=ep), max_tokens_per_rank=TOKENS,
                       options=REFERENCE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = batch(ctx.rank)
    model(x, labels=x).loss.backward()
    opt.step()
    save_checkpoint(path, model)
    with torch.no_grad():
        logits = model(batch(0)).logits.float()
    return {"state": _global_state(model), "logits": logits}


def case_load(ctx, *, family: str, path: str, layout: str):
    """Loads a ``case_save`` checkpoint into a model of other initial weights: expert-parallel
    over all ranks (``layout="ep"``, a 1-D EP layout, or ``"fsdp"``, a ``(1, W)`` mesh) or the
    unsharded model (``"unsharded"``, what turns a te_ep checkpoint back into a transformers one).

    Returns the global state dict and the logits of a fixed batch."""
    _, model = build(family, seed=7)
    if layout != "unsharded":
        mesh = None if layout == "ep" else init_moe_mesh("cpu", dp=1, ep=ctx.world_size)
        parallelize_hf_moe(model, mesh, max_tokens_per_rank=TOKENS, options=REFERENCE)
    load_checkpoint(path, model)
    with torch.no_grad():
        logits = model(batch(0)).logits.float()
    return {"state": _global_state(model), "logits": logits}


# ---- faults and refusals ---------------------------------------------------------------------


def case_bad_batch_one_rank(ctx):
    """A batch longer than max_tokens_per_rank on the last rank only: every rank raises in that
    forward (the ops' checks, agreed), none waits for the faulty one; then a good step works."""
    _, model = build("qwen3_moe")
    parallelize_hf_moe(model, None, max_tokens_per_rank=TOKENS, options=REFERENCE)
    last = ctx.rank == ctx.world_size - 1
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 3 if last else SEQ))
    try:
        model(x)
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        seen = {"type": type(exc).__name__, "message": str(exc)}
    else:
        seen = {"type": "none", "message": ""}
    ref, _ = build("qwen3_moe")
    x = batch(ctx.rank)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, atol=1e-5, rtol=1e-4)
    return seen


def case_refusals(ctx):
    """What parallelize_hf_moe refuses: returns ``{label: "Type: message"}`` of each refusal,
    and checks that a refused model is left untouched (no DTensor, implementation unchanged)."""
    from torch.distributed.device_mesh import init_device_mesh

    seen = {}

    def expect(label, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            seen[label] = f"{type(exc).__name__}: {exc}"
        else:
            seen[label] = "no error"

    def fresh(family="qwen3_moe", **overrides):
        config = make_config(family)
        for k, v in overrides.items():
            setattr(config, k, v)
        return AutoModelForCausalLM.from_config(config, experts_implementation="eager")

    opts = dict(max_tokens_per_rank=TOKENS, options=REFERENCE)
    keywords = dict(max_tokens_per_rank=TOKENS)  # a bad EP keyword is refused before its FutureWarning
    # num_experts not divisible by the EP size (here 2): 5 experts.
    five = fresh(num_experts=5)
    expect("indivisible", lambda: parallelize_hf_moe(five, None, **opts))
    untouched = (not any(isinstance(p, DTensor) for p in five.parameters())
                 and five.config._experts_implementation == "eager")
    # A dense model: nothing of the decorated kind.
    dense = AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    expect("no_experts", lambda: parallelize_hf_moe(dense, None, **opts))
    # Experts with a parameter te_ep can't shard or use (what quantized experts look like).
    extra = fresh()
    extra.model.layers[0].mlp.experts.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(8, 1)))
    expect("extra_param", lambda: parallelize_hf_moe(extra, None, **opts))
    # An interleaved gate/up layout that relies on transformers' default (concatenated) gate.
    interleaved = fresh()
    interleaved.model.layers[0].mlp.experts.is_concatenated = False
    expect("interleaved", lambda: parallelize_hf_moe(interleaved, None, **opts))
    # Experts kept as a list of modules (not of the decorated kind): they would stay replicated.
    listed = fresh()
    listed.model.layers[1].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(8)])
    expect("module_list", lambda: parallelize_hf_moe(listed, None, **opts))
    # Bad options, each naming its argument.
    model = fresh()
    for label, kwargs in {
        "max_tokens": dict(opts, max_tokens_per_rank=0),
        "backend": dict(keywords, backend="mpi"),
        "alignment": dict(opts, alignment=3),
        "capacity_factor": dict(keywords, capacity_factor=0.5),
        "overflow": dict(keywords, overflow="skip"),
        "expert_impl": dict(opts, expert_impl="fast"),
        "nccl_ep_mode": dict(keywords, nccl_ep_mode="fast"),
        "checks": dict(keywords, checks="strict"),
        "dtype": dict(opts, dtype=torch.int8),
        "fsdp_options_without_mesh": dict(opts, blocks=[]),
    }.items():
        expect(label, lambda kwargs=kwargs: parallelize_hf_moe(model, None, **kwargs))
    expect("mesh_dims", lambda: parallelize_hf_moe(
        model, init_device_mesh("cpu", (1, ctx.world_size), mesh_dim_names=("a", "b")), **opts))
    expect("mesh_type", lambda: parallelize_hf_moe(model, "ep", **opts))
    untouched = untouched and not any(isinstance(p, DTensor) for p in model.parameters())
    # Applied twice.
    twice = fresh()
    parallelize_hf_moe(twice, None, **opts)
    expect("twice", lambda: parallelize_hf_moe(twice, None, **opts))
    # A model sharing its config with an expert-parallel one runs te_ep without a handle.
    shared_config = AutoModelForCausalLM.from_config(twice.model.layers[0].mlp.experts.config)
    expect("not_parallelized", lambda: shared_config(batch(0)))
    return {"seen": seen, "untouched": untouched}


# ---- transformers' EP registry (>= 5.23): DistributedConfig(ep_implementation="te_ep") -------


def distribute(model, distributed_config):
    """transformers' own sharding of a built model: the two steps ``from_pretrained(...,
    distributed_config=)`` takes around its init (meshes, then the TP/EP plans and FSDP2),
    without its checkpoint loading (which needs accelerate's device_map); every rank built
    the same weights, so each keeps its slice."""
    cls = type(model)
    config, _, mesh_manager = cls.prepare_distribute_model(distributed_config)
    return cls.maybe_distribute_model(model, config, mesh_manager)


def _moe_layers(model) -> List[str]:
    return [name for name, m in model.named_modules() if type(m).__name__.endswith("Experts")]


def case_registry_parity(ctx, *, family: str, ep: Optional[int] = None, dtype: str = "float32",
                         scenario: str = "random", impl: str = "te_ep", options: Optional[dict] = None):
    """Logits, loss and every gradient of a model sharded by transformers with
    ``DistributedConfig(fsdp_size=W, ep_size=ep, ep_implementation=impl)`` vs the unsharded one.

    ``options``: register ``impl`` first with ``register_te_ep(impl, **options)`` (the EP
    options among them as ``options=EpOptions(...)``).
    ``dtype="bfloat16"``: bfloat16 parameters, compute and reduction, against the bfloat16
    reference. (Not ``fsdp_mixed_precision``: in transformers 5.24 its EP path, with
    ``"all_to_all"`` as with te_ep, moves the logits of these tiny models by up to a fifth
    of their range from the bfloat16 model's, while without EP it matches exactly.)
    Returns ``{"diffs", "counts", "layers": [experts module names], "states": {name:
    {handles, generations, capacity, impl}}, "made_before_forward": [names], "ep"}``.
    """
    from transformers.distributed import DistributedConfig

    W = ctx.world_size
    ep = ep or W
    torch_dtype = _DTYPES[dtype]
    device = torch.device(ctx.device)
    if options is not None:
        ep_fields = {k: v for k, v in options.items() if k in EP_FIELDS}
        register_te_ep(impl, **{k: v for k, v in options.items() if k not in EP_FIELDS},
                       options=EpOptions(**dict(ep_fields, backend=ctx.backend)))
    ref, model = build(family, dtype=torch_dtype, scenario=scenario, ep=ep)
    ref.to(device)
    model.to(device)
    names = [n for n, _ in ref.named_parameters()]
    model = distribute(model, DistributedConfig(fsdp_size=W, ep_size=ep, ep_implementation=impl))
    made_before_forward = [name for name, _ in expert_parallel_modules(model)]

    ids = [batch(r).to(device) for r in range(W)]
    out = model(ids[ctx.rank], labels=ids[ctx.rank])
    out.loss.backward()
    diffs, params = _against_reference(ctx, model, ref, ids, out, names)
    for name, p_ref in ref.named_parameters():
        p = params[name]
        if p.grad is None or p_ref.grad is None:
            raise AssertionError(f"{name}: no gradient (ours {p.grad is None}, reference {p_ref.grad is None})")
        diffs[name + ".grad"] = _diff(_full(p.grad), p_ref.grad.float())
        diffs[name] = _diff(_full(p.data), p_ref.detach().float())
    states = {}
    for name, m in expert_parallel_modules(model):
        handles = list(m.te_ep.handles.values())
        states[name] = {"handles": [repr(h) for h in handles], "generations": [h.generation for h in handles],
                        "capacity": [h.config.capacity for h in handles],
                        "worst_case": m.te_ep.group.worst_case_capacity(m.te_ep.top_k, handles[0].config.alignment),
                        "max_tokens_per_rank": m.te_ep.group.max_tokens_per_rank,
                        "impls": sorted(set(m.te_ep.impls.values()))}
    return {"diffs": diffs, "counts": _expert_counts(ref, ids), "layers": _moe_layers(model), "states": states,
            "made_before_forward": made_before_forward, "ep": ep}


def case_registry_refusals(ctx):
    """What ``ep_implementation="te_ep"`` refuses when transformers shards a model: returns
    ``{label: "Type: message"}``."""
    from transformers.distributed import DistributedConfig

    W = ctx.world_size
    seen = {}

    def expect(label, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            seen[label] = f"{type(exc).__name__}: {exc}"
        else:
            seen[label] = "no error"

    def fresh(family="qwen3_moe", **overrides):
        config = make_config(family)
        for k, v in overrides.items():
            setattr(config, k, v)
        return AutoModelForCausalLM.from_config(config)

    # Tensor-parallel ranks share one batch; te_ep expects a batch per EP rank.
    expect("tp", lambda: distribute(fresh(), DistributedConfig(tp_size=W, ep_size=W, ep_implementation="te_ep")))
    # Experts with a parameter te_ep does not know (what quantized experts look like).
    extra = fresh()
    extra.model.layers[0].mlp.experts.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(8, 1)))
    expect("extra_param", lambda: distribute(extra, DistributedConfig(fsdp_size=W, ep_size=W,
                                                                       ep_implementation="te_ep")))
    return seen

