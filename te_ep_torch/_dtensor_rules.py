"""DTensor sharding rules of the ``te_ep`` permutation ops (docs/permutation.md, "DTensor").

Registered once, when the module is imported (``te_ep_torch.permutation``
imports it, and ``import te_ep_torch`` imports that), and only where
``torch.distributed`` is available. The ops' Python API is in
``permutation.py``, their fake kernels and autograd formulas in
``ops/permute.py``.
"""

from __future__ import annotations

import math

import torch

# Loads the op library and registers the fake kernels that the rules' global shapes come from.
from .ops import permute as _fakes  # noqa: F401


# Placements per mesh dim: every tensor with a token/row dim is Shard(0) (each rank
# works on its shard, no communication) or all are Replicate(). Chunk maps [2, N]
# shard on dim 1. Output shapes of every op but `permute` follow from input shapes,
# so register_sharding (whose global shapes come from the fake kernels) covers them;
# `permute`'s row count is the per-shard `capacity`, so its global shape is
# `capacity` times the number of shards, which a sharding rule cannot express: it has
# a DTensor op handler instead.


def _register_dtensor_rules() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.te_ep

    def opt(t, placement):
        return None if t is None else placement

    @register_sharding(ops.permute_bwd.default)
    def _permute_bwd_rule(row_id_map, grad_output, grad_permuted_probs):
        return [([p, p], [p, opt(grad_output, p), opt(grad_permuted_probs, p)]) for p in (Replicate(), Shard(0))]

    @register_sharding(ops.unpermute.default)
    def _unpermute_rule(input, row_id_map, src_slot, merging_probs):
        return [([p], [p, p, p, opt(merging_probs, p)]) for p in (Replicate(), Shard(0))]

    @register_sharding(ops.unpermute_bwd.default)
    def _unpermute_bwd_rule(grad_output, row_id_map, src_slot, merging_probs, input):
        return [
            ([p, p], [p, p, p, opt(merging_probs, p), opt(input, p)])
            for p in (Replicate(), Shard(0))
        ]

    @register_sharding(ops.sort_chunks_by_index.default)
    def _sort_chunks_by_index_rule(input, split_sizes, sorted_index, probs):
        r, s = Replicate(), Shard(0)
        return [
            ([r, r, r], [r, r, r, opt(probs, r)]),
            # Each rank has its own chunk sizes and order (e.g. what it received),
            # stacked as Shard(0) DTensors of W * n entries ...
            ([s, s, Shard(1)], [s, s, s, opt(probs, s)]),
            # ... or all ranks share them.
            ([s, s, Shard(1)], [s, r, r, opt(probs, s)]),
        ]

    @register_sharding(ops.sort_chunks_by_map.default)
    def _sort_chunks_by_map_rule(input, row_map, probs, inverse):
        r, s = Replicate(), Shard(0)
        return [
            ([r, r], [r, r, opt(probs, r), None]),
            ([s, s], [s, Shard(1), opt(probs, s), None]),
        ]

    # A private DTensor hook; should a torch release drop it, DTensor permute fails
    # with DTensor's own "no sharding strategy" error instead of breaking the import.
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)
    if isinstance(handlers, dict):
        handlers[ops.permute.default] = _permute_dtensor_handler


def _permute_dtensor_handler(op_call, args, kwargs):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    op = "te_ep.permute"
    names = ("tokens", "routing", "probs", "num_experts", "capacity", "alignment")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    tokens, routing, probs = bound["tokens"], bound["routing"], bound["probs"]
    tensors = {n: t for n, t in (("tokens", tokens), ("routing", routing), ("probs", probs)) if t is not None}
    plain = [n for n, t in tensors.items() if not isinstance(t, DTensor)]
    if plain:
        raise RuntimeError(f"{op}: with DTensor inputs, tokens, routing and probs must all be DTensors; got plain {plain}")
    mesh, placements = tokens.device_mesh, tuple(tokens.placements)
    for name, t in tensors.items():
        if t.device_mesh != mesh or tuple(t.placements) != placements:
            raise RuntimeError(
                f"{op}: {name} must be on the mesh and placements of tokens ({placements}), got {tuple(t.placements)}"
            )
    for p in placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
            raise RuntimeError(
                f"{op}: DTensor inputs must be Shard(0) (token dim) or Replicate() on every mesh dim, got {placements}"
            )
    local = op_call(
        tokens._local_tensor,
        routing._local_tensor,
        None if probs is None else probs._local_tensor,
        bound["num_experts"],
        bound["capacity"],
        bound["alignment"],
    )
    shards = math.prod(mesh.size(d) for d, p in enumerate(placements) if isinstance(p, Shard))
    # Per-rank outputs stack along dim 0: block r is rank r's result. row_id_map
    # instead follows the tokens' own (possibly uneven) sharding.
    global_rows = [
        local[0].shape[0] * shards,
        local[1].shape[0] * shards,
        routing.shape[0],
        local[3].shape[0] * shards,
        local[4].shape[0] * shards,
        local[5].shape[0] * shards,
    ]
    outputs = []
    for t, rows in zip(local, global_rows):
        shape = torch.Size((rows, *t.shape[1:]))
        stride = make_contiguous_strides_for(shape)
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, t.dtype))
        outputs.append(DTensor(t, spec, requires_grad=False))
    return tuple(outputs)


if torch.distributed.is_available():
    _register_dtensor_rules()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel DTensor parameter (the tensor itself otherwise):
    what the expert FFNs of ``te.MoE`` and both integrations run on."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t
